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

import json
import re
import time
from typing import Any

from sqlalchemy import select
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edgepack_core.protocol.ids import ID_PATTERN, is_valid_id
from edgepack_core.schema import Validator
from edgepack_core.settings_doc import MAX_PEM_CHARS, MODEL_LIMIT, SETTING_KEYS
from edgepack_core.signing import KEY_KINDS, key_id, public_key_from_pem
from sdk.errors import ApiError
from sdk.fleet_server import db as tables
from sdk.fleet_server import settings_db
from sdk.fleet_server.db import Database
from sdk.fleet_server.settings import DEVICE, FLEET, GROUP, KEY_SETTING, FleetKey

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


# ---------------------------------------------------------------- views


def _shown(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings for display: key lists as their ids (a PEM says nothing to a reader)."""
    out = dict(settings)
    for key in KEY_SETTING.values():
        if key in out:
            out[key] = [key_id(public_key_from_pem(pem.encode())) for pem in out[key]]
    return out


def device_view(database: Database, device: str, now: float | None = None) -> dict[str, Any]:
    """``GET /api/devices/{id}/settings``: the effective document, where each key came from, the
    newest generation sent, and what the device reported (generation, per key, keys held)."""
    now = time.time() if now is None else now
    with database.read() as connection:
        found = settings_db.plans(connection, now, [device])
        if not found:
            raise ApiError(404, "not_found", f"no device {device}")
        _device, document, decision = found[0]
        sent = settings_db.sent_documents(connection, device).get(device)
        report = settings_db.device_reports(connection, device).get(device)
    return {
        "device": device,
        "settings": _shown(dict(document.settings)),
        "sources": dict(document.sources),
        "conflicts": {k: list(v) for k, v in document.conflicts.items()},
        "sent": None
        if sent is None
        else {"generation": sent.generation, "command": sent.command_id, "at": sent.created_at},
        "reported": None
        if report is None
        else {
            "generation": report["generation"],
            "results": json.loads(report["results"]),
            "keys": {"release": json.loads(report["release_keys"]), "operator": json.loads(report["operator_keys"])},
            "heard_at": report["heard_at"],
        },
        "decision": {"kind": decision.kind, "generation": decision.generation, "reason": decision.reason},
    }


def scopes_view(database: Database) -> dict[str, Any]:
    """``GET /api/settings``: every scope's entries with who set them, and the fleet's keys."""
    with database.read() as connection:
        rows = (
            connection.execute(
                select(tables.settings_entries).order_by(
                    tables.settings_entries.c.scope, tables.settings_entries.c.name, tables.settings_entries.c.key
                )
            )
            .mappings()
            .all()
        )
        keys = settings_db.load_keys(connection)
    entries = [
        {
            "scope": r["scope"],
            "name": r["name"] or None,
            "key": r["key"],
            "value": json.loads(r["value"]),
            "set_by": r["set_by"],
            "set_at": r["set_at"],
        }
        for r in rows
    ]
    return {"entries": entries, "keys": [keys_row(k) for k in keys]}


def keys_row(key: FleetKey) -> dict[str, Any]:
    return {
        "key_id": key.key_id,
        "kind": key.kind,
        "added_at": key.added_at,
        "retired_at": key.retired_at,
        "in_use": key.in_use,
    }


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
        return JSONResponse(await run_in_threadpool(scopes_view, self.database))

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
            return self.context.answer_then_wake(await run_in_threadpool(scopes_view, self.database))

        return handler

    async def device(self, request: Request, _actor: str) -> Response:
        _no_query(request)
        device = str(request.path_params["device_id"])
        if not is_valid_id(device):
            raise ApiError(404, "not_found", "no such device")
        return JSONResponse(await run_in_threadpool(device_view, self.database, device))

    async def keys(self, request: Request, _actor: str) -> Response:
        _no_query(request)
        return JSONResponse({"keys": (await run_in_threadpool(scopes_view, self.database))["keys"]})

    async def add_key(self, request: Request, actor: str) -> Response:
        _no_query(request)
        body = await self._body(request, _KEY_VALIDATOR)
        remote = self._remote(request)
        key = await run_in_threadpool(
            lambda: settings_db.add_key(self.database, body["kind"], body["pem"], actor=actor, remote=remote)
        )
        return self.context.answer_then_wake(keys_row(key), 201)

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
        return self.context.answer_then_wake(keys_row(key))


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
_SETTABLE = {key: schema for key, schema in SETTING_KEYS.items() if key not in KEY_SETTING.values()}
_NAMES = {"anyOf": [{"enum": sorted(_SETTABLE)}, {"type": "string", "pattern": MODEL_LIMIT.pattern}]}
DESCRIBED_BODY: dict[str, Any] = {
    **SETTINGS_BODY,
    "properties": {
        **SETTINGS_BODY["properties"],
        "set": {
            **SETTINGS_BODY["properties"]["set"],
            "properties": _SETTABLE,
            "patternProperties": {MODEL_LIMIT.pattern: {"type": "integer", "minimum": 1, "maximum": 2**50}},
            "additionalProperties": False,
        },
        "unset": {**SETTINGS_BODY["properties"]["unset"], "items": _NAMES},
    },
}
"""The body as the OpenAPI document describes it: each settable key with its value's schema (the
server checks the same with :func:`edgepack_core.settings_doc.check_value`, naming the key)."""
_PUT = {
    "summary": "Set or unset settings of a scope (keys: " + ", ".join(sorted(SETTING_KEYS)) + ")",
    "requestBody": {"required": True, "content": {"application/json": {"schema": DESCRIBED_BODY}}},
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
