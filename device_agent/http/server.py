"""The agent's HTTP/1.1 server: Hypercorn's h11 protocol and connection driver on one listening
socket, on its own thread and event loop, with what an exposed device needs and Hypercorn lacks.

Hypercorn (pure Python, no click: the device stays light) parses with h11, frames bodies,
recycles kept-alive connections, applies back pressure to a body the app reads slowly (at most
``max_app_queue_size`` chunks wait) and bounds a request head (``h11_max_incomplete_size``).
Added here, each as narrowly as its classes allow:

- HTTP/1.1 only: no HTTP/2 (neither ``h2c`` upgrade nor prior knowledge) and no websockets;
  an ``Upgrade`` header is ignored and the request answered in HTTP/1.1;
- at most ``max_connections`` connections, and ``HEALTH_CONNECTIONS`` more for health checks
  only (``device_agent/admission.py``): when all are taken, a new connection evicts the one
  that has waited longest (at least ``EVICT_AFTER_S``) for its request head (half-open heads and
  idle kept-alive connections are the cheapest to drop); when none waits, it is answered ``503``
  and closed. A connection taken
  in the health reserve answers ``/healthz``, ``/metrics`` and ``/v2/health/*`` without a body
  (then closes) and ``503 busy`` for anything else;
- a deadline for the request head: it must arrive within ``read_timeout_s`` of the connection
  or of the previous answer, else ``408`` (nothing at all: the connection just closes; an idle
  kept-alive one after ``keep_alive_s``). The body's deadline is the app's (``app.py``);
- protocol errors h11 refuses (a ``Content-Length`` of 5,000 digits, a head over 16 KiB, bad
  framing) answered in the documented JSON shape, ``400 bad_http``, instead of an empty body;
- lingering close: a closing connection sends its answer and a FIN, then keeps reading (and
  dropping) what its client still sends for ``LINGER_S``, so a client still sending a refused
  body reads the answer rather than a reset;
- one write per answer (the head waits for the body's first bytes) and ``TCP_NODELAY`` on
  accepted sockets (the listening socket is created with ``IPPROTO_TCP``), so no answer waits
  about 40 ms for the client's delayed ACK;
- every answer given here counted by status class (``count``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from http import HTTPStatus
from typing import Any

import h11
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.asyncio.task_group import TaskGroup
from hypercorn.asyncio.tcp_server import TCPServer
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.typing import ConnectionState
from hypercorn.utils import parse_socket_addr

from device_agent.config import ApiSettings
from device_agent.http import admission
from device_agent.http.admission import Slot
from device_agent.http.app import AgentApp
from device_agent.runtime import InferenceService
from edgepack_core import wire_json

log = logging.getLogger("edgepack.agent.http")
_PHRASES = {status.value: status.phrase.encode() for status in HTTPStatus}

MAX_HEAD_BYTES = 16 * 1024
# How long a closing connection keeps reading (and discarding) what its client still sends.
LINGER_S = 2.0
# How long a stopping server waits for the answers in flight before it cancels them.
GRACEFUL_S = 5.0
# What one read takes from a connection, and how many such chunks of a body wait for the app
# before reading pauses: at most 768 KiB per request (Hypercorn: 64 KiB reads, 10 chunks, 640 KiB).
# Reads of 256 KiB are about as many as asyncio's transport makes; with 64 KiB a 600 kB body took
# 1.6x uvicorn's Python calls on the event loop, with 256 KiB 1.15x (tools/bench/http_api.py).
READ_BYTES = 256 * 1024
APP_QUEUE_CHUNKS = 3


def error_body(kind: str, message: str) -> bytes:
    """An error in the documented shape, ``{"error": {"kind", "message"}}``."""
    return wire_json.dumps({"error": {"kind": kind, "message": message}}) + b"\n"


def error_bytes(status: int, kind: str, message: str) -> bytes:
    """A whole HTTP/1.1 error answer that closes the connection, for answers the server gives
    outside h11 (503 over the connection cap, 408 for a head that did not arrive)."""
    body = error_body(kind, message)
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


def head_bytes(request: h11.Request) -> int:
    """The length of a request's head as a client that writes no optional whitespace sends it
    (request line, header lines, the empty line)."""
    line = len(request.method) + len(request.target) + len(request.http_version) + 9  # " ", " HTTP/", CRLF
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


def listening_socket(address: tuple[str, int], backlog: int) -> socket.socket:
    """A TCP socket listening on ``address``, created with ``IPPROTO_TCP`` as its protocol: asyncio
    sets ``TCP_NODELAY`` on accepted connections only then, and without it every answer whose head
    and body leave apart waits about 40 ms for the client's delayed ACK."""
    family, kind, proto, _, sockaddr = socket.getaddrinfo(address[0] or None, address[1], type=socket.SOCK_STREAM,
                                                          proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class AgentH11Protocol(H11Protocol):
    """Hypercorn's HTTP/1.1 protocol, HTTP/1.1 only, with JSON protocol errors and one write per answer."""

    count: Callable[[int], None] = staticmethod(lambda status: None)
    reserve = False  # its connection holds a health slot: health routes only, one answer
    _held_head = b""

    async def _check_protocol(self, event: h11.Request) -> None:
        """No switch to HTTP/2: an ``Upgrade: h2c`` request (or ``PRI *``) is answered in HTTP/1.1."""

    async def _create_stream(self, request: h11.Request) -> None:
        """Every request is plain HTTP: without its ``Upgrade`` header a websocket handshake is
        a GET like any other (h11 knows the upgrade was declined when the answer is no 101). A
        head over ``MAX_HEAD_BYTES`` is refused like an unfinished one (h11 bounds only those:
        a whole head that came in one read would pass)."""
        if head_bytes(request) > MAX_HEAD_BYTES:
            await self._send_error_response(431)
            await self.send(Closed())
            return
        if self.reserve and not admission.health_check(request.target, request.headers):
            await self._send_json_error(503, "busy", "every connection the agent serves requests on is busy "
                                        "(api.max_connections): retry later")
            await self.send(Closed())
            return
        if any(name == b"upgrade" for name, _ in request.headers):
            request = h11.Request(method=request.method, target=request.target, http_version=request.http_version,
                                  headers=[(name, value) for name, value in request.headers if name != b"upgrade"])
        await super()._create_stream(request)

    async def _send_h11_event(self, event: Any) -> None:
        if self.reserve and type(event) is h11.Response and (b"connection", b"close") not in event.headers:
            # a health slot serves one answer, then closes
            event = h11.Response(status_code=event.status_code, reason=event.reason,
                                 headers=[*event.headers, (b"connection", b"close")])
        try:
            data = self.connection.send(event)
        except h11.LocalProtocolError:
            if self.connection.their_state != h11.ERROR:
                raise
            return
        if isinstance(event, (h11.Response, h11.InformationalResponse)) and not event.reason and data:
            # Hypercorn gives no reason phrase: h11 wrote "HTTP/1.1 404 \r\n"
            data = data.replace(b" \r\n", b" " + _PHRASES.get(event.status_code, b"") + b"\r\n", 1)
        if type(event) is h11.Response:  # held: it leaves with the body's first bytes, in one send
            self._held_head = data or b""
            return
        if self._held_head:
            data, self._held_head = self._held_head + (data or b""), b""
        if data:
            await self.send(RawData(data=data))

    async def _send_error_response(self, status_code: int) -> None:
        """What h11 refuses to parse, answered in the documented shape (``400 bad_http``)."""
        await self._send_json_error(400, "bad_http", "malformed HTTP request (request line, headers or framing)")

    async def _send_json_error(self, status: int, kind: str, message: str) -> None:
        """An error answer in the documented shape that closes the connection, given by the protocol."""
        self.count(status)
        body = error_body(kind, message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), *self.config.response_headers("h11")]
        if status == 503:
            headers.append((b"retry-after", b"1"))
        await self._send_h11_event(h11.Response(status_code=status, headers=headers,
                                                reason=HTTPStatus(status).phrase.encode()))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


