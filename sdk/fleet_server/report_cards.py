"""Report cards on the fleet server (issue 26 item 7): what each device measured of each model
at activation (``edgepack_core/protocol/report_card.py``), stored per device and model version.

- Ingest (:func:`save`): ``device_report_cards`` is kept equal to the cards of each device's
  newest online state (a state that lists models replaces the device's rows; a model whose
  entry carries no card, an older agent's, has none).
- ``GET /api/devices/{id}`` lists the device's cards (:func:`of_device`).
- ``GET /api/report-cards[?model=NAME]`` (:func:`handler`): per model version (name, version,
  model file sha256), the devices that report a card and the median of each figure over them,
  and how many run it on which provider; the dashboard's device page shows the device's cards.
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from edgepack_core.protocol.ids import ID_PATTERN
from edgepack_core.protocol.messages import DeviceState
from sdk.fleet_server.db import Database
from sdk.fleet_server.http_input import Params
from sdk.fleet_server.report_card_table import device_report_cards as table

FIGURES = ("p50_ms", "p99_ms", "first_inference_ms", "peak_rss_bytes", "accelerated_share")
CARD_COLUMNS = ("provider", "runs", *FIGURES, "nodes", "accelerated_nodes", "budget_hit", "measured_at")
BATCH = 500  # devices per delete (the bound of an IN list)

Handler = Callable[[Request, str], Awaitable[Response]]


def save(connection: Connection, records: Sequence[tuple[DeviceState, float]]) -> None:
    """Keep each device's cards equal to those of its newest online state (``records``: the
    fresh online states that list models, each with when it was heard)."""
    listing = [(record, heard) for record, heard in records if record.status == "online" and record.models]
    if not listing:
        return
    devices = [record.device for record, _heard in listing]
    for start in range(0, len(devices), BATCH):
        connection.execute(table.delete().where(table.c.device.in_(devices[start : start + BATCH])))
    rows = [
        {"device": record.device, "name": model.name, "version": model.version, "model_sha256": model.sha256,
         "heard_at": heard, **{column: getattr(model.report_card, column) for column in CARD_COLUMNS}}
        for record, heard in listing
        for model in record.models
        if model.report_card is not None
    ]
    if rows:
        connection.execute(table.insert(), rows)


def forget(connection: Connection, devices: Sequence[str]) -> None:
    """A decommissioned device's cards go with it."""
    for start in range(0, len(devices), BATCH):
        connection.execute(table.delete().where(table.c.device.in_(list(devices[start : start + BATCH]))))


def of_device(connection: Connection, device: str) -> list[dict[str, Any]]:
    """The device's cards, by model name."""
    rows = connection.execute(select(table).where(table.c.device == device).order_by(table.c.name)).mappings()
    return [{key: value for key, value in row.items() if key != "device"} for row in rows]


def _median(values: list[Any]) -> float | None:
    present = [value for value in values if value is not None]
    return float(statistics.median(present)) if present else None


def aggregate(database: Database, model: str | None) -> dict[str, Any]:
    """Per model version: devices, the median of each figure over them, providers counted."""
    query = select(table.c.name, table.c.version, table.c.model_sha256, *(table.c[f] for f in FIGURES),
                   table.c.provider)
    if model is not None:
        query = query.where(table.c.name == model)
    groups: dict[tuple[str, str | None, str | None], list[Any]] = {}
    with database.read() as connection:
        for row in connection.execute(query):
            groups.setdefault((row.name, row.version, row.model_sha256), []).append(row)
    versions = []
    for (name, version, sha), rows in sorted(groups.items(), key=lambda item: tuple(str(k) for k in item[0])):
        providers: dict[str, int] = {}
        for row in rows:
            providers[row.provider] = providers.get(row.provider, 0) + 1
        versions.append({"name": name, "version": version, "model_sha256": sha, "devices": len(rows),
                         "median": {figure: _median([getattr(row, figure) for row in rows]) for figure in FIGURES},
                         "providers": providers})
    return {"versions": versions}


def handler(context: Any) -> Handler:
    """``GET /api/report-cards?model=NAME`` (a read)."""
    async def report_cards(request: Request, _actor: str) -> Response:
        params = Params(request, {"model"})
        model = params.text("model", id_like=True)
        return JSONResponse(await run_in_threadpool(aggregate, context.database, model))

    return report_cards


_FIGURE = {"type": ["number", "null"]}
CARD_SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string"}, "version": {"type": ["string", "null"]}, "model_sha256": {"type": ["string", "null"]},
    "provider": {"type": "string"}, "runs": {"type": "integer"}, **{figure: _FIGURE for figure in FIGURES},
    "nodes": {"type": ["integer", "null"]}, "accelerated_nodes": {"type": ["integer", "null"]},
    "budget_hit": {"type": "boolean"}, "measured_at": {"type": "number"}, "heard_at": {"type": "number"}}}

OPENAPI_OPERATIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("get", "/api/report-cards", {
        "summary": "Report cards per model version: the devices that measured one at activation and the median "
                   "p50/p99 latency, time to first inference, peak RSS and accelerated share over them, with the "
                   "providers they run it on",
        "parameters": [{"name": "model", "in": "query", "required": False,
                        "schema": {"type": "string", "pattern": ID_PATTERN},
                        "description": "only this model's versions"}],
        "responses": {"200": {"description": "the versions", "content": {"application/json": {"schema": {
            "type": "object", "properties": {"versions": {"type": "array", "items": {"type": "object", "properties": {
                "name": {"type": "string"}, "version": {"type": ["string", "null"]},
                "model_sha256": {"type": ["string", "null"]}, "devices": {"type": "integer"},
                "median": {"type": "object", "properties": {figure: _FIGURE for figure in FIGURES}},
                "providers": {"type": "object", "additionalProperties": {"type": "integer"}}}}}}}}}},
            "400": {"description": "a bad query parameter, named", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Error"}}}}}}),
]
