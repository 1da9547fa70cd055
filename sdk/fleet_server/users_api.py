"""The API's routes for users: tokens (made, listed, revoked), who a token is, the audit log and
its JSON lines export. Wired into :func:`.api.build_app` behind its guard (roles: :mod:`.roles`).
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from edgepack_core.protocol.ids import ID_PATTERN, is_valid_id
from edgepack_core.schema import Validator
from sdk.errors import ApiError
from sdk.fleet_server import audit, queries, roles, users
from sdk.fleet_server.api import ApiContext
from sdk.fleet_server.http_input import Params, _remote, _validate, read_json
from sdk.fleet_server.openapi import _json, _path, _query, _ref

TOKEN_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["name", "role"],
    "properties": {"name": {"type": "string", "pattern": ID_PATTERN, "description": "1 to 64 letters, digits, . _ -"},
                   "role": {"type": "string", "enum": list(roles.ROLES)}},
}
_TOKEN_VALIDATOR = Validator(TOKEN_REQUEST_SCHEMA, document="token")


def file_token_doc(token: Any) -> dict[str, Any]:
    """A token of the token file as :func:`.users.document` shows the database's."""
    return {"name": token.name, "role": token.role, "source": "file", "created_at": None, "created_by": None,
            "revoked_at": None, "revoked_by": None, "last_used_at": None}


class UserRoutes:
    """Handlers taking ``(request, actor)``, run behind :meth:`.api.Routes.guard`."""

    def __init__(self, context: ApiContext) -> None:
        self.context = context
        self.database = context.database

    def _caller(self, request: Request, actor: str) -> users.Caller:
        tokens = self.context.tokens
        return users.Caller(actor, _remote(request), frozenset(tokens.names()), tokens.admins())

    async def whoami(self, request: Request, _actor: str) -> Response:
        Params(request, set())
        identity: roles.Identity = request.state.identity
        return JSONResponse({"name": identity.name, "role": identity.role, "source": identity.source,
                             "actions": roles.allowed_actions(identity.role)})

    async def tokens(self, request: Request, _actor: str) -> Response:
        Params(request, set())
        stored = await run_in_threadpool(users.listing, self.database)
        return JSONResponse({"tokens": [*(file_token_doc(t) for t in self.context.tokens.tokens), *stored]})

    async def create_token(self, request: Request, actor: str) -> Response:
        Params(request, set())
        body = await read_json(request)
        _validate(_TOKEN_VALIDATOR, body)
        doc, secret = await run_in_threadpool(users.create, self.database, body["name"], body["role"],
                                              self._caller(request, actor))
        return JSONResponse({**doc, "token": secret}, status_code=201)

    async def revoke_token(self, request: Request, actor: str) -> Response:
        Params(request, set())
        name = request.path_params["name"]
        if not is_valid_id(name):
            raise ApiError(404, "not_found", "no such token")
        return JSONResponse(await run_in_threadpool(users.revoke, self.database, name, self._caller(request, actor)))

    async def audit_log(self, request: Request, _actor: str) -> Response:
        """A page of the audit, newest first; ``format=jsonl``: the entries, oldest first, streamed."""
        params = Params(request, {"limit", "before", "action", "format", "since"})
        which = audit.AuditQuery(
            before=None if params.values.get("before") is None else params.integer("before", 0, 0,
                                                                                   queries.MAX_ROW_ID),
            action=params.text("action", limit=64),
            since=None if params.values.get("since") is None else params.number("since", 0.0))
        form = params.values.get("format", "json")
        if form not in ("json", "jsonl"):
            raise ApiError(400, "invalid", "format: json (a page) or jsonl (an export)")
        if form == "jsonl":
            limit = None if params.values.get("limit") is None else params.integer("limit", 0, 1, audit.MAX_PAGE)
            return StreamingResponse(audit.export_lines(self.database, which, limit),
                                     media_type="application/x-ndjson")
        entries = await run_in_threadpool(
            audit.entries, self.database, limit=params.integer("limit", 100, 1, audit.MAX_PAGE),
            before=which.before, action=which.action, since=which.since)
        return JSONResponse({"entries": entries})

_TOKEN_DOC: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string"}, "role": {"type": "string", "enum": list(roles.ROLES)},
    "source": {"type": "string", "enum": ["file", "database"]}, "created_at": {"type": ["number", "null"]},
    "created_by": {"type": ["string", "null"]}, "revoked_at": {"type": ["number", "null"]},
    "revoked_by": {"type": ["string", "null"]}, "last_used_at": {"type": ["number", "null"]}}}
_ADMIN = " (admin role)"

OPERATIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("get", "/api/whoami", {
        "summary": "The token's name and role, and every action the role may do (any role)",
        "responses": {"200": _json("who", {"type": "object", "properties": {
            "name": {"type": "string"}, "role": {"type": "string"}, "source": {"type": "string"},
            "actions": {"type": "array", "items": {"type": "string"}}}})}}),
    ("get", "/api/tokens", {
        "summary": "Every token: the token file's and the database's, in force and revoked (never a token or "
                   "its digest)" + _ADMIN,
        "responses": {"200": _json("tokens", {"type": "object", "properties": {
            "tokens": {"type": "array", "items": _TOKEN_DOC}}})}}),
    ("post", "/api/tokens", {
        "summary": "Make a named token with a role (audited as token.create); the answer holds the token, "
                   "shown this once" + _ADMIN,
        "requestBody": {"required": True, "content": {"application/json": {"schema": TOKEN_REQUEST_SCHEMA}}},
        "responses": {"201": _json("made", {**_TOKEN_DOC, "properties": {**_TOKEN_DOC["properties"],
                                                                         "token": {"type": "string"}}}),
                      "409": _json("the name is in force, in the token file or the server's own", _ref("Error"))}}),
    ("delete", "/api/tokens/{name}", {
        "summary": "Revoke a token (audited as token.revoke): refused at its next request, on every server" + _ADMIN,
        "parameters": [_path("name", ID_PATTERN, "the token's name")],
        "responses": {"200": _json("revoked", _TOKEN_DOC),
                      "404": _json("no token of that name in force", _ref("Error")),
                      "409": _json("the last admin token, or a token of the token file", _ref("Error"))}}),
    ("get", "/api/audit", {
        "summary": "Every write, newest first; format=jsonl: the entries oldest first as JSON lines, streamed (an "
                   "export)",
        "parameters": [_query("limit", {"type": "integer", "minimum": 1, "maximum": audit.MAX_PAGE},
                              "page size (json: default 100; jsonl: every entry unless given)"),
                       _query("before", {"type": "integer", "minimum": 0, "maximum": queries.MAX_ROW_ID},
                              "entries with a smaller id (paging)"),
                       _query("action", {"type": "string", "maxLength": 64}, "only this action"),
                       _query("since", {"type": "number", "minimum": 0}, "entries from this time on (unix seconds)"),
                       _query("format", {"type": "string", "enum": ["json", "jsonl"], "default": "json"},
                              "jsonl: an export, oldest first")],
        "responses": {"200": {"description": "entries", "content": {
            "application/json": {"schema": {"type": "object", "properties": {
                "entries": {"type": "array", "items": _ref("AuditEntry")}}}},
            "application/x-ndjson": {"schema": _ref("AuditEntry")}}}}}),
]
"""The OpenAPI operations of these routes (:func:`.openapi.describe` adds them)."""
