"""The agent's log ring: its recent log records, bounded in bytes and in records, kept across a
restart, for a ``fetch-logs`` command (``device_agent/updates/fetch_logs.py``) to send.

Why a ring of its own rather than the journal: a device's journal is not readable remotely, and
an operator needs the records from before a problem, not after the next rotation. In memory:
the newest records within ``logs.max_bytes`` (their JSON line size) and ``logs.max_records``.
On disk (``<store>/logs/``, ``logs.persist``): an append-only segment pair, ``current.jsonl``
and ``previous.jsonl``, each at most half of both bounds; a full ``current`` replaces
``previous`` (an atomic rename) and a new ``current`` starts, so the files never hold more than
the bounds plus one record. A restart reads ``previous`` then ``current``. A torn last line (a
crash mid-write) is cut off; a segment that is not what the ring writes (a bad line, over its
bound) is deleted with a warning: never fatal. A write that fails (a full or read-only medium)
turns persistence off with a warning and the ring goes on in memory.

A record is held as its JSON line alone (bytes), decoded into a :class:`LogLine` only when a
fetch reads the ring (a rare command: decoding a full ring takes milliseconds), so what the ring
holds is about ``logs.max_bytes`` plus ~40 bytes a record, not the ``LogLine`` objects and
their strings (issue 25 item 10; 70-character messages: 1.3 MiB of Python heap instead of 2.2
for a full default ring, 0.7 MiB instead of 1.6 for what a restart reads back).

Every record passes :class:`~device_agent.log_redact.RedactingFilter` first, on the ring and on
the stderr handler alike, so no configured secret is kept, printed or sent.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from device_agent.log_redact import RedactingFilter, Redactor, configured_secrets
from edgepack_core.fsutil import fsync_dir
from edgepack_core.protocol.logs import LEVEL_NUMBERS, MAX_LOGGER_CHARS, MAX_MESSAGE_CHARS, LogLine, level_name

log = logging.getLogger("edgepack.agent.logs")

CURRENT, PREVIOUS = "current.jsonl", "previous.jsonl"

LOGS_CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "description": "the log ring a fetch-logs command reads (docs/agent.md, \"Remote logs\")",
    "properties": {
        "max_bytes": {"type": "integer", "minimum": 16 * 1024, "maximum": 64 * 1024 * 1024},
        "max_records": {"type": "integer", "minimum": 10, "maximum": 1_000_000},
        "persist": {"type": "boolean"},
        "fetch_burst": {"type": "integer", "minimum": 1, "maximum": 1000},
        "fetch_per_minute": {"type": "number", "exclusiveMinimum": 0, "maximum": 6000},
    },
}


@dataclass(frozen=True)
class LogSettings:
    """agent.yaml ``logs:``: the ring's bounds, whether it is kept on disk, and how many
    ``fetch-logs`` commands the device answers (a token bucket: ``fetch_burst`` at once,
    ``fetch_per_minute`` sustained)."""

    max_bytes: int = 1024 * 1024
    max_records: int = 10_000
    persist: bool = True
    fetch_burst: int = 10
    fetch_per_minute: float = 12.0


def encode_line(line: LogLine) -> bytes:
    return json.dumps(line.to_json(), separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def _decode_line(raw: bytes) -> LogLine:
    doc = json.loads(raw)
    if not isinstance(doc, dict) or doc.get("level") not in LEVEL_NUMBERS:
        raise ValueError("not a log record")
    line = LogLine.from_json(doc)
    if line.seq < 0 or len(line.message) > MAX_MESSAGE_CHARS or len(line.logger) > MAX_LOGGER_CHARS:
        raise ValueError("a record out of bounds")
    return line


class Segments:
    """The on-disk pair. Not thread-safe: the ring calls it under its lock."""

    def __init__(self, directory: Path, max_bytes: int, max_records: int) -> None:
        self.directory = directory
        self.max_bytes, self.max_records = max_bytes, max_records
        self._handle: Any = None
        self._size = 0
        self._count = 0

    def load(self) -> tuple[list[bytes], int, list[str]]:
        """The records kept (oldest first), the number after the highest one, and warnings about
        what was dropped."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        entries: list[bytes] = []
        notes: list[str] = []
        last = -1
        for name in (PREVIOUS, CURRENT):
            path = self.directory / name
            try:
                found, keep, seq = self._read(path)
            except (OSError, ValueError, TypeError, KeyError) as err:
                notes.append(f"log ring segment {path} is unreadable ({str(err)[:200]}): dropped")
                path.unlink(missing_ok=True)
                continue
            entries.extend(found)
            last = max(last, seq)
            if name == CURRENT:
                self._size, self._count = keep, len(found)
        return entries, last + 1, notes

    def _read(self, path: Path) -> tuple[list[bytes], int, int]:
        """A segment's records, the size its valid part ends at (a torn tail is cut off), and
        the highest record number in it (-1: none). Each line is checked whole, then kept as
        its bytes: no :class:`LogLine` outlives the check."""
        if not path.exists():
            return [], 0, -1
        limit = self.max_bytes + MAX_MESSAGE_CHARS * 6 + 1024
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
        if len(data) > limit:
            raise ValueError(f"over its bound of {limit} bytes")
        end = data.rfind(b"\n") + 1
        entries: list[bytes] = []
        seq = -1
        for raw in data[:end].splitlines():
            if raw:
                seq = max(seq, _decode_line(raw).seq)
                entries.append(raw + b"\n")
        if len(entries) > self.max_records + 1:
            raise ValueError(f"{len(entries)} records is over its bound of {self.max_records}")
        if end < len(data):
            os.truncate(path, end)
        return entries, end, seq

    def append(self, data: bytes) -> None:
        if self._handle is not None and (self._size + len(data) > self.max_bytes or self._count >= self.max_records):
            self._rotate()
        if self._handle is None:
            fd = os.open(self.directory / CURRENT, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._handle = os.fdopen(fd, "ab")
        self._handle.write(data)
        self._handle.flush()
        self._size += len(data)
        self._count += 1

    def _rotate(self) -> None:
        self._handle.close()
        self._handle = None
        os.replace(self.directory / CURRENT, self.directory / PREVIOUS)
        fsync_dir(self.directory)
        self._size = self._count = 0

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


class LogRing(logging.Handler):
    """The bounded ring (a :class:`logging.Handler`); :meth:`query` is what a fetch reads."""

    def __init__(self, settings: LogSettings, directory: Path | None = None) -> None:
        super().__init__(logging.DEBUG)
        self.settings = settings
        self._records: deque[bytes] = deque()  # JSON lines, oldest first
        self._bytes = 0
        self._seq = 0
        self._guard = threading.Lock()
        self._segments = None if directory is None else Segments(directory, settings.max_bytes // 2,
                                                                 max(1, settings.max_records // 2))

    def load(self) -> list[str]:
        """Read what the segments kept; the warnings to log once the ring is attached."""
        if self._segments is None:
            return []
        entries, next_seq, notes = self._segments.load()
        with self._guard:
            for entry in entries:
                self._keep(entry)
            self._seq = next_seq
        return notes

    def _keep(self, data: bytes) -> None:
        self._records.append(data)
        self._bytes += len(data)
        bounds = self.settings
        while self._records and (self._bytes > bounds.max_bytes or len(self._records) > bounds.max_records):
            self._bytes -= len(self._records.popleft())

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.exc_text:
            message = f"{message}\n{record.exc_text}"
        with self._guard:
            line = LogLine(self._seq, round(record.created, 6), level_name(record.levelno),
                           record.name[:MAX_LOGGER_CHARS], message[:MAX_MESSAGE_CHARS])
            self._seq += 1
            data = encode_line(line)
            self._keep(data)
            self._persist(data, line.ts)

    def _persist(self, data: bytes, ts: float) -> None:
        if self._segments is None:
            return
        try:
            self._segments.append(data)
        except OSError as err:  # a full or read-only medium: the ring goes on in memory
            segments, self._segments = self._segments, None
            segments.close()
            note = LogLine(self._seq, ts, "warning", log.name,
                           f"log ring not kept on disk any more: {err}"[:MAX_MESSAGE_CHARS])
            self._seq += 1
            self._keep(encode_line(note))

    def records(self) -> Iterator[LogLine]:
        with self._guard:
            kept = list(self._records)
        return iter([_decode_line(data) for data in kept])

    def query(self, *, since: float | None, level: str, lines: int) -> list[LogLine]:
        """The newest ``lines`` records logged after ``since`` at ``level`` or above, oldest first."""
        floor = LEVEL_NUMBERS[level]
        with self._guard:
            kept = list(self._records)
        chosen = [line for line in map(_decode_line, kept)
                  if LEVEL_NUMBERS[line.level] >= floor and (since is None or line.ts > since)]
        return chosen[-lines:]

    @property
    def size(self) -> tuple[int, int]:
        """(records, bytes) held in memory."""
        with self._guard:
            return len(self._records), self._bytes

    def close(self) -> None:
        with self._guard:
            if self._segments is not None:
                self._segments.close()
        super().close()


def attach(config: Any) -> LogRing:
    """Redact every root handler's records and add the ring (kept under ``<store>/logs/`` unless
    ``logs.persist`` is false) to the root logger. :func:`detach` undoes it."""
    redacting = RedactingFilter(Redactor(configured_secrets(config)))
    root = logging.getLogger()
    for handler in root.handlers:
        handler.addFilter(redacting)
    settings: LogSettings = config.logs
    ring = LogRing(settings, config.store / "logs" if settings.persist else None)
    ring.addFilter(redacting)
    notes = ring.load()
    root.addHandler(ring)
    for note in notes:
        log.warning("%s", note)
    return ring


def detach(ring: LogRing) -> None:
    root = logging.getLogger()
    root.removeHandler(ring)
    for handler in root.handlers:
        for found in [f for f in handler.filters if isinstance(f, RedactingFilter)]:
            handler.removeFilter(found)
    ring.close()
