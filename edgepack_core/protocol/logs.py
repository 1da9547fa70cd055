"""Log chunks (``edgepack.logs/1``): the answer to a ``fetch-logs`` command, built by the device
and parsed by the fleet server, in one place so the two agree on every bound.

A device answers one fetch with one or more chunks on ``{root}/dev/{d}/logs``, numbered from 0,
the last one marked, each at most :data:`MAX_CHUNK_BYTES` (the bound every device message is
held to, :mod:`.bounds`) and :data:`MAX_CHUNK_RECORDS` records. A record's message is cut to
:data:`MAX_MESSAGE_CHARS` before it is kept, so one record always fits a chunk (even with every
character escaped). Pure: no I/O; the parser never raises on input.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from edgepack_core.errors import SchemaError
from edgepack_core.protocol.bounds import MAX_MESSAGE_BYTES, Refusal, decode_document, number
from edgepack_core.protocol.payloads import LOGS_SCHEMA_ID, validate_payload

MAX_CHUNK_BYTES = MAX_MESSAGE_BYTES
MAX_CHUNK_RECORDS = 500
MAX_MESSAGE_CHARS = 4096
MAX_LOGGER_CHARS = 128
MAX_CHUNKS = 10_000
LEVELS = ("debug", "info", "warning", "error", "critical")
LEVEL_NUMBERS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}


def level_name(number: int) -> str:
    """The protocol's name of a :mod:`logging` level number (NOTSET and custom ones rounded down)."""
    found = "debug"
    for name, value in LEVEL_NUMBERS.items():
        if number >= value:
            found = name
    return found


@dataclass(frozen=True)
class LogLine:
    """One log record as it travels: its number in the device's ring, time, level, logger, text."""

    seq: int
    ts: float
    level: str
    logger: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "ts": self.ts, "level": self.level, "logger": self.logger, "message": self.message}

    @staticmethod
    def from_json(doc: dict[str, Any]) -> LogLine:
        """From a document the schema accepted."""
        return LogLine(int(doc["seq"]), float(doc["ts"]), str(doc["level"]), str(doc["logger"]), str(doc["message"]))


@dataclass(frozen=True)
class LogChunk:
    """One parsed chunk of a fetch's answer."""

    device: str
    request: str
    chunk: int
    last: bool
    ts: float
    records: tuple[LogLine, ...]


def _encode(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def chunk_records(records: Iterable[LogLine], *, device: str, request: str, now: float,
                  max_bytes: int = MAX_CHUNK_BYTES) -> list[bytes]:
    """The wire payloads of one answer: records packed in order into chunks of at most
    ``max_bytes`` and :data:`MAX_CHUNK_RECORDS`; always at least one chunk (an empty answer is a
    single empty last chunk). A record that fits no chunk on its own is refused
    (:class:`SchemaError`): the ring cuts messages so that it cannot happen."""
    head = {"schema": LOGS_SCHEMA_ID, "device": device, "ts": round(now, 3), "request": request}
    chunks: list[list[bytes]] = [[]]
    sizes = [0]
    base = len(_encode({**head, "chunk": MAX_CHUNKS, "last": False, "records": []}))
    for record in records:
        encoded = _encode(record.to_json())
        if base + len(encoded) > max_bytes:
            raise SchemaError("records", f"record {record.seq} alone is over {max_bytes} bytes")
        if len(chunks[-1]) >= MAX_CHUNK_RECORDS or base + sizes[-1] + len(encoded) + 1 > max_bytes:
            chunks.append([])
            sizes.append(0)
        chunks[-1].append(encoded)
        sizes[-1] += len(encoded) + 1
    if len(chunks) > MAX_CHUNKS:
        raise SchemaError("records", f"{len(chunks)} chunks is over the limit of {MAX_CHUNKS}")
    out = []
    for index, parts in enumerate(chunks):
        start = _encode({**head, "chunk": index, "last": index == len(chunks) - 1})[:-1]
        out.append(start + b',"records":[' + b",".join(parts) + b"]}")
    return out


def parse_logs_chunk(device: str, payload: bytes) -> LogChunk | Refusal:
    """A chunk heard on ``device``'s logs topic, or why it was refused (the ingest counts it)."""
    doc = decode_document(payload)
    if isinstance(doc, str):
        return doc
    try:
        validate_payload("logs", doc)
    except SchemaError:
        return "bad_schema"
    if doc["device"] != device:
        return "device_mismatch"
    if number(doc["ts"]) is None or any(number(item["ts"]) is None for item in doc["records"]):
        return "bad_schema"  # NaN passes a schema's minimum
    records = tuple(LogLine.from_json(item) for item in doc["records"])
    return LogChunk(device, doc["request"], int(doc["chunk"]), bool(doc["last"]), float(doc["ts"]), records)
