"""The fleet server's connection limits as pure decisions (the I/O is in :mod:`.http_guard`).

A client that opens connections and sends nothing, half a request head, or a body a byte at a
time must pay for what it holds: each such connection costs the server a descriptor and some
memory, and the descriptors run out long before the CPU does (1,100 half-open connections took
the API and the dashboard down under a 1,024-descriptor limit). So a connection has a deadline
for its head, a body must keep a minimum rate, and the number of connections is capped below
the descriptor limit; at the cap the connection that has waited longest without a request is
the one dropped (it has cost its client one connect; a request in progress is never dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

from sdk.errors import ServerConfigError

RESERVED_FDS = 256
"""Descriptors kept for everything but HTTP connections: the database pool (SQLite: the file,
its WAL and shared memory per connection), the MQTT connections, artifact files being read or
written, the listening socket and one accept batch (:data:`ACCEPT_BACKLOG`)."""
ACCEPT_BACKLOG = 128
"""The listen queue, also how many connections one accept round may take before the cap is
applied to them: kept well inside :data:`RESERVED_FDS`."""
MIN_CONNECTIONS = 16


@dataclass(frozen=True)
class HttpLimits:
    """``--head-timeout``, ``--body-min-rate`` and ``--max-connections`` (docs/fleet-server.md).

    ``head_timeout_s``: a connection sends a whole request head within this long of connecting
    or of its previous answer (else: closed in silence when nothing came, 408 when part did).
    ``body_min_rate``: bytes per second a request body must keep up, judged over each
    ``head_timeout_s`` window in which the server was reading (0: no floor).
    ``max_connections``: open connections at most (lowered to fit the descriptor limit)."""

    head_timeout_s: float = 10.0
    body_min_rate: int = 1024
    max_connections: int = 1000

    def __post_init__(self) -> None:
        if not 0.1 <= self.head_timeout_s <= 3600:
            raise ServerConfigError(f"--head-timeout {self.head_timeout_s:g} s must be 0.1 s to 1 h")
        if not 0 <= self.body_min_rate <= 1024**3:
            raise ServerConfigError(f"--body-min-rate {self.body_min_rate} must be 0 (none) to 1G bytes/s")
        if not MIN_CONNECTIONS <= self.max_connections <= 1_000_000:
            raise ServerConfigError(f"--max-connections {self.max_connections} must be {MIN_CONNECTIONS} to 1000000")


def wanted_fd_limit(limits: HttpLimits) -> int:
    """The descriptor soft limit that lets ``max_connections`` connections be open at once."""
    return limits.max_connections + RESERVED_FDS


def connection_cap(limits: HttpLimits, fd_soft_limit: int) -> int:
    """``max_connections``, lowered so that the connections and :data:`RESERVED_FDS` fit in
    ``fd_soft_limit``. :class:`ServerConfigError` when fewer than :data:`MIN_CONNECTIONS` fit."""
    cap = min(limits.max_connections, fd_soft_limit - RESERVED_FDS)
    if cap < MIN_CONNECTIONS:
        raise ServerConfigError(
            f"the open-file limit ({fd_soft_limit}) leaves room for {max(cap, 0)} connections; "
            f"raise it (ulimit -n, LimitNOFILE=) to at least {RESERVED_FDS + MIN_CONNECTIONS}"
        )
    return cap


def body_too_slow(received: int, window_s: float, min_rate: int) -> bool:
    """Whether ``received`` bytes of a body in a ``window_s`` window of reading are under the
    floor. Pure."""
    return min_rate > 0 and received < min_rate * window_s
