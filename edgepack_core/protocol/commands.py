"""Remote commands (``edgepack.cmd/1``): the one builder (host) and the one parser (device).

Every command has an ``id`` (a duplicate delivery is answered with the existing job, never
re-run) and an ``expires_at`` (unix seconds; a command that arrives late, e.g. queued on the
broker while the device was off for a week, is rejected instead of acted on). Its lifetime is
bounded by :data:`MAX_LIFETIME_S`, because a device remembers ids until they expire.

The parser is pure and total: bytes in, a :class:`Command` or a :class:`Rejection` out, never
an exception. Everything is bounded before it is parsed (size, nesting, non-finite numbers),
and no string from a rejected command survives except an id that passed
:func:`~edgepack_core.protocol.ids.validate_id`: a rejected command with an unsafe id is named
by a hash (:attr:`Rejection.ref`), so nothing from the network can become a file name.
"""

from __future__ import annotations

import copy
import json
import math
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edgepack_core.errors import CommandBuildError, SchemaError
from edgepack_core.protocol.ids import digest_ref, is_valid_id, safe_id
from edgepack_core.protocol.payloads import CMD_SCHEMA_ID, load_schema, validate_payload

MAX_COMMAND_BYTES = 64 * 1024
MAX_LIFETIME_S = 7 * 24 * 3600
"""No command is valid for longer than this (clock skew included): the device's memory of
command ids, which stops replays, lasts until expiry and must stay bounded."""
MAX_REASON_CHARS = 300
COMMAND_TYPES = ("deploy", "rollback", "cancel", "remove", "ping", "get-state", "set-telemetry-interval",
                 "apply-settings", "fetch-logs", "renew-certificate")
READ_ONLY_TYPES = ("ping", "get-state")

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


@dataclass(frozen=True)
class Command:
    """A command that passed the schema, the id rules and the expiry check. ``body`` is the
    whole decoded document (signature included), for the signature check and the job."""

    id: str
    type: str
    expires_at: float
    body: dict[str, Any]

    @property
    def target(self) -> dict[str, str] | None:
        """``{"device": d}`` or ``{"group": g}`` if the command names its target."""
        return self.body.get("target")


@dataclass(frozen=True)
class Rejection:
    """A command that cannot be run. ``id`` is the command's own id only when it passed
    :func:`~edgepack_core.protocol.ids.validate_id`, else None; ``ref`` always names the
    command safely (as a topic level or a file name): the id, or ``rejected-<hash>`` of the
    raw id (or of the whole payload when there is no string id)."""

    id: str | None
    reason: str
    ref: str


# --------------------------------------------------------------------------- building (host)


def field_schema(command_type: str, field: str) -> dict[str, Any]:
    """The JSON Schema devices check ``field`` of a ``command_type`` command with. A host that
    takes a value from its own users and signs it into such a command bounds it with this
    (the fleet server's rollout API does), so the two bounds are one and cannot drift apart.
    :class:`KeyError` for a type or field the protocol does not have."""
    for variant in load_schema("cmd")["oneOf"]:
        if variant["properties"]["type"].get("const") == command_type:
            return copy.deepcopy(variant["properties"][field])
    raise KeyError(f"no command type {command_type!r}")



def new_command_id(kind: str, *parts: str) -> str:
    """A fresh, readable id within the id pattern: ``<kind>-<parts...>-<random>``."""
    suffix = uuid.uuid4().hex[:8]
    head = "-".join([kind, *parts])
    return safe_id(f"{head[: 64 - len(suffix) - 1]}-{suffix}")


