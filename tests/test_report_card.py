"""Report cards (issue 26 item 7): the pure decisions on their boundaries, the protocol value's
parser, and the card a real onnxruntime load measures of a real artifact (structure and sanity,
never speed)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from device_agent.models import ModelSlot, describe_service, state_entry
from device_agent.report_card import (
    MAX_RUNS,
    measure_latency,
    node_share,
    parse_profile,
    peak_rss_bytes,
    percentile,
    should_stop,
)
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.errors import SchemaError
from edgepack_core.protocol.messages import DeviceState, parse_state
from edgepack_core.protocol.payloads import STATE_SCHEMA_ID, validate_payload
from edgepack_core.protocol.report_card import ReportCard, parse_report_card
from edgepack_core.signing import TrustStore, load_public_key
from edgepack_core.targets import CPU
from tests.artifacts import build_artifact
from tests.fake_ort import FakeGpuOrt

CUDA, TRT = "CUDAExecutionProvider", "TensorrtExecutionProvider"


# ---------------------------------------------------------------- pure decisions


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 21)]  # 20 runs: p50 the 10th, p99 the 20th
    assert percentile(values, 50) == 10.0 and percentile(values, 99) == 20.0
    assert percentile([3.0], 50) == percentile([3.0], 99) == 3.0
    assert percentile([5.0, 1.0], 50) == 1.0


def test_the_node_share_on_the_cpu_provider_is_zero():
    assignment = {"conv": CPU, "relu": CPU, "gemm": CPU}
    assert node_share(assignment, CPU) == (3, 0, 0.0)


def test_the_node_share_counts_nodes_off_the_cpu_provider():
    """A fake node -> provider assignment, as a Jetson's TensorRT session would give it."""
    assignment = {"trt_fused": TRT, "conv": CUDA, "nms": CPU, "topk": CPU}
    assert node_share(assignment, TRT) == (4, 2, 0.5)
    assert node_share({"all": CUDA}, CUDA) == (1, 1, 1.0)
    assert node_share({}, CUDA) == (0, 0, 0.0)


def test_the_latency_runs_stop_at_their_count_and_at_the_budget():
    assert not should_stop(0, 99.0, 99.0)  # always one run
    assert not should_stop(MAX_RUNS - 1, 0.0, 0.0) and should_stop(MAX_RUNS, 0.0, 0.0)
    assert not should_stop(3, 1.5, 0.5, budget_s=2.0)  # the next run ends on the budget: allowed
    assert should_stop(3, 1.5, 0.51, budget_s=2.0)  # it would end past it


