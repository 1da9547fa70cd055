"""Who gets a connection and how many body bytes may be held: the HTTP API's admission rules,
pure (``server.py`` and ``app.py`` apply them; tests pin their boundaries here).

Connections are cheap to open and dear to hold, so a connection that has not sent a whole
request head is the cheapest to drop: when every slot is taken, a new connection evicts the one
that has waited longest for its head (a half-open head or an idle kept-alive connection, once it
has waited ``EVICT_AFTER_S``: a client's head follows its connect at once) rather than being
refused. Health checks keep ``HEALTH_CONNECTIONS`` slots beyond ``max_connections``
for themselves, so ``/healthz`` and ``/metrics`` answer while every other slot is busy.

Body bytes are counted as they arrive, never as they are declared: a client declaring 16 MiB
and sending nothing reserves nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

# Connections beyond api.max_connections that only health routes may use (each closes after one answer).
HEALTH_CONNECTIONS = 4
HEALTH_PATHS = frozenset({"/healthz", "/metrics", "/v2/health/live", "/v2/health/ready"})
# How long a connection waits for its head before a newcomer may evict it: long enough for any
# client's head to follow its connect, far shorter than api.read_timeout_s.
EVICT_AFTER_S = 1.0


class Slot(enum.Enum):
    GENERAL = "general"  # any route
    RESERVE = "reserve"  # health routes only


@dataclass(frozen=True)
class Occupancy:
    """The open connections of each kind, and how many of them still wait for a request head."""

    general: int
    reserve: int
    general_waiting: int
    reserve_waiting: int


@dataclass(frozen=True)
class Placement:
    """Where a new connection goes: ``slot`` (None: refused with 503) and which kind of
    connection, if any, it evicts first (the one of that kind waiting longest for its head)."""

    slot: Slot | None
    evict: Slot | None = None


def place_connection(occupancy: Occupancy, max_connections: int, reserve: int = HEALTH_CONNECTIONS) -> Placement:
    """A new connection's placement (pure): a free general slot, else the general slot of a
    connection still waiting for its head, else a reserve slot, else a waiting reserve one's."""
    if occupancy.general < max_connections:
        return Placement(Slot.GENERAL)
    if occupancy.general_waiting:
        return Placement(Slot.GENERAL, evict=Slot.GENERAL)
    if occupancy.reserve < reserve:
        return Placement(Slot.RESERVE)
    if occupancy.reserve_waiting:
        return Placement(Slot.RESERVE, evict=Slot.RESERVE)
    return Placement(None)


def evictable(waiting_since: float | None, now: float, after: float = EVICT_AFTER_S) -> bool:
    """A connection waiting for its head (``waiting_since``; None: it is not) long enough to be
    dropped for a newcomer (pure)."""
    return waiting_since is not None and now - waiting_since >= after


def grace(slot: Slot) -> float:
    """How long a connection in ``slot`` waits for its head before a newcomer may evict it (pure):
    ``EVICT_AFTER_S`` in a general slot, none in a health one (a health check's head follows its
    connect at once, and a flood of fresh connections must not keep health checks out)."""
    return EVICT_AFTER_S if slot is Slot.GENERAL else 0.0


def is_health_target(target: bytes | str) -> bool:
    """A request target naming a health route, query ignored (pure)."""
    text = target.decode("latin1") if isinstance(target, bytes) else target
    return text.partition("?")[0] in HEALTH_PATHS


def health_check(target: bytes | str, headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """A request a health slot serves (pure): a health route, without a body (a declared body
    that never comes would hold the slot while the answer waits to drain it)."""
    framing = {name.lower(): value for name, value in headers if name.lower() in (b"content-length",
                                                                                   b"transfer-encoding")}
    return is_health_target(target) and framing.get(b"content-length", b"0").strip() == b"0" and \
        b"transfer-encoding" not in framing


class BodyBudget:
    """Body bytes held at once, counted as they arrive (event loop only: no lock)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def take(self, size: int) -> bool:
        """Hold ``size`` more bytes if they fit under the limit; False (nothing held) if not."""
        if self.held + size > self.limit:
            return False
        self.held += size
        return True

    def give(self, size: int) -> None:
        self.held -= size
