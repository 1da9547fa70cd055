"""Remote commands (``edgepack.cmd/1``): schema and parsing. Pure: bytes in, typed command or a
rejection reason out.

Every command has an ``id`` (a duplicate delivery is answered with the existing job, never
re-run) and an ``expires_at`` (unix seconds; a command that arrives late, e.g. queued on the
broker while the device was off for a week, is rejected instead of acted on).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from edgepack_core.errors import SchemaError
from edgepack_core.schema import validate
from edgepack_core.versions import VERSION_PATTERN

COMMAND_SCHEMA_ID = "edgepack.cmd/1"
MAX_COMMAND_BYTES = 64 * 1024
COMMAND_TYPES = ("deploy", "rollback", "ping", "get-state", "set-telemetry-interval")

_ID = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"}
_BASE = {
    "schema": {"const": COMMAND_SCHEMA_ID},
    "id": _ID,
    "type": {"enum": list(COMMAND_TYPES)},
    "expires_at": {"type": "number", "minimum": 0},
    "issued_at": {"type": "number", "minimum": 0},
}


def _command(type_name: str, extra: dict[str, Any] | None = None, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["schema", "id", "type", "expires_at", *(required or [])],
        "properties": {**_BASE, "type": {"const": type_name}, **(extra or {})},
    }


ARTIFACT_REF = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "url": {"type": "string", "pattern": r"^https?://[^\s]+$", "maxLength": 2048},
        "xfer": {
            "type": "object",
            "additionalProperties": False,
            "required": ["id", "chunk_size", "chunks"],
            "properties": {
                "id": {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"},
                "chunk_size": {"type": "integer", "minimum": 1024, "maximum": 4 * 1024 * 1024},
                "chunks": {"type": "integer", "minimum": 1},
            },
        },
    },
}

COMMAND_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "Edgepack remote command (edgepack.cmd/1)",
    "oneOf": [
        _command("deploy", {
            "artifact": ARTIFACT_REF,
            "name": {"type": "string", "minLength": 1, "maxLength": 64},
            "version": {"type": "string", "pattern": VERSION_PATTERN},
            "size": {"type": "integer", "minimum": 1},
            "sha256": {"type": "string", "pattern": "^[0-9a-f]{64}$"},
            "force_downgrade": {"type": "boolean"},
            "health_window_s": {"type": "number", "minimum": 0},
        }, ["artifact", "version", "size", "sha256"]),
        _command("rollback"),
        _command("ping"),
        _command("get-state"),
        _command("set-telemetry-interval", {"seconds": {"type": "number", "minimum": 0.1, "maximum": 86400}},
                 ["seconds"]),
    ],
}


@dataclass(frozen=True)
class Command:
    id: str
    type: str
    expires_at: float
    body: dict[str, Any]


@dataclass(frozen=True)
class Rejection:
    """A command that cannot be run. ``id`` is None when the payload has no usable id."""

    id: str | None
    reason: str


def parse_command(payload: bytes, now: float) -> Command | Rejection:
    """Decode and validate a command payload. Never raises."""
    if len(payload) > MAX_COMMAND_BYTES:
        return Rejection(None, f"command of {len(payload)} bytes is over the limit of {MAX_COMMAND_BYTES}")
    try:
        document = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        return Rejection(None, f"command is not JSON: {err}")
    if not isinstance(document, dict):
        return Rejection(None, "command is not a JSON object")
    raw_id = document.get("id")
    command_id = raw_id if isinstance(raw_id, str) and len(raw_id) <= 128 and raw_id.isprintable() else None
    if document.get("type") not in COMMAND_TYPES:
        return Rejection(command_id, f"unknown command type {str(document.get('type'))[:40]!r}")
    try:
        validate(document, COMMAND_SCHEMA, document="command")
    except SchemaError as err:
        return Rejection(command_id, str(err))
    if float(document["expires_at"]) < now:
        return Rejection(command_id, f"command expired at {document['expires_at']:.0f} (now {now:.0f})")
    artifact = document.get("artifact")
    if artifact is not None and ("url" in artifact) == ("xfer" in artifact):
        return Rejection(command_id, "artifact needs exactly one of url or xfer")
    return Command(document["id"], document["type"], float(document["expires_at"]), document)
