"""HTTP routes of remote agent settings and fleet keys (:mod:`.settings_db` does the work).

    GET    /api/settings                              every scope's entries, and the fleet's keys
    PUT    /api/settings/fleet | groups/{g} | devices/{d}   {"set": {KEY: VALUE}, "unset": [KEY], "reason"}
    GET    /api/devices/{device_id}/settings          the device's document, sent and reported generation
    GET    /api/keys                                  the fleet's release and operator keys
    POST   /api/keys                                  {"kind": "release"|"operator", "pem": "..."}: 201
    DELETE /api/keys/{key_id}                         retire it (the next documents leave it out)

The API module wires them (``build_app``) and the OpenAPI document lists :data:`OPERATIONS`.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edgepack_core.protocol.ids import ID_PATTERN, is_valid_id
from edgepack_core.schema import Validator
from edgepack_core.settings_doc import MAX_PEM_CHARS, SETTING_KEYS
from edgepack_core.signing import KEY_KINDS
from sdk.errors import ApiError
from sdk.fleet_server import settings_db
from sdk.fleet_server.settings import DEVICE, FLEET, GROUP

_KEY_ID = re.compile(r"^[0-9a-f]{16}$")
SETTINGS_BODY: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "set": {
            "type": "object",
            "description": 'dotted agent.yaml keys to values (docs/fleet-server.md, "Settings and keys"); '
            "each key must be a remote setting",
        },
        "unset": {"type": "array", "maxItems": settings_db.MAX_ENTRIES, "items": {"type": "string", "maxLength": 64}},
        "reason": {"type": "string", "maxLength": 500},
    },
}
KEY_BODY: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["kind", "pem"],
    "properties": {
        "kind": {"enum": list(KEY_KINDS)},
        "pem": {"type": "string", "minLength": 1, "maxLength": MAX_PEM_CHARS},
    },
}
_SETTINGS_VALIDATOR = Validator(SETTINGS_BODY, document="settings")
_KEY_VALIDATOR = Validator(KEY_BODY, document="key")


class SettingsRoutes:
    """The handlers; each takes ``(request, actor)`` and runs behind the API's guard."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.database = context.database

    async def _body(self, request: Request, validator: Validator) -> dict[str, Any]:
        from sdk.fleet_server.api import _validate, read_json

        body = await read_json(request)
        _validate(validator, body)
        return body

    @staticmethod
    def _remote(request: Request) -> str:
        return f"{request.client.host}:{request.client.port}" if request.client else ""

    async def show(self, request: Request, _actor: str) -> Response:
        _no_query(request)
        return JSONResponse(await run_in_threadpool(settings_db.scopes_view, self.database))

    def put(self, scope: str) -> Any:
        async def handler(request: Request, actor: str) -> Response:
            _no_query(request)
            name = "" if scope == FLEET else str(request.path_params["group" if scope == GROUP else "device_id"])
            if scope != FLEET and not is_valid_id(name):
                raise ApiError(404, "not_found", f"no such {scope}")
            body = await self._body(request, _SETTINGS_VALIDATOR)
            values, unset = body.get("set", {}), body.get("unset", [])
            remote = self._remote(request)
            await run_in_threadpool(
                lambda: settings_db.set_entries(
                    self.database, scope, name, values, unset, actor=actor, remote=remote, reason=body.get("reason", "")
                )
            )
            self.context.wake_driver()
            return JSONResponse(await run_in_threadpool(settings_db.scopes_view, self.database))

        return handler

    async def device(self, request: Request, _actor: str) -> Response:
        _no_query(request)
        device = str(request.path_params["device_id"])
        if not is_valid_id(device):
            raise ApiError(404, "not_found", "no such device")
        return JSONResponse(await run_in_threadpool(settings_db.device_view, self.database, device))

    async def keys(self, request: Request, _actor: str) -> Response:
        _no_query(request)
        return JSONResponse({"keys": (await run_in_threadpool(settings_db.scopes_view, self.database))["keys"]})

    async def add_key(self, request: Request, actor: str) -> Response:
        _no_query(request)
        body = await self._body(request, _KEY_VALIDATOR)
        remote = self._remote(request)
        key = await run_in_threadpool(
            lambda: settings_db.add_key(self.database, body["kind"], body["pem"], actor=actor, remote=remote)
        )
        self.context.wake_driver()
        return JSONResponse(settings_db.keys_row(key), status_code=201)

    async def retire_key(self, request: Request, actor: str) -> Response:
        _no_query(request)
        kid = str(request.path_params["key_id"])
        if not _KEY_ID.match(kid):
            raise ApiError(404, "not_found", "no such key")
        signers = [key.key_id for key in getattr(self.context.commands, "operator_keys", ())]
        remote = self._remote(request)
        key = await run_in_threadpool(
            lambda: settings_db.retire_key(self.database, kid, signers, actor=actor, remote=remote)
        )
        self.context.wake_driver()
        return JSONResponse(settings_db.keys_row(key))


