"""Key files: private 0600, no overwrite without force, wrong kinds of key refused clearly."""

from __future__ import annotations

import stat

import pytest

from edgepack_core.errors import KeyFileError
from edgepack_core.signing import load_private_key, load_public_key
from sdk.keys import write_keypair


def test_keygen_writes_private_key_0600_and_matching_public_key(tmp_path):
    private, public = tmp_path / "k.key", tmp_path / "k.pub"
    key_id = write_keypair(private, public)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert private.read_bytes().startswith(b"edgepack-key: release\n-----BEGIN PRIVATE KEY-----")
    signing = load_private_key(private)
    assert signing.key_id == key_id
    message = b"manifest bytes"
    load_public_key(public).verify(signing.private.sign(message), message)


def test_keygen_refuses_to_overwrite_without_force(tmp_path):
    private, public = tmp_path / "k.key", tmp_path / "k.pub"
    write_keypair(private, public)
    before = private.read_bytes()
    with pytest.raises(KeyFileError, match="already exists"):
        write_keypair(private, public)
    assert private.read_bytes() == before, "the existing private key must be untouched"
    new_id = write_keypair(private, public, force=True)
    assert private.read_bytes() != before and load_private_key(private).key_id == new_id
    assert stat.S_IMODE(private.stat().st_mode) == 0o600


def test_public_key_given_where_private_expected_is_a_clear_error(tmp_path):
    private, public = tmp_path / "k.key", tmp_path / "k.pub"
    write_keypair(private, public)
    with pytest.raises(KeyFileError, match="not a PEM private key"):
        load_private_key(public)
    with pytest.raises(KeyFileError, match="private key; trust the public key"):
        load_public_key(private)
    with pytest.raises(KeyFileError, match="no such key file"):
        load_public_key(tmp_path / "missing.pub")
