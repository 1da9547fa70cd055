"""uvicorn's HTTP/1.1 protocol (h11) with the limits of :mod:`.http_limits` applied per connection.

uvicorn has a keep-alive timeout (armed only after an answer) and a concurrency limit that
answers 503 to *requests* while the connections stay open, so a client that connects and
sends nothing, or half a head, holds a descriptor for ever. :class:`GuardedH11Protocol` adds,
each as narrowly as uvicorn's class allows:

- a head deadline, armed when the connection opens and after each answer: nothing arrived,
  the connection closes in silence; part of a head, ``408`` (in the API's error shape);
- a body rate floor: while a request's body is still coming, each ``head_timeout_s`` window
  in which the server was reading must bring ``body_min_rate * head_timeout_s`` bytes, else
  ``408`` (before the answer began) and the connection closes;
- a connection cap: one connection over it drops (RST, at once) the connection that has
  waited longest for a request head; when every connection has a request in progress the
  new one is answered ``503`` and closed. A client that sent no whole request loses nothing
  it had sent, the server gets its descriptor back;
- lingering close: a connection the server closes (a 401, a 408, a 503, an answer before the
  body was read) sends its answer and a FIN, then reads and drops what its client still sends
  for :data:`LINGER_S`; closing at once with unread bytes would make the kernel send a reset,
  and the client would lose the answer. Lingering connections are the first dropped at the cap;
- every drop counted by reason (:class:`Guard`, shown in ``/metrics`` and ``/api/status``).

The API adds ``Connection: close`` to its 401 answers, so a client without a token cannot keep
a connection it cannot use.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import Counter
from typing import Any, Protocol

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from sdk.fleet_server.http_limits import HttpLimits, body_too_slow, connection_cap, wanted_fd_limit

log = logging.getLogger("edgepack.fleet_server.http")

LINGER_S = 2.0
"""How long a closing connection keeps reading (and dropping) what its client still sends."""


def error_bytes(status: int, phrase: str, code: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer in the API's error shape that closes the connection, for answers
    given outside h11 (no request was parsed, or its app is cut off)."""
    body = json.dumps({"error": {"status": status, "code": code, "message": message}}).encode()
    return (
        f"HTTP/1.1 {status} {phrase}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body


def raise_fd_limit(limits: HttpLimits) -> int:
    """Raise the descriptor soft limit towards what ``max_connections`` needs, as far as the hard
    limit allows; the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = wanted_fd_limit(limits)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as err:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, err)
    return soft


class Connection(Protocol):
    """What the guard holds: a connection it can drop (the h11 protocol, or a TLS port's
    connection before its handshake, :mod:`.tls_listener`)."""

    def drop(self) -> None: ...


class Guard:
    """The limits in force and the server's connections: which ones wait for a request head (in
    the order they began to wait: the first is the one a new connection over the cap drops)."""

    def __init__(self, limits: HttpLimits, fd_limit: int) -> None:
        self.limits = limits
        self.fd_limit = fd_limit
        self.cap = connection_cap(limits, fd_limit)
        self.open: set[Connection] = set()
        self.waiting: dict[Connection, None] = {}  # insertion order: longest waiting first
        self.lingering: dict[Connection, None] = {}  # answered and closing: dropped first
        self.dropped: Counter[str] = Counter()

    def admit(self, connection: Connection) -> bool:
        """A new connection: True if it may go on (possibly after dropping the one that has waited
        longest for a head), False if it must be refused (every connection has a request)."""
        self.open.add(connection)
        if len(self.open) <= self.cap:
            return True
        victim = next(iter(self.lingering), None) or next(
            (other for other in self.waiting if other is not connection), None
        )
        if victim is None:
            self.dropped["over_cap"] += 1
            return False
        self.dropped["evicted"] += 1
        victim.drop()
        return True

    def forget(self, connection: Connection) -> None:
        self.open.discard(connection)
        self.waiting.pop(connection, None)
        self.lingering.pop(connection, None)

    def to_json(self) -> dict[str, Any]:
        return {
            "open": len(self.open),
            "waiting_for_head": len(self.waiting),
            "max_connections": self.cap,
            "fd_limit": self.fd_limit,
            "head_timeout_s": self.limits.head_timeout_s,
            "body_min_rate": self.limits.body_min_rate,
            "dropped": dict(self.dropped),
        }


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a :class:`Guard` (see the module docstring). Made per server
    with :func:`protocol_class`."""

    guard: Guard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._timer: asyncio.TimerHandle | None = None
        self._received = 0  # bytes read from the connection
        self._mark = 0  # bytes read when the current body window began
        if not self.guard.admit(self):
            self._refuse(
                503,
                "Service Unavailable",
                "busy",
                f"over --max-connections ({self.guard.cap}) open connections: retry later",
            )
            return
        self._wait_for_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self.guard.forget(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # lingering: what still arrives is dropped, never parsed
        self._received += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        if self.cycle is not before and not self.transport.is_closing():
            self._request_began()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._wait_for_head()  # a pipelined head already here ends the wait at once (handle_events)
        super().on_response_complete()

    # ---------------------------------------------------------------- the deadlines

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _wait_for_head(self) -> None:
        self._cancel_timer()
        self.guard.waiting.pop(self, None)
        self.guard.waiting[self] = None
        self._timer = self.loop.call_later(self.guard.limits.head_timeout_s, self._head_late)

    def _request_began(self) -> None:
        self._cancel_timer()
        self.guard.waiting.pop(self, None)
        self._mark = self._received
        if self.guard.limits.body_min_rate > 0:
            self._timer = self.loop.call_later(self.guard.limits.head_timeout_s, self._check_body)

    def _head_late(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        self.guard.dropped["head_timeout"] += 1
        if not self.conn.trailing_data[0]:
            self.transport.close()  # nothing of a request: nothing to answer
            return
        self._refuse(
            408,
            "Request Timeout",
            "timeout",
            f"the request head did not arrive within {self.guard.limits.head_timeout_s:g} s (--head-timeout)",
        )

    def _check_body(self) -> None:
        """One window of a body in progress: judged unless the server paused reading it."""
        self._timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return  # the body is complete (the request may still be running: not ours to judge)
        window = self.guard.limits.head_timeout_s
        if not self.flow.read_paused and body_too_slow(
            self._received - self._mark, window, self.guard.limits.body_min_rate
        ):
            self.guard.dropped["body_too_slow"] += 1
            self._refuse(
                408,
                "Request Timeout",
                "timeout",
                f"the request body came slower than {self.guard.limits.body_min_rate} bytes/s (--body-min-rate)",
            )
            return
        self._mark = self._received
        self._timer = self.loop.call_later(window, self._check_body)

    # ---------------------------------------------------------------- closing

    def _refuse(self, status: int, phrase: str, code: str, message: str) -> None:
        """Answer outside h11 (unless an answer already began) and close."""
        answering = self.cycle is not None and self.cycle.response_started and not self.cycle.response_complete
        if not answering:
            self.transport.write(error_bytes(status, phrase, code, message))
        self.transport.close()

    def linger(self) -> None:
        """The transport began a lingering close: no deadline of ours applies any more."""
        self._cancel_timer()
        self.guard.waiting.pop(self, None)
        self.guard.lingering[self] = None

    def drop(self) -> None:
        """Close at once (RST): the descriptor is free in this loop round, nothing is flushed."""
        self._cancel_timer()
        self.guard.forget(self)
        self.transport.abort()


class LingeringTransport:
    """The connection's transport as uvicorn sees it, with :meth:`close` made a lingering close
    (the rest is the real transport's)."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._lingering or self._transport.is_closing()

    def close(self) -> None:
        """Send what is queued and a FIN, keep reading (and dropping) until the client closes too
        or :data:`LINGER_S` passed, then close."""
        if self.is_closing():
            return
        if not self._transport.can_write_eof():
            self._transport.close()
            return
        self._lingering = True
        self._protocol.linger()
        self._transport.resume_reading()
        self._transport.write_eof()
        self._protocol.loop.call_later(LINGER_S, self._transport.abort)


def protocol_class(guard: Guard) -> type[GuardedH11Protocol]:
    """The protocol class uvicorn instantiates per connection, bound to ``guard``."""
    return type("FleetH11Protocol", (GuardedH11Protocol,), {"guard": guard})
