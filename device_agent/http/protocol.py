"""HTTP/1.1 on one connection, without I/O: bytes in, typed events out, answers as bytes
(``server.py`` moves the bytes; tests can drive this alone). h11 parses and frames; added here:

- HTTP/1.1 only: an ``Upgrade`` header is dropped (no h2c, no websocket: the request is answered
  in HTTP/1.1, and h11 knows the upgrade was declined when the answer is no 101);
- a whole head is bounded by ``MAX_HEAD_BYTES`` (h11 bounds only an unfinished one);
- what h11 refuses to parse is answered ``400 bad_http`` in the documented JSON shape;
- a connection in a health slot serves health routes only (else ``503 busy``), one answer, then
  closes; any other closes after ``MAX_REQUESTS`` answers;
- every answer carries its reason phrase and a ``Date``, and leaves in one write: the head waits
  for the body's first bytes; the body is dropped where HTTP has none (HEAD, 1xx, 204, 304).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from http import HTTPStatus

import h11

from device_agent.http import admission
from edgepack_core import wire_json

MAX_HEAD_BYTES = 16 * 1024
# Requests one connection serves: the answer to the last says ``Connection: close``.
MAX_REQUESTS = 1000
BUSY_MESSAGE = "every connection the agent serves requests on is busy (api.max_connections): retry later"
_PHRASES = {status.value: status.phrase.encode() for status in HTTPStatus}


@dataclass(frozen=True)
class Head:
    """A request head to serve: method (upper case), target, HTTP version, headers (lower-case
    names, ``Upgrade`` dropped)."""

    method: str
    target: bytes
    http_version: str
    headers: list[tuple[bytes, bytes]]


@dataclass(frozen=True)
class Refusal:
    """Answer with this error and close: nothing more of the connection is parsed."""

    status: int
    kind: str
    message: str


@dataclass(frozen=True)
class Body:
    data: bytes


class Signal:
    """A singleton event without data."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


END = Signal("END")  # the request's body is complete
NEED_DATA = Signal("NEED_DATA")  # read more
PAUSED = Signal("PAUSED")  # the next request waits until this answer is complete
CLOSED = Signal("CLOSED")  # the client closed its side
Event = Head | Refusal | Body | Signal


def error_body(kind: str, message: str) -> bytes:
    """An error in the documented shape, ``{"error": {"kind", "message"}}``."""
    return wire_json.dumps({"error": {"kind": kind, "message": message}}) + b"\n"


def error_bytes(status: int, kind: str, message: str) -> bytes:
    """A whole HTTP/1.1 error answer that closes the connection, given outside h11 (503 over
    the connection cap, 408 for a head that did not arrive, what h11 refused)."""
    body = error_body(kind, message)
    retry = "retry-after: 1\r\n" if status == 503 else ""
    return (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n{retry}connection: close\r\ndate: {http_date()}\r\n\r\n"
    ).encode() + body


_date = [0, ""]
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def http_date(now: float | None = None) -> str:
    """``now`` (default: the current second) as an HTTP date (RFC 9110 IMF-fixdate), made once a
    second; without ``email.utils``, which an idle agent has no other use for."""
    second = int(time.time() if now is None else now)
    if _date[0] != second or not _date[1]:
        t = time.gmtime(second)
        _date[:] = [
            second,
            f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT",
        ]
    return str(_date[1])


def head_bytes(request: h11.Request) -> int:
    """The length of a request's head as a client that writes no optional whitespace sends it
    (request line, header lines, the empty line)."""
    line = len(request.method) + len(request.target) + len(request.http_version) + 9  # " ", " HTTP/", CRLF
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers) + 2


def suppress_body(method: str, status: int) -> bool:
    """Answers that carry no body whatever the app gives (pure)."""
    return method == "HEAD" or status < 200 or status in (204, 304)