class AgentConnection(TCPServer):
    """One accepted connection: Hypercorn's connection driver with :class:`AgentH11Protocol`, the
    head deadline and lingering close."""

    def __init__(self, server: HttpServer, context: WorkerContext, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        super().__init__(server.app, asyncio.get_running_loop(), server.config, context, {}, reader, writer)
        self.settings = server.settings
        self.count = server.count
        self.protocol: AgentH11Protocol | None = None  # type: ignore[assignment]
        self.closing = False  # what still arrives is dropped, never parsed
        self.slot: Slot | None = Slot.GENERAL  # None: refused over every slot
        self.since = self.loop.time()  # when it began to wait for a head (or to close)
        self._head_timer: asyncio.TimerHandle | None = None  # armed while waiting for a request head
        self._linger: asyncio.TimerHandle | None = None

    async def run(self) -> None:
        """Hypercorn's ``TCPServer.run`` with :class:`AgentH11Protocol` itself rather than the
        wrapper that switches a connection to HTTP/2, and the head deadline's timer in place of
        Hypercorn's idle task; the socket closes at once when it ends."""
        sock = self.writer.get_extra_info("socket")
        try:
            client = parse_socket_addr(sock.family, sock.getpeername())
            server = parse_socket_addr(sock.family, sock.getsockname())
            async with TaskGroup(self.loop) as task_group:
                self._task_group = task_group
                self.protocol = AgentH11Protocol(self.app, self.config, self.context, task_group,
                                                 ConnectionState({}), False, client, server, self.protocol_send)
                self.protocol.count = self.count
                self.protocol.reserve = self.slot is Slot.RESERVE
                self._wait_for_head()
                await self._read_data()
        except OSError:
            pass
        finally:
            await self._close_now()

    async def refuse(self, status: int, kind: str, message: str) -> None:
        """Answer at once, read no request, close (lingering): a connection over the cap."""
        try:
            self._answer_and_close(status, kind, message)
            await self._read_data()
        except OSError:
            pass
        finally:
            await self._close_now()

    def shutdown(self) -> None:
        """The server stops: a connection waiting for a request closes, a lingering one ends; one
        being answered finishes its answer (Hypercorn closes it then)."""
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
        self.writer.transport.abort()

    async def protocol_send(self, event: Any) -> None:
        """Hypercorn's, except that its idle and busy updates (a connection waits for a request,
        or has one) drive the head deadline's timer rather than its idle task."""
        if isinstance(event, Updated):
            self._stop_waiting()
            if event.idle:
                self._wait_for_head()
            return
        await super().protocol_send(event)

    async def _read_data(self) -> None:
        """Hypercorn's read loop, except that a closing connection drops what still arrives (never
        parsed, never buffered)."""
        while not self.reader.at_eof():
            try:
                data = await self.reader.read(READ_BYTES)
            except (ConnectionError, OSError):
                break
            if not self.closing and self.protocol is not None:
                await self.protocol.handle(RawData(data))
        self._stop_waiting()
        if self.protocol is not None:
            await self.protocol.handle(Closed())

    async def _close(self) -> None:
        """Lingering close, where Hypercorn closes at once (see :meth:`_start_lingering`)."""
        if self._linger is None and not self._start_lingering():
            await self._close_now()

    async def _close_now(self) -> None:
        self._stop_waiting()
        if self._linger is not None:
            self._linger.cancel()
        await super()._close()

    def _start_lingering(self) -> bool:
        """Send what is queued and a FIN, then let the read loop drop what the client still sends
        until it closes too, or ``LINGER_S`` ends it. False when there is nothing to linger for:
        the client closed, or the server stops."""
        if self.writer.is_closing() or self.reader.at_eof() or self.context.terminated.is_set():
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

    def _wait_for_head(self) -> None:
        """Arm the head deadline (Hypercorn's idle timeout closes in silence after
        ``keep_alive_timeout`` even when part of a head arrived): a connection where nothing
        arrives closes after ``read_timeout_s`` (after an answer: ``keep_alive_s``, if shorter);
        one whose head began and did not end within ``read_timeout_s`` is answered 408."""
        assert self.protocol is not None
        deadline = self.settings.read_timeout_s
        quiet = min(self.settings.keep_alive_s, deadline) if self.protocol.keep_alive_requests else deadline
        self._head_timer = self.loop.call_later(quiet, self._head_late, deadline - quiet)
        self.since = self.loop.time()

    def _head_late(self, rest: float) -> None:
        assert self.protocol is not None
        self._head_timer = None
        if not self.protocol.connection.trailing_data[0]:  # nothing of a request: close in silence
            self.writer.close()
        elif rest > 0:  # a head began after an answer: it has until read_timeout_s
            self._head_timer = self.loop.call_later(rest, self._head_late, 0.0)
        else:
            self._answer_and_close(408, "timeout", f"the request head did not arrive within "
                                   f"{self.settings.read_timeout_s:g} s (api.read_timeout_s)")

    def _stop_waiting(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _answer_and_close(self, status: int, kind: str, message: str) -> None:
        """Answer outside h11 (no request was parsed, or none will be) and close, lingering."""
        self.closing = True  # nothing more of this connection is parsed
        self.count(status)
        self.writer.write(error_bytes(status, kind, message))
        if not self._start_lingering():
            self.writer.close()


class HttpServer:
    """Hypercorn's HTTP/1.1 protocol serving an ASGI ``app`` on a listening socket, on its own event
    loop (:meth:`serve` is its thread's target; :meth:`stop` may be called from any thread).
    Stopping closes idle and lingering connections at once and gives answers in flight
    ``GRACEFUL_S`` to finish."""

    def __init__(self, app: Any, sock: socket.socket, settings: ApiSettings, count: Callable[[int], None]) -> None:
        config = Config()
        config.h11_max_incomplete_size = MAX_HEAD_BYTES
        config.read_timeout = None  # per read: it would cut a connection whose request is being inferred
        config.max_app_queue_size = APP_QUEUE_CHUNKS
        config.include_server_header = False
        config.accesslog = None
        config.errorlog = log
        self.config = config
        self.app = ASGIWrapper(app)
        self.socket = sock
        self.settings = settings
        self.count = count
        self.connections: set[AgentConnection] = set()  # open ones, lingering and refused ones included
        self.ready = threading.Event()
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
        waiting = {kind: [c for c in kinds[kind]
                          if admission.evictable(c.waiting_since, now, admission.grace(kind))]
                   for kind in Slot}
        occupancy = admission.Occupancy(len(kinds[Slot.GENERAL]), len(kinds[Slot.RESERVE]),
                                        len(waiting[Slot.GENERAL]), len(waiting[Slot.RESERVE]))
        placement = admission.place_connection(occupancy, self.settings.max_connections)
        if placement.evict is not None:
            min(waiting[placement.evict], key=lambda c: c.since).evict()
        return placement.slot

    async def _serve(self) -> None:
        context = WorkerContext(None)
        handlers: set[asyncio.Task] = set()
        limit = self.settings.max_connections

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            handlers.add(task)
            connection = AgentConnection(self, context, reader, writer)
            slot = self._place()
            self.connections.add(connection)
            try:
                if slot is None:
                    connection.slot = None
                    await connection.refuse(503, "busy", f"over api.max_connections ({limit}) open connections and "
                                            f"{admission.HEALTH_CONNECTIONS} for health checks: retry later")
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
            await context.terminated.set()  # answers in flight close their connections
            for connection in list(self.connections):
                connection.shutdown()
            if handlers:
                await asyncio.wait(set(handlers), timeout=GRACEFUL_S)


class ApiServer:
    """The agent's HTTP API on ``address``: the app on Hypercorn's HTTP/1.1 protocol
    (above) on its own thread and event loop, inference on a bounded
    pool. The socket is bound in the constructor (an address in use fails there)."""

    def __init__(self, address: tuple[str, int], service: InferenceService, *, max_body_bytes: int | None = None,
                 health: Callable[[], dict[str, Any]] | None = None, settings: ApiSettings | None = None,
                 models: Callable[[], Mapping[str, InferenceService]] | None = None,
                 pipelines: Callable[[], Sequence[Any]] | None = None) -> None:
        settings = settings or ApiSettings()
        if max_body_bytes is not None:
            settings = replace(settings, max_body_bytes=max_body_bytes,
                               max_buffered_bytes=max(settings.max_buffered_bytes, max_body_bytes))
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
