"""A device's pipelines on the fleet server (issue 26): the ``pipelines`` section of its newest
telemetry (:mod:`edgepack_core.protocol.pipeline_figures`), each pipeline's frames per second
worked out from the sample before, in ``device_pipelines`` (on :data:`.db.metadata`: db.py
imports this module), listed in ``GET /api/devices/{id}`` and on the dashboard's device page.

- Ingest (:func:`save`, in the batch's transaction): a device's row follows the sample that
  becomes its latest figures (the same rule as the ``devices`` row, passed in by the writer); a
  sample without pipelines (an agent that runs none, or an older one) deletes the row.
- What is stored is the typed figures' own JSON (the protocol's parser ran at the ingest
  boundary, so at most :data:`MAX_PIPELINES` pipelines of :data:`MAX_RULES` rules and
  :data:`MAX_STAGES` stage latencies each); a read parses it again with the same parser, so the
  page never gets more than a device may send.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Column, Float, String, Table, Text, select
from sqlalchemy.engine import Connection

from edgepack_core.pipeline_spec import MAX_STAGES
from edgepack_core.protocol.bounds import number
from edgepack_core.protocol.messages import Telemetry
from edgepack_core.protocol.pipeline_figures import (
    EVENT_KINDS,
    MAX_PIPELINES,
    MAX_REASON_CHARS,
    MAX_RULES,
    PIPELINE_STATES,
    SOURCE_STATES,
    PipelineFigures,
    parse_pipelines_section,
)
from sdk.fleet_server.db import ID, Database, metadata

device_pipelines = Table(
    "device_pipelines",
    metadata,
    Column("device", String(ID), primary_key=True),
    Column("seq", BigInteger),  # the sample's number (the device's)
    Column("clock", Float, nullable=False),  # the sample's ts (the device's clock), else when it was heard
    Column("heard_at", Float, nullable=False),
    Column("figures", Text, nullable=False),  # {"pipelines": [PipelineFigures.to_json()], "fps": {name: fps}}
)

MAX_FPS_GAP_S = 300.0
"""Samples further apart than this give no frames per second (an average over a device's
absence says nothing about now)."""
BATCH = 500  # devices per IN list

Replaces = Callable[[int | None, float, int | None, float | None], bool]
"""The writer's rule: does a sample (seq, heard) replace the stored one (seq, heard)?"""


def fps(frames: int | None, clock: float, frames_before: int | None, clock_before: float) -> float | None:
    """Frames per second between two samples of one pipeline: None without both counts, when
    the counter went back (the agent restarted), or when the samples are not 0 < gap <=
    :data:`MAX_FPS_GAP_S` apart. Pure."""
    elapsed = clock - clock_before
    if frames is None or frames_before is None or frames < frames_before or not 0 < elapsed <= MAX_FPS_GAP_S:
        return None
    return (frames - frames_before) / elapsed


@dataclass(frozen=True)
class PipelineView:
    """One pipeline as the API and the dashboard show it: the device's figures and the frames
    per second the server worked out (None for the first sample)."""

    figures: PipelineFigures
    fps: float | None

    def to_json(self) -> dict[str, Any]:
        return {**self.figures.to_json(), "fps": self.fps}


