"""Per-stage latency of a pipeline: the fixed-bucket histogram (device_agent/pipelines/latency.py)
at its boundaries, its Prometheus text, and telemetry's bounded ``stages``. A real pipeline's
figures are tested in tests/test_pipeline_counters.py (its clip and models)."""

from __future__ import annotations

import json
import random

import pytest

from device_agent.http.prometheus import pipeline_latency_metrics
from device_agent.pipelines.latency import (
    BUCKETS_S,
    Histogram,
    HistogramSnapshot,
    LatencyRecorder,
    PipelineLatency,
    StageLatency,
)
from device_agent.telemetry.metrics import TELEMETRY_SCHEMA
from edgepack_core.protocol.messages import Telemetry, parse_telemetry
from edgepack_core.protocol.pipeline_figures import (
    MAX_STAGES,
    PipelineFigures,
    StageFigures,
    parse_pipelines_section,
)
from edgepack_core.schema import validate


def filled(*seconds: float) -> HistogramSnapshot:
    histogram = Histogram()
    for value in seconds:
        histogram.record(value)
    return histogram.snapshot()


def test_a_sample_exactly_on_a_bound_counts_in_that_bounds_bucket_and_one_above_in_the_next():
    on_edge = filled(BUCKETS_S[0])
    assert on_edge.cumulative[0] == 1 and on_edge.count == 1
    above = filled(BUCKETS_S[0] + 1e-9)
    assert above.cumulative[0] == 0 and above.cumulative[1] == 1
    last = filled(BUCKETS_S[-1])
    assert last.cumulative[-2] == 1  # the last bound is still a finite bucket


def test_a_sample_above_the_last_bound_lands_in_inf_and_reads_as_the_last_bound():
    slow = filled(BUCKETS_S[-1] + 0.001, 3600.0)
    assert slow.cumulative[-2] == 0 and slow.count == 2 and slow.sum_s == pytest.approx(3610.001)
    assert slow.quantile(0.5) == slow.quantile(0.95) == BUCKETS_S[-1]


def test_an_empty_histogram_has_no_quantiles():
    empty = Histogram().snapshot()
    assert empty.count == 0 and empty.sum_s == 0.0 and empty == HistogramSnapshot()
    assert empty.quantile(0.5) is None and empty.quantile_ms(0.95) is None


def test_a_quantile_is_interpolated_within_its_bucket_like_histogram_quantile():
    ten = filled(*[0.003] * 10)  # all in (2.5 ms, 5 ms]
    assert ten.quantile(0.5) == pytest.approx(0.00375) and ten.quantile_ms(0.5) == 3.75
    assert ten.quantile(1.0) == pytest.approx(0.005)
    low = filled(0.0001)  # the first bucket starts at 0
    assert low.quantile(1.0) == pytest.approx(BUCKETS_S[0])
    split = filled(0.0005, 0.2)  # one sample in the first bucket, one in (0.1, 0.25]
    assert split.quantile(0.5) == pytest.approx(BUCKETS_S[0]) and split.quantile(0.95) == pytest.approx(0.235)
    for q in (0.0, -0.1, 1.01):
        with pytest.raises(ValueError):
            ten.quantile(q)


def test_p50_is_never_above_p95_and_a_snapshot_never_moves():
    rng = random.Random(26)
    histogram = Histogram()
    for _ in range(200):
        histogram.record(rng.lognormvariate(-4, 2))
        snap = histogram.snapshot()
        assert 0 < snap.quantile(0.5) <= snap.quantile(0.95) <= BUCKETS_S[-1]  # type: ignore[operator]
    before = histogram.snapshot()
    histogram.record(0.01)
    assert before.count == 200 and histogram.snapshot().count == 201


def test_a_recorders_snapshot_keeps_the_stages_order_and_models():
    recorder = LatencyRecorder((("det", "detector"), ("paint", "colour")))
    recorder.by_stage["paint"].record(0.002)
    snap = recorder.snapshot()
    assert [(s.name, s.model, s.histogram.count) for s in snap.stages] == [("det", "detector", 0),
                                                                          ("paint", "colour", 1)]
    assert snap.end_to_end.count == 0


