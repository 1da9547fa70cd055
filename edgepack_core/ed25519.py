"""Ed25519 public keys that verify signatures through libsodium (PyNaCl), without ``cryptography``.

Why: the agent checks signatures on manifests, commands and settings documents, and holds
nothing else of ``cryptography``; its Rust extension costs 6.6 MiB resident, PyNaCl's libsodium
1.2 MiB (BENCHMARKS.md). Signing, key generation, private keys and X.509 stay with
``cryptography`` on the host (and in ``edgepack-agent enroll``), imported where they run.

As strict as before and stricter on degenerate input: libsodium refuses what OpenSSL refuses (a
signature whose S is not below the group order, the malleable ``S + L``; an R that is not the
canonical encoding of the point the check computes) and also a signature whose R is a
small-order point and a key that is not a canonical point; a key must moreover be a point of the
prime-order subgroup that is not of small order (what every key generator makes), checked when
the key is made, so a small-order key, with which anyone could forge, never reaches a trust store.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import nacl.bindings
import nacl.exceptions

from edgepack_core.errors import BadSignatureError, Ed25519KeyError

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    AnyPublicKey: TypeAlias = "PublicKey | Ed25519PublicKey"

KEY_BYTES = 32
SIGNATURE_BYTES = 64


@dataclass(frozen=True)
class PublicKey:
    """An Ed25519 public key (its raw 32 bytes), checked when made: a point of the prime-order
    subgroup, canonically encoded, not of small order."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != KEY_BYTES:
            size = len(self.raw) if isinstance(self.raw, (bytes, bytearray, memoryview)) else type(self.raw).__name__
            raise Ed25519KeyError(f"an Ed25519 public key is {KEY_BYTES} bytes, not {size}")
        if nacl.bindings.has_crypto_core_ed25519 and not nacl.bindings.crypto_core_ed25519_is_valid_point(self.raw):
            raise Ed25519KeyError("not an Ed25519 public key: a small-order, non-canonical or off-curve point")

    @classmethod
    def from_public_bytes(cls, data: bytes) -> PublicKey:
        """The key of its raw 32 bytes (the name of ``cryptography``'s constructor)."""
        return cls(bytes(data) if isinstance(data, (bytearray, memoryview)) else data)

    def public_bytes_raw(self) -> bytes:
        return self.raw

    def verify(self, signature: bytes, data: bytes) -> None:
        """Return when ``signature`` is this key's over ``data``; raise :class:`BadSignatureError`
        otherwise, a signature of the wrong length included."""
        if len(signature) != SIGNATURE_BYTES:
            raise BadSignatureError(f"an Ed25519 signature is {SIGNATURE_BYTES} bytes, not {len(signature)}")
        try:
            nacl.bindings.crypto_sign_open(bytes(signature) + bytes(data), self.raw)
        except nacl.exceptions.BadSignatureError as err:
            raise BadSignatureError("the Ed25519 signature does not verify") from err


def public_key(key: AnyPublicKey) -> PublicKey:
    """``key`` as a :class:`PublicKey`: itself, or a ``cryptography`` Ed25519 public key (host code
    and tests pass those) by its raw bytes. ``cryptography`` is never imported here: a key of its
    type can only exist once it is."""
    if isinstance(key, PublicKey):
        return key
    crypto = sys.modules.get("cryptography.hazmat.primitives.asymmetric.ed25519")
    if crypto is not None and isinstance(key, crypto.Ed25519PublicKey):
        return PublicKey.from_public_bytes(key.public_bytes_raw())
    raise TypeError(f"not an Ed25519 public key: {type(key).__name__}")
