"""Schema ids and JSON Schemas of every MQTT payload, in one place.

The schemas are JSON files beside this module (``schemas/<kind>.schema.json``, shipped as
package data so the device reads the same files the host does) and are copied to the
repository's ``schemas/`` for consumers outside Python; ``tests/test_protocol.py`` fails when
the two copies differ. Both sides validate with :func:`validate_payload`: the agent what it
receives, the host what it sends, so a host bug is caught before it reaches a fleet.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Literal

from edgepack_core.schema import Validator

PayloadKind = Literal["cmd", "job", "state", "telemetry", "xfer", "events", "logs"]
KINDS: tuple[PayloadKind, ...] = ("cmd", "job", "state", "telemetry", "xfer", "events", "logs")

CMD_SCHEMA_ID = "edgepack.cmd/1"
JOB_SCHEMA_ID = "edgepack.job/1"
STATE_SCHEMA_ID = "edgepack.state/1"
TELEMETRY_SCHEMA_ID = "edgepack.telemetry/1"
XFER_SCHEMA_ID = "edgepack.xfer/1"
EVENTS_SCHEMA_ID = "edgepack.events/1"  # generated from edgepack_core.protocol.events.Event
LOGS_SCHEMA_ID = "edgepack.logs/1"

SCHEMA_IDS: dict[PayloadKind, str] = {
    "cmd": CMD_SCHEMA_ID, "job": JOB_SCHEMA_ID, "state": STATE_SCHEMA_ID,
    "telemetry": TELEMETRY_SCHEMA_ID, "xfer": XFER_SCHEMA_ID, "events": EVENTS_SCHEMA_ID,
    "logs": LOGS_SCHEMA_ID,
}

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"


def schema_path(kind: PayloadKind) -> Path:
    """Where the JSON Schema of ``kind`` lives inside the package."""
    if kind not in SCHEMA_IDS:
        raise KeyError(f"no payload kind {kind!r} (known: {', '.join(KINDS)})")
    return SCHEMA_DIR / f"{kind}.schema.json"


@cache
def _schema_text(kind: PayloadKind) -> str:
    return schema_path(kind).read_text(encoding="utf-8")


def load_schema(kind: PayloadKind) -> dict[str, Any]:
    """A fresh copy of the JSON Schema of ``kind`` (callers may not mutate a shared one)."""
    schema: dict[str, Any] = json.loads(_schema_text(kind))
    return schema


@cache
def validator(kind: PayloadKind) -> Validator:
    """The validator of ``kind``, built once (the schema check of the schema itself runs once)."""
    return Validator(load_schema(kind), document=SCHEMA_IDS[kind])


def validate_payload(kind: PayloadKind, document: Any) -> None:
    """Raise :class:`~edgepack_core.errors.SchemaError` naming the first offending key path."""
    validator(kind).validate(document)
