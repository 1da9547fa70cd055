"""Per-source and per-rule counters: a real pipeline's figures (the golden clip through the
packaged detector) in the agent's /metrics text and in telemetry's ``pipelines`` section, the
section's parser bounded, and a fleet server that stores a telemetry message carrying it."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest

from device_agent.http.prometheus import pipeline_latency_metrics, pipeline_metrics
from device_agent.pipelines.checks import StageContract
from device_agent.pipelines.host import PipelineSet
from device_agent.pipelines.latency import LatencyRecorder
from device_agent.pipelines.runner import PipelineRunner
from device_agent.pipelines.spec import parse_pipelines
from device_agent.runtime import InferenceService, load_model
from device_agent.telemetry.metrics import TELEMETRY_SCHEMA
from edgepack_core.protocol.messages import Telemetry, parse_telemetry
from edgepack_core.protocol.pipeline_figures import (
    MAX_PIPELINES,
    MAX_RULES,
    PipelineFigures,
    SourceFigures,
    StageFigures,
    parse_pipelines_section,
)
from edgepack_core.schema import validate
from tests.fleet_server_process import FleetServerProcess, wait_for
from tests.stream_models import LABELS, draw
from tests.test_pipeline_streams import (  # noqa: F401
    FPS,
    FRAMES,
    HEIGHT,
    PATHS,
    PIPELINE,
    WIDTH,
    expected_events,
    scene,
    service_of,
)


@pytest.fixture(scope="module")
def finished(scene) -> tuple[PipelineFigures, ...]:  # noqa: F811
    """The golden clip run to its end by the agent's PipelineSet, beside a pipeline refused for
    a model that is not installed."""
    service = service_of(scene)
    clip = json.loads(json.dumps(PIPELINE).replace("CLIP", str(scene["clip"])))
    clip["source"]["policy"] = "every"
    missing = {**clip, "name": "yard", "stages": [{"model": "absent"}]}
    pipelines = PipelineSet(parse_pipelines([clip, missing]), "pi-07", lambda name: service, None)
    pipelines.start({"detector": StageContract("image", "detection", LABELS)})
    try:
        assert pipelines.runners["door-cam"].finished.wait(60)
    finally:
        pipelines.stop()
    return pipelines.figures()


def expected_counts() -> Counter[tuple[str, str]]:
    return Counter((rule, kind) for _, rule, kind, _, _ in expected_events())


def test_a_pipelines_counters_are_its_frames_source_and_events_by_rule_and_kind(finished):
    refused, door = finished
    assert (refused.name, refused.state, refused.source) == ("yard", "refused", None)
    assert refused.reason and "absent" in refused.reason
    assert (door.name, door.state, door.frames, door.dropped, door.stage_errors) == (
        "door-cam", "finished", FRAMES, 0, 0)
    assert door.source == SourceFigures("up", FRAMES, 0, 0)
    assert {(rule, kind): n for rule, kinds in door.events for kind, n in kinds} == expected_counts()
    assert [(s.name, s.count) for s in door.stages] == [("detector", FRAMES)]
    assert door.end_to_end is not None and door.end_to_end.count == FRAMES  # from the file's reader on
    assert refused.stages == () and refused.end_to_end is None


def test_metrics_carry_each_pipeline_its_source_and_its_events_by_rule_and_kind(finished):
    text = pipeline_metrics(finished)
    lines = set(text.splitlines())
    for line in (f'edgepack_pipeline_frames_total{{pipeline="door-cam"}} {FRAMES}',
                 'edgepack_pipeline_dropped_total{pipeline="door-cam"} 0',
                 'edgepack_pipeline_stage_errors_total{pipeline="door-cam"} 0',
                 f'edgepack_pipeline_source_frames_total{{pipeline="door-cam"}} {FRAMES}',
                 'edgepack_pipeline_source_reconnects_total{pipeline="door-cam"} 0',
                 'edgepack_pipeline_source_failures_total{pipeline="door-cam"} 0',
                 'edgepack_pipeline_source_up{pipeline="door-cam"} 1',
                 'edgepack_pipeline_state{pipeline="door-cam",state="finished"} 1',
                 'edgepack_pipeline_state{pipeline="door-cam",state="running"} 0',
                 'edgepack_pipeline_state{pipeline="yard",state="refused"} 1'):
        assert line in lines, line
    for (rule, kind), n in expected_counts().items():
        assert f'edgepack_pipeline_events_total{{pipeline="door-cam",rule="{rule}",kind="{kind}"}} {n}' in lines
    assert not [line for line in lines if 'pipeline="yard"' in line and "state" not in line]  # no source, no frames
    assert pipeline_metrics(()) == ""


def test_telemetrys_pipelines_section_validates_and_parses_back_to_the_same_figures(finished):
    sample = Telemetry("pi-07", seq=1, ts=1.0, interval_s=10.0, throughput_per_s=0.0, inferences_total=0,
                       inferences_interval=0, uptime_s=1.0, pipelines=finished)
    validate(sample.to_json(), TELEMETRY_SCHEMA, document="telemetry")
    parsed = parse_telemetry("pi-07", sample.encode())
    assert isinstance(parsed, Telemetry) and parsed.pipelines == finished
    older = Telemetry("pi-07", seq=1, ts=1.0).to_json()
    assert "pipelines" not in older  # an agent without pipelines sends what it always sent
    assert parse_telemetry("pi-07", json.dumps(older).encode()).pipelines == ()  # type: ignore[union-attr]


def test_a_source_that_is_down_sends_why_in_telemetry(scene):  # noqa: F811
    """What an operator reads on the fleet server's device page: the reader's failure, bounded."""
    down = {**PIPELINE, "name": "gate", "source": {"url": "rtsp://127.0.0.1:9/none", "reconnect_s": 0.05,
                                                   "reconnect_max_s": 0.1}}
    service = service_of(scene)
    pipelines = PipelineSet(parse_pipelines([down]), "pi-07", lambda name: service, None)
    pipelines.start({"detector": StageContract("image", "detection", LABELS)})
    try:
        found = wait_for(lambda: (lambda f: f if f.source is not None and f.source.state == "down" else None)(
            pipelines.figures()[0]), 20)
    finally:
        pipelines.stop()
    assert found is not None and found.source is not None and found.source.reason, found
    assert "127.0.0.1:9" in found.source.reason or "refused" in found.source.reason.lower(), found.source.reason
    sample = Telemetry("pi-07", seq=1, ts=1.0, interval_s=10.0, throughput_per_s=0.0, inferences_total=0,
                       inferences_interval=0, uptime_s=1.0, pipelines=(found,))
    validate(sample.to_json(), TELEMETRY_SCHEMA, document="telemetry")
    parsed = parse_telemetry("pi-07", sample.encode())
    assert isinstance(parsed, Telemetry) and parsed.pipelines[0].source == found.source


def pipeline_doc(name: str, rules: int = 1, **extra: Any) -> dict[str, Any]:
    return {"name": name, "state": "running", "frames": 5, "dropped": 1, "stage_errors": 0,
            "source": {"state": "down", "frames": 6, "reconnects": 2, "failures": 2},
            "events": {f"r{i}": {"cross": i} for i in range(rules)}, **extra}


def test_the_section_keeps_the_limit_of_pipelines_and_rules_and_drops_one_more():
    at_limit = parse_pipelines_section([pipeline_doc(f"p{i}", MAX_RULES) for i in range(MAX_PIPELINES)])
    assert len(at_limit) == MAX_PIPELINES and all(len(p.events) == MAX_RULES for p in at_limit)
    over = parse_pipelines_section([pipeline_doc(f"p{i}", MAX_RULES + 1) for i in range(MAX_PIPELINES + 1)])
    assert len(over) == MAX_PIPELINES and all(len(p.events) == MAX_RULES for p in over)
    assert over[-1].name == f"p{MAX_PIPELINES - 1}"


def test_a_wrong_figure_reads_none_and_never_costs_the_telemetry_message():
    bad = [pipeline_doc("a", frames=-1, dropped="many", state="exploded", source={"state": 1, "frames": 2**63},
                        events={"gate": {"cross": 3, "teleport": 9, "leave": -2}, "../x": {"cross": 1}, "z": 7}),
           pipeline_doc("a"), pipeline_doc("bad name!"), "junk", None]
    (figures,) = parse_pipelines_section(bad)
    assert (figures.frames, figures.dropped, figures.state) == (None, None, None)
    assert figures.source == SourceFigures(None, None, None, None)
    assert figures.events == (("gate", (("cross", 3),)),)
    doc = {"schema": "edgepack.telemetry/1", "device": "pi-07", "seq": 3, "pipelines": {"not": "a list"}}
    parsed = parse_telemetry("pi-07", json.dumps(doc).encode())
    assert isinstance(parsed, Telemetry) and parsed.seq == 3 and parsed.pipelines == ()


def test_the_fleet_server_stores_telemetry_that_carries_pipelines_and_lists_them_on_the_device(
        tmp_path, mosquitto_broker, server_keys):
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    try:
        telemetry = {"schema": "edgepack.telemetry/1", "device": "pi-07", "seq": 1, "latency_ms": {"p50": 3.0},
                     "inferences": {"interval": 5, "total": 5}, "pipelines": [pipeline_doc("door-cam", 3)]}
        mosquitto_broker.publish([("edgepack/v1/dev/pi-07/telemetry", json.dumps(telemetry).encode())])
        stored = wait_for(lambda: (lambda s: s if s["ingest"]["stored"].get("telemetry") == 1 else None)(
            server.get("/api/status")), 15)
        assert stored is not None and sum(stored["ingest"]["dropped"].values()) == 0
        assert server.get("/api/devices")["devices"][0]["latency_ms"]["p50"] == 3.0
        (shown,) = server.get("/api/devices/pi-07")["pipelines"]  # what it sent, typed, on the device's document
        assert shown == {**parse_pipelines_section([pipeline_doc("door-cam", 3)])[0].to_json(), "fps": None}
        assert shown["source"]["state"] == "down" and shown["events"] == {"r0": {"cross": 0}, "r1": {"cross": 1},
                                                                          "r2": {"cross": 2}}
    finally:
        server.stop()


class _Advancing:
    """A running pipeline's counters as its threads move them: each read of a figure finds it one
    higher, so two separate reads of one answer would disagree."""

    def __init__(self) -> None:
        self.reads = 0
        self.stage_errors = 0
        self.by_kind = {("gate", "cross"): 2}

    @property
    def frames(self) -> int:
        self.reads += 1
        return 100 + self.reads

    @property
    def events(self) -> int:
        return 2 + self.reads


def test_healthz_and_metrics_derive_from_one_snapshot_so_a_moving_pipeline_never_disagrees_with_itself():
    import threading
    from types import SimpleNamespace

    from device_agent.pipelines.host import figures_of, status_of
    from device_agent.pipelines.sources import SourceStatus

    counters, done = _Advancing(), threading.Event()
    pipelines = PipelineSet((), "pi-07", lambda name: None, None)
    reader = SimpleNamespace(status=SourceStatus("up", "ok", frames=100, reconnects=1, failures=0))
    pipelines.runners["cam"] = SimpleNamespace(counters=counters, finished=done, queue=SimpleNamespace(dropped=3),
                                               reader=reader, latency=LatencyRecorder((("det", "detector"),)))
    pipelines.refused["yard"] = "model absent is not installed"
    snapshot = pipelines.snapshot()
    assert counters.reads == 1  # each figure read once, whatever is derived from it after
    status, figures = status_of(snapshot), figures_of(snapshot)
    assert counters.reads == 1 and status_of(snapshot) == status and figures_of(snapshot) == figures
    empty = {"count": 0, "p50_ms": None, "p95_ms": None}
    assert status["cam"] == {"state": "running", "frames": 101, "events": 3, "dropped": 3, "stage_errors": 0,
                             "source": {"state": "up", "detail": "ok", "reconnects": 1},
                             "stages": [{"name": "det", "model": "detector", **empty}], "end_to_end": empty}
    assert figures == (PipelineFigures("yard", "refused", reason="model absent is not installed"),
                       PipelineFigures("cam", "running", 101, 3, 0, SourceFigures("up", 100, 1, 0),
                                       (("gate", (("cross", 2),)),), stages=(StageFigures("det", 0),),
                                       end_to_end=StageFigures("end_to_end", 0)))
    assert status["yard"] == {"state": "refused", "reason": "model absent is not installed"}
    done.set()
    assert pipelines.status()["cam"]["state"] == "finished" and pipelines.figures()[1].state == "finished"


def test_each_stage_of_a_running_chain_counts_the_frames_it_answered_with_its_p50_at_most_its_p95(scene):  # noqa: F811
    """Detector -> crop classifier (a stage named apart from its model), frames pushed: each
    stage's histogram counts every frame it answered, its p50 and p95 are positive and ordered,
    and /healthz, /metrics and telemetry show them from one snapshot."""
    services = {"detector": service_of(scene),
                "colour": InferenceService(load_model(scene["colour"].root, scene["colour"].manifest))}
    document = {**PIPELINE, "source": {"push": True, "policy": "every", "queue": 4},
                "stages": [{"model": "detector"}, {"model": "colour", "name": "paint", "crop": {"from": "detector"}}]}
    (chain,) = parse_pipelines([document])
    runner = PipelineRunner(chain, "pi-07", services.get, [])
    pipelines = PipelineSet((), "pi-07", services.get, None)
    pipelines.runners[chain.name] = runner
    runner.start()
    for index in range(FRAMES):
        runner.push(draw(PATHS, index, WIDTH, HEIGHT), ts=index / FPS)
    runner.queue.close()
    assert runner.finished.wait(60)
    runner.stop()
    (reading,) = pipelines.snapshot()
    assert reading.latency is not None and (reading.frames, reading.stage_errors) == (FRAMES, 0)
    assert [(s.name, s.model, s.histogram.count) for s in reading.latency.stages] == [
        ("detector", "detector", FRAMES), ("paint", "colour", FRAMES)]
    status = reading.status()
    for shown in (*status["stages"], status["end_to_end"]):
        assert shown["count"] == FRAMES and 0 < shown["p50_ms"] <= shown["p95_ms"], shown
    assert [s["name"] for s in status["stages"]] == ["detector", "paint"] and status["stages"][1]["model"] == "colour"
    figures = reading.figures()
    assert [s.to_json() for s in figures.stages] == [{k: v for k, v in s.items() if k != "model"}
                                                     for s in status["stages"]]
    sample = Telemetry("pi-07", seq=1, ts=1.0, interval_s=10.0, throughput_per_s=0.0, inferences_total=0,
                       inferences_interval=0, uptime_s=1.0, pipelines=(figures,))
    validate(sample.to_json(), TELEMETRY_SCHEMA, document="telemetry")
    parsed = parse_telemetry("pi-07", sample.encode())
    assert isinstance(parsed, Telemetry) and parsed.pipelines == (figures,)
    lines = pipeline_latency_metrics({reading.name: reading.latency}).splitlines()
    for stage in ("detector", "paint"):
        labels = f'pipeline="door-cam",stage="{stage}"'
        counts = [int(line.rsplit(" ", 1)[1]) for line in lines
                  if line.startswith(f"edgepack_pipeline_stage_seconds_bucket{{{labels},")]
        assert counts == sorted(counts) and counts[-1] == FRAMES
        assert f"edgepack_pipeline_stage_seconds_count{{{labels}}} {FRAMES}" in lines
    assert f'edgepack_pipeline_end_to_end_seconds_bucket{{pipeline="door-cam",le="+Inf"}} {FRAMES}' in lines
