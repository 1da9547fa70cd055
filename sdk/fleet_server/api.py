"""The fleet server's REST API (Starlette): JSON in and out, one error shape, bearer tokens.

Rules every route follows:

- **Authentication.** Every route but ``/healthz``, ``/openapi.json``, ``/artifacts/...``
  (devices fetch those; they verify the signature) and the static ``/ui/`` shell needs
  ``Authorization: Bearer TOKEN``, compared in constant time (:mod:`.auth`); reads too,
  because the fleet list tells an attacker what runs where. A failure is 401 with
  ``WWW-Authenticate: Bearer``. Browser pages cannot be made to send the header by another
  site, so there is no cookie and nothing for a cross-site request to ride on.
- **Bounded input.** JSON bodies are read up to :data:`MAX_JSON_BYTES` (413 beyond; a
  ``Content-Length`` over it is refused before a byte is read), must be one JSON object
  without NaN or Infinity, and are validated against their schema naming the offending key;
  uploads stop at ``--max-upload``; query parameters are typed and bounded, and unknown
  ones are refused; path ids must match the protocol's id pattern.
- **One error shape.** ``{"error": {"status": 404, "code": "not_found", "message": "..."}}``
  for every error, the router's 404/405 and an unexpected exception (500, logged) included.
- **Audit.** Every write, accepted or refused after authentication, is a row in the audit
  table (:mod:`.audit`).

Blocking work (database, verification) runs in Starlette's thread pool, never on the loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from edgepack_core.errors import DocumentRuleError, InvalidTransition, SchemaError
from edgepack_core.schema import Validator
from sdk.errors import ApiError, ForbiddenError
from sdk.fleet_server import (
    access,
    actions,
    audit,
    bad_releases,
    desired,
    device_logs,
    history,
    openapi,
    queries,
    report_cards,
    roles,
    settings_api,
    wave_waits,
)
from sdk.fleet_server.alerts_http import list_alerts
from sdk.fleet_server.artifacts import ArtifactStore, check_sha256
from sdk.fleet_server.auth import TokenCheck
from sdk.fleet_server.db import Database
from sdk.fleet_server.disk import is_disk_full
from sdk.fleet_server.http_input import (  # noqa: F401  (read_json, Params, ... are imported from here too)
    MAX_JSON_BYTES,
    Params,
    _path_id,
    _remote,
    _validate,
    read_json,
)
from sdk.fleet_server.retention import RetentionPolicy
from sdk.fleet_server.rollouts import STATES

log = logging.getLogger("edgepack.fleet_server.api")

MAX_ROLLOUT_JSON_BYTES = 8 * 1024 * 1024  # a rollout may list up to 100,000 devices
UI_DIR = Path(__file__).resolve().parent / "ui"
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    # The dashboard (ui/) runs under it: its own script and style files only (no inline script or
    # style attribute, no eval), no request to another origin; tests/test_dashboard.py checks it.
    (b"content-security-policy", b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                 b"connect-src 'self'; object-src 'none'; frame-ancestors 'none'; base-uri 'none'; "
                                 b"form-action 'self'"),
]

_ROLLOUT_VALIDATOR = Validator(queries.ROLLOUT_REQUEST_SCHEMA, document="rollout")
_GROUPS_VALIDATOR = Validator(queries.GROUPS_REQUEST_SCHEMA, document="groups")
_DEVICE_ACTION_VALIDATOR = Validator(actions.ACTION_REQUEST_SCHEMA, document="action")
_BAD_VALIDATOR = Validator(bad_releases.REQUEST_SCHEMA, document="request")
_ACTION_VALIDATOR = Validator({"type": "object", "additionalProperties": False,
                               "properties": {"reason": {"type": "string", "maxLength": 500}}}, document="request")


@dataclass
class ApiContext:
    """What the routes need from the server."""

    database: Database
    tokens: TokenCheck
    store: ArtifactStore
    retention: RetentionPolicy
    artifact_url: Callable[[str], str]
    silence_s: float = 60.0
    status: Callable[[], dict[str, Any]] = dict
    metrics: Callable[[], str] = str
    wake_driver: Callable[[], None] = lambda: None
    clear_retained_state: Callable[[str], None] = lambda _device: None  # publishes the empty retained state
    command_ttl_s: float = 24 * 3600.0
    commands: actions.CommandSink | None = None  # the driver: signs, records and publishes a device action's command
    auth_failures: int = 0
    requests: int = 0
    ui_dir: Path = UI_DIR
    enrollment: Any = None  # an enrollment.Enrollment (sdk/fleet_server/enrollment_api.py); None: off

    def view(self) -> desired.View:
        """Now, as the targets code reads the fleet (online window, command lifetime)."""
        return desired.View(time.time(), self.silence_s, self.command_ttl_s)

    def answer_then_wake(self, doc: Any, status_code: int = 200) -> JSONResponse:
        """The answer to a write the driver acts on, waking the driver once the answer is sent:
        the caller learns its change was stored before any command it causes goes out (a server
        that dies in that round has still answered)."""
        return JSONResponse(doc, status_code=status_code, background=BackgroundTask(self.wake_driver))


def error_response(status: int, code: str, message: str) -> JSONResponse:
    # A client without a valid token cannot keep the connection (it could do nothing with it).
    headers = {"WWW-Authenticate": 'Bearer realm="edgepack"', "Connection": "close"} if status == 401 else None
    return JSONResponse({"error": {"status": status, "code": code, "message": message}}, status_code=status,
                        headers=headers)


_HTTP_CODES = {400: "invalid", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
               413: "too_large", 415: "unsupported_media_type"}


_DOMAIN_ANSWERS: dict[type[Exception], tuple[int, str]] = {InvalidTransition: (409, "conflict"),
                                                             DocumentRuleError: (422, "invalid"),
                                                             SchemaError: (400, "invalid")}
"""The domain errors the pure modules raise, as HTTP answers (status, code), the first that
matches (a document its schema accepts but whose parts do not fit is a 422): this layer alone
decides the status."""
_REFUSALS: tuple[type[Exception], ...] = (ApiError, *_DOMAIN_ANSWERS)


def as_api_error(exc: Exception) -> ApiError:
    """``exc`` as the API's refusal: an :class:`ApiError` as it is, a domain error by
    :data:`_DOMAIN_ANSWERS`, its message kept."""
    if isinstance(exc, ApiError):
        return exc
    status, code = next(answer for kind, answer in _DOMAIN_ANSWERS.items() if isinstance(exc, kind))
    return ApiError(status, code, str(exc))


async def _api_error(_request: Request, exc: Exception) -> Response:
    refusal = as_api_error(exc)
    response = error_response(refusal.status, refusal.code, refusal.message)
    if isinstance(refusal, ForbiddenError):  # the least role that may, for programs
        response = JSONResponse({"error": {"status": 403, "code": "forbidden", "message": refusal.message,
                                           "needs": refusal.needs}}, status_code=403)
    return response


def allowed_methods(app: Any, path: str) -> list[str]:
    """Every method some route serves at ``path`` (a path may have one route per method), for
    the ``Allow`` header of a 405; the static ``/ui/`` mount serves GET and HEAD."""
    methods: set[str] = set()
    for route in app.routes:
        if isinstance(route, Route) and route.methods and route.path_regex.match(path):
            methods |= route.methods
        elif isinstance(route, Mount) and path.startswith(route.path + "/"):
            methods |= {"GET", "HEAD"}
    return sorted(methods)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: "no such route", 405: "method not allowed"}.get(exc.status_code, str(exc.detail))
    response = error_response(exc.status_code, _HTTP_CODES.get(exc.status_code, "error"), message)
    if exc.status_code == 405:
        response.headers["Allow"] = ", ".join(allowed_methods(request.app, request.url.path))
    return response


async def _database_error(request: Request, exc: Exception) -> Response:
    """A database error: no space left is the client's 507 with the reason (nothing was stored);
    anything else is a 500, logged."""
    if is_disk_full(exc):
        log.error("%s %s: the database has no space left: %s", request.method, request.url.path, exc)
        return error_response(507, "insufficient_storage", "the database has no space left (its disk is full): "
                                                           "nothing was stored; free space and retry")
    return await _internal_error(request, exc)


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal", "internal error (see the server's log)")


class SecurityHeaders:
    """Adds the security headers to every response (the dashboard loads nothing from elsewhere)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


