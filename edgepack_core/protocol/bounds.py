"""The bounds every message from a device is held to before any of its values is used.

One home for these rules because three host readers (``edgepack fleet``, the fleet server's
ingest, deploy's job listener) take the same messages: a payload is at most
:data:`MAX_MESSAGE_BYTES`, a JSON object, holds at most :data:`MAX_STRINGS` strings, and no
string (keys included) holds a NUL or a lone surrogate (sqlite3 and psycopg cannot encode a
surrogate, PostgreSQL text refuses NUL, and neither can be answered as UTF-8). Figures are taken
only with the right type and a finite value; counters are below :data:`BIG` (2^62) and a sum of
counters is clamped to it, so no stored integer, nor the sum of two, passes a signed 64-bit
column. Pure: no I/O, never raises on input.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any, Literal, Protocol, TypeVar

MAX_MESSAGE_BYTES = 64 * 1024
MAX_STRINGS = 10_000  # strings looked at in one message (a 64 KiB payload holds fewer)
BIG = 2**62  # counters beyond this are nonsense (and would overflow a BIGINT)
MAX_FIGURE = 1e15  # a latency, a percentage or a temperature beyond this is nonsense

Refusal = Literal["too_large", "not_json", "bad_schema", "bad_text", "device_mismatch"]
"""Why a message was refused; readers count drops by these names."""

_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")


def has_bad_text(doc: Any) -> bool:
    """Whether any string in the decoded JSON (keys too) holds a NUL or a lone surrogate, or the
    document holds more than :data:`MAX_STRINGS` strings. Iterative: no recursion on depth."""
    stack, seen = [doc], 0
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            seen += 1
            if seen > MAX_STRINGS or _BAD_TEXT.search(item) is not None:
                return True
    return False


def decode_document(payload: bytes) -> dict[str, Any] | Refusal:
    """The payload as a JSON object, or why not: size first, then JSON (nesting errors are
    ``not_json``), then the object shape, then every string."""
    if len(payload) > MAX_MESSAGE_BYTES:
        return "too_large"
    try:
        doc = json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "not_json"
    if not isinstance(doc, dict):
        return "bad_schema"
    return "bad_text" if has_bad_text(doc) else doc


def number(value: Any) -> float | None:
    """A finite number below :data:`MAX_FIGURE` in size, as a float; None for anything else
    (booleans, NaN, Infinity, strings, an integer too large for a float: JSON does not bound one)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and not -MAX_FIGURE < value < MAX_FIGURE:
        return None  # float() of a 400-digit integer raises instead of answering
    figure = float(value)
    return figure if math.isfinite(figure) and abs(figure) < MAX_FIGURE else None


def count(value: Any) -> int | None:
    """A counter: an integer in ``[0, BIG)``; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < BIG:
        return None
    return value


def text(value: Any, limit: int) -> str | None:
    """A string cut to ``limit`` characters; None for a non-string."""
    return value[:limit] if isinstance(value, str) else None


def counter_sum(value: Any) -> tuple[int | None, bool]:
    """The sum of a map of counters (the valid ones), clamped to :data:`BIG`, and whether it was
    clamped; (None, False) when ``value`` is not a map."""
    if not isinstance(value, dict):
        return None, False
    total = sum(c for c in (count(item) for item in value.values()) if c is not None)
    return min(total, BIG), total > BIG


def counter_map(value: Any, max_keys: int, key_chars: int) -> tuple[tuple[str, int], ...]:
    """The first ``max_keys`` valid counters of a map, keys cut to ``key_chars``; empty for a
    non-map."""
    if not isinstance(value, dict):
        return ()
    pairs: list[tuple[str, int]] = []
    for key, item in value.items():
        kept = count(item)
        if kept is not None and len(pairs) < max_keys:
            pairs.append((str(key)[:key_chars], kept))
    return tuple(pairs)


class _Named(Protocol):
    @property
    def name(self) -> str: ...


_N = TypeVar("_N", bound=_Named)


def first_named(value: Any, limit: int, parse: Callable[[Any], _N | None]) -> tuple[_N, ...]:
    """The items of a list section (a message's ``models``, ``pipelines``) that ``parse`` accepts,
    among the first ``limit``, each name once (the first wins); () for a non-list."""
    if not isinstance(value, list):
        return ()
    found: dict[str, _N] = {}
    for item in value[:limit]:
        parsed = parse(item)
        if parsed is not None and parsed.name not in found:
            found[parsed.name] = parsed
    return tuple(found.values())