def test_a_slow_model_runs_once_within_the_budget():
    """A fake clock: each run costs 3 s against a 2 s budget, so one run is all it gets."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    def run(_feed):
        now[0] += 3.0

    times, hit = measure_latency(run, [{}], budget_s=2.0, clock=clock)
    assert times == [3.0] and hit is True
    now[0] = 0.0
    times, hit = measure_latency(lambda _f: now.__setitem__(0, now[0] + 0.1), [{}], budget_s=2.0, clock=clock)
    assert len(times) == 19 and hit is True  # the 20th would end at 2.0000..01 s
    times, hit = measure_latency(lambda _f: None, [{}, {}], budget_s=2.0, clock=clock)
    assert len(times) == MAX_RUNS and hit is False


def test_the_profile_parser_keeps_kernel_events_with_a_provider():
    events = [{"cat": "Session", "name": "model_run"},
              {"cat": "Node", "name": "conv_fence_before", "args": {}},
              {"cat": "Node", "name": "conv_kernel_time", "args": {"provider": CUDA, "op_name": "Conv"}},
              {"cat": "Node", "name": "nms_kernel_time", "args": {"provider": CPU}},
              {"cat": "Node", "name": "odd_kernel_time", "args": "no"}, "not an event"]
    assert parse_profile(events) == {"conv": CUDA, "nms": CPU}
    assert parse_profile({"not": "a list"}) == {}


def test_peak_rss_reads_vmhwm_and_falls_back_to_getrusage(tmp_path):
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  123456 kB\nVmRSS:\t 1000 kB\n")
    assert peak_rss_bytes(status) == 123456 * 1024
    fallback = peak_rss_bytes(tmp_path / "absent")
    assert fallback is not None and fallback > 0


# ---------------------------------------------------------------- the protocol value


def _card(**changes) -> dict:
    doc = {"provider": CPU, "runs": 20, "p50_ms": 0.01, "p99_ms": 0.02, "first_inference_ms": 5.0,
           "peak_rss_bytes": 100 << 20, "nodes": 3, "accelerated_nodes": 0, "accelerated_share": 0.0,
           "measured_at": 1.7e9, "budget_hit": False}
    return {**doc, **changes}


def test_a_report_card_round_trips_through_its_parser():
    card = parse_report_card(_card())
    assert card is not None and parse_report_card(card.to_json()) == card


@pytest.mark.parametrize("changes", [
    {"p99_ms": 0.009},  # p99 below p50
    {"accelerated_share": 1.0000001}, {"accelerated_share": -0.1},
    {"accelerated_nodes": 4},  # more than the nodes
    {"runs": 1001}, {"runs": -1}, {"runs": True}, {"runs": None},
    {"provider": ""}, {"provider": 7},
    {"p50_ms": "fast"}, {"p50_ms": float("nan")}, {"peak_rss_bytes": 2**62},
    {"measured_at": -1}, {"nodes": 1_000_001},
])
def test_an_inconsistent_or_out_of_range_report_card_is_dropped_whole(changes):
    assert parse_report_card(_card(**changes)) is None


def test_the_report_card_bounds_pass_at_their_limits():
    card = parse_report_card(_card(runs=1000, accelerated_share=1.0, accelerated_nodes=3, p99_ms=0.01,
                                   nodes=1_000_000, peak_rss_bytes=2**62 - 1))
    assert card is not None and card.runs == 1000 and card.accelerated_share == 1.0
    assert parse_report_card(_card(p50_ms=None, p99_ms=None, first_inference_ms=None)) is not None


def _state(models: list[dict]) -> bytes:
    return json.dumps({"schema": STATE_SCHEMA_ID, "device": "dev-1", "status": "online", "ts": 1.0,
                       "models": models}).encode()


def test_a_state_from_an_agent_without_report_cards_parses_as_before():
    state = parse_state("dev-1", _state([{"name": "m", "version": "1", "sha256": "a" * 64, "state": "serving"}]))
    assert isinstance(state, DeviceState) and state.models[0].report_card is None
    assert "report_card" not in state.models[0].to_json()


def test_a_bad_report_card_does_not_refuse_the_state():
    entry = {"name": "m", "version": "1", "sha256": "a" * 64, "state": "serving", "report_card": _card(p99_ms=-1)}
    state = parse_state("dev-1", _state([entry, {**entry, "name": "n", "report_card": _card()}]))
    assert isinstance(state, DeviceState)
    assert state.models[0].report_card is None and state.models[1].report_card == parse_report_card(_card())


# ---------------------------------------------------------------- a real load


@pytest.fixture(scope="module")
def loaded(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("card")
    artifact = build_artifact(folder, keypair[0])
    verified = extract_artifact(artifact, folder / "x", TrustStore([load_public_key(keypair[1])]))
    return load_model(verified.root, verified.manifest, report_card=True)


def test_a_real_load_measures_a_sane_report_card(loaded):
    card = loaded.report_card
    assert isinstance(card, ReportCard) and card.provider == CPU
    assert 1 <= card.runs <= MAX_RUNS and card.p50_ms is not None and card.p99_ms is not None
    assert card.p99_ms >= card.p50_ms > 0
    assert card.first_inference_ms is not None and card.first_inference_ms > 0
    assert card.peak_rss_bytes is not None and card.peak_rss_bytes > 0
    assert card.nodes is not None and card.nodes >= 1  # the profile of the smoke test named its kernels
    assert card.accelerated_nodes == 0 and card.accelerated_share == 0.0
    assert parse_report_card(card.to_json()) == card


def test_the_profile_ends_with_the_load(loaded):
    """Profiling stopped before the latency runs: the session has no profile left to end."""
    assert loaded.session.end_profiling() == ""
    loaded.run({"x": np.ones((1, 4), np.float32)})
    assert loaded.session.end_profiling() == ""


def test_a_load_without_a_card_measures_none(loaded):
    plain = load_model(loaded.root, loaded.manifest)
    assert plain.report_card is None and plain.session.end_profiling() == ""


def test_the_card_is_in_healthz_and_in_the_state_entry(loaded):
    service = InferenceService(loaded)
    health = describe_service("scale", service)
    assert health["report_card"] == loaded.report_card.to_json()
    entry = state_entry(ModelSlot("scale", None, service))  # type: ignore[arg-type]
    assert entry["report_card"] == loaded.report_card.to_json()
    validate_payload("state", json.loads(_state([entry])))
    wrong = {**entry, "report_card": {**entry["report_card"], "accelerated_share": 1.5}}
    with pytest.raises(SchemaError, match="accelerated_share"):
        validate_payload("state", json.loads(_state([wrong])))


def test_a_tensorrt_session_reports_its_nodes_on_the_accelerator(loaded, monkeypatch):
    """A Jetson's onnxruntime-gpu as tests/fake_ort.py fakes it: the session heads with TensorRT
    and its profile names TensorRT for the kernels, so the whole graph is accelerated."""
    import onnxruntime as ort

    monkeypatch.setattr(ort, "get_available_providers", lambda: [TRT, CUDA, CPU])
    model = load_model(loaded.root, loaded.manifest, profile="jetson", factory=FakeGpuOrt(), report_card=True)
    card = model.report_card
    assert card is not None and card.provider == TRT
    assert card.nodes is not None and card.accelerated_nodes == card.nodes >= 1 and card.accelerated_share == 1.0
    assert card.p99_ms is not None and card.p50_ms is not None and card.p99_ms >= card.p50_ms > 0


def test_no_profile_file_is_left_behind(loaded, tmp_path, monkeypatch):
    """Profiles go to a temporary directory removed with the load: none in the working
    directory, none left in the temporary one (also after a provider that failed its check)."""
    import tempfile

    import onnxruntime as ort

    work, temp = tmp_path / "work", tmp_path / "temp"
    work.mkdir()
    temp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    load_model(loaded.root, loaded.manifest, report_card=True)
    monkeypatch.setattr(ort, "get_available_providers", lambda: [TRT, CUDA, CPU])
    model = load_model(loaded.root, loaded.manifest, profile="jetson", factory=FakeGpuOrt(distort={TRT: 1.5}),
                       report_card=True)
    assert model.provider == CUDA and model.report_card is not None and model.report_card.provider == CUDA
    assert not list(work.iterdir()) and not list(temp.iterdir())
