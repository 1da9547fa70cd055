"""HTTPS on the fleet server's own port (``fleet serve --tls-cert/--tls-key [--tls-client-ca]``).

Why not uvicorn's ``ssl_certfile``: asyncio would do the handshake before our protocol sees the
connection, so (1) a plain HTTP request to the TLS port would get a closed connection and no
word, and (2) connections still in their handshake would escape :class:`~.http_guard.Guard`'s
head deadline and connection cap. Instead each accepted connection starts as a
:class:`TlsSniffer`, counted by the guard like any connection waiting for a head. Its first
bytes decide: a TLS handshake record is handed to asyncio's own TLS protocol (the handshake must
end within ``--head-timeout`` of connecting), then to the guarded h11 protocol, which applies
every limit to the decrypted stream; an HTTP request line is answered with a plain ``400``
naming the ``https://`` URL (as nginx's 497) and closed; anything else is closed. A refused
handshake is logged as one line naming the client (``certificate verify failed: ... (client
HOST:PORT)``), at most one line a minute with the count of the others, so a scanner cannot fill
the log.
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
import time
from asyncio import sslproto
from typing import Any

from edgepack_core.tls import first_bytes_kind, tls_failure
from sdk.fleet_server.http_guard import LINGER_S, Guard, GuardedH11Protocol, error_bytes, protocol_class

_HOST_HEADER = re.compile(rb"\r\nhost:[ \t]*([A-Za-z0-9.\-\[\]:]{1,255})[ \t]*\r\n", re.IGNORECASE)
_PEEK_LIMIT = 8192  # a plain request's head is read this far to find its Host header
LOG_EVERY_S = 60.0
log = logging.getLogger("edgepack.fleet_server.tls")


class RefusalLog:
    """Refused handshakes in the server's log: the first at once, then at most one line per
    ``every_s`` saying how many were left out (a port scan is a few lines, not thousands)."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Any = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self._next = 0.0
        self._held = 0

    def refused(self, line: str) -> bool:
        """Log ``line`` unless one was logged within ``every_s``; whether it was logged."""
        now = self.clock()
        if now < self._next:
            self._held += 1
            return False
        more = f" ({self._held} more refused since the last line)" if self._held else ""
        log.warning("%s%s", line, more)
        self._next, self._held = now + self.every_s, 0
        return True


REFUSALS = RefusalLog()


def plain_http_answer(head: bytes, fallback: str) -> bytes:
    """The ``400`` a plain HTTP request on the TLS port gets, naming the ``https://`` address:
    the request's own Host header when it is a plain host name, else ``fallback``. Pure."""
    match = _HOST_HEADER.search(head)
    host = match[1].decode("ascii") if match else fallback
    return error_bytes(400, "Bad Request", "tls_required", f"this port speaks HTTPS: use https://{host}")