def _stored(connection: Connection, devices: list[str]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for start in range(0, len(devices), BATCH):
        part = devices[start : start + BATCH]
        found.update(
            (row.device, row)
            for row in connection.execute(select(device_pipelines).where(device_pipelines.c.device.in_(part)))
        )
    return found


def _document(record: Telemetry, clock: float, before: Any) -> str:
    """The row's JSON: the figures, and each pipeline's fps against the stored sample."""
    previous = {view.figures.name: view.figures.frames for view in _views(before.figures)} if before else {}
    rates = {
        p.name: fps(p.frames, clock, previous.get(p.name), before.clock) if before else None for p in record.pipelines
    }
    return json.dumps({"pipelines": [p.to_json() for p in record.pipelines], "fps": rates}, separators=(",", ":"))


def save(
    database: Database, connection: Connection, latest: Sequence[tuple[Telemetry, float]], replaces: Replaces
) -> None:
    """Keep each device's row equal to the pipelines of the sample that became its latest
    (``latest``: the newest sample per device in the batch, each with when it was heard)."""
    if not latest:
        return
    stored = _stored(connection, [record.device for record, _ in latest])
    rows, emptied = [], []
    for record, heard in latest:
        before = stored.get(record.device)
        if before is not None and not replaces(record.seq, heard, before.seq, before.heard_at):
            continue
        if not record.pipelines:
            if before is not None:
                emptied.append(record.device)
            continue
        clock = record.ts if record.ts is not None else heard
        rows.append(
            {
                "device": record.device,
                "seq": record.seq,
                "clock": clock,
                "heard_at": heard,
                "figures": _document(record, clock, before),
            }
        )
    for start in range(0, len(emptied), BATCH):
        connection.execute(
            device_pipelines.delete().where(device_pipelines.c.device.in_(emptied[start : start + BATCH]))
        )
    if rows:
        stmt = database.insert(device_pipelines)
        connection.execute(
            stmt.on_conflict_do_update(
                index_elements=["device"],
                set_={name: stmt.excluded[name] for name in ("seq", "clock", "heard_at", "figures")},
            ),
            rows,
        )


def forget(connection: Connection, devices: Sequence[str]) -> None:
    """A decommissioned device's pipelines go with it."""
    for start in range(0, len(devices), BATCH):
        connection.execute(
            device_pipelines.delete().where(device_pipelines.c.device.in_(list(devices[start : start + BATCH])))
        )


def _views(figures: str) -> tuple[PipelineView, ...]:
    """The stored document, parsed again by the protocol's parser (bounded and typed)."""
    doc = json.loads(figures)
    if not isinstance(doc, dict):
        return ()
    found = doc.get("fps")
    rates: dict[str, Any] = found if isinstance(found, dict) else {}
    return tuple(PipelineView(p, number(rates.get(p.name))) for p in parse_pipelines_section(doc.get("pipelines")))


def of_device(connection: Connection, device: str) -> list[dict[str, Any]]:
    """The device's pipelines as of its newest sample that carried them, in the device's order."""
    figures = connection.execute(select(device_pipelines.c.figures).where(device_pipelines.c.device == device)).scalar()
    return [view.to_json() for view in _views(figures)] if figures else []


_COUNT = {"type": ["integer", "null"], "minimum": 0}
_MS = {"type": ["number", "null"], "minimum": 0, "description": "estimated from the device's histogram buckets"}
_LATENCY = {"count": {**_COUNT, "description": "frames answered"}, "p50_ms": _MS, "p95_ms": _MS}
PIPELINE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "state": {"enum": [*PIPELINE_STATES, None]},
        "reason": {"type": "string", "maxLength": MAX_REASON_CHARS, "description": "refused: why"},
        "frames": {**_COUNT, "description": "frames the stages answered"},
        "dropped": {**_COUNT, "description": "frames the latest policy dropped"},
        "stage_errors": {**_COUNT, "description": "frames skipped because a stage's model failed"},
        "fps": {
            "type": ["number", "null"],
            "description": "frames answered per second between the device's last two "
            "samples (null for the first, or after a restart)",
        },
        "source": {
            "type": ["object", "null"],
            "description": "the source's reader (null: frames pushed from Python, or refused)",
            "properties": {
                "state": {"enum": [*SOURCE_STATES, None]},
                "frames": {**_COUNT, "description": "frames read"},
                "reconnects": _COUNT,
                "failures": _COUNT,
                "reason": {"type": "string", "maxLength": MAX_REASON_CHARS, "description": "down: why"},
            },
        },
        "events": {
            "type": "object",
            "description": f"events by rule (at most {MAX_RULES}), then kind",
            "additionalProperties": {
                "type": "object",
                "properties": {k: {"type": "integer"} for k in EVENT_KINDS},
                "additionalProperties": False,
            },
        },
        "stages": {
            "type": "array",
            "maxItems": MAX_STAGES,
            "description": "per stage in order, its work on a frame (absent: an older agent)",
            "items": {"type": "object", "properties": {"name": {"type": "string"}, **_LATENCY}},
        },
        "end_to_end": {
            "type": "object",
            "description": "frames from the source's reader to the sinks done (absent: an older agent)",
            "properties": _LATENCY,
        },
    },
}
PIPELINES_PROPERTY: dict[str, Any] = {
    "type": "array",
    "maxItems": MAX_PIPELINES,
    "items": PIPELINE_SCHEMA,
    "description": "only on GET /api/devices/{device_id}: per pipeline, its figures in the device's newest telemetry "
    '(empty: the device runs none, or its agent sends none; docs/fleet-server.md, "Pipelines")',
}