class Session:
    """The HTTP/1.1 state of one connection: feed it what arrives (:meth:`receive`), take its
    events (:meth:`next_event`), and turn the app's answer into bytes (:meth:`start`, :meth:`body`)."""

    def __init__(self, reserve: bool = False) -> None:
        self.connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
        self.reserve = reserve  # a health slot: health routes only, one answer
        self.requests = 0  # heads served on this connection
        self.refused = False  # answered outside h11: nothing more is parsed
        self._held: list[tuple[bytes, bytes]] | None = None
        self._started = False  # the current request's answer has begun
        self._status = 0
        self._method = "GET"

    @property
    def head_begun(self) -> bool:
        """Part of a next request has arrived (its head is not complete)."""
        return bool(self.connection.trailing_data[0])

    def receive(self, data: bytes) -> None:
        self.connection.receive_data(data)

    def continue_bytes(self) -> bytes:
        """``100 Continue`` when the client waits for it (sent as soon as the head is read), else nothing."""
        if not self.connection.they_are_waiting_for_100_continue:
            return b""
        return self._send(h11.InformationalResponse(status_code=100, headers=[], reason=b"Continue"))

    def next_event(self) -> Event:
        if self.refused:
            return NEED_DATA
        try:
            event = self.connection.next_event()
        except h11.RemoteProtocolError:
            if self.connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                return self._refuse(400, "bad_http", "malformed HTTP request (request line, headers or framing)")
            return CLOSED
        if isinstance(event, h11.Request):
            return self._head(event)
        if isinstance(event, h11.Data):
            return Body(bytes(event.data))
        if isinstance(event, h11.EndOfMessage):
            return END
        if event is h11.PAUSED:
            return PAUSED
        if event is h11.NEED_DATA:
            return NEED_DATA
        return CLOSED  # h11.ConnectionClosed

    def _head(self, request: h11.Request) -> Event:
        if head_bytes(request) > MAX_HEAD_BYTES:
            return self._refuse(400, "bad_http", "malformed HTTP request (request line, headers or framing)")
        if self.reserve and not admission.health_check(request.target, request.headers):
            return self._refuse(503, "busy", BUSY_MESSAGE)
        self.requests += 1
        self._started = False
        self._method = request.method.decode("ascii").upper()
        return Head(
            self._method,
            request.target,
            request.http_version.decode("ascii"),
            [(name, value) for name, value in request.headers if name != b"upgrade"],
        )

    def _refuse(self, status: int, kind: str, message: str) -> Refusal:
        self.refused = True
        return Refusal(status, kind, message)

    def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        """The answer's head, held until its body's first bytes (:meth:`body`)."""
        self._status = status
        self._held = headers
        self._started = True

    def body(self, data: bytes, more: bool) -> bytes:
        """The bytes to write for this part of the body: the held head first, the end of the
        message when nothing ``more`` follows."""
        out = b""
        if self._held is not None:
            headers, self._held = self._held, None
            if (self.reserve or self.requests >= MAX_REQUESTS) and (b"connection", b"close") not in headers:
                headers = [*headers, (b"connection", b"close")]  # a health slot serves one answer
            headers.append((b"date", http_date().encode()))
            out = self._send(
                h11.Response(status_code=self._status, headers=headers, reason=_PHRASES.get(self._status, b""))
            )
        if data and not suppress_body(self._method, self._status):
            out += self._send(h11.Data(data=data))
        if not more:
            out += self._send(h11.EndOfMessage())
        return out

    @property
    def answered(self) -> bool:
        """The current request's answer has begun (its head is out or held)."""
        return self._started

    def recycle(self) -> bool:
        """After a complete answer: ready for the next request on this connection (True), or
        the connection must close (the request's body was not all read, or either side said close)."""
        if self.connection.our_state is h11.DONE and self.connection.their_state is h11.DONE:
            try:
                self.connection.start_next_cycle()
            except h11.LocalProtocolError:
                return False
            return True
        return False

    def _send(self, event: h11.Event) -> bytes:
        try:
            return self.connection.send(event) or b""
        except h11.LocalProtocolError:
            if self.connection.their_state is not h11.ERROR:
                raise
            return b""
