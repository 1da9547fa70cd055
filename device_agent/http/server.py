"""The agent's HTTP/1.1 server: its own connection driver on asyncio streams, one listening
socket, on its own thread and event loop, serving an ASGI-shaped app (``guards.Guard`` around
``web.Router``). HTTP itself (h11's parsing and framing, the head bound, HTTP/1.1 only, JSON
protocol errors, health slots answering once) is ``protocol.py``, apart from the I/O here.

No Hypercorn: it brought h2, hpack, hyperframe, wsproto and multiprocessing that an HTTP/1.1
device never speaks (3.4 MiB), and the bounds below were overrides of its private methods. What
the driver does, each rule documented in docs/agent.md ("HTTP API"):

- at most ``max_connections`` connections, and ``HEALTH_CONNECTIONS`` more for health checks
  only (``admission.py``): when all are taken, a new connection evicts the one that has waited
  longest (at least ``EVICT_AFTER_S``) for its request head (half-open heads and idle
  kept-alive connections are the cheapest to drop); when none waits, it is answered ``503`` and
  closed. A connection taken in the health reserve answers ``/healthz``, ``/metrics`` and
  ``/v2/health/*`` without a body (then closes) and ``503 busy`` for anything else;
- a deadline for the request head: it must arrive within ``read_timeout_s`` of the connection
  or of the previous answer, else ``408`` (nothing at all: the connection just closes; an idle
  kept-alive one after ``keep_alive_s``). The body's deadline is the app's (``app.py``);
- back pressure on a body the app reads slowly: at most ``APP_QUEUE_CHUNKS`` chunks wait for
  it, then reading pauses; once the app has answered, what still arrives is dropped, never queued;
- lingering close: a closing connection sends its answer and a FIN, then keeps reading (and
  dropping) what its client still sends for ``LINGER_S``, so a client still sending a refused
  body reads the answer rather than a reset;
- ``TCP_NODELAY`` on accepted sockets (the listening socket is created with ``IPPROTO_TCP``),
  and one write per answer (``protocol.py``), so no answer waits ~40 ms for a delayed ACK;
- a graceful stop: connections waiting for a head close, answers in flight get ``GRACEFUL_S``;
- every answer the server gives itself counted by status class (``count``; the guard counts the app's).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any
from urllib.parse import unquote

from device_agent.config import ApiSettings
from device_agent.http import admission
from device_agent.http.admission import Slot
from device_agent.http.app import AgentApp
from device_agent.http.protocol import (
    CLOSED,
    END,
    MAX_HEAD_BYTES,
    NEED_DATA,
    PAUSED,
    Body,
    Head,
    Refusal,
    Session,
    error_bytes,
)
from device_agent.runtime import InferenceService

log = logging.getLogger("edgepack.agent.http")

__all__ = ["MAX_HEAD_BYTES", "ApiServer", "HttpServer", "listening_socket"]

# How long a closing connection keeps reading (and discarding) what its client still sends.
LINGER_S = 2.0
# How long a stopping server waits for the answers in flight before it cancels them.
GRACEFUL_S = 5.0
# What one read takes from a connection, and how many messages of a body wait for the app before
# reading pauses: at most 768 KiB per request. Reads of 256 KiB are about as many as asyncio's
# transport makes (tools/bench/http_api.py).
READ_BYTES = 256 * 1024
APP_QUEUE_CHUNKS = 3


def listening_socket(address: tuple[str, int], backlog: int) -> socket.socket:
    """A TCP socket listening on ``address``, created with ``IPPROTO_TCP`` as its protocol: asyncio
    sets ``TCP_NODELAY`` on accepted connections only then, and without it every answer whose head
    and body leave apart waits about 40 ms for the client's delayed ACK."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        address[0] or None, address[1], type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class BodyQueue:
    """A request's messages on their way to the app, at most ``size`` waiting: :meth:`put`
    waits for room (back pressure on the read loop) until the app is done, after which what
    arrives is dropped. After the client went away, the app reads ``http.disconnect``."""

    def __init__(self, size: int) -> None:
        self._items: collections.deque[dict[str, Any]] = collections.deque()
        self._size = size
        self._done = False  # the app has returned: nothing more is queued
        self._gone = False  # the client went away
        self._readable = asyncio.Event()
        self._room = asyncio.Event()

    async def put(self, message: dict[str, Any]) -> None:
        while len(self._items) >= self._size and not self._done:
            self._room.clear()
            await self._room.wait()
        if not self._done:
            self._items.append(message)
            self._readable.set()

    async def get(self) -> dict[str, Any]:
        while not self._items:
            if self._gone:
                return {"type": "http.disconnect"}
            self._readable.clear()
            await self._readable.wait()
        self._room.set()
        return self._items.popleft()

    def disconnect(self) -> None:
        self._gone = True
        self._readable.set()

    def close(self) -> None:
        self._done = True
        self._items.clear()
        self._room.set()


