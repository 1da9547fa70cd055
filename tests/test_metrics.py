"""Latency histogram accuracy against numpy, the telemetry payload, and the system readings."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from device_agent.telemetry.metrics import (
    BUCKETS,
    MAX_ERROR_KINDS,
    MAX_RELATIVE_ERROR,
    TELEMETRY_SCHEMA,
    LatencyHistogram,
    ModelInfo,
    SystemReading,
    TelemetryAggregator,
    read_system,
)
from edgepack_core.errors import SchemaError, UsageError
from edgepack_core.protocol.payloads import TELEMETRY_SCHEMA_ID
from edgepack_core.protocol.topics import InvalidNameError, Topics, validate_device_id
from edgepack_core.schema import validate


@pytest.mark.parametrize("distribution", ["lognormal", "uniform", "bimodal"])
def test_histogram_percentiles_match_numpy_within_bucket_error(distribution: str) -> None:
    rng = np.random.default_rng(7)
    if distribution == "lognormal":
        samples = rng.lognormal(mean=math.log(0.004), sigma=0.8, size=50_000)
    elif distribution == "uniform":
        samples = rng.uniform(1e-5, 2.0, size=50_000)
    else:  # fast path plus a slow tail, the shape of a cache-miss latency profile
        samples = np.concatenate([rng.normal(0.002, 0.0002, 40_000).clip(1e-6), rng.normal(0.150, 0.02, 10_000)])
    histogram = LatencyHistogram()
    for value in samples:
        histogram.record(float(value))
    assert MAX_RELATIVE_ERROR < 0.05
    for p in (1, 50, 90, 99, 99.9):
        expected = float(np.percentile(samples, p))
        got = histogram.percentile(p)
        assert got is not None
        assert abs(got - expected) / expected <= 0.05, (p, got, expected)
    assert histogram.percentile(100) == pytest.approx(float(samples.max()))
    assert histogram.count == len(samples)
    assert histogram.mean == pytest.approx(float(samples.mean()))


def test_histogram_memory_is_fixed_and_extremes_are_exact() -> None:
    histogram = LatencyHistogram()
    for value in (0.0, 5e-7, 250.0, 1e6):
        histogram.record(value)
    assert len(histogram.counts) == BUCKETS + 2  # does not grow with samples or range
    assert histogram.counts[0] == 2 and histogram.counts[-1] == 2
    assert histogram.percentile(25) == 0.0  # underflow reports the exact minimum
    assert histogram.percentile(100) == 1e6  # overflow reports the exact maximum
    single = LatencyHistogram()
    single.record(0.0123)
    assert single.percentile(50) == 0.0123  # clamped to [min, max]: one sample is exact
    assert LatencyHistogram().percentile(50) is None
    with pytest.raises(ValueError):
        single.record(float("nan"))
    with pytest.raises(ValueError):
        single.record(-1.0)
    with pytest.raises(ValueError):
        single.percentile(0)


def test_histogram_merge_equals_recording_everything_and_snapshot_resets() -> None:
    rng = np.random.default_rng(3)
    a_samples, b_samples = rng.exponential(0.01, 2000), rng.exponential(0.2, 3000)
    a, b, both = LatencyHistogram(), LatencyHistogram(), LatencyHistogram()
    for value in a_samples:
        a.record(float(value))
        both.record(float(value))
    for value in b_samples:
        b.record(float(value))
        both.record(float(value))
    a.merge(b)
    assert a.counts == both.counts and a.count == 5000
    assert a.minimum == both.minimum and a.maximum == both.maximum
    snapshot = a.snapshot_and_reset()
    assert snapshot.counts == both.counts and snapshot.percentile(99) == both.percentile(99)
    assert a.count == 0 and a.percentile(50) is None and sum(a.counts) == 0


def _queue() -> dict[str, int]:
    return {"queued": 3, "dropped": 2, "produced": 10, "delivered": 5}


def test_aggregator_builds_a_valid_payload_with_interval_and_cumulative_counts() -> None:
    aggregator = TelemetryAggregator("pi-07", started=100.0)
    for i in range(100):
        aggregator.record_inference(0.001 * (i + 1))  # 1..100 ms
    aggregator.record_error("preprocess")
    aggregator.record_error("preprocess")
    aggregator.record_error("runtime")
    model = ModelInfo("ocr-cls", "1.2.0", "ab" * 32)
    system = SystemReading(1.0, 1.0, 12.5, 50_000_000, 48.2)
    payload = aggregator.build(now=110.0, ts=1_700_000_000.123456, model=model, provider="CPUExecutionProvider",
                               system=system, queue=_queue()).to_json()
    validate(payload, TELEMETRY_SCHEMA, document="telemetry")
    assert payload["schema"] == TELEMETRY_SCHEMA_ID and payload["device"] == "pi-07" and payload["seq"] == 1
    assert payload["model"] == {"name": "ocr-cls", "version": "1.2.0", "sha256": "ab" * 32}
    assert payload["inferences"] == {"interval": 100, "total": 100}
    assert payload["errors"] == {"preprocess": 2, "runtime": 1}
    assert payload["throughput_per_s"] == 10.0 and payload["interval_s"] == 10.0
    assert payload["latency_ms"]["p50"] == pytest.approx(50.0, rel=MAX_RELATIVE_ERROR)
    assert payload["latency_ms"]["p99"] == pytest.approx(99.0, rel=MAX_RELATIVE_ERROR)
    assert payload["latency_ms"]["max"] == 100.0
    assert payload["queue"] == {"depth": 3, "dropped": 2, "produced": 10, "delivered": 5}
    assert (payload["cpu_percent"], payload["memory_rss_bytes"], payload["temperature_c"]) == (12.5, 50_000_000, 48.2)
    assert payload["uptime_s"] == 10.0 and payload["ts"] == 1_700_000_000.123

    # The next interval starts empty; cumulative totals carry on.
    aggregator.record_inference(0.5)
    aggregator.record_error("runtime")
    second = aggregator.build(now=115.0, ts=1.0, model=None, provider=None, system=None, queue=None).to_json()
    validate(second, TELEMETRY_SCHEMA, document="telemetry")
    assert second["inferences"] == {"interval": 1, "total": 101} and second["seq"] == 2
    assert second["errors"] == {"preprocess": 2, "runtime": 2}
    assert second["errors_interval"] == {"runtime": 1}
    assert second["latency_ms"]["p50"] == 500.0 and second["interval_s"] == 5.0
    idle = aggregator.build(now=120.0, ts=2.0, model=None, provider=None, system=None, queue=None).to_json()
    validate(idle, TELEMETRY_SCHEMA, document="telemetry")
    assert idle["latency_ms"] == {"p50": None, "p90": None, "p99": None, "max": None, "mean": None}
    assert idle["throughput_per_s"] == 0.0
    resumed = TelemetryAggregator("pi-07", started=0.0, first_seq=42)
    assert resumed.build(now=1.0, ts=1.0, model=None, provider=None, system=None, queue=None).seq == 42


def test_error_kinds_are_bounded_so_memory_stays_fixed() -> None:
    aggregator = TelemetryAggregator("d1", started=0.0)
    for i in range(MAX_ERROR_KINDS + 10):
        aggregator.record_error(f"kind-{i}")
    payload = aggregator.build(now=1.0, ts=1.0, model=None, provider=None, system=None, queue=None).to_json()
    assert len(payload["errors"]) == MAX_ERROR_KINDS + 1
    assert payload["errors"]["other"] == 10


def test_schema_rejects_a_payload_with_an_unknown_key() -> None:
    aggregator = TelemetryAggregator("d1", started=0.0)
    payload = aggregator.build(now=1.0, ts=1.0, model=None, provider=None, system=None, queue=None).to_json()
    payload["surprise"] = 1
    with pytest.raises(SchemaError) as info:
        validate(payload, TELEMETRY_SCHEMA, document="telemetry")
    assert info.value.path == "surprise"


def test_read_system_reads_real_proc_and_a_thermal_tree(tmp_path: Path) -> None:
    thermal = tmp_path / "thermal"
    for zone, millidegrees in (("thermal_zone0", "45000\n"), ("thermal_zone1", "51250\n"), ("thermal_zone2", "bad")):
        (thermal / zone).mkdir(parents=True)
        (thermal / zone / "temp").write_text(millidegrees)
    first = read_system(thermal=thermal)
    assert first.cpu_percent is None  # no interval yet
    assert first.temperature_c == 51.25  # hottest readable zone
    if Path("/proc/self/status").exists():
        assert first.memory_rss_bytes is not None and first.memory_rss_bytes > 1_000_000
    deadline = os.times().user + os.times().system + 0.05
    while os.times().user + os.times().system < deadline:  # burn some CPU so the delta is > 0
        sum(range(10_000))
    second = read_system(first, thermal=thermal)
    assert second.cpu_percent is not None and second.cpu_percent > 0
    bare = read_system(proc=tmp_path / "no-proc", thermal=tmp_path / "no-thermal")
    assert bare.memory_rss_bytes is None and bare.temperature_c is None


def test_telemetry_and_healthz_read_the_resident_size_the_same_way(tmp_path: Path) -> None:
    """One reader (``VmRSS`` of the status file): a fake proc's figure comes through telemetry
    exactly, a status without the field (a kernel thread's) or a garbled one reads as unknown."""
    from device_agent.memory import memory_reading

    proc = tmp_path / "proc"
    proc.mkdir()
    status = "Name:\tedgepack-agent\nVmPeak:\t  90000 kB\nVmRSS:\t   41564 kB\nRssAnon:\t   35000 kB\n"
    (proc / "status").write_text(status)
    reading = read_system(proc=proc, thermal=tmp_path / "none")
    assert reading.memory_rss_bytes == 41564 * 1024 == memory_reading(status, None).rss
    (proc / "status").write_text("Name:\tkthreadd\nVmPeak:\t 1 kB\n")
    assert read_system(proc=proc, thermal=tmp_path / "none").memory_rss_bytes is None
    (proc / "status").write_text("VmRSS:\n")
    assert read_system(proc=proc, thermal=tmp_path / "none").memory_rss_bytes is None


# ---------------------------------------------------------------------- topics (pure, no broker)


def test_topics_follow_the_v1_layout_and_parse_back() -> None:
    topics = Topics()
    assert topics.state("pi-07") == "edgepack/v1/dev/pi-07/state"
    assert topics.telemetry("pi-07") == "edgepack/v1/dev/pi-07/telemetry"
    assert topics.cmd("pi-07") == "edgepack/v1/dev/pi-07/cmd"
    assert topics.job("pi-07") == "edgepack/v1/dev/pi-07/job"
    assert topics.group_cmd("kitchen") == "edgepack/v1/grp/kitchen/cmd"
    assert topics.xfer("pi-07", "job-1", "chunk", "3") == "edgepack/v1/dev/pi-07/xfer/job-1/chunk/3"
    assert topics.all_of("state") == "edgepack/v1/dev/+/state"
    assert topics.xfer_filter("pi-07") == "edgepack/v1/dev/pi-07/xfer/#"
    assert topics.parse("edgepack/v1/dev/pi-07/telemetry").device == "pi-07"
    parsed = topics.parse("edgepack/v1/dev/pi-07/xfer/job-1/chunk/3")
    assert parsed is not None and parsed.kind == "xfer" and parsed.rest == ("job-1", "chunk", "3")
    group = topics.parse("edgepack/v1/grp/kitchen/cmd")
    assert group is not None and group.kind == "group_cmd" and group.group == "kitchen"
    custom = Topics("acme/edge/v1")
    assert custom.cmd("d1") == "acme/edge/v1/dev/d1/cmd"
    assert custom.parse("edgepack/v1/dev/d1/cmd") is None  # other root


@pytest.mark.parametrize("topic", [
    "other/v1/dev/d/state", "edgepack/v1/dev/d", "edgepack/v1/dev/d/unknown", "edgepack/v1/dev/d/state/extra",
    "edgepack/v1/dev/$bad/state", "edgepack/v1/grp/g/telemetry", "edgepack/v1/dev/d/xfer", "edgepack/v1/x/d/cmd",
])
def test_parse_ignores_foreign_or_malformed_topics(topic: str) -> None:
    assert Topics().parse(topic) is None


@pytest.mark.parametrize("name", ["", "a/b", "a+", "#", "+", "x" * 65, "-lead", ".", "..", "$SYS", "sp ace", "é", 7])
def test_wildcard_and_unsafe_names_are_refused_before_reaching_a_topic(name: object) -> None:
    with pytest.raises(InvalidNameError) as info:
        validate_device_id(name)
    assert isinstance(info.value, UsageError) and info.value.path == "device_id"
    with pytest.raises(InvalidNameError):
        Topics().group_cmd(name)  # type: ignore[arg-type]
    with pytest.raises(InvalidNameError):
        Topics().xfer("d1", name)  # type: ignore[arg-type]


@pytest.mark.parametrize("root", ["", "/edgepack", "edgepack/", "edge//v1", "edge/+/v1", "edge/#", "$SYS/x"])
def test_bad_topic_roots_are_refused(root: str) -> None:
    with pytest.raises(InvalidNameError):
        Topics(root)


def test_longest_allowed_name_is_accepted() -> None:
    assert validate_device_id("a" * 64) == "a" * 64
    assert validate_device_id("Pi_07.kitchen-2") == "Pi_07.kitchen-2"
