"""One pattern for every id and name that crosses the wire: device ids, group names, command
and job ids, transfer ids, model names.

Why one pattern: these strings become MQTT topic levels, mosquitto ACL substitutions (``%u``),
journal file names and store directory names. A name holding ``/``, ``..``, ``+`` or ``#``
would be a path traversal or an ACL bypass, and a long or non-ASCII one makes file names fail
in ways that lose the command. So every name is checked here, before anything uses it; a
value that fails never becomes part of a path (:func:`digest_ref` names it instead).
"""

from __future__ import annotations

import hashlib
import re

from edgepack_core.errors import InvalidNameError

MAX_ID_LENGTH = 64
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
"""Starts with a letter or digit (never ``.``, ``..``, ``-x`` or a ``$SYS``-like name), then
up to 63 characters that are safe in a topic level, a file name and an ACL pattern alike."""

_ID = re.compile(ID_PATTERN)


def is_valid_id(value: object) -> bool:
    """Whether ``value`` is a string matching :data:`ID_PATTERN`. Never raises."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def validate_id(value: object, what: str) -> str:
    """Return ``value`` if it matches :data:`ID_PATTERN`; raise :class:`InvalidNameError`
    naming ``what`` (the field) and the first rule it breaks."""
    if not isinstance(value, str):
        raise InvalidNameError(what, str(value), "must be a string")
    if not value:
        raise InvalidNameError(what, value, "must not be empty")
    if len(value) > MAX_ID_LENGTH:
        raise InvalidNameError(what, value, f"is longer than {MAX_ID_LENGTH} characters")
    for char in "+#/":
        if char in value:
            raise InvalidNameError(what, value, f"must not contain {char!r}")
    if _ID.fullmatch(value) is None:
        raise InvalidNameError(
            what, value, "may hold only letters, digits, '.', '_' and '-' and must start with a letter or digit")
    return value


def digest_ref(raw: object) -> str:
    """A safe stand-in for a value that failed :func:`validate_id` (e.g. the id of a rejected
    command): ``rejected-`` and 16 hex digits of the SHA-256 of its text (``repr`` for a
    non-string). Equal raw values give equal refs, so duplicates of one bad command can still
    be recognised; the result always matches :data:`ID_PATTERN`."""
    text = raw if isinstance(raw, str) else repr(raw)
    return "rejected-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def safe_id(text: str, *, fallback: str = "x") -> str:
    """``text`` squeezed into :data:`ID_PATTERN` (for ids the host makes up from model names and
    versions, e.g. a semver ``1.0.0+build`` holds ``+``): other characters become ``_``, a first
    character that is not a letter or digit gets ``fallback`` in front, the result is cut to the
    maximum length. ``fallback`` must itself start with a letter or digit."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]", "_", text)
    if not cleaned[:1].isalnum():
        cleaned = fallback + cleaned
    return cleaned[:MAX_ID_LENGTH]
