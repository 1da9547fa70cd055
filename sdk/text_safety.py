"""The one rule for printing untrusted text on an operator's terminal. Pure.

Much of what the CLI prints was sent by devices (status and job reasons, model names and
versions, pipeline names, log records, settings results) or is the fleet server's stored copy of
it, kept as it came: bounded, not cleaned. Printed raw, ``\\x1b]0;...\\x07`` retitles the
terminal, ``\\x1b[2J`` wipes it, ``\\x1b]52;c;...`` writes the clipboard, ``\\r`` and ``\\n``
forge whole lines, U+202E reverses text. So every such string is shown with its control
(C0 and C1), format (bidi overrides, zero-width), surrogate, private-use, unassigned and
line/paragraph separator characters as visible ``\\xNN``/``\\uNNNN`` escapes: the operator still
sees that something was there, and no byte of it acts on the terminal.
"""

from __future__ import annotations

import unicodedata
from typing import Any

MAX_TEXT = 500
"""Characters :func:`clean` keeps by default (the server's own reason limit); longer ones end in ``…``."""
ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _escaped(char: str) -> str:
    if unicodedata.category(char) not in ESCAPED_CATEGORIES:
        return char
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` whole, each character of :data:`ESCAPED_CATEGORIES` (``\\n`` included) as its
    escape: one inert line. For a line the CLI formatted itself, of any length."""
    return "".join(_escaped(char) for char in text)


def clean(value: Any, limit: int = MAX_TEXT) -> str:
    """``value`` as text safe to print on one terminal line: control, format (bidi overrides),
    surrogate, unassigned and line-separator characters as ``\\xNN``/``\\uNNNN`` escapes, the
    result cut to ``limit`` characters (the last one ``…``). A non-string is ``""``. Pure."""
    if not isinstance(value, str):
        return ""
    out: list[str] = []
    size = 0
    for char in value:  # at most limit + 1 characters are looked at: each adds one or more
        char = _escaped(char)
        if size + len(char) > limit:
            return "".join(out)[: limit - 1] + "…"
        out.append(char)
        size += len(char)
    return "".join(out)


def cell(value: Any, width: int) -> str:
    """A table cell: ``value`` (anything; ``None`` is ``-``) as text, escaped, cut to ``width``."""
    return clean("-" if value is None else str(value), width)
