"""The ASGI guard around the app: every answer counted by status class, and no part of a body
ever left to be parsed as the next request (read and dropped when small, else the connection
closed)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from device_agent.http.prometheus import HttpStats

# A body this small left unread by an early answer is read and dropped before the answer goes
# out (h11 frames it, nothing of it is ever parsed as a request) and the connection kept; a
# larger one closes the connection.
DRAIN_LIMIT = 64 * 1024


@dataclass
class _Body:
    """How much of a request's body the app has received."""

    done: bool  # all of it (or the client went away)
    small: bool  # declared with a Content-Length of at most DRAIN_LIMIT


async def _drop_body(receive: Callable[[], Any]) -> None:
    """Receive the rest of a request's body and drop it."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class Guard:
    """ASGI wrapper around the app: counts every answer by status class, and never leaves part of
    a body to be parsed as the next request. When the app answers before it read the whole body,
    a body declared at most ``DRAIN_LIMIT`` is read and dropped first (within ``read_timeout_s``)
    and the connection stays open; any other gets ``Connection: close``, and what of it the server
    still queues for the app is dropped while the answer goes out (``server.py`` drops what
    arrives once the app is done, so a queue full of unread chunks never hangs the connection)."""

    def __init__(self, app: Any, stats: HttpStats, read_timeout_s: float) -> None:
        self.app = app
        self.stats = stats
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        chunked = b"transfer-encoding" in headers
        body = _Body(done=not chunked and length in (None, b"0"),
                     small=not chunked and length is not None and length.isdigit() and int(length) <= DRAIN_LIMIT)

        async def tracked_receive() -> dict[str, Any]:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body.done = True
            return message

        async def guarded_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                self.stats.count(message["status"])
                if not body.done:
                    message = await self._settle_body(message, body, tracked_receive)
            elif message["type"] == "http.response.body" and not message.get("more_body", False) and not body.done:
                dropping = asyncio.ensure_future(_drop_body(tracked_receive))
                try:
                    await send(message)
                finally:
                    await asyncio.wait([dropping], timeout=self.read_timeout_s)
                    dropping.cancel()
                return
            await send(message)

        await self.app(scope, tracked_receive, guarded_send)

    async def _settle_body(self, start: dict[str, Any], body: _Body, receive: Callable[[], Any]) -> dict[str, Any]:
        """The answer's start once the body left unread is dropped (small), or with ``Connection: close``."""
        headers = list(start.get("headers", []))
        if (b"connection", b"close") in headers:
            return start
        if body.small:
            try:
                await asyncio.wait_for(_drop_body(receive), self.read_timeout_s)
                return start
            except asyncio.TimeoutError:
                pass
        return {**start, "headers": [*headers, (b"connection", b"close")]}
