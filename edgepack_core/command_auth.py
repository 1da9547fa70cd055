"""Operator signatures on remote commands (Uptane/TUF: the party that decides what a device runs
signs that decision; the broker is only a courier).

A command that changes what a device runs or how a new model is judged is signed by an
operator key (``edgepack keygen --operator``) over its canonical JSON: every field but
``signature``, so the id, the target device or group and the expiry are covered too. The
agent checks the signature against the ``operator_keys`` of its agent.yaml, then that the
command names this device (or one of its groups) and has not expired.

Hard to misuse, after itsdangerous: the algorithm is fixed (Ed25519 through
:mod:`edgepack_core.signing`, which owns key ids and the algorithm check), nothing in the
command chooses it, and the signed bytes start with a domain prefix so that a manifest
signature can never pass as a command signature or the other way round::

    {"schema": "edgepack.cmd/1", "id": "...", "type": "deploy", "expires_at": 1767225600,
     "target": {"device": "pi-07"}, ...,
     "signature": {"keyid": "3f2a9c0d11e2b7a4", "sig": "<base64 Ed25519 signature>"}}
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from edgepack_core.errors import BadSignatureError, CommandSignatureError, SignatureError, UntrustedKeyError
from edgepack_core.signing import ALGORITHM, SIGNATURE_SCHEMA, SigningKey, TrustStore

if TYPE_CHECKING:  # signing is the host's; the agent only verifies, without cryptography
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

DOMAIN = b"edgepack.cmd-signature/1\n"
SIGNATURE_FIELD = "signature"

READ_ONLY_TYPES = frozenset({"ping", "get-state"})
"""The only command types that may arrive unsigned; everything else must be signed."""
STATE_CHANGING_TYPES = frozenset({"deploy", "rollback", "cancel", "remove", "set-telemetry-interval",
                                  "apply-settings", "fetch-logs", "renew-certificate"})
"""Types that change what runs, how it is judged, or what the device reports (``fetch-logs``: its
logs leave the device; ``renew-certificate``: its identity files): always signed."""
SIGNED_FIELDS = frozenset({"force_downgrade", "health_window_s", "allow_contract_change"})
"""Fields that make any command carrying them need a signature, whatever its type."""

MAX_SIGNED_LIFETIME_S = 7 * 24 * 3600
"""A signed command may not be valid for longer than this: the agent remembers every signed id
until its expiry, so the expiry bounds that memory (and the window for a replay)."""

_KEYID = re.compile(r"^[0-9a-f]{16}$")
_MAX_SIG_CHARS = 128


def requires_signature(command: Mapping[str, Any]) -> bool:
    """Whether ``command`` must carry an operator signature. Default-deny: only a read-only type
    without any safety-switch field may go unsigned; an unknown type needs a signature too."""
    if command.get("type") not in READ_ONLY_TYPES:
        return True
    return any(name in command for name in SIGNED_FIELDS)


def canonical_bytes(command: Mapping[str, Any]) -> bytes:
    """The bytes an operator signs: the domain prefix, then compact sorted-key JSON of every
    field but ``signature``. Non-finite numbers are refused (they have no JSON spelling)."""
    body = {key: value for key, value in command.items() if key != SIGNATURE_FIELD}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise CommandSignatureError(f"command cannot be signed: {err}") from err
    return DOMAIN + text.encode("ascii")


def _signing_key(private_key: Ed25519PrivateKey | SigningKey) -> SigningKey:
    if isinstance(private_key, SigningKey):
        return private_key
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    if isinstance(private_key, Ed25519PrivateKey):
        return SigningKey(private_key)
    raise TypeError("operator commands are signed with an Ed25519 private key")


def sign_command(command: Mapping[str, Any], private_key: Ed25519PrivateKey | SigningKey) -> dict[str, Any]:
    """A copy of ``command`` with ``"signature": {"keyid", "sig"}`` over :func:`canonical_bytes`.

    A signature already present is replaced (re-signing after an edit is the only sane meaning).
    """
    key = _signing_key(private_key)
    signed = key.sign(canonical_bytes(command))
    out = {k: v for k, v in command.items() if k != SIGNATURE_FIELD}
    out[SIGNATURE_FIELD] = {"keyid": signed["key_id"], "sig": signed["signature"]}
    return out


def _signature_parts(command: Mapping[str, Any]) -> tuple[str, str]:
    block = command.get(SIGNATURE_FIELD)
    if block is None:
        raise CommandSignatureError(f"{command.get('type', 'this')} command must be signed by an operator key")
    if not isinstance(block, dict) or set(block) != {"keyid", "sig"}:
        raise CommandSignatureError("signature must be an object with exactly keyid and sig")
    keyid, sig = block["keyid"], block["sig"]
    if not isinstance(keyid, str) or not _KEYID.match(keyid):
        raise CommandSignatureError("signature keyid is not a key id (16 hex digits)")
    if not isinstance(sig, str) or not 0 < len(sig) <= _MAX_SIG_CHARS:
        raise CommandSignatureError("signature sig is not a base64 Ed25519 signature")
    return keyid, sig


def verify_command(command: Mapping[str, Any], trust: TrustStore) -> str:
    """Check the operator signature of ``command`` against ``trust``; return the key id.

    Raises :class:`CommandSignatureError` when the signature is missing, malformed, by a key
    that is not trusted, or does not match the command's canonical bytes (any field changed).
    """
    keyid, sig = _signature_parts(command)
    data = canonical_bytes(command)
    document = json.dumps({"schema": SIGNATURE_SCHEMA,
                           "signatures": [{"key_id": keyid, "algorithm": ALGORITHM, "signature": sig}]})
    try:
        return trust.verify(data, document.encode("ascii"))
    except UntrustedKeyError as err:
        raise CommandSignatureError(f"signed by key id {keyid}, which is not an operator key of this device") \
            from err
    except BadSignatureError as err:
        raise CommandSignatureError(f"signature by operator key {keyid} does not match the command "
                                    "(changed after signing?)") from err
    except SignatureError as err:
        raise CommandSignatureError("signature is malformed") from err


def check_scope(command: Mapping[str, Any], *, device_id: str, groups: Iterable[str], now: float,
                max_lifetime_s: float = MAX_SIGNED_LIFETIME_S) -> None:
    """Check that a signed command names this device or one of its groups and is current. Pure.

    The expiry must be a finite number in ``(now, now + max_lifetime_s]``: expired commands are
    stale (or replayed), and an expiry far in the future would have to be remembered forever.
    """
    expires_at = command.get("expires_at")
    if isinstance(expires_at, bool) or not isinstance(expires_at, (int, float)) or not math.isfinite(expires_at):
        raise CommandSignatureError("signed command has no valid expires_at")
    if expires_at <= now:
        raise CommandSignatureError(f"signed command expired at {expires_at:.0f} (now {now:.0f})")
    if expires_at > now + max_lifetime_s:
        raise CommandSignatureError(f"signed command expires more than {max_lifetime_s:.0f} s from now")
    target = command.get("target")
    if not isinstance(target, dict) or len(target) != 1:
        raise CommandSignatureError("signed command must name its target: {\"device\": ID} or {\"group\": NAME}")
    (kind, name), = target.items()
    if kind == "device" and name == device_id:
        return
    if kind == "group" and isinstance(name, str) and name in set(groups):
        return
    if kind not in ("device", "group"):
        raise CommandSignatureError("signed command target must be a device or a group")
    raise CommandSignatureError(f"signed command is for {kind} {str(name)[:64]!r}, not for this device")


def authorize_command(command: Mapping[str, Any], trust: TrustStore | None, *, device_id: str,
                      groups: Iterable[str], now: float) -> str | None:
    """The agent's whole decision on one parsed command. Pure (given ``now``).

    Returns the verifying operator key id, or None when no signature was needed (a read-only
    command) or no operator keys are configured (``trust`` None: the unprotected mode the agent
    warns about at start). Raises :class:`CommandSignatureError` otherwise.
    """
    if trust is None or not requires_signature(command):
        return None
    keyid = verify_command(command, trust)
    check_scope(command, device_id=device_id, groups=groups, now=now)
    return keyid