class AgentConnection:
    """One accepted connection: reads, feeds its :class:`Session`, runs the app once per
    request, and applies the head deadline, eviction and lingering close."""

    def __init__(self, server: HttpServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.settings = server.settings
        self.count = server.count
        self.reader = reader
        self.writer = writer
        self.loop = asyncio.get_running_loop()
        self.session = Session()
        self.closing = False  # what still arrives is dropped, never parsed
        self.slot: Slot | None = Slot.GENERAL  # None: refused over every slot
        self.since = self.loop.time()  # when it began to wait for a head (or to close)
        self._head_timer: asyncio.TimerHandle | None = None  # armed while waiting for a request head
        self._linger: asyncio.TimerHandle | None = None
        self._queue: BodyQueue | None = None  # the request being served's body
        self._task: asyncio.Task[None] | None = None  # the app serving it
        self._peer = _address(writer.get_extra_info("peername"))  # (host, port) of the client
        self._local = _address(writer.get_extra_info("sockname"))
        self._cycle = asyncio.Event()  # set when no answer is in progress
        self._cycle.set()

    async def run(self) -> None:
        """Serve requests until either side closes; an answer in flight finishes first."""
        try:
            self.session.reserve = self.slot is Slot.RESERVE
            self._wait_for_head()
            await self._read_loop()
            if self._task is not None:
                await asyncio.wait([self._task])
        except OSError:
            pass
        finally:
            await self._close_now()

    async def refuse(self, status: int, kind: str, message: str) -> None:
        """Answer at once, read no request, close (lingering): a connection over the cap."""
        try:
            self._answer_and_close(status, kind, message)
            await self._read_loop()
        except OSError:
            pass
        finally:
            await self._close_now()

    def shutdown(self) -> None:
        """The server stops: a connection waiting for a request closes, a lingering one ends; one
        being answered finishes its answer, then closes."""
        if self._head_timer is not None:
            self._stop_waiting()
            self.writer.close()
        self.stop_lingering()

    @property
    def waiting_since(self) -> float | None:
        """Since when it waits for a request head or closes (None: a request is in progress)."""
        return self.since if self.closing or self._head_timer is not None else None

    def evict(self) -> None:
        """Dropped for a new connection while all slots are taken: closed at once, unanswered."""
        self.closing = True
        self._stop_waiting()
        if self._linger is not None:
            self._linger.cancel()
        if self._queue is not None:
            self._queue.disconnect()
        self.writer.transport.abort()

    # ------------------------------------------------------------ reading

    async def _read_loop(self) -> None:
        """Read until the client closes; a closing connection drops what still arrives (never
        parsed, never buffered)."""
        while not self.reader.at_eof():
            try:
                data = await self.reader.read(READ_BYTES)
            except (ConnectionError, OSError):
                break
            if data and not self.closing:
                self.session.receive(data)
                await self._handle_events()
        self._stop_waiting()
        if self._queue is not None:
            self._queue.disconnect()

    async def _handle_events(self) -> None:
        session = self.session
        while not self.closing:
            waiting = session.continue_bytes()
            if waiting:
                self.writer.write(waiting)
            event = session.next_event()
            if isinstance(event, Head):
                self._start_request(event)
            elif isinstance(event, Body):
                await self._put({"type": "http.request", "body": event.data, "more_body": True})
            elif event is END:
                await self._put({"type": "http.request", "body": b"", "more_body": False})
            elif isinstance(event, Refusal):
                self._answer_and_close(event.status, event.kind, event.message)
            elif event is PAUSED and not self._cycle.is_set():  # a next request came early: parsed
                await self._cycle.wait()  # once this answer is out
            else:  # NEED_DATA, CLOSED, or PAUSED on a connection that closes
                assert event in (NEED_DATA, CLOSED, PAUSED)
                return

    async def _put(self, message: dict[str, Any]) -> None:
        if self._queue is not None:
            await self._queue.put(message)

    # ------------------------------------------------------------ serving a request

    def _start_request(self, head: Head) -> None:
        self._stop_waiting()
        self._cycle.clear()
        path, _, query = head.target.partition(b"?")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.1"},
            "http_version": head.http_version,
            "method": head.method,
            "scheme": "http",
            "path": unquote(path.decode("ascii")),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": head.headers,
            "client": self._peer,
            "server": self._local,
        }
        self._queue = BodyQueue(APP_QUEUE_CHUNKS)
        self._task = self.loop.create_task(self._serve(scope, self._queue))

    async def _serve(self, scope: dict[str, Any], queue: BodyQueue) -> None:
        try:
            await self.server.app(scope, queue.get, self._send)
        except Exception:  # the connection survives anything the app raises
            log.exception("the HTTP app failed on %s", str(scope["path"])[:200])
        finally:
            queue.close()
            if self._task is asyncio.current_task():
                self._task = None
            if self._queue is queue:  # its answer never ended: none began (500), or it stopped midway
                self._queue = None
                if not self.closing and not self.session.answered:
                    self._answer_and_close(500, "internal", "the request failed before its answer began")
                elif not self.closing:
                    self._close()
                self._cycle.set()

    async def _send(self, message: dict[str, Any]) -> None:
        """The app's ``send``: the head is held, then leaves with the body in one write."""
        if self.closing:
            return
        if message["type"] == "http.response.start":
            self.session.start(int(message["status"]), list(message.get("headers", ())))
        elif message["type"] == "http.response.body":
            more = bool(message.get("more_body", False))
            data = self.session.body(message.get("body", b""), more)
            if data:
                self.writer.write(data)
                with contextlib.suppress(ConnectionError, RuntimeError):
                    await self.writer.drain()
            if not more:
                self._end_cycle()

    def _end_cycle(self) -> None:
        """The answer is out: the next request is read on this connection, or it closes (the
        body was not all read, either side said close, the server stops). The app may still
        run (the guard dropping a body): it keeps its own queue."""
        if self.closing:
            pass
        elif not self.server.stopping and self.session.recycle():
            self._queue = None
            self._wait_for_head()
        else:
            if self._queue is not None:
                self._queue.disconnect()
            self._queue = None
            self._close()
        self._cycle.set()

    # ------------------------------------------------------------ closing

    def _close(self) -> None:
        """Lingering close (:meth:`_start_lingering`), else at once."""
        if self._linger is None and not self._start_lingering():
            self.writer.close()

    async def _close_now(self) -> None:
        self._stop_waiting()
        if self._linger is not None:
            self._linger.cancel()
        if self._task is not None:
            self._task.cancel()
        with contextlib.suppress(ConnectionError, RuntimeError, asyncio.CancelledError):
            self.writer.close()
            await self.writer.wait_closed()

    def _start_lingering(self) -> bool:
        """Send what is queued and a FIN, then let the read loop drop what the client still sends
        until it closes too, or ``LINGER_S`` ends it. False when there is nothing to linger for:
        the client closed, or the server stops."""
        if self.writer.is_closing() or self.reader.at_eof() or self.server.stopping:
            return False
        self.closing = True
        self._stop_waiting()
        with contextlib.suppress(NotImplementedError, OSError, RuntimeError):
            self.writer.write_eof()
        self._linger = self.loop.call_later(LINGER_S, self.stop_lingering)
        self.since = self.loop.time()
        return True

    def stop_lingering(self) -> None:
        """End a lingering close now (its time is up, or the server stops): nothing more is sent."""
        if self._linger is not None:
            self.writer.transport.abort()

    def _answer_and_close(self, status: int, kind: str, message: str) -> None:
        """Answer outside h11 (no request was parsed, or none will be) and close, lingering."""
        self.closing = True  # nothing more of this connection is parsed
        self.count(status)
        if self._queue is not None:
            self._queue.disconnect()
        self.writer.write(error_bytes(status, kind, message))
        if not self._start_lingering():
            self.writer.close()

    # ------------------------------------------------------------ the head deadline

    def _wait_for_head(self) -> None:
        """Arm the head deadline: a connection where nothing arrives closes after
        ``read_timeout_s`` (after an answer: ``keep_alive_s``, if shorter); one whose head began
        and did not end within ``read_timeout_s`` is answered 408."""
        deadline = self.settings.read_timeout_s
        quiet = min(self.settings.keep_alive_s, deadline) if self.session.requests else deadline
        self._head_timer = self.loop.call_later(quiet, self._head_late, deadline - quiet)
        self.since = self.loop.time()

    def _head_late(self, rest: float) -> None:
        self._head_timer = None
        if not self.session.head_begun:  # nothing of a request: close in silence
            self.writer.close()
        elif rest > 0:  # a head began after an answer: it has until read_timeout_s
            self._head_timer = self.loop.call_later(rest, self._head_late, 0.0)
        else:
            self._answer_and_close(
                408,
                "timeout",
                f"the request head did not arrive within {self.settings.read_timeout_s:g} s (api.read_timeout_s)",
            )

    def _stop_waiting(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def _address(sockaddr: Any) -> tuple[str, int] | None:
    """(host, port) of an IPv4 or IPv6 socket address; None for anything else."""
    return (str(sockaddr[0]), int(sockaddr[1])) if isinstance(sockaddr, tuple) and len(sockaddr) >= 2 else None


class HttpServer:
    """An ASGI-shaped ``app`` served over HTTP/1.1 on a listening socket, on its own event loop
    (:meth:`serve` is its thread's target; :meth:`stop` may be called from any thread).
    Stopping closes idle and lingering connections at once and gives answers in flight
    ``GRACEFUL_S`` to finish."""

    def __init__(self, app: Any, sock: socket.socket, settings: ApiSettings, count: Callable[[int], None]) -> None:
        self.app = app
        self.socket = sock
        self.settings = settings
        self.count = count
        self.connections: set[AgentConnection] = set()  # open ones, lingering and refused ones included
        self.ready = threading.Event()
        self.stopping = False  # answers in flight close their connections
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None

    def serve(self) -> None:
        asyncio.run(self._serve())

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is already closed
                self._loop.call_soon_threadsafe(self._stop.set)

    def _place(self) -> Slot | None:
        """The slot of a connection being accepted (``admission.place_connection``), evicting the
        connection of that slot that has waited longest for its head where the rule says so."""
        held = [c for c in self.connections if c.slot is not None and not c.writer.transport.is_closing()]
        kinds = {kind: [c for c in held if c.slot is kind] for kind in Slot}
        now = asyncio.get_running_loop().time()
        waiting = {
            kind: [c for c in kinds[kind] if admission.evictable(c.waiting_since, now, admission.grace(kind))]
            for kind in Slot
        }
        occupancy = admission.Occupancy(
            len(kinds[Slot.GENERAL]), len(kinds[Slot.RESERVE]), len(waiting[Slot.GENERAL]), len(waiting[Slot.RESERVE])
        )
        placement = admission.place_connection(occupancy, self.settings.max_connections)
        if placement.evict is not None:
            min(waiting[placement.evict], key=lambda c: c.since).evict()
        return placement.slot

    async def _serve(self) -> None:
        handlers: set[asyncio.Task[Any]] = set()
        limit = self.settings.max_connections

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            handlers.add(task)
            connection = AgentConnection(self, reader, writer)
            slot = self._place()
            self.connections.add(connection)
            try:
                if slot is None:
                    connection.slot = None
                    await connection.refuse(
                        503,
                        "busy",
                        f"over api.max_connections ({limit}) open connections and "
                        f"{admission.HEALTH_CONNECTIONS} for health checks: retry later",
                    )
                else:
                    connection.slot = slot
                    await connection.run()
            finally:
                self.connections.discard(connection)
                handlers.discard(task)

        self._stop = asyncio.Event()
        server = await asyncio.start_server(accept, sock=self.socket, backlog=min(limit, 1024))
        self._loop = asyncio.get_running_loop()
        self.ready.set()
        try:
            await self._stop.wait()
        finally:
            server.close()
            self.stopping = True  # answers in flight close their connections
            for connection in list(self.connections):
                connection.shutdown()
            if handlers:
                await asyncio.wait(set(handlers), timeout=GRACEFUL_S)


class ApiServer:
    """The agent's HTTP API on ``address``: the app on the server above, on its own thread and
    event loop, inference on a bounded pool. The socket is bound in the constructor (an address
    in use fails there)."""

    def __init__(
        self,
        address: tuple[str, int],
        service: InferenceService,
        *,
        max_body_bytes: int | None = None,
        health: Callable[[], dict[str, Any]] | None = None,
        settings: ApiSettings | None = None,
        models: Callable[[], Mapping[str, InferenceService]] | None = None,
        pipelines: Callable[[], Sequence[Any]] | None = None,
    ) -> None:
        settings = settings or ApiSettings()
        if max_body_bytes is not None:
            settings = replace(
                settings,
                max_body_bytes=max_body_bytes,
                max_buffered_bytes=max(settings.max_buffered_bytes, max_body_bytes),
            )
        self.settings = settings
        self.service = service
        self.app = AgentApp(service, settings, health, models, pipelines)
        self._socket = listening_socket(address, backlog=min(settings.max_connections, 1024))
        self._server = HttpServer(self.app.asgi, self._socket, settings, self.app.http_stats.count)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    @property
    def listening(self) -> socket.socket:
        return self._socket

    def connections(self) -> list[Any]:
        """The open connections (``AgentConnection``; read them on the server's loop only)."""
        return list(self._server.connections)

    def start(self) -> ApiServer:
        self._thread = threading.Thread(target=self._server.serve, name="http-api", daemon=True)
        self._thread.start()
        while not self._server.ready.wait(0.05):
            if not self._thread.is_alive():
                raise OSError(f"the HTTP API did not start on port {self.port}")
        return self

    def stop(self) -> None:
        self._server.stop()
        if self._thread is not None:
            self._thread.join(10)
        self.app.pool.shutdown(wait=False, cancel_futures=True)
        self._socket.close()
