"""``GET /api/alerts``: the open alerts and the newest ones (its handler and its OpenAPI operation).

A read for any token; the alerts are recorded by :mod:`.alert_runner` on the server that leads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sdk.errors import ApiError
from sdk.fleet_server.alert_runner import MAX_PAGE, listing
from sdk.fleet_server.db import Database

STATES = ("open", "resolved", "notice")
DEFAULT_LIMIT = 100


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    if not value.isdigit() or len(value) > 6 or not 1 <= int(value) <= MAX_PAGE:
        raise ApiError(400, "invalid", f"limit: must be a whole number in 1..{MAX_PAGE}")
    return int(value)


def list_alerts(database: Database) -> Callable[[Request, str], Awaitable[Response]]:
    """The handler (behind the API's token guard)."""

    async def handler(request: Request, _actor: str) -> Response:
        params = request.query_params
        unknown = sorted(set(params.keys()) - {"limit", "state"})
        if unknown:
            raise ApiError(400, "invalid", f"unknown query parameter {unknown[0]!r} (allowed: limit, state)")
        if any(len(params.getlist(key)) > 1 for key in params):
            raise ApiError(400, "invalid", "a query parameter is given twice")
        state = params.get("state")
        if state is not None and state not in STATES:
            raise ApiError(400, "invalid", f"state: must be one of {', '.join(STATES)}")
        limit = _limit(params.get("limit"))
        return JSONResponse(await run_in_threadpool(listing, database, limit=limit, state=state))

    return handler


_ALERT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "kind": {"type": "string", "enum": ["offline", "error_rate", "failed_update", "rollout"]},
        "subject": {"type": "string", "description": "the device, or the rollout"},
        "state": {"type": "string", "enum": list(STATES)},
        "key": {"type": "string", "description": "kind:subject (a rollout notice: rollout:ID:TRANSITION)"},
        "summary": {"type": "string"},
        "detail": {"type": "object"},
        "opened_at": {"type": "number"},
        "resolved_at": {"type": ["number", "null"]},
    },
}

OPERATIONS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "get",
        "/api/alerts",
        {
            "summary": "Alerts: every open one, and the newest (fired, resolved, rollout notices); "
            "docs/fleet-server.md, "
            '"Alerts"',
            "parameters": [
                {
                    "name": "limit",
                    "in": "query",
                    "required": False,
                    "description": "newest alerts listed",
                    "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE, "default": DEFAULT_LIMIT},
                },
                {
                    "name": "state",
                    "in": "query",
                    "required": False,
                    "description": "only the newest in this state",
                    "schema": {"type": "string", "enum": list(STATES)},
                },
            ],
            "responses": {
                "200": {
                    "description": "alerts",
                    "content": {
                        "application/json": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "open": {"type": "array", "items": _ALERT},
                                    "recent": {"type": "array", "items": _ALERT},
                                },
                            }
                        }
                    },
                }
            },
        },
    ),
]
