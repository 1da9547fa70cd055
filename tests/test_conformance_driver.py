"""The conformance driver itself: onnx's runner in forked workers that survive a backend killed
by a signal or stuck in a kernel, and the pure counting and grouping of outcomes."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import onnx
import pytest
from onnx.backend.base import Backend, BackendRep

from tools.conformance.backends import BareOrtBackend, BareOrtRep, StageFailure, feed_names, stage
from tools.conformance.driver import Case, Outcome, categories, describe, failure_key, list_cases, run_suite, tally


class _HostileRep(BackendRep):
    """Bare onnxruntime, except Acos dies of SIGFPE (like onnxruntime's STFT kernel once did) and
    Asin never returns (a stuck kernel)."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.op = model.graph.node[0].op_type
        self.inner = BareOrtRep(model)

    def run(self, inputs: Any, **kwargs: Any) -> Any:
        if self.op == "Acos":
            os.kill(os.getpid(), signal.SIGFPE)
        if self.op == "Asin":
            threading.Event().wait()
        return self.inner.run(inputs)


class _HostileBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> _HostileRep:
        return _HostileRep(model)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"


@pytest.fixture(scope="module")
def all_cases() -> list[Case]:
    return list_cases()


def test_the_suite_is_the_runners_plain_tensor_cases_per_part(all_cases):
    parts = {}
    for case in all_cases:
        parts[case.part] = parts.get(case.part, 0) + 1
    # Plain tensor inputs/outputs only: node tests with sequences/optionals are left out.
    assert set(parts) == {"node", "simple", "pytorch-converted", "pytorch-operator", "light"}
    assert parts["light"] == 9 and parts["node"] > 1000
    names = {c.name for c in all_cases}
    assert "test_resnet50_cpu" in names and "test_abs_cpu" in names
    assert "test_sequence_insert_at_back_cpu" not in names  # a sequence input
    assert not any(c.name.endswith("_cuda") for c in all_cases)


def test_a_crashing_or_stuck_backend_is_recorded_and_the_next_case_still_runs(all_cases):
    wanted = ["test_abs_cpu", "test_acos_cpu", "test_asin_cpu", "test_add_cpu", "test_and2d_cpu"]
    cases = [c for c in all_cases if c.name in wanted]
    assert len(cases) == len(wanted)
    outcomes = run_suite(cases, jobs=1, timeout=5, backends={"onnxruntime": BareOrtBackend,
                                                             "hostile": _HostileBackend})
    by = {(o.case.name, o.backend): o for o in outcomes}
    assert all(by[(name, "onnxruntime")].status == "pass" for name in wanted)
    assert by[("test_acos_cpu", "hostile")].status == "crash"
    assert by[("test_acos_cpu", "hostile")].message == "killed by SIGFPE"
    assert by[("test_asin_cpu", "hostile")].status == "timeout"
    assert {by[(name, "hostile")].status for name in ("test_abs_cpu", "test_add_cpu", "test_and2d_cpu")} == {"pass"}


def _case(name: str, part: str = "node") -> Case:
    return Case(part, "NodeModel", name)


def test_tally_counts_edgepack_only_over_what_onnxruntime_passes():
    a, b, c, d = _case("test_a_cpu"), _case("test_b_cpu"), _case("test_c_cpu", "light"), _case("test_d_cpu")
    outcomes = [Outcome(a, "onnxruntime", "pass", "", 0), Outcome(a, "edgepack", "pass", "", 0),
                Outcome(b, "onnxruntime", "pass", "", 0), Outcome(b, "edgepack", "error", "build: X: y", 0),
                Outcome(c, "onnxruntime", "error", "Fail: no kernel", 0),
                Outcome(d, "onnxruntime", "crash", "killed by SIGSEGV", 0)]
    rows = {r.part: r for r in tally([a, b, c, d], outcomes)}
    assert (rows["node"].cases, rows["node"].onnxruntime, rows["node"].edgepack) == (3, 2, 1)
    light = rows["light"]
    assert (light.cases, light.onnxruntime, light.edgepack, light.rate) == (1, 0, 0, 1.0)
    assert (rows["total"].cases, rows["total"].onnxruntime, rows["total"].edgepack) == (4, 2, 1)
    assert rows["total"].rate == 0.5 and "simple" not in rows


def test_failures_group_by_cause_with_numbers_and_names_blanked():
    one = Outcome(_case("test_a_cpu"), "edgepack", "error",
                  "build: ModelError: opset 22 is outside the supported range 11-21\nsecond line", 0)
    two = Outcome(_case("test_b_cpu"), "edgepack", "error", "build: ModelError: opset 9 is outside the supported "
                  "range 11-21", 0)
    three = Outcome(_case("test_c_cpu"), "edgepack", "error", "run: BadRequest: input 'x' must be float32, got [1]", 0)
    groups = categories([one, two, three, Outcome(_case("test_d_cpu"), "onnxruntime", "error", "x", 0)], "edgepack")
    assert [(g.count, g.example) for g in groups] == [(2, "test_a_cpu"), (1, "test_c_cpu")]
    assert groups[0].key == "error: build: ModelError: opset N is outside the supported range N-N"
    assert groups[0].message.endswith("second line")  # every line of the example is kept
    assert failure_key("run: BadRequest: input x must be float32, got [1, 2]") == \
        "run: BadRequest: input … must be float32, got […]"


def test_stage_failures_name_the_stage_and_keep_the_cause():
    with pytest.raises(StageFailure) as caught, stage("verify"):
        raise ValueError("bad signature\nkey id abc")
    assert str(caught.value) == "verify: ValueError: bad signature\nkey id abc"
    assert isinstance(caught.value.__cause__, ValueError)
    assert describe(caught.value).startswith("verify: ValueError")
    assert describe(AssertionError("Output 0 differs")) == "compare: AssertionError: Output 0 differs"


def test_feed_names_skip_initializers_listed_as_inputs_on_ir3_models():
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("x", "w", "y")]
    graph = helper.make_graph([helper.make_node("Sum", ["x", "w", "y"], ["z"])], "g", inputs,
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])],
                              [helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0])])
    model = helper.make_model(graph)
    assert feed_names(model, 2) == ["x", "y"]
    assert feed_names(model, 3) == ["x", "w", "y"]