class _ServerTlsProtocol(sslproto.SSLProtocol):
    """asyncio's TLS protocol, telling the sniffer when the connection is gone (during the
    handshake nothing else would)."""

    def __init__(self, sniffer: TlsSniffer, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sniffer = sniffer

    def connection_lost(self, exc: BaseException | None) -> None:
        self._sniffer.ended()
        super().connection_lost(exc)

    def _on_handshake_complete(self, handshake_exc: BaseException | None) -> None:
        """A refused handshake (mutual TLS without a good client certificate) first sends
        OpenSSL's alert, so the client can say why; asyncio would close without it."""
        if handshake_exc is not None:
            peer = self._sniffer.transport.get_extra_info("peername") if self._sniffer.transport else None
            where = f"client {peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "client"
            REFUSALS.refused(tls_failure(handshake_exc, where) or f"{type(handshake_exc).__name__} ({where})")
        flush = getattr(self, "_process_outgoing", None)
        if handshake_exc is not None and flush is not None:
            flush()
            self._refused = True
        super()._on_handshake_complete(handshake_exc)

    def _fatal_error(self, exc: BaseException, message: str = "Fatal error on transport") -> None:
        """After a refused handshake, close lingering instead of at once: under TLS 1.3 the
        client's request is already on its way, and closing with it unread would reset the
        connection, which can reach the client before the alert does."""
        raw = self._transport
        if getattr(self, "_refused", False) and isinstance(raw, asyncio.Transport) and raw.can_write_eof():
            self._refused = False
            self._transport = None
            _Drain(self._sniffer, raw)
            return
        super()._fatal_error(exc, message)


class _Drain(asyncio.Protocol):
    """A refused TLS connection's last moments: the alert is sent, a FIN follows, and what the
    client still sends is read and dropped until it closes or :data:`LINGER_S` passed."""

    def __init__(self, sniffer: TlsSniffer, transport: asyncio.Transport) -> None:
        self._sniffer = sniffer
        sniffer.guard.waiting.pop(sniffer, None)
        sniffer.guard.lingering[sniffer] = None
        transport.set_protocol(self)
        transport.write_eof()
        sniffer.loop.call_later(LINGER_S, transport.abort)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool | None:
        self._transport.abort()
        return None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._sniffer.ended()


class TlsSniffer(asyncio.Protocol):
    """One accepted connection until its first bytes are known (module docstring). Made per
    server by :func:`tls_protocol_class`; uvicorn instantiates it as its HTTP protocol."""

    guard: Guard
    context: ssl.SSLContext
    inner: type[GuardedH11Protocol]
    address: str  # HOST:PORT for the 400's URL when the request names none

    def __init__(self, config: Any, server_state: Any, app_state: Any, _loop: Any = None) -> None:
        self._inner_args = {"config": config, "server_state": server_state, "app_state": app_state, "_loop": _loop}
        self.loop: asyncio.AbstractEventLoop = _loop or asyncio.get_event_loop()
        self.transport: asyncio.Transport | None = None
        self._seen = b""
        self._timer: asyncio.TimerHandle | None = None
        self._done = False

    # ---------------------------------------------------------------- the guard's view

    def drop(self) -> None:
        """Close at once (the guard's eviction, or the deadline)."""
        self.ended()
        if self.transport is not None:
            self.transport.abort()

    def ended(self) -> None:
        """This connection no longer counts as the sniffer's (closed, or handed to h11)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.guard.forget(self)

    def handed_over(self) -> None:
        """The handshake is done: from now on the h11 protocol is the connection (it is admitted
        by the guard again, as itself)."""
        self._done = True
        self.ended()

    # ---------------------------------------------------------------- asyncio protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.guard.admit(self):
            self.guard.forget(self)
            transport.abort()
            return
        self.guard.waiting[self] = None
        self._timer = self.loop.call_later(self.guard.limits.head_timeout_s, self._late)

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended()

    def data_received(self, data: bytes) -> None:
        if self._done:
            return  # lingering after the 400: dropped, never parsed
        self._seen += data
        kind = first_bytes_kind(self._seen[:16])
        if kind == "tls":
            self._start_tls()
        elif kind == "http":
            self._tell_plain_http()
        elif kind == "other":
            self.drop()

    def eof_received(self) -> bool | None:
        if self._done and self.transport is not None:
            self.transport.close()  # the 400 was answered: let it flush, then close
        else:
            self.drop()
        return None

    # ---------------------------------------------------------------- outcomes

    def _late(self) -> None:
        self._timer = None
        self.guard.dropped["head_timeout"] += 1
        self.drop()

    def _start_tls(self) -> None:
        assert self.transport is not None
        inner = self.inner(**self._inner_args)
        inner.sniffer = self  # type: ignore[attr-defined]  # read by the class tls_protocol_class makes
        left = max(0.1, self._timer.when() - self.loop.time()) if self._timer is not None else 1.0
        protocol = _ServerTlsProtocol(
            self, self.loop, inner, self.context, None, server_side=True, ssl_handshake_timeout=left
        )
        self.transport.set_protocol(protocol)
        protocol.connection_made(self.transport)
        _feed(protocol, self._seen)
        self._seen = b""

    def _tell_plain_http(self) -> None:
        """Answer the 400 once enough of the head arrived to read its Host (or the head is over
        the peek limit), then close lingering, like the guarded protocol's close."""
        if b"\r\n\r\n" not in self._seen and len(self._seen) < _PEEK_LIMIT:
            return
        assert self.transport is not None
        self._done = True
        self.guard.dropped["plain_http_on_tls"] += 1
        self.guard.waiting.pop(self, None)
        self.guard.lingering[self] = None
        if self._timer is not None:
            self._timer.cancel()
        self.transport.write(plain_http_answer(self._seen[:_PEEK_LIMIT], self.address))
        self._seen = b""
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self._timer = self.loop.call_later(LINGER_S, self.drop)


def _feed(protocol: asyncio.BaseProtocol, data: bytes) -> None:
    """Hand bytes already read to a protocol as its transport would (buffered or not)."""
    if isinstance(protocol, asyncio.BufferedProtocol):
        view = memoryview(data)
        while view:
            buffer = memoryview(protocol.get_buffer(len(view)))
            size = min(len(buffer), len(view))
            buffer[:size] = view[:size]
            protocol.buffer_updated(size)
            view = view[size:]
    elif isinstance(protocol, asyncio.Protocol):
        protocol.data_received(data)


def tls_protocol_class(guard: Guard, context: ssl.SSLContext, address: str) -> type[TlsSniffer]:
    """The protocol class uvicorn instantiates per connection when the server speaks TLS."""
    guarded = protocol_class(guard)

    class TlsH11(guarded):  # type: ignore[valid-type,misc]  # a class made at run time
        sniffer: TlsSniffer | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            if self.sniffer is not None:
                self.sniffer.handed_over()
            super().connection_made(transport)

    return type(
        "FleetTlsSniffer", (TlsSniffer,), {"guard": guard, "context": context, "inner": TlsH11, "address": address}
    )