def _no_query(request: Request) -> None:
    if request.query_params:
        raise ApiError(400, "invalid", f"unknown query parameter {next(iter(request.query_params))!r} (allowed: none)")


def routes(context: Any, guard: Any) -> list[Any]:
    """The Route lines ``build_app`` adds."""
    from starlette.routing import Route

    r = SettingsRoutes(context)
    return [
        Route("/api/settings", guard(r.show), methods=["GET"]),
        Route("/api/settings/fleet", guard(r.put(FLEET), "settings.set"), methods=["PUT"]),
        Route("/api/settings/groups/{group}", guard(r.put(GROUP), "settings.set"), methods=["PUT"]),
        Route("/api/settings/devices/{device_id}", guard(r.put(DEVICE), "settings.set"), methods=["PUT"]),
        Route("/api/devices/{device_id}/settings", guard(r.device), methods=["GET"]),
        Route("/api/keys", guard(r.keys), methods=["GET"]),
        Route("/api/keys", guard(r.add_key, "keys.add"), methods=["POST"]),
        Route("/api/keys/{key_id}", guard(r.retire_key, "keys.retire"), methods=["DELETE"]),
    ]


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _path(name: str, pattern: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string", "pattern": pattern}}


_OBJECT = {"type": "object"}
_KEY_ROW = {
    "type": "object",
    "required": ["key_id", "kind", "in_use"],
    "properties": {"key_id": {"type": "string"}, "kind": {"enum": list(KEY_KINDS)}, "in_use": {"type": "boolean"}},
}
_PUT = {
    "summary": "Set or unset settings of a scope (keys: " + ", ".join(sorted(SETTING_KEYS)) + ")",
    "requestBody": {"required": True, "content": {"application/json": {"schema": SETTINGS_BODY}}},
    "responses": {"200": _json("every scope's settings", _OBJECT)},
}
OPERATIONS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "get",
        "/api/settings",
        {"summary": "Every scope's settings and the fleet's keys", "responses": {"200": _json("settings", _OBJECT)}},
    ),
    ("put", "/api/settings/fleet", _PUT),
    ("put", "/api/settings/groups/{group}", {**_PUT, "parameters": [_path("group", ID_PATTERN)]}),
    ("put", "/api/settings/devices/{device_id}", {**_PUT, "parameters": [_path("device_id", ID_PATTERN)]}),
    (
        "get",
        "/api/devices/{device_id}/settings",
        {
            "summary": "A device's settings document: each key and where it came from, the generation sent, what the "
            "device reported (generation, applied or refused per key, keys held)",
            "parameters": [_path("device_id", ID_PATTERN)],
            "responses": {"200": _json("the device's settings", _OBJECT)},
        },
    ),
    (
        "get",
        "/api/keys",
        {"summary": "The fleet's release and operator public keys", "responses": {"200": _json("keys", _OBJECT)}},
    ),
    (
        "post",
        "/api/keys",
        {
            "summary": "Add a public key for every device to hold",
            "requestBody": {"required": True, "content": {"application/json": {"schema": KEY_BODY}}},
            "responses": {"201": _json("the key", _KEY_ROW)},
        },
    ),
    (
        "delete",
        "/api/keys/{key_id}",
        {
            "summary": "Retire a key: the next documents leave it out",
            "parameters": [_path("key_id", "^[0-9a-f]{16}$")],
            "responses": {"200": _json("the key", _KEY_ROW)},
        },
    ),
]
