"""Where a download may come from, and the bounds it is held to: pure decisions, apart from
the HTTP machinery of :mod:`device_agent.updates.download` (which re-exports them), so the
update service checks and keeps its bounds without loading ``http.client`` and ``urllib``
until a deploy actually downloads."""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

STALL_S = 5.0
"""A read that sees no byte for this long ends the attempt (and bounds how late a cancel is seen);
the head of an answer must arrive within it in all; a failed attempt lasts at least this long."""
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True)
class Bounds:
    """Limits on one download. ``origins`` are ``scheme://host:port`` strings (normalised)."""

    origins: frozenset[str]
    max_bytes: int
    deadline_s: float = 3600.0
    min_rate_bytes_s: float = 1024.0
    any_port_hosts: frozenset[str] = frozenset()
    stall_s: float = STALL_S
    ca: Path | None = None  # agent.yaml updates.ca; None: the system's CAs verify https:// downloads
    client: tuple[str, str] | None = None  # the device's certificate and key, for a server that asks (mutual TLS)


def origin_of(url: str) -> str | None:
    """``scheme://host:port`` of an http(s) URL (port made explicit), or None. Pure."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
        return None
    return f"{parts.scheme}://{parts.hostname.lower()}:{port or _DEFAULT_PORTS[parts.scheme]}"


def allowed_origins(origins: Iterable[str]) -> frozenset[str]:
    """Normalise agent.yaml ``updates.allowed_origins`` entries."""
    normalised = {origin_of(entry) for entry in origins}
    return frozenset(o for o in normalised if o is not None)


def origin_allowed(url: str, bounds: Bounds) -> bool:
    """Whether ``url`` is on an allowed origin (or an allowed host, any port). Pure."""
    origin = origin_of(url)
    if origin is None:
        return False
    if origin in bounds.origins:
        return True
    host = urllib.parse.urlsplit(url).hostname or ""
    return host.lower() in bounds.any_port_hosts
