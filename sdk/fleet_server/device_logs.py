"""A device's logs through the server: ``POST /api/devices/{id}/logs/fetch`` (an operator asks the
device for its records: a ``fetch-logs`` command, signed, recorded and published by the driver's
code like a device action's, audited as ``logs.fetch``) and ``GET /api/devices/{id}/logs``
(what devices sent, stored by :mod:`.log_ingest`; ``request=`` also says whether that fetch's
answer is complete). The dashboard's device page and ``edgepack device logs`` use both.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edgepack_core.protocol.commands import build_command, field_schema
from edgepack_core.protocol.logs import LEVEL_NUMBERS, LEVELS
from edgepack_core.schema import Validator, json_integers
from sdk.errors import ApiError
from sdk.fleet_server import audit
from sdk.fleet_server import db as tables
from sdk.fleet_server.actions import CommandSink
from sdk.fleet_server.db import Database
from sdk.fleet_server.http_input import Params, _path_id, _remote, _validate, read_json
from sdk.fleet_server.log_tables import device_log_chunks, device_logs

MAX_PAGE = 10_000
DEFAULT_PAGE = 1000
FETCH_TTL_S = 300.0
"""A fetch is worth answering for a few minutes only: a device that comes back later is asked again."""

FETCH_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "lines": field_schema("fetch-logs", "lines"),
        "since": {"type": "number", "minimum": 0, "description": "only records logged after this time"},
        "level": field_schema("fetch-logs", "level"),
        "reason": {"type": "string", "maxLength": 500, "description": "why (kept in the audit)"},
    },
}
_FETCH_VALIDATOR = Validator(FETCH_REQUEST_SCHEMA, document="request")

Handler = Callable[[Request, str], Awaitable[Response]]


@dataclass(frozen=True)
class LogQuery:
    """A page of stored records: after ``since``, at ``level`` or above, the newest ``limit``."""

    since: float | None = None
    level: str = "debug"
    limit: int = DEFAULT_PAGE
    request: str | None = None


def send_fetch(database: Database, sink: CommandSink, device: str, body: dict[str, Any], *, actor: str,
               remote: str, now: float) -> dict[str, Any]:
    """Build the fetch-logs command, record it (signed by the driver) with its audit row, publish it."""
    fields: dict[str, Any] = {key: body[key] for key in ("lines", "since", "level") if key in body}
    with database.write() as connection:
        if connection.execute(select(tables.devices.c.id).where(tables.devices.c.id == device)).first() is None:
            raise ApiError(404, "not_found", f"no device {device}")
        command = build_command("fetch-logs", device=device, ttl_s=FETCH_TTL_S, now=now, **fields)
        recorded = sink.record_command(connection, device, "fetch-logs", command, now)
        audit.record(connection, actor=actor, action="logs.fetch", target=device, remote=remote, now=now,
                     detail={"reason": body.get("reason", ""), "command": command["id"], **fields})
    if recorded is not None:
        sink.publish([recorded], now)
    return {"device": device, "command": command["id"], **fields}


def _request_state(connection: Connection, device: str, request: str) -> dict[str, Any]:
    """How far a fetch's answer got: chunks stored, whether all of them, and the device's job
    state with its reason (a refusal says why: the rate limit, a missing signature)."""
    marks, events = device_log_chunks, tables.job_events
    rows = connection.execute(select(marks.c.chunk, marks.c.last, marks.c.records).where(
        marks.c.request == request, marks.c.device == device)).all()
    last = next((row.chunk for row in rows if row.last), None)
    job = connection.execute(select(events.c.state, events.c.final, events.c.reason).where(
        events.c.device == device, events.c.job == request).order_by(events.c.id.desc()).limit(1)).first()
    return {"id": request, "chunks": len(rows), "records": sum(row.records for row in rows),
            "complete": last is not None and len(rows) == last + 1,
            "state": None if job is None else job.state, "final": bool(job is not None and job.final),
            "reason": None if job is None else job.reason}


def read_logs(database: Database, device: str, query: LogQuery) -> dict[str, Any]:
    """Stored records of ``device`` (oldest first), the newest time among them, and the state of
    ``query.request`` when given. 404 for a device the server knows nothing of."""
    logs = device_logs
    levels = [name for name in LEVELS if LEVEL_NUMBERS[name] >= LEVEL_NUMBERS[query.level]]
    select_page = select(logs.c.seq, logs.c.ts, logs.c.level, logs.c.logger, logs.c.message, logs.c.received_at) \
        .where(logs.c.device == device, logs.c.level.in_(levels))
    if query.since is not None:
        select_page = select_page.where(logs.c.ts > query.since)
    with database.read() as connection:
        rows = connection.execute(select_page.order_by(logs.c.ts.desc(), logs.c.seq.desc()).limit(query.limit)).all()
        known = rows or connection.execute(select(tables.devices.c.id).where(tables.devices.c.id == device)).first() \
            or connection.execute(select(func.count()).select_from(logs).where(logs.c.device == device)).scalar()
        state = _request_state(connection, device, query.request) if query.request else None
    if not known:
        raise ApiError(404, "not_found", f"no device {device}")
    records = [{"seq": r.seq, "ts": r.ts, "level": r.level, "logger": r.logger, "message": r.message,
                "received_at": r.received_at} for r in reversed(rows)]
    doc: dict[str, Any] = {"device": device, "records": records, "newest": records[-1]["ts"] if records else None}
    if state is not None:
        doc["request"] = state
    return doc


def fetch_handler(context: Any) -> Handler:
    """``POST /api/devices/{id}/logs/fetch`` (an operator's write, behind the API's guard)."""
    async def fetch(request: Request, actor: str) -> Response:
        Params(request, set())
        device = _path_id(request, "device_id")
        body = json_integers(await read_json(request, optional=True), FETCH_REQUEST_SCHEMA)  # 7978.0 is 7978
        _validate(_FETCH_VALIDATOR, body)
        if context.commands is None:
            raise ApiError(503, "unavailable", "this server sends no commands (no broker connection)")
        done = await run_in_threadpool(send_fetch, context.database, context.commands, device, body, actor=actor,
                                       remote=_remote(request), now=time.time())
        return JSONResponse(done)

    return fetch


def read_handler(context: Any) -> Handler:
    """``GET /api/devices/{id}/logs?since=&level=&limit=&request=`` (a read)."""
    async def read(request: Request, _actor: str) -> Response:
        params = Params(request, {"since", "level", "limit", "request"})
        device = _path_id(request, "device_id")
        level = params.text("level") or "debug"
        if level not in LEVEL_NUMBERS:
            raise ApiError(400, "invalid", f"level: {level[:32]!r} is not one of {', '.join(LEVELS)}")
        since = params.number("since", -1.0)
        query = LogQuery(since=None if since < 0 else since, level=level,
                         limit=params.integer("limit", DEFAULT_PAGE, 1, MAX_PAGE),
                         request=params.text("request", id_like=True))
        return JSONResponse(await run_in_threadpool(read_logs, context.database, device, query))

    return read


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


_DEVICE = {"name": "device_id", "in": "path", "required": True,
           "schema": {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"}, "description": "device id"}
_ERROR = {"$ref": "#/components/schemas/Error"}
_RECORD = {"type": "object", "properties": {
    "seq": {"type": "integer"}, "ts": {"type": "number"}, "level": {"type": "string", "enum": list(LEVELS)},
    "logger": {"type": "string"}, "message": {"type": "string"}, "received_at": {"type": "number"}}}

OPENAPI_OPERATIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("post", "/api/devices/{device_id}/logs/fetch", {
        "summary": "Ask a device for its log records (a signed fetch-logs command, audited as logs.fetch); the "
                   "device answers in chunks the server stores (GET .../logs?request=COMMAND says when complete)",
        "parameters": [_DEVICE],
        "requestBody": {"required": False, "content": {"application/json": {"schema": FETCH_REQUEST_SCHEMA}}},
        "responses": {"200": {"description": "the command sent", "content": {"application/json": {"schema": {
            "type": "object", "properties": {"device": {"type": "string"}, "command": {"type": "string"}}}}}},
            "404": {"description": "no such device", "content": {"application/json": {"schema": _ERROR}}}}}),
    ("get", "/api/devices/{device_id}/logs", {
        "summary": "The log records devices sent (oldest first; the newest per device are kept)",
        "parameters": [_DEVICE,
                       _query("since", {"type": "number", "minimum": 0}, "only records logged after this time"),
                       _query("level", {"type": "string", "enum": list(LEVELS)}, "this level and above"),
                       _query("limit", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE,
                                        "default": DEFAULT_PAGE}, "the newest this many"),
                       _query("request", {"type": "string", "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"},
                              "a fetch's command id: its answer's state too")],
        "responses": {"200": {"description": "records", "content": {"application/json": {"schema": {
            "type": "object", "properties": {
                "device": {"type": "string"}, "records": {"type": "array", "items": _RECORD},
                "newest": {"type": ["number", "null"]},
                "request": {"type": "object", "properties": {
                    "id": {"type": "string"}, "chunks": {"type": "integer"}, "records": {"type": "integer"},
                    "complete": {"type": "boolean"}, "state": {"type": ["string", "null"]},
                    "final": {"type": "boolean"}, "reason": {"type": ["string", "null"]}}}}}}}},
            "404": {"description": "no such device", "content": {"application/json": {"schema": _ERROR}}}}}),
]