# --------------------------------------------------------------------------- routes

Handler = Callable[[Request, str], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


class Routes:
    """The route handlers. Those taking ``(request, actor)`` run behind :meth:`guard`."""

    def __init__(self, context: ApiContext) -> None:
        self.context = context
        self.database = context.database

    def guard(self, handler: Handler, write_action: str | None = None, *, needs: str | None = None) -> Endpoint:
        """Authenticate (401 without a valid token), authorize (403 naming the role needed:
        :mod:`.roles`; a read is ``read`` unless ``needs`` names it) and audit a write's refusal."""
        context = self.context
        action = write_action or needs or roles.READ

        async def endpoint(request: Request) -> Response:
            context.requests += 1
            identity = await access.identify(context.tokens, context.database, request.headers.get("authorization"))
            if identity is None:
                context.auth_failures += 1
                raise ApiError(401, "unauthorized", "a valid token is needed: Authorization: Bearer TOKEN")
            request.state.identity = identity
            try:
                access.authorize(identity, action)
                return await handler(request, identity.name)
            except _REFUSALS as err:
                if write_action is not None:
                    refusal = as_api_error(err)
                    await run_in_threadpool(audit.record_refusal, context.database, actor=identity.name,
                                            action=write_action, target=access.refusal_target(request.path_params),
                                            reason=f"{refusal.status} {refusal.message}", remote=_remote(request))
                raise
        setattr(endpoint, "action", action)  # noqa: B010  the permission table's test reads it
        return endpoint

    # ---------------------------------------------------------------- open routes

    async def healthz(self, _request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def openapi_json(self, request: Request) -> Response:
        return JSONResponse(openapi.describe())

    async def root(self, _request: Request) -> Response:
        return RedirectResponse("/ui/", status_code=302)

    async def artifact_file(self, request: Request) -> Response:
        status_code, headers, body = await run_in_threadpool(
            self.context.store.open_range, request.path_params["file_name"], request.headers.get("range", ""))
        if body is None:
            return Response(status_code=status_code, headers=headers)
        return StreamingResponse(body, status_code=status_code, headers=headers)

    # ---------------------------------------------------------------- reads

    async def metrics(self, _request: Request, _actor: str) -> Response:
        text = await run_in_threadpool(self.context.metrics)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    async def status(self, _request: Request, _actor: str) -> Response:
        return JSONResponse(await run_in_threadpool(self.context.status))

    async def devices(self, request: Request, _actor: str) -> Response:
        params = Params(request, {"group", "online", "version", "limit", "offset"})
        where = queries.DeviceFilter(group=params.text("group", id_like=True), online=params.boolean("online"),
                                     version=params.text("version"),
                                     limit=params.integer("limit", 1000, 1, queries.MAX_DEVICES_PAGE),
                                     offset=params.integer("offset", 0, 0, 10**9))
        body = await run_in_threadpool(queries.list_devices_json, self.database, where, now=time.time(),
                                       silence_s=self.context.silence_s)
        return Response(body, media_type="application/json")

    async def device(self, request: Request, _actor: str) -> Response:
        Params(request, set())
        return JSONResponse(await run_in_threadpool(queries.get_device, self.database,
                                                    _path_id(request, "device_id"), now=time.time(),
                                                    silence_s=self.context.silence_s))

    async def device_history(self, request: Request, _actor: str) -> Response:
        params = Params(request, {"limit", "before"})
        page = history.Page(limit=params.integer("limit", history.DEFAULT_PAGE, 1, history.MAX_PAGE),
                            before=None if params.values.get("before") is None else params.number("before", 0.0))
        return JSONResponse(await run_in_threadpool(history.device_history, self.database,
                                                    _path_id(request, "device_id"), page, now=time.time()))

    async def device_telemetry(self, request: Request, _actor: str) -> Response:
        params = Params(request, {"since", "until", "step"})
        now = time.time()
        doc = await run_in_threadpool(
            queries.telemetry, self.database, _path_id(request, "device_id"),
            since=params.number("since", now - 3600), until=params.number("until", now),
            step=params.integer("step", 60, 1, 86400 * 30), policy=self.context.retention, now=now)
        return JSONResponse(doc)

    async def artifacts(self, request: Request, _actor: str) -> Response:
        Params(request, set())
        rows = await run_in_threadpool(queries.list_artifacts, self.database)
        url = self.context.artifact_url
        return JSONResponse({"artifacts": [queries.artifact_doc(row, url(row["sha256"])) for row in rows]})

    async def artifact(self, request: Request, _actor: str) -> Response:
        Params(request, set())
        sha = _artifact_sha(request)
        row = await run_in_threadpool(queries.get_artifact, self.database, sha)
        return JSONResponse(queries.artifact_doc(row, self.context.artifact_url(sha)))

    async def mark_bad(self, request: Request, actor: str) -> Response:
        """Mark a release bad fleet-wide (``DELETE``: clear the mark); the answer lists what names it."""
        Params(request, set())
        sha = _artifact_sha(request)
        if request.method == "DELETE":
            named = await run_in_threadpool(lambda: bad_releases.clear_bad(self.database, sha, actor=actor,
                                                                           remote=_remote(request)))
        else:
            body = await read_json(request)
            _validate(_BAD_VALIDATOR, body)
            named = await run_in_threadpool(lambda: bad_releases.mark_bad(self.database, sha, body["reason"],
                                                                          actor=actor, remote=_remote(request)))
        row = await run_in_threadpool(queries.get_artifact, self.database, sha)
        return self.context.answer_then_wake({"artifact": queries.artifact_doc(row, self.context.artifact_url(sha)),
                                              **named})

    async def rollouts(self, request: Request, _actor: str) -> Response:
        params = Params(request, {"state", "limit"})
        state = params.text("state", id_like=True)
        if state is not None and state not in STATES:
            raise ApiError(400, "invalid", f"state: {state[:64]!r} is not one of {', '.join(STATES)}")
        docs = await run_in_threadpool(queries.list_rollouts, self.database, state=state,
                                       limit=params.integer("limit", 100, 1, 1000))
        return JSONResponse({"rollouts": docs})

    async def rollout(self, request: Request, _actor: str) -> Response:
        Params(request, set())
        return JSONResponse(await run_in_threadpool(self._rollout_doc, _path_id(request, "rollout_id")))

    def _rollout_doc(self, rollout_id: str) -> dict[str, Any]:
        """The rollout's document with what its waves wait for (offline devices, the deadline)."""
        return wave_waits.annotate(self.database, queries.get_rollout(self.database, rollout_id), now=time.time(),
                                   silence_s=self.context.silence_s)

    async def dead_letters(self, request: Request, _actor: str) -> Response:
        params = Params(request, {"limit", "before", "device"})
        before = params.values.get("before")
        entries = await run_in_threadpool(
            queries.dead_letters, self.database,
            limit=params.integer("limit", 100, 1, queries.MAX_DEAD_LETTER_PAGE),
            before=None if before is None else params.integer("before", 0, 0, queries.MAX_ROW_ID),
            device=params.text("device", id_like=True))
        return JSONResponse({"dead_letters": entries})

    # ---------------------------------------------------------------- writes

    async def set_groups(self, request: Request, actor: str) -> Response:
        Params(request, set())
        device = _path_id(request, "device_id")
        body = await read_json(request)
        _validate(_GROUPS_VALIDATOR, body)
        groups = list(dict.fromkeys(body["groups"]))
        await run_in_threadpool(queries.set_device_groups, self.database, device, groups, actor=actor,
                                remote=_remote(request))
        return JSONResponse(await run_in_threadpool(queries.get_device, self.database, device, now=time.time(),
                                                    silence_s=self.context.silence_s))

    async def decommission(self, request: Request, actor: str) -> Response:
        Params(request, set())
        device = _path_id(request, "device_id")
        body = await read_json(request, optional=True)
        _validate(_ACTION_VALIDATOR, body)
        done = await run_in_threadpool(queries.decommission_device, self.database, device,
                                       reason=body.get("reason", ""), actor=actor, remote=_remote(request))
        # After the commit: the cleared retained state the ingest then hears finds the mark.
        self.context.clear_retained_state(device)
        return JSONResponse(done)

    async def device_action(self, request: Request, actor: str) -> Response:
        Params(request, set())
        device = _path_id(request, "device_id")
        body = await read_json(request, optional=True)
        _validate(_DEVICE_ACTION_VALIDATOR, body)
        parsed = actions.parse_action(str(request.path_params["action"]), body)
        caller = actions.Caller(actor, _remote(request), self.context.view())
        done = await run_in_threadpool(lambda: actions.perform(self.database, self.context.commands, device, parsed,
                                                               caller, command_ttl_s=self.context.command_ttl_s))
        if parsed.action in ("rerun", "release"):
            return self.context.answer_then_wake(done)
        return JSONResponse(done)

    async def enroll(self, request: Request, actor: str) -> Response:
        Params(request, set())
        device = _path_id(request, "device_id")
        body = await read_json(request, optional=True)
        _validate(_ACTION_VALIDATOR, body)
        return JSONResponse(await run_in_threadpool(queries.enroll_device, self.database, device,
                                                    reason=body.get("reason", ""), actor=actor,
                                                    remote=_remote(request)))

    async def decommissioned(self, request: Request, _actor: str) -> Response:
        Params(request, set())
        return JSONResponse({"devices": await run_in_threadpool(queries.decommissioned_devices, self.database)})

    async def upload(self, request: Request, actor: str) -> Response:
        store = self.context.store
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > store.max_bytes):
            raise ApiError(413, "too_large", f"the upload is over the limit of {store.max_bytes} bytes")
        pending = await run_in_threadpool(store.begin_upload)
        try:
            async for chunk in request.stream():
                pending.write(chunk)
        except ClientDisconnect:  # from None: a disconnect has nothing more to say
            pending.discard()
            raise ApiError(400, "invalid", "the client went away before the upload was complete") from None
        except BaseException:
            pending.discard()
            raise
        stored = await run_in_threadpool(pending.finish)
        created = await run_in_threadpool(queries.save_artifact, self.database, stored, actor=actor,
                                          remote=_remote(request))
        row = await run_in_threadpool(queries.get_artifact, self.database, stored.sha256)
        return JSONResponse(queries.artifact_doc(row, self.context.artifact_url(stored.sha256)),
                            status_code=201 if created else 200)

    async def create_rollout(self, request: Request, actor: str) -> Response:
        Params(request, set())
        body = await read_json(request, MAX_ROLLOUT_JSON_BYTES)
        _validate(_ROLLOUT_VALIDATOR, body)
        rollout_id = await run_in_threadpool(queries.create_rollout, self.database,
                                             queries.RolloutRequest.from_json(body), actor=actor,
                                             remote=_remote(request), silence_s=self.context.silence_s)
        return self.context.answer_then_wake(await run_in_threadpool(self._rollout_doc, rollout_id), 201)

    def action(self, name: str) -> Handler:
        async def act(request: Request, actor: str) -> Response:
            Params(request, set())
            body = await read_json(request, optional=True)
            _validate(_ACTION_VALIDATOR, body)
            rollout_id = _path_id(request, "rollout_id")
            await run_in_threadpool(queries.rollout_action, self.database, rollout_id, name, actor=actor,
                                    remote=_remote(request), reason=body.get("reason", ""))
            return self.context.answer_then_wake(await run_in_threadpool(self._rollout_doc, rollout_id))
        return act


def _artifact_sha(request: Request) -> str:
    """The path's artifact sha256; 404 for anything that is not one (no artifact has that name)."""
    try:
        return check_sha256(request.path_params["sha256"])
    except ApiError:
        raise ApiError(404, "not_found", "no such artifact") from None  # our own refusal, reworded


def build_app(context: ApiContext) -> Starlette:
    """The ASGI application."""
    from sdk.fleet_server import enrollment_api  # it builds on this module
    from sdk.fleet_server.targets_api import TargetRoutes  # it imports this module's context
    from sdk.fleet_server.users_api import UserRoutes  # it imports this module's helpers

    r = Routes(context)
    t = TargetRoutes(context)
    u = UserRoutes(context)
    guard = r.guard
    routes = [
        Route("/", r.root, methods=["GET"], include_in_schema=False),
        Route("/healthz", r.healthz, methods=["GET"]),
        Route("/openapi.json", r.openapi_json, methods=["GET"]),
        Route("/metrics", guard(r.metrics), methods=["GET"]),
        Route("/api/status", guard(r.status), methods=["GET"]),
        Route("/api/devices", guard(r.devices), methods=["GET"]),
        Route("/api/devices/{device_id}", guard(r.device), methods=["GET"]),
        enrollment_api.decommission_route(context, guard, r.decommission),
        *enrollment_api.routes(context, guard),
        Route("/api/devices/{device_id}/enroll", guard(r.enroll, "device.enroll"), methods=["POST"]),
        Route("/api/devices/{device_id}/actions/{action}", guard(r.device_action, "device.action"), methods=["POST"]),
        Route("/api/decommissioned", guard(r.decommissioned), methods=["GET"]),
        Route("/api/devices/{device_id}/telemetry", guard(r.device_telemetry), methods=["GET"]),
        Route("/api/devices/{device_id}/history", guard(r.device_history), methods=["GET"]),
        Route("/api/devices/{device_id}/logs", guard(device_logs.read_handler(context)), methods=["GET"]),
        Route("/api/devices/{device_id}/logs/fetch", guard(device_logs.fetch_handler(context), "logs.fetch"),
              methods=["POST"]),
        Route("/api/devices/{device_id}/groups", guard(r.set_groups, "device.groups"), methods=["PUT"]),
        Route("/api/devices/{device_id}/target", guard(t.device_target), methods=["GET"]),
        Route("/api/report-cards", guard(report_cards.handler(context)), methods=["GET"]),
        Route("/api/targets", guard(t.targets), methods=["GET"]),
        *[route for scope, path in (("fleet", "/api/targets/fleet"), ("group", "/api/targets/groups/{group}"),
                                    ("device", "/api/targets/devices/{device_id}"))
          for route in (Route(path, guard(t.target(scope)), methods=["GET"]),
                        Route(path, guard(t.set_target(scope), "target.set"), methods=["PUT"]))],
        Route("/api/dead-letters", guard(r.dead_letters), methods=["GET"]),
        Route("/api/artifacts", guard(r.artifacts), methods=["GET"]),
        Route("/api/artifacts", guard(r.upload, "artifact.upload"), methods=["POST"]),
        Route("/api/artifacts/{sha256}", guard(r.artifact), methods=["GET"]),
        Route("/api/artifacts/{sha256}/bad", guard(r.mark_bad, "artifact.bad"), methods=["POST"]),
        Route("/api/artifacts/{sha256}/bad", guard(r.mark_bad, "artifact.good"), methods=["DELETE"]),
        Route("/api/rollouts", guard(r.rollouts), methods=["GET"]),
        Route("/api/rollouts", guard(r.create_rollout, "rollout.create"), methods=["POST"]),
        Route("/api/rollouts/{rollout_id}", guard(r.rollout), methods=["GET"]),
        *[Route(f"/api/rollouts/{{rollout_id}}/{name}", guard(r.action(name), f"rollout.{name}"), methods=["POST"])
          for name in ("pause", "resume", "abort")],
        Route("/api/audit", guard(u.audit_log), methods=["GET"]),
        Route("/api/whoami", guard(u.whoami), methods=["GET"]),
        Route("/api/tokens", guard(u.tokens, needs="token.list"), methods=["GET"]),
        Route("/api/tokens", guard(u.create_token, "token.create"), methods=["POST"]),
        Route("/api/tokens/{name}", guard(u.revoke_token, "token.revoke"), methods=["DELETE"]),
        *settings_api.routes(context, guard),
        Route("/api/alerts", guard(list_alerts(context.database)), methods=["GET"]),
        Route("/artifacts/{file_name}", r.artifact_file, methods=["GET"]),
        Mount("/ui", app=StaticFiles(directory=context.ui_dir, html=True, check_dir=False), name="ui"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(SecurityHeaders)],
                     exception_handlers={ApiError: _api_error, InvalidTransition: _api_error, SchemaError: _api_error,
                                         HTTPException: _http_error, DBAPIError: _database_error,
                                         Exception: _internal_error})
