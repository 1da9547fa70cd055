"""Key pair files on the host: private key 0600, never overwritten unless forced."""

from __future__ import annotations

import os
from pathlib import Path

from edgepack_core.errors import KeyFileError
from edgepack_core.fsutil import atomic_write
from edgepack_core.signing import (
    OPERATOR,
    RELEASE,
    SigningKey,
    generate_private_key,
    load_private_key,
    private_key_pem,
    public_key_pem,
)


def _write_new(path: Path, data: bytes, mode: int, force: bool) -> None:
    """Write ``data`` with ``mode`` from the first byte, atomically; never over an existing file
    (even one that appeared meanwhile) unless ``force``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        atomic_write(path, data, mode=mode, overwrite=force)
    except FileExistsError as err:
        raise KeyFileError(str(path), "already exists (use --force to overwrite)") from err


def write_keypair(private_path: Path, public_path: Path, *, force: bool = False, kind: str = RELEASE) -> str:
    """Generate an Ed25519 pair; write the private key 0600 and the public key 0644, both
    labelled with ``kind`` (``edgepack_core.signing.KEY_KINDS``)."""
    if private_path.resolve() == public_path.resolve():
        raise KeyFileError(str(private_path), "private and public key paths are the same file")
    if not force:
        for path in (private_path, public_path):
            if path.exists():
                raise KeyFileError(str(path), "already exists (use --force to overwrite)")
    key = generate_private_key()
    _write_new(private_path, private_key_pem(key, kind), 0o600, force)
    _write_new(public_path, public_key_pem(key, kind), 0o644, force)
    return key.key_id


def write_operator_keypair(private_path: Path, public_path: Path, *, force: bool = False) -> str:
    """An operator key pair: the private half signs commands (``--operator-key``), the public
    half goes into devices' ``operator_keys``. Same format as artifact keys, kept as a separate
    pair so that the key that builds models cannot also order devices around, and vice versa."""
    return write_keypair(private_path, public_path, force=force, kind=OPERATOR)


def load_operator_key(path: Path) -> SigningKey:
    """Load an operator private key for signing commands, refusing one that others can read
    (like ssh: a key anyone on the workstation could copy commands the whole fleet)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise KeyFileError(str(path), "no such key file") from None  # the message names the missing file
    except OSError as err:
        raise KeyFileError(str(path), f"cannot read: {err.strerror}") from err
    if mode & 0o077:
        raise KeyFileError(str(path), f"operator key is readable by others (mode {mode & 0o777:o}); chmod 600 it")
    password = os.environ.get("EDGEPACK_KEY_PASSWORD")
    return load_private_key(path, password.encode() if password else None, kind=OPERATOR)
