"""Ed25519 signing of manifest bytes, key ids, and a trust store of several public keys.

Design (after itsdangerous and TUF): the signature covers the exact bytes of manifest.json,
nothing is parsed before it verifies, and every signature names the key that made it by a
key id derived from the public key itself (first 16 hex digits of sha256 of the raw key),
so a device can hold several trusted keys during a rotation and an artifact may carry
signatures from the old and the new key at once.

manifest.sig is JSON::

    {"schema": "edgepack.sig/1",
     "signatures": [{"key_id": "3f2a...", "algorithm": "ed25519", "signature": "<base64>"}]}
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgepack_core.ed25519 import PublicKey, public_key
from edgepack_core.errors import (
    BadSignatureError,
    Ed25519KeyError,
    KeyFileError,
    MissingSignatureError,
    SignatureError,
    SignatureLayoutError,
    UntrustedKeyError,
)

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from edgepack_core.ed25519 import AnyPublicKey

SIGNATURE_SCHEMA = "edgepack.sig/1"
ALGORITHM = "ed25519"
MAX_SIGNATURE_BYTES = 64 * 1024


def key_id(key: AnyPublicKey) -> str:
    """Stable short id of a public key: 16 hex digits of sha256 over the raw 32 key bytes."""
    raw = key.public_bytes_raw()
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class SigningKey:
    """A private key ready to sign; hard to misuse: it signs bytes and says which key it is.
    Host side (and tests): signing needs ``cryptography``, verifying does not."""

    private: Ed25519PrivateKey

    @property
    def key_id(self) -> str:
        return key_id(self.private.public_key())

    def public_key(self) -> PublicKey:
        return public_key(self.private.public_key())

    def sign(self, data: bytes) -> dict[str, str]:
        return {
            "key_id": self.key_id,
            "algorithm": ALGORITHM,
            "signature": base64.b64encode(self.private.sign(data)).decode("ascii"),
        }


def signature_document(data: bytes, keys: Iterable[SigningKey]) -> bytes:
    """manifest.sig bytes for ``data`` signed by every key in ``keys`` (one or more)."""
    signatures = [key.sign(data) for key in keys]
    if not signatures:
        raise ValueError("at least one signing key is required")
    return _layout({"schema": SIGNATURE_SCHEMA, "signatures": signatures})


_ENTRY_KEYS = frozenset({"key_id", "algorithm", "signature"})


def _layout(doc: object) -> bytes:
    """The one byte layout of manifest.sig (the writer's, and the only one a reader accepts)."""
    return json.dumps(doc, sort_keys=True, indent=1).encode("utf-8") + b"\n"


def check_signature_layout(signature_bytes: bytes) -> None:
    """Refuse a manifest.sig that verifies but is not laid out byte for byte as
    :func:`signature_document` lays it out: its bytes are not signed, so a key, a space or a
    padding byte the writer does not put there could carry anything. Call after ``verify``."""
    try:
        doc = json.loads(signature_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SignatureLayoutError(f"manifest.sig is not valid JSON: {err}") from err
    entries = doc.get("signatures") if isinstance(doc, dict) else None
    shaped = (
        isinstance(doc, dict)
        and set(doc) == {"schema", "signatures"}
        and isinstance(entries, list)
        and all(
            isinstance(e, dict) and set(e) == _ENTRY_KEYS and all(isinstance(v, str) for v in e.values())
            for e in entries
        )
    )
    if not shaped or not isinstance(entries, list) or _layout(doc) != signature_bytes:
        raise SignatureLayoutError("manifest.sig is not laid out as Edgepack writes it (keys, spacing or padding)")
    if not all(_canonical_base64(entry["signature"]) for entry in entries):
        raise SignatureLayoutError("manifest.sig holds a signature in non-canonical base64 (padding bits set)")


def _canonical_base64(text: str) -> bool:
    """Whether ``text`` is the one base64 spelling of its bytes: a decoder ignores the unused low
    bits of the last character, so ``...D==`` and ``...E==`` can be the same signature."""
    try:
        return base64.b64encode(base64.b64decode(text, validate=True)).decode("ascii") == text
    except (binascii.Error, ValueError):
        return False


class TrustStore:
    """The public keys a verifier accepts, by key id. Several keys allow rotation."""

    def __init__(self, keys: Iterable[AnyPublicKey] = ()) -> None:
        self._keys: dict[str, PublicKey] = {}
        for key in keys:
            self._keys[key_id(key)] = public_key(key)

    @classmethod
    def from_paths(cls, paths: Iterable[str | os.PathLike[str]], *, kind: str | None = None) -> TrustStore:
        """Load PEM public keys; a directory contributes every ``*.pub`` file inside it. A file
        labelled with another kind than ``kind`` is refused."""
        keys: list[PublicKey] = []
        for entry in paths:
            path = Path(entry)
            files = sorted(path.glob("*.pub")) if path.is_dir() else [path]
            for file in files:
                keys.append(load_public_key(file, kind=kind))
        if not keys:
            raise KeyFileError(", ".join(str(p) for p in paths) or "<none>", "no trusted public keys given")
        return cls(keys)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def replace(self, keys: Iterable[AnyPublicKey]) -> None:
        """Trust exactly ``keys`` from now on (a settings document from the server): every holder
        of this store (the model stores, the update service) sees the change at once."""
        fresh = {key_id(key): public_key(key) for key in keys}
        if not fresh:
            raise ValueError("a trust store cannot be emptied")
        self._keys = fresh

    def public_keys(self) -> list[PublicKey]:
        return [self._keys[kid] for kid in sorted(self._keys)]

    def __len__(self) -> int:
        return len(self._keys)

    def verify(self, data: bytes, signature_bytes: bytes | None) -> str:
        """Check ``signature_bytes`` (manifest.sig) over ``data``; return the verifying key id.

        Passes when at least one signature is by a trusted key and verifies. A signature by a
        trusted key that does not verify is an attack or corruption, so it fails outright even
        if another signature would pass.
        """
        seen: list[str] = []
        for entry in _signature_entries(signature_bytes):
            kid, algorithm, sig = _entry_fields(entry)
            seen.append(kid)
            public = self._keys.get(kid)
            if public is None:
                continue
            _verify_entry(public, kid, algorithm, sig, data)
            return kid
        raise UntrustedKeyError(seen)


def _signature_entries(signature_bytes: bytes | None) -> list[Any]:
    """The ``signatures`` list of manifest.sig (bounded, parsed, at least one entry)."""
    if signature_bytes is None:
        raise MissingSignatureError("manifest.sig is missing: the artifact is unsigned")
    if len(signature_bytes) > MAX_SIGNATURE_BYTES:
        raise SignatureError("manifest.sig is too large")
    try:
        doc = json.loads(signature_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SignatureError(f"manifest.sig is not valid JSON: {err}") from err
    if not isinstance(doc, dict) or doc.get("schema") != SIGNATURE_SCHEMA:
        raise SignatureError(f"manifest.sig schema is not {SIGNATURE_SCHEMA}")
    signatures = doc.get("signatures")
    if not isinstance(signatures, list) or not signatures:
        raise MissingSignatureError("manifest.sig holds no signatures")
    return signatures


def _entry_fields(entry: Any) -> tuple[str, Any, str]:
    """(key id, algorithm, base64 signature) of one manifest.sig entry."""
    if not isinstance(entry, dict):
        raise SignatureError("manifest.sig entry is not an object")
    kid, algorithm, sig = entry.get("key_id"), entry.get("algorithm"), entry.get("signature")
    if not isinstance(kid, str) or not isinstance(sig, str):
        raise SignatureError("manifest.sig entry needs key_id and signature strings")
    return kid, algorithm, sig


def _verify_entry(public: PublicKey, kid: str, algorithm: Any, sig: str, data: bytes) -> None:
    """Check one signature by a trusted key: a mismatch fails outright (attack or corruption)."""
    if algorithm != ALGORITHM:
        raise SignatureError(f"unsupported signature algorithm {algorithm!r}")
    try:
        raw = base64.b64decode(sig, validate=True)
        public.verify(raw, data)
    except (BadSignatureError, binascii.Error, ValueError) as cause:
        raise BadSignatureError(
            f"signature by trusted key {kid} does not match manifest.json (manifest changed?)"
        ) from cause


# --------------------------------------------------------------------------- key files


RELEASE = "release"
OPERATOR = "operator"
KEY_KINDS = (RELEASE, OPERATOR)
"""What a key is for: a release key signs artifacts (devices' ``trust``), an operator key signs
commands (devices' ``operator_keys``). Key files say which in their first line, a header
``edgepack-key: release`` (or ``operator``) before the PEM block: PEM readers (cryptography,
openssl) skip text before ``-----BEGIN``, so the files stay plain PEM. A file without the line
(written before keys had kinds) loads as either kind."""
_KIND_HEADER = b"edgepack-key:"


def kind_header(kind: str) -> bytes:
    """The first line of a key file of ``kind``."""
    if kind not in KEY_KINDS:
        raise ValueError(f"unknown key kind {kind!r} (known: {', '.join(KEY_KINDS)})")
    return _KIND_HEADER + b" " + kind.encode("ascii") + b"\n"


def file_kind(data: bytes, path: str) -> str | None:
    """The kind a key file's header line names, or None for a file without one (an old key)."""
    first = data.lstrip().split(b"\n", 1)[0].strip()
    if not first.startswith(_KIND_HEADER):
        return None
    kind = first[len(_KIND_HEADER):].strip().decode("ascii", "replace")
    if kind not in KEY_KINDS:
        raise KeyFileError(path, f"unknown key kind {kind[:20]!r} in its header (known: {', '.join(KEY_KINDS)})")
    return kind


def _article(kind: str) -> str:
    return "an" if kind[0] in "aeiou" else "a"


def check_kind(data: bytes, path: str, wanted: str | None) -> None:
    """Refuse a key file labelled with another kind than ``wanted`` (None: any kind), in one line
    naming both kinds."""
    found = file_kind(data, path)
    if wanted is not None and found is not None and found != wanted:
        raise KeyFileError(path, f"is {_article(found)} {found} key, but {_article(wanted)} {wanted} key is needed "
                                 "here (release keys sign artifacts, operator keys sign commands)")


def generate_private_key() -> SigningKey:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    return SigningKey(Ed25519PrivateKey.generate())


def private_key_pem(key: SigningKey, kind: str | None = None) -> bytes:
    """The PKCS#8 PEM of ``key``, after the header line of ``kind`` when given."""
    from cryptography.hazmat.primitives import serialization

    pem = key.private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return (kind_header(kind) if kind else b"") + pem


def public_key_pem(key: SigningKey | AnyPublicKey, kind: str | None = None) -> bytes:
    """The SubjectPublicKeyInfo PEM of ``key``, after the header line of ``kind`` when given
    (byte for byte what ``cryptography`` writes: 44 bytes of DER fit one base64 line)."""
    raw = (key.public_key() if isinstance(key, SigningKey) else key).public_bytes_raw()
    body = base64.b64encode(_ED25519_SPKI_PREFIX + raw)
    pem = b"-----BEGIN PUBLIC KEY-----\n" + body + b"\n-----END PUBLIC KEY-----\n"
    return (kind_header(kind) if kind else b"") + pem


def _read_key_file(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise KeyFileError(str(path), "no such key file") from None  # the message names the missing file
    except OSError as err:
        raise KeyFileError(str(path), f"cannot read: {err.strerror}") from err
    if len(data) > 64 * 1024:
        raise KeyFileError(str(path), "too large to be a key file")
    return data


def load_private_key(path: str | os.PathLike[str], password: bytes | None = None, *,
                     kind: str | None = None) -> SigningKey:
    """A private key file; one labelled with another kind than ``kind`` is refused."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    path = Path(path)
    data = _read_key_file(path)
    check_kind(data, str(path), kind)
    try:
        key = serialization.load_pem_private_key(data, password=password)
    except TypeError as err:
        raise KeyFileError(str(path), "key is encrypted: set EDGEPACK_KEY_PASSWORD") from err
    except ValueError as err:
        raise KeyFileError(str(path), "not a PEM private key (or wrong password)") from err
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(str(path), "not an Ed25519 private key")
    return SigningKey(key)


# DER of an Ed25519 SubjectPublicKeyInfo up to the 32 key bytes (RFC 8410): SEQUENCE { SEQUENCE
# { OID 1.3.101.112 }, BIT STRING (0 unused bits) }.
_ED25519_SPKI_PREFIX = bytes.fromhex("302a300506032b6570032100")


def _plain_ed25519_pem(data: bytes, path: str = "<key>") -> PublicKey | None:
    """The key of a PEM file that holds exactly one Ed25519 SubjectPublicKeyInfo (what
    ``edgepack keygen`` writes), read without cryptography, whose import is about a tenth of
    ``edgepack-agent predict``'s cold start and 6.6 MiB of an agent's memory; None for anything
    else, which then goes through cryptography's full PEM reader."""
    lines = data.strip().splitlines()
    if lines and lines[0].startswith(_KIND_HEADER):
        lines = lines[1:]
    if (
        len(lines) < 3
        or lines[0].strip() != b"-----BEGIN PUBLIC KEY-----"
        or lines[-1].strip() != b"-----END PUBLIC KEY-----"
    ):
        return None
    try:
        der = base64.b64decode(b"".join(line.strip() for line in lines[1:-1]), validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(der) != len(_ED25519_SPKI_PREFIX) + 32 or not der.startswith(_ED25519_SPKI_PREFIX):
        return None
    return _checked_key(der[len(_ED25519_SPKI_PREFIX) :], path)


def _checked_key(raw: bytes, path: str) -> PublicKey:
    try:
        return PublicKey.from_public_bytes(raw)
    except Ed25519KeyError as err:
        raise KeyFileError(path, str(err)) from err


def load_public_key(path: str | os.PathLike[str], *, kind: str | None = None) -> PublicKey:
    """A public key file; one labelled with another kind than ``kind`` is refused."""
    path = Path(path)
    data = _read_key_file(path)
    check_kind(data, str(path), kind)
    return public_key_from_pem(data, str(path))


def public_key_from_pem(data: bytes, path: str = "<key>") -> PublicKey:
    """The Ed25519 key of PEM bytes (a file's, or a settings document's); ``path`` names it."""
    plain = _plain_ed25519_pem(data, path)
    if plain is not None:
        return plain
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        key = serialization.load_pem_public_key(data)
    except ValueError as err:
        if b"PRIVATE KEY" in data:
            raise KeyFileError(path, "this is a private key; trust the public key instead") from err
        raise KeyFileError(path, "not a PEM public key") from err
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(path, "not an Ed25519 public key")
    return _checked_key(key.public_bytes_raw(), path)
