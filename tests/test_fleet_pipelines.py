"""A device's pipelines on the fleet server (issue 26): the ``pipelines`` section of its newest
telemetry, parsed once at the ingest boundary, stored per device with each pipeline's frames per
second, and listed in ``GET /api/devices/{id}`` (bounded, described by the OpenAPI document); on
SQLite and PostgreSQL. The page's table is tested in tests/test_dashboard.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from edgepack_core.pipeline_spec import MAX_STAGES
from edgepack_core.protocol.messages import Telemetry, parse_telemetry
from edgepack_core.protocol.pipeline_figures import MAX_PIPELINES, MAX_REASON_CHARS, SourceFigures
from edgepack_core.schema import validate
from sdk.fleet_server.db import Database, open_database
from sdk.fleet_server.device_pipelines import MAX_FPS_GAP_S, PIPELINES_PROPERTY, fps
from sdk.fleet_server.ingest import Writer
from sdk.fleet_server.openapi import describe
from sdk.fleet_server.queries import decommission_device, get_device
from tests.postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)

HOSTILE = "<img src=x onerror=\"document.title='pwned'\">"
T0 = 1.7e9


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'fleet.db'}" if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    opened = open_database(url)
    yield opened
    opened.dispose()


def pipeline(name: str, frames: int, **changes: Any) -> dict[str, Any]:
    return {
        "name": name,
        "state": "running",
        "frames": frames,
        "dropped": 2,
        "stage_errors": 0,
        "source": {"state": "up", "frames": frames + 2, "reconnects": 0, "failures": 0},
        "events": {"door-line": {"cross": 4, "enter": 1}},
        **changes,
    }


def sample(device: str, seq: int, ts: float, *pipelines: Any) -> Telemetry:
    doc = {
        "schema": "edgepack.telemetry/1",
        "device": device,
        "seq": seq,
        "ts": ts,
        "latency_ms": {"p50": 3.0},
        "inferences": {"interval": 5, "total": 5},
        **({"pipelines": list(pipelines)} if pipelines else {}),
    }
    parsed = parse_telemetry(device, json.dumps(doc).encode())
    assert isinstance(parsed, Telemetry)
    return parsed


def write(database: Database, *records: Telemetry) -> None:
    with database.write() as connection:
        Writer(database).telemetry(connection, [(record, time.time()) for record in records])


def shown(database: Database, device: str) -> list[dict[str, Any]]:
    return get_device(database, device, now=time.time(), silence_s=60)["pipelines"]


def test_a_device_that_sent_pipeline_figures_shows_them_and_one_that_sent_none_an_empty_list(database):
    down = pipeline(
        "yard",
        50,
        source={
            "state": "down",
            "frames": 60,
            "reconnects": 3,
            "failures": 4,
            "reason": "cannot open rtsp://cam: Connection refused",
        },
    )
    refused = {"name": "attic", "state": "refused", "reason": "pipelines[2].stages[0].model: no installed model"}
    write(database, sample("cam-1", 1, T0, pipeline("door", 100), down, refused), sample("plain", 1, T0))
    door, yard, attic = shown(database, "cam-1")
    assert door == {
        "name": "door",
        "state": "running",
        "frames": 100,
        "dropped": 2,
        "stage_errors": 0,
        "fps": None,
        "source": {"state": "up", "frames": 102, "reconnects": 0, "failures": 0},
        "events": {"door-line": {"enter": 1, "cross": 4}},
    }
    assert yard["source"] == {
        "state": "down",
        "frames": 60,
        "reconnects": 3,
        "failures": 4,
        "reason": "cannot open rtsp://cam: Connection refused",
    }
    assert (attic["state"], attic["reason"], attic["source"]) == ("refused", refused["reason"], None)
    assert shown(database, "plain") == []
    validate(shown(database, "cam-1"), PIPELINES_PROPERTY, document="pipelines")
    # The next sample, 10 s later on the device's clock: frames per second from the difference.
    write(database, sample("cam-1", 2, T0 + 10, pipeline("door", 400), pipeline("yard", 40)))
    assert [(p["name"], p["fps"]) for p in shown(database, "cam-1")] == [("door", 30.0), ("yard", None)]


def test_a_late_sample_changes_nothing_and_one_without_pipelines_clears_them(database):
    write(database, sample("cam-1", 5, T0, pipeline("door", 100)))
    write(database, sample("cam-1", 4, T0 - 10, pipeline("door", 1), pipeline("old", 1)))  # from the outbox
    assert [(p["name"], p["frames"]) for p in shown(database, "cam-1")] == [("door", 100)]
    write(database, sample("cam-1", 6, T0 + 10))  # its pipelines were all removed
    assert shown(database, "cam-1") == []
    write(database, sample("cam-1", 7, T0 + 20, pipeline("door", 5)))
    assert [p["name"] for p in shown(database, "cam-1")] == ["door"]
    decommission_device(database, "cam-1", reason="gone", actor="t", remote="test")
    with database.read() as connection:
        from sdk.fleet_server.device_pipelines import of_device

        assert of_device(connection, "cam-1") == []


def test_the_page_gets_at_most_the_pipelines_a_device_may_send_and_never_a_hostile_name(database):
    many = [pipeline(f"p{i:02d}", i) for i in range(MAX_PIPELINES + 1)]
    write(database, sample("busy", 1, T0, *many))
    names = [p["name"] for p in shown(database, "busy")]
    assert names == [f"p{i:02d}" for i in range(MAX_PIPELINES)]  # the limit kept, one more dropped
    long_reason = "x" * (MAX_REASON_CHARS + 1)
    write(
        database,
        sample(
            "evil",
            1,
            T0,
            pipeline(HOSTILE, 1),
            pipeline(
                "ok", 1, source={"state": "down", "frames": 1, "reconnects": 0, "failures": 1, "reason": long_reason}
            ),
        ),
    )
    (kept,) = shown(database, "evil")
    assert kept["name"] == "ok" and kept["source"]["reason"] == "x" * MAX_REASON_CHARS


def test_frames_per_second_only_between_close_samples_of_a_counter_that_grew():
    assert fps(400, T0 + 10, 100, T0) == 30.0
    assert fps(100, T0 + 10, 100, T0) == 0.0
    assert fps(160, T0 + MAX_FPS_GAP_S, 100, T0) == 60 / MAX_FPS_GAP_S  # the longest gap still counts
    assert fps(160, T0 + MAX_FPS_GAP_S + 0.001, 100, T0) is None  # one step more does not
    assert fps(99, T0 + 10, 100, T0) is None  # the agent restarted
    assert fps(100, T0, 50, T0) is None and fps(100, T0 - 1, 50, T0) is None
    assert fps(None, T0 + 10, 50, T0) is None and fps(100, T0 + 10, None, T0) is None


def test_a_down_sources_reason_travels_bounded_and_an_older_agents_source_has_none():
    doc = {
        "name": "door",
        "source": {
            "state": "down",
            "frames": 0,
            "reconnects": 1,
            "failures": 1,
            "reason": "y" * (MAX_REASON_CHARS + 1),
        },
    }
    (figures,) = sample("d", 1, T0, doc).pipelines
    assert figures.source == SourceFigures("down", 0, 1, 1, "y" * MAX_REASON_CHARS)
    older = {"name": "door", "source": {"state": "up", "frames": 3, "reconnects": 0, "failures": 0}}
    (figures,) = sample("d", 1, T0, older).pipelines
    assert figures.source is not None and figures.source.reason is None
    assert "reason" not in figures.source.to_json()  # what an up source sends is unchanged


def test_the_openapi_document_describes_a_devices_pipelines():
    device = describe()["components"]["schemas"]["Device"]["properties"]
    assert device["pipelines"]["maxItems"] == MAX_PIPELINES
    assert {"fps", "source", "events", "frames", "dropped"} <= set(device["pipelines"]["items"]["properties"])


def test_each_stages_p50_and_p95_are_stored_and_served_bounded_and_an_older_agents_pipeline_has_none(database):
    stages = [{"name": f"s{i}", "count": 10 + i, "p50_ms": 1.5, "p95_ms": 4.25} for i in range(MAX_STAGES + 1)]
    chain = pipeline("door", 100, stages=stages, end_to_end={"count": 100, "p50_ms": 9.5, "p95_ms": 30.0})
    write(database, sample("cam-1", 1, T0, chain, pipeline("yard", 5)))
    door, yard = shown(database, "cam-1")
    assert door["stages"] == stages[:MAX_STAGES]  # the limit kept, one more dropped at the ingest
    assert door["end_to_end"] == {"count": 100, "p50_ms": 9.5, "p95_ms": 30.0}
    assert "stages" not in yard and "end_to_end" not in yard  # an older agent's pipeline
    validate(shown(database, "cam-1"), PIPELINES_PROPERTY, document="pipelines")
    assert PIPELINES_PROPERTY["items"]["properties"]["stages"]["maxItems"] == MAX_STAGES
