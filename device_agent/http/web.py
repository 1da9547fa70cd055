"""The agent's own small web pieces, in place of a framework: a :class:`Request` (method, path,
query, headers, path parameters, the body as bounded chunks), a :class:`Response` and a
:class:`Router` that matches method and path and answers what matches no route in the
documented JSON error shape (404, or 405 with ``Allow``).

The interface between the server (``server.py``) and the app stays ASGI-shaped (``scope``,
``receive``, ``send``): the guard (``guards.py``) wraps the router as ASGI middleware, and the
server knows nothing of routes. A framework (starlette: 11 MiB with anyio and its imports on a
device) would bring what the agent does not use: forms, cookies, templates, websockets,
lifespans, middleware stacks.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

from device_agent.errors import BadRequest
from device_agent.http.protocol import error_body

log = logging.getLogger("edgepack.agent.http")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
JSON_MEDIA_TYPE = "application/json"
# A path parameter is one segment, as the path arrives percent-decoded.
_PARAMETER = re.compile(r"\{([a-z_]+)\}")


class Headers:
    """A request's headers, read by name whatever its case (the first of a repeated one)."""

    __slots__ = ("_values",)

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        values: dict[str, str] = {}
        for name, value in raw:
            values.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        self._values = values

    @overload
    def get(self, name: str) -> str | None: ...

    @overload
    def get(self, name: str, default: str) -> str: ...

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._values.get(name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._values


class Request:
    """One request as an endpoint reads it; its body comes chunk by chunk (:meth:`chunk`)."""

    __slots__ = ("_ended", "_receive", "client", "headers", "method", "path", "path_params", "query")

    def __init__(self, scope: Scope, receive: Receive, path_params: Mapping[str, str] | None = None) -> None:
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query: str = scope.get("query_string", b"").decode("latin-1")
        self.headers = Headers(scope["headers"])
        self.path_params: dict[str, str] = dict(path_params or {})
        client = scope.get("client")
        self.client: str = client[0] if client else ""  # the peer's address ("" when unknown)
        self._receive = receive
        self._ended = False

    async def chunk(self) -> tuple[bytes, bool]:
        """The body's next chunk and whether more follows; ``BadRequest`` (``disconnected``) when
        the client went away first. Bounds are the caller's: it counts what arrives."""
        if self._ended:
            return b"", False
        message = await self._receive()
        if message["type"] != "http.request":
            raise BadRequest("disconnected", "the client went away before its body arrived")
        more = bool(message.get("more_body", False))
        self._ended = not more
        return message.get("body", b""), more


class Response:
    """A whole answer: status, headers and body, sent in one ``http.response.start`` and one
    ``http.response.body`` (the server writes them in one write)."""

    __slots__ = ("body", "headers", "status_code")

    def __init__(
        self,
        content: bytes = b"",
        status_code: int = 200,
        headers: Mapping[str, str] | None = None,
        media_type: str | None = None,
    ) -> None:
        self.status_code = status_code
        self.body = content
        raw = [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in (headers or {}).items()]
        if status_code >= 200 and status_code not in (204, 304):
            raw.append((b"content-length", str(len(content)).encode()))
        if media_type is not None:
            raw.append((b"content-type", media_type.encode("latin-1")))
        self.headers = raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.headers})
        await send({"type": "http.response.body", "body": self.body})


def json_error(status: int, kind: str, message: str, headers: Mapping[str, str] | None = None) -> Response:
    """The documented error shape, ``{"error": {"kind", "message"}}``."""
    return Response(error_body(kind, message), status, headers, JSON_MEDIA_TYPE)


Endpoint = Callable[[Request], Awaitable[Response]]


@dataclass(frozen=True)
class Route:
    """``methods`` on ``path`` (``{name}`` matches one path segment); a GET route answers HEAD too."""

    path: str
    endpoint: Endpoint
    methods: frozenset[str]
    pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __init__(self, path: str, endpoint: Endpoint, methods: Iterable[str]) -> None:
        wanted = {method.upper() for method in methods}
        if "GET" in wanted:
            wanted.add("HEAD")
        object.__setattr__(self, "path", path)
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "methods", frozenset(wanted))
        parts = _PARAMETER.split(path)  # literal, name, literal, name, ..., literal
        regex = "".join(re.escape(part) if index % 2 == 0 else f"(?P<{part}>[^/]+)" for index, part in enumerate(parts))
        object.__setattr__(self, "pattern", re.compile(regex + r"\Z"))


def default_miss(request: Request, allowed: frozenset[str] | None) -> Response:
    """404 for a path no route has, 405 (with ``Allow``) for a method the path's route lacks."""
    if allowed is None:
        return json_error(404, "not_found", f"no such endpoint {request.path[:200]}")
    allow = ", ".join(sorted(allowed))
    return json_error(
        405,
        "method_not_allowed",
        f"{request.method} is not allowed on {request.path[:200]}; allowed: {allow}",
        {"Allow": allow},
    )


def default_crash(request: Request, exc: Exception) -> Response:
    log.error("request to %s failed", request.path[:200], exc_info=exc)
    return json_error(500, "internal", f"{type(exc).__name__}: {exc}")


class Router:
    """An ASGI app over ``routes``: the first route whose path and method match serves the
    request; ``miss`` answers when none does (``allowed``: the methods of the first route whose
    path matched, None when none did), ``crash`` when an endpoint raises."""

    def __init__(
        self,
        routes: Iterable[Route],
        miss: Callable[[Request, frozenset[str] | None], Response] = default_miss,
        crash: Callable[[Request, Exception], Response] = default_crash,
    ) -> None:
        self.routes = tuple(routes)
        self.miss = miss
        self.crash = crash

    def match(self, method: str, path: str) -> tuple[Route | None, dict[str, str], frozenset[str] | None]:
        """The route serving ``method`` on ``path`` and its parameters; else None and the
        methods of the first route with that path (None: no route has it)."""
        allowed: frozenset[str] | None = None
        for route in self.routes:
            found = route.pattern.match(path)
            if found is None:
                continue
            if method in route.methods:
                return route, found.groupdict(), None
            if allowed is None:
                allowed = route.methods
        return None, {}, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route, params, allowed = self.match(scope["method"], scope["path"])
        request = Request(scope, receive, params)
        if route is None:
            response = self.miss(request, allowed)
        else:
            try:
                response = await route.endpoint(request)
            except Exception as exc:  # the server must survive anything a request triggers
                response = self.crash(request, exc)
        await response(scope, receive, send)
