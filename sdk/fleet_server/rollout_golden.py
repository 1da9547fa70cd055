"""The golden stream counts of a rollout device's job, on :data:`.db.metadata`'s
``rollout_devices`` (db.py imports this module, so Alembic's comparison and every reader see
them; db.py is at its size limit).

A device refuses a candidate whose golden clip gives other events and sends the counts in the
job's detail; the ingest stores them as the protocol parsed them
(:attr:`edgepack_core.protocol.messages.JobEvent.golden_stream`) and the rollout driver reads
them back typed (:attr:`sdk.fleet_server.rollouts.DeviceStatus.golden_stream`), so a wave's
failure counts the mismatches without reading the reason line.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, Integer, Table

from edgepack_core.golden_stream import GoldenCounts
from sdk.fleet_server.db import metadata

rollout_devices = Table(
    "rollout_devices",
    metadata,
    Column("golden_events", Integer),  # None: the job's events carried no golden stream counts
    Column("golden_mismatches", Integer),
    extend_existing=True,
)


def golden_values(counts: GoldenCounts | None) -> dict[str, Any]:
    """The columns a job event writes (None clears counts an earlier event of the job left)."""
    return {
        "golden_events": None if counts is None else counts.events,
        "golden_mismatches": None if counts is None else counts.mismatches,
    }


def golden_of(events: int | None, mismatches: int | None) -> GoldenCounts | None:
    """The typed counts of a row's columns, or None when it has none."""
    return None if events is None or mismatches is None else GoldenCounts(events, mismatches)