def series(text: str, metric: str, labels: str) -> list[tuple[str, float]]:
    """(le, value) of one histogram's buckets, in the text's order."""
    prefix = f"{metric}_bucket{{{labels},le=\""
    return [(line[len(prefix):].split('"', 1)[0], float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines() if line.startswith(prefix)]


def test_the_prometheus_histograms_are_cumulative_and_end_with_inf_equal_to_count():
    stage = filled(0.0005, 0.001, 0.003, 0.3, 20.0)
    text = pipeline_latency_metrics({'door"cam\\1': PipelineLatency(
        (StageLatency("det", "detector", stage),), filled(0.01, 0.02))})
    labels = 'pipeline="door\\"cam\\\\1",stage="det"'
    buckets = series(text, "edgepack_pipeline_stage_seconds", labels)
    assert [le for le, _ in buckets] == [str(b) for b in BUCKETS_S] + ["+Inf"]
    values = [v for _, v in buckets]
    assert values == sorted(values) and values[0] == 2 and values[-2] == 4  # 1 ms on the edge counts in 1 ms
    lines = set(text.splitlines())
    assert f"edgepack_pipeline_stage_seconds_count{{{labels}}} 5" in lines and values[-1] == 5
    assert f"edgepack_pipeline_stage_seconds_sum{{{labels}}} {stage.sum_s:.9f}" in lines
    pipeline = 'pipeline="door\\"cam\\\\1"'
    end = series(text, "edgepack_pipeline_end_to_end_seconds", pipeline)
    assert end[-1] == ("+Inf", 2) and f"edgepack_pipeline_end_to_end_seconds_count{{{pipeline}}} 2" in lines
    assert "# TYPE edgepack_pipeline_stage_seconds histogram" in lines
    assert "# TYPE edgepack_pipeline_end_to_end_seconds histogram" in lines
    assert pipeline_latency_metrics({}) == ""


def stage_doc(name: str, **changes: object) -> dict[str, object]:
    return {"name": name, "count": 60, "p50_ms": 2.5, "p95_ms": 4.75, **changes}


def test_stage_latencies_round_trip_through_telemetry_and_an_older_agent_sends_none():
    figures = PipelineFigures("door-cam", "running", 60, 0, 0, None, (),
                              stages=(StageFigures("det", 60, 2.5, 4.75), StageFigures("paint", 58, 0.5, None)),
                              end_to_end=StageFigures("end_to_end", 60, 9.0, 21.0))
    sample = Telemetry("pi-07", seq=1, ts=1.0, interval_s=10.0, throughput_per_s=0.0, inferences_total=0,
                       inferences_interval=0, uptime_s=1.0, pipelines=(figures,))
    validate(sample.to_json(), TELEMETRY_SCHEMA, document="telemetry")
    assert sample.to_json()["pipelines"][0]["end_to_end"] == {"count": 60, "p50_ms": 9.0, "p95_ms": 21.0}
    parsed = parse_telemetry("pi-07", sample.encode())
    assert isinstance(parsed, Telemetry) and parsed.pipelines == (figures,)
    (older,) = parse_pipelines_section([{"name": "door-cam", "state": "running", "frames": 3}])
    assert older.stages == () and older.end_to_end is None
    assert "stages" not in older.to_json() and "end_to_end" not in older.to_json()


def test_a_hostile_stages_list_is_cut_to_the_stage_limit_and_wrong_figures_read_none():
    many = [stage_doc(f"s{i}") for i in range(10_000)]
    (kept,) = parse_pipelines_section([{"name": "cam", "stages": many}])
    assert [s.name for s in kept.stages] == [f"s{i}" for i in range(MAX_STAGES)]  # the limit kept, one more not
    (exact,) = parse_pipelines_section([{"name": "cam", "stages": many[:MAX_STAGES]}])
    assert len(exact.stages) == MAX_STAGES
    wrong = [stage_doc("a", count=-1, p50_ms=-2.0, p95_ms=float("inf")), stage_doc("a", count=9),
             stage_doc("<b>"), "junk", stage_doc("b", p50_ms="1", p95_ms=True)]
    (bad,) = parse_pipelines_section([{"name": "cam", "stages": wrong, "end_to_end": {"count": 2**63, "p50_ms": 1}}])
    assert bad.stages == (StageFigures("a"), StageFigures("b", 60))  # each name once, the first wins
    assert bad.end_to_end == StageFigures("end_to_end", None, 1.0, None)
    (not_a_list,) = parse_pipelines_section([{"name": "cam", "stages": {"det": 1}, "end_to_end": [1]}])
    assert not_a_list.stages == () and not_a_list.end_to_end is None
    doc = {"schema": "edgepack.telemetry/1", "device": "pi-07", "seq": 2,
           "pipelines": [{"name": "cam", "stages": many[:MAX_STAGES + 1]}]}
    parsed = parse_telemetry("pi-07", json.dumps(doc).encode())
    assert isinstance(parsed, Telemetry) and len(parsed.pipelines[0].stages) == MAX_STAGES


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_recent_quantiles_cover_the_last_one_to_two_windows_and_the_counts_every_sample():
    """A sample stays in the recent figures until two windows after the one it fell in began
    (119.999 s in: there; 120 s: gone), while the since-start counts keep it."""
    from device_agent.pipelines.latency import WINDOW_S

    clock = Clock()
    histogram = Histogram(clock)
    histogram.record(0.002)
    clock.now += WINDOW_S - 0.001
    assert histogram.recent().count == 1
    clock.now += 0.001  # the next window: the sample is in the previous one
    assert histogram.recent().count == 1
    clock.now += WINDOW_S - 0.001
    assert histogram.recent().count == 1
    clock.now += 0.001
    assert histogram.recent().count == 0 and histogram.recent().quantile(0.5) is None
    assert histogram.snapshot().count == 1
    histogram.record(0.003)
    clock.now += 10 * WINDOW_S  # idle for long: nothing recent, whatever came before
    assert histogram.recent().count == 0 and histogram.snapshot().count == 2


def test_a_stage_that_turns_slow_after_hours_shows_it_in_its_recent_p50():
    """Hours of fast frames, then a minute of slow ones: /healthz's and telemetry's p50 is the
    slow one (the since-start buckets, /metrics', would still say fast)."""
    from device_agent.pipelines.host import _stage_figures

    clock = Clock()
    recorder = LatencyRecorder((("detect", "yolo"),), clock)
    for _ in range(3 * 3600):  # one frame a second for three hours, 2 ms each
        recorder.by_stage["detect"].record(0.002)
        clock.now += 1.0
    for _ in range(60):
        recorder.by_stage["detect"].record(0.4)
        clock.now += 1.0
    stage = recorder.snapshot().stages[0]
    assert stage.histogram.quantile(0.5) <= 0.0025  # type: ignore[operator]
    figures = _stage_figures(stage.name, stage.histogram, stage.recent)
    assert figures.count == 3 * 3600 + 60 and figures.p50_ms is not None and figures.p50_ms > 250
