"""Key files say what they are (release or operator) and every command refuses the wrong kind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from cryptography.hazmat.primitives import serialization

from edgepack_core.errors import KeyFileError
from edgepack_core.signing import (
    OPERATOR,
    RELEASE,
    TrustStore,
    generate_private_key,
    load_private_key,
    load_public_key,
    private_key_pem,
    public_key_pem,
)
from sdk.cli import main
from sdk.keys import load_operator_key, write_keypair, write_operator_keypair

ROOT = Path(__file__).resolve().parents[1]


def _pairs(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    release = (tmp_path / "release.key", tmp_path / "release.pub")
    operator = (tmp_path / "operator.key", tmp_path / "operator.pub")
    write_keypair(*release)
    write_operator_keypair(*operator)
    return {RELEASE: release, OPERATOR: operator}


def test_new_key_files_name_their_kind_and_stay_plain_pem(tmp_path):
    pairs = _pairs(tmp_path)
    for kind, (private, public) in pairs.items():
        assert private.read_bytes().startswith(f"edgepack-key: {kind}\n-----BEGIN PRIVATE KEY-----".encode())
        assert public.read_bytes().startswith(f"edgepack-key: {kind}\n-----BEGIN PUBLIC KEY-----".encode())
        # cryptography (and openssl) read them as they are
        serialization.load_pem_private_key(private.read_bytes(), None)
        serialization.load_pem_public_key(public.read_bytes())
        public_id = TrustStore([load_public_key(public, kind=kind)]).key_ids[0]
        assert load_private_key(private, kind=kind).key_id == public_id


def test_a_release_key_passed_as_operator_key_is_refused(tmp_path):
    pairs = _pairs(tmp_path)
    release_private, release_public = pairs[RELEASE]
    with pytest.raises(KeyFileError) as caught:
        load_operator_key(release_private)
    line = str(caught.value)
    assert "\n" not in line and "release key" in line and "operator key is needed" in line
    # the fleet server's flag: one line, exit 1, before it touches the broker or the database
    tokens = tmp_path / "tokens"
    tokens.write_text("ops:" + "t" * 32 + "\n")
    tokens.chmod(0o600)
    result = CliRunner().invoke(
        main,
        [
            "fleet",
            "serve",
            "--broker",
            "127.0.0.1:1",
            "--trust",
            str(release_public),
            "--token-file",
            str(tokens),
            "--operator-key",
            str(release_private),
            "--db",
            f"sqlite:///{tmp_path / 'fleet.db'}",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "is a release key, but an operator key is needed here" in result.output
    assert result.output.strip().count("\n") == 0 and "Traceback" not in result.output
    assert not (tmp_path / "fleet.db").exists()


def test_an_operator_key_passed_as_release_key_is_refused_everywhere(tmp_path):
    pairs = _pairs(tmp_path)
    operator_private, operator_public = pairs[OPERATOR]
    with pytest.raises(KeyFileError, match="is an operator key, but a release key is needed"):
        load_private_key(operator_private, kind=RELEASE)  # edgepack build --key
    with pytest.raises(KeyFileError, match="is an operator key, but a release key is needed"):
        TrustStore.from_paths([operator_public], kind=RELEASE)  # verify --trust, the agent's trust
    with pytest.raises(KeyFileError, match="is a release key, but an operator key is needed"):
        TrustStore.from_paths([pairs[RELEASE][1]], kind=OPERATOR)  # the agent's operator_keys
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "none.edgepkg"), "--trust", str(operator_public)])
    assert result.exit_code in (1, 2) and "operator key" in result.output


def test_old_unlabelled_keys_still_load_as_either_kind(tmp_path):
    key = generate_private_key()
    private, public = tmp_path / "old.key", tmp_path / "old.pub"
    private.write_bytes(private_key_pem(key))
    private.chmod(0o600)
    public.write_bytes(public_key_pem(key))
    for kind in (RELEASE, OPERATOR):
        assert load_private_key(private, kind=kind).key_id == key.key_id
        assert TrustStore.from_paths([public], kind=kind).key_ids == [key.key_id]
    assert load_operator_key(private).key_id == key.key_id


def test_an_unknown_kind_in_the_header_is_refused(tmp_path):
    key = generate_private_key()
    path = tmp_path / "k.pub"
    path.write_bytes(b"edgepack-key: root\n" + public_key_pem(key))
    with pytest.raises(KeyFileError, match="unknown key kind 'root'"):
        load_public_key(path)


def test_the_agent_refuses_a_release_key_in_operator_keys(tmp_path):
    pairs = _pairs(tmp_path)
    config = tmp_path / "agent.yaml"
    config.write_text(
        f"device_id: d1\nstore: {tmp_path / 'store'}\ntrust: [{pairs[RELEASE][1]}]\n"
        f"operator_keys: [{pairs[RELEASE][1]}]\napi: {{enabled: false}}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "device_agent.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 1, done.stderr
    assert "is a release key, but an operator key is needed here" in done.stderr
    assert "Traceback" not in done.stderr