def build_command(
    command_type: str,
    *,
    device: str | None = None,
    group: str | None = None,
    command_id: str | None = None,
    ttl_s: float = 3600.0,
    now: float | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """A complete command for ``device`` or ``group``, validated against the same schema and
    rules the device applies (:func:`check_command`). Raises :class:`CommandBuildError`."""
    if (device is None) == (group is None):
        raise CommandBuildError("target", "a command goes to exactly one device or one group")
    if not 0 < ttl_s <= MAX_LIFETIME_S:
        raise CommandBuildError("expires_at", f"lifetime {ttl_s!r} s is outside (0, {MAX_LIFETIME_S}]")
    issued = time.time() if now is None else now
    command: dict[str, Any] = {
        "schema": CMD_SCHEMA_ID,
        "id": command_id or new_command_id(command_type),
        "type": command_type,
        "issued_at": round(issued, 3),
        "expires_at": round(issued + ttl_s, 3),
        "target": {"device": device} if device is not None else {"group": group},
        **{key: value for key, value in fields.items() if value is not None},
    }
    try:
        check_command(command, issued)
    except SchemaError as err:
        raise CommandBuildError(err.path, err.problem) from err
    return command


def encode_command(command: Mapping[str, Any]) -> bytes:
    """The wire bytes of a built (and possibly signed) command: compact JSON, no NaN."""
    data = json.dumps(command, separators=(",", ":"), allow_nan=False).encode()
    if len(data) > MAX_COMMAND_BYTES:
        raise CommandBuildError("command", f"{len(data)} bytes is over the limit of {MAX_COMMAND_BYTES}")
    return data


# --------------------------------------------------------------------------- checking (both)


def _check_values(value: Any, path: str) -> None:
    """What the JSON Schema cannot say, for every value at any depth: numbers are finite (NaN
    passes every minimum and maximum) and strings hold no control character (a Python ``$``
    in a schema pattern also matches before a trailing newline, so ``"id\\n"`` would pass)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SchemaError(path, f"{value} is not a finite number")
    if isinstance(value, str) and _CONTROL.search(value):
        raise SchemaError(path, "holds a control character")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_values(item, f"{path}.{key}")


def check_command(document: Any, now: float) -> None:
    """Schema, id rules, expiry and lifetime of a decoded command; :class:`SchemaError` if not."""
    if not isinstance(document, dict) or document.get("type") not in COMMAND_TYPES:
        shown = str(document.get("type") if isinstance(document, dict) else None)[:40]
        raise SchemaError("type", f"unknown command type {shown!r} (known: {', '.join(COMMAND_TYPES)})")
    for key, value in document.items():
        _check_values(value, key)
    artifact = document.get("artifact")
    if isinstance(artifact, dict) and ("url" in artifact) == ("xfer" in artifact):
        raise SchemaError("artifact", "needs exactly one of url or xfer")
    validate_payload("cmd", document)
    expires_at = float(document["expires_at"])
    if expires_at < now:
        raise SchemaError("expires_at", f"command expired at {expires_at:.0f} (now {now:.0f})")
    if expires_at > now + MAX_LIFETIME_S:
        raise SchemaError("expires_at", f"{expires_at:.0f} is more than {MAX_LIFETIME_S} s ahead (now {now:.0f})")


# --------------------------------------------------------------------------- parsing (device)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _decode(payload: bytes) -> Any:
    """JSON without NaN/Infinity, with nesting errors turned into ValueError."""
    try:
        return json.loads(payload, parse_constant=_refuse_constant)
    except RecursionError as err:
        raise ValueError("nested too deeply") from err


def _short(reason: str) -> str:
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


def _rejection(command_id: str | None, reason: str, raw: str) -> Rejection:
    return Rejection(command_id, _short(reason), command_id if command_id is not None else digest_ref(raw))


def parse_command(payload: bytes, now: float) -> Command | Rejection:
    """Decode and validate a command payload. Never raises."""
    if len(payload) > MAX_COMMAND_BYTES:
        return _rejection(None, f"command of {len(payload)} bytes is over the limit of {MAX_COMMAND_BYTES}",
                          payload[:4096].hex())
    try:
        document = _decode(payload)
    except (UnicodeDecodeError, ValueError) as err:
        return _rejection(None, f"command is not JSON: {err}", payload.hex())
    if not isinstance(document, dict):
        return _rejection(None, "command is not a JSON object", payload.hex())
    raw_id = document.get("id")
    command_id = raw_id if is_valid_id(raw_id) else None
    raw = raw_id if isinstance(raw_id, str) else payload.hex()
    try:
        check_command(document, now)
    except SchemaError as err:
        return _rejection(command_id, str(err), raw)
    return Command(document["id"], document["type"], float(document["expires_at"]), document)
