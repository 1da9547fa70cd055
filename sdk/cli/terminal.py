"""The CLI's output boundary for text a device or the fleet server's stored data can hold.

Every command prints such text through :func:`echo`: each argument is one line, escaped whole
by :func:`sdk.text_safety.escape` (so a ``\\n``, ``\\r``, ESC, BEL, C1 CSI or bidi override a
device sent shows as ``\\x0a``, ``\\x1b``... and never acts on the terminal or forges a line).
``--json`` output goes through ``json.dumps`` (ASCII only) and needs nothing more;
:class:`JsonLines` re-encodes a server's streamed JSON lines the same way.
"""

from __future__ import annotations

import json
import logging
import traceback
from typing import Any, BinaryIO

import click

from sdk.text_safety import escape

MAX_LINE_BYTES = 1024 * 1024
"""A streamed line longer than this is passed on as it stands (one JSON string) and a new one begun."""


def echo(*lines: str, err: bool = False) -> None:
    """Print each of ``lines`` as one line, escaped (stdout, or stderr with ``err``); no line, nothing."""
    if not lines:
        return
    click.echo("\n".join(escape(str(line)) for line in lines), err=err)


def echo_text(text: str, err: bool = False) -> None:
    """Print text a formatter made of several lines, each line escaped: for text read from a
    local file (an artifact's manifest), whose values the formatter did not mark."""
    echo(*text.split("\n"), err=err)


def escape_lines(text: str) -> str:
    """Each line of ``text`` escaped, the lines kept: for a message made of the operator's own
    input (a usage error) or a traceback, whose line breaks are the program's."""
    return "\n".join(escape(line) for line in text.split("\n"))


def _escaped_within(chunk: str) -> str:
    """``chunk``'s text escaped whole (an exception's message: one line), its leading and
    trailing line breaks (the traceback's own) kept."""
    body = chunk.strip("\n")
    start = chunk.index(body) if body else len(chunk)
    return chunk[:start] + escape(body) + chunk[start + len(body) :]


class EscapingFormatter(logging.Formatter):
    """A log line of ``edgepack fleet serve``: its message (a rollout's reason quoting a device's)
    escaped whole, so one record is one inert line; a traceback's frames keep their lines (the
    program's), each exception's own message is escaped whole (it may quote a device)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        chunks = traceback.format_exception(*ei)
        return "".join(escape_lines(c) if c.startswith("  File ") else _escaped_within(c) for c in chunks).rstrip("\n")

    def formatStack(self, stack_info: str) -> str:
        return escape_lines(super().formatStack(stack_info))


class JsonLines:
    """A binary sink that passes on JSON lines re-encoded by ``json.dumps`` (ASCII, control
    characters escaped); a line that is not JSON comes out as one escaped JSON string."""

    def __init__(self, sink: BinaryIO) -> None:
        self.sink = sink
        self.pending = b""

    def write(self, data: bytes) -> int:
        lines = (self.pending + data).split(b"\n")
        self.pending = lines.pop()
        for line in lines:
            self._line(line)
        if len(self.pending) > MAX_LINE_BYTES:
            self._line(self.pending)
            self.pending = b""
        return len(data)

    def close(self) -> None:
        """Pass on what is left after the last newline."""
        if self.pending:
            self._line(self.pending)
            self.pending = b""
        self.sink.flush()

    def _line(self, raw: bytes) -> None:
        if not raw.strip():
            return
        text = raw.decode("utf-8", "replace")
        try:
            value = json.loads(text, strict=False)  # raw controls in a string: kept, then escaped
        except ValueError:
            value = text
        self.sink.write(json.dumps(value, separators=(",", ":")).encode() + b"\n")
