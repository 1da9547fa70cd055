"""Evidence before int8 ships (issue 23, item 9): each task metric's interval, checked against
scipy's and published values, its boundaries pinned, and the detector with 4 reference
detections built end to end: it keeps float and names the data it needs."""

from __future__ import annotations

import json
import math
import tarfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from sdk.packager import evidence, quant_search
from sdk.packager.evidence import (
    MetricEvidence,
    bootstrap,
    decide,
    paired_difference_interval,
    samples_needed,
    wilson,
    wilson_interval,
    wilson_lower,
)
from sdk.packager.passes import quantize
from sdk.packager.pipeline import build
from sdk.packager.task_metrics import Detections, evaluate
from sdk.recipe import recipe_from_dict

# --------------------------------------------------------------------------- the intervals


@pytest.mark.parametrize(("successes", "n"), [(8, 10), (0, 10), (10, 10), (4, 4), (1, 3), (37, 37), (440, 450)])
def test_the_wilson_interval_is_scipys(successes, n):
    stats = pytest.importorskip("scipy.stats")
    reference = stats.binomtest(successes, n).proportion_ci(0.95, method="wilson")
    low, high = wilson_interval(successes, n)
    assert low == pytest.approx(reference.low, abs=1e-12) and high == pytest.approx(reference.high, abs=1e-12)


def test_the_wilson_interval_matches_published_values():
    # Newcombe (1998), "Two-sided confidence intervals for the single proportion", Table I:
    # 81/263 -> 0.2553..0.3662; 15/148 -> 0.0624..0.1605; 0/20 -> 0..0.1611; 1/29 -> 0.0061..0.1718.
    for (k, n), (low, high) in {
        (81, 263): (0.2553, 0.3662),
        (15, 148): (0.0624, 0.1605),
        (0, 20): (0.0, 0.1611),
        (1, 29): (0.0061, 0.1718),
    }.items():
        got = wilson_interval(k, n)
        assert got == pytest.approx((low, high), abs=5e-5)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(5, 4)


def test_newcombes_paired_interval_matches_published_values():
    # Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency Tables" (2017), ch. 8:
    # complete response before and after consolidation therapy (Cavo et al., 2012), the table
    # 59, 6 / 16, 80: difference -0.0621, Newcombe square-and-add 95% CI -0.1186 to -0.0046.
    low, high = paired_difference_interval(59, 6, 16, 80)
    assert (low, high) == pytest.approx((-0.1186, -0.0046), abs=5e-5)


def test_two_models_right_on_the_same_samples_still_get_an_interval_that_reflects_the_sample_size():
    # 64 of 64 right for both: a bootstrap would say exactly 0; the paired interval is as wide
    # as the data is thin.
    low, high = paired_difference_interval(64, 0, 0, 0)
    assert high == pytest.approx(1 - wilson_interval(64, 64)[0]) and low == pytest.approx(-high)
    assert paired_difference_interval(0, 0, 0, 0) == (-1.0, 1.0)


def test_the_bootstrap_is_reproducible_and_narrows_with_more_data():
    rng = np.random.default_rng(5)
    values = rng.uniform(0.98, 1.0, 40).tolist()
    first = bootstrap("cosine", values, "samples", (-1.0, 1.0))
    assert first == bootstrap("cosine", values, "samples", (-1.0, 1.0)), "the seed is fixed"
    assert first.low < np.mean(values) < first.high
    wider = bootstrap("cosine", values[:10], "samples", (-1.0, 1.0))
    assert wider.high - wider.low > first.high - first.low
    one = bootstrap("cosine", [0.999], "samples", (-1.0, 1.0))
    assert (one.low, one.high) == (-1.0, 1.0), "one value has no spread"


# --------------------------------------------------------------------------- the decision


def test_a_lower_bound_exactly_at_the_budget_ships_and_just_below_keeps_float():
    at = MetricEvidence("recall", 1.0, 80, 0.95, 1.0, "wilson", "reference detections")
    assert decide(at, "at least", 0.95).decided
    below = MetricEvidence("recall", 1.0, 80, math.nextafter(0.95, 0.0), 1.0, "wilson", "reference detections")
    assert not decide(below, "at least", 0.95).decided
    upper = MetricEvidence("top-1 accuracy drop", 0.0, 500, -0.01, 0.01, "newcombe", "labelled samples")
    assert decide(upper, "at most", 0.01).decided
    above = MetricEvidence("top-1 accuracy drop", 0.0, 500, -0.01, math.nextafter(0.01, 1.0), "newcombe")
    assert not decide(above, "at most", 0.01).decided


def test_recall_on_73_reference_detections_all_found_is_judged_and_on_72_it_is_not():
    # Wilson's lower bound of n/n is n / (n + z^2): 0.95 needs n >= 19 z^2 = 72.99.
    assert samples_needed(1.0, 0.95) == 73
    assert decide(wilson("recall", 73, 73, "reference detections"), "at least", 0.95).decided
    short = decide(wilson("recall", 72, 72, "reference detections"), "at least", 0.95)
    assert not short.decided and short.needed == 73


def test_the_samples_needed_are_the_least_that_meet_the_budget():
    for observed, budget in [(1.0, 0.95), (1.0, 0.99), (0.99, 0.95), (0.97, 0.9), (0.6, 0.5)]:
        n = samples_needed(observed, budget)
        assert n is not None and wilson_lower(observed, n) >= budget > wilson_lower(observed, n - 1)
    assert samples_needed(0.95, 0.95) is None and samples_needed(0.9, 0.95) is None
    assert samples_needed(1.0, 1.0) is None, "no finite sample shows a share of exactly 1"


def test_four_reference_detections_cannot_show_a_recall_of_095_and_the_line_says_how_many_would():
    call = decide(wilson("recall", 4, 4, "reference detections"), "at least", 0.95)
    assert not call.decided and call.evidence.low == pytest.approx(0.5101, abs=1e-4)
    assert call.why == (
        "4 reference detections: recall cannot be judged >= 0.95 (95% interval 0.5101..1, wilson); about 73 are needed"
    )


def _d(n: int) -> list[Detections]:
    return [Detections.of([[10 * i, 0, 10 * i + 8, 8]], [0.9], [0]) for i in range(n)]


def test_a_detection_evaluation_carries_n_and_the_interval_of_each_gated_figure():
    def decode(sample):
        return _d(int(sample["n"][0]))

    result = evaluate(
        [{"n": np.array([4.0])}], [{"n": np.array([4.0])}], metric="detection", outputs=["n"], decode=decode
    )
    assert result.met and not result.decided
    (score,) = result.scores
    names = [(c.evidence.name, c.evidence.n, c.evidence.unit, c.evidence.method) for c in score.evidence]
    assert names == [
        ("recall", 4, "reference detections", "wilson"),
        ("precision", 4, "candidate detections", "wilson"),
        ("mean score shift", 4, "matched detections", "bootstrap"),
    ]
    doc = result.to_json()
    assert doc["decided"] is False and doc["evidence"].startswith("4 reference detections: recall cannot be judged")
    assert doc["outputs"][0]["evidence"][0]["interval"] == [0.510109, 1.0]


def test_top1_agreement_and_a_labelled_drop_are_judged_by_their_intervals():
    ref = [np.eye(3, dtype=np.float32)[i % 3] for i in range(400)]
    agree = evaluate([{"y": r} for r in ref], [{"y": r} for r in ref], metric="agreement", outputs=["y"])
    (call,) = agree.scores[0].evidence
    assert (call.evidence.n, call.decided) == (400, True)  # 400/400: lower bound 0.9905 >= 0.99
    few = evaluate([{"y": r} for r in ref[:64]], [{"y": r} for r in ref[:64]], metric="agreement", outputs=["y"])
    assert few.met and not few.decided and few.scores[0].evidence[0].needed == 381
    labels = [i % 3 for i in range(64)]
    labelled = evaluate(
        [{"y": r} for r in ref[:64]], [{"y": r} for r in ref[:64]], metric="top1", outputs=["y"], labels=labels
    )
    (drop,) = labelled.scores[0].evidence
    assert drop.evidence.method == "newcombe" and not drop.decided and drop.needed == 381


def test_the_same_data_gives_the_same_intervals_and_decision():
    rng = np.random.default_rng(9)
    ref = [{"y": rng.standard_normal(16).astype(np.float32)} for _ in range(20)]
    cand = [{"y": r["y"] + rng.normal(0, 0.05, 16).astype(np.float32)} for r in ref]
    first = evaluate(ref, cand, metric="cosine", outputs=["y"]).to_json()
    again = evaluate(ref, cand, metric="cosine", outputs=["y"]).to_json()
    assert json.dumps(first, sort_keys=True) == json.dumps(again, sort_keys=True)
    assert first["outputs"][0]["evidence"][0]["method"] == "bootstrap"


def test_the_search_stops_trying_int8_when_even_a_perfect_candidate_could_not_be_shown():
    thin = decide(wilson("recall", 4, 4, "reference detections"), "at least", 0.95)
    assert quant_search.evidence_stop(True, [thin]) == "no int8 candidate can show recall on 4 reference detections"
    assert quant_search.evidence_stop(False, [thin]) is None, "a candidate that missed says nothing of the data"
    near = decide(wilson("recall", 72, 73, "reference detections"), "at least", 0.95)  # 73/73 would be shown
    assert not near.decided and quant_search.evidence_stop(True, [near]) is None
    speed = quant_search.SpeedCall(2.0, 1.9, 2.1, "faster")
    assert quant_search.verdict("int8", True, speed, decided=False).ships is False
    assert quant_search.verdict("fp16", True, speed, decided=False).ships is True, "fp16 is judged on accuracy"


# --------------------------------------------------------------------------- end to end

ANCHORS, FEATURES = 8, 8


def _one_box_detector(path: Path) -> Path:
    """A YOLOv8-style head [1, 5, 8] with one class: input e_i lights anchor i (score logit
    +6, every other anchor -6), each anchor's box fixed apart from the others, so each validation
    sample is exactly one reference detection."""
    rng = np.random.default_rng(11)
    score_w = (12 * np.eye(FEATURES, ANCHORS) - 6).astype(np.float32)
    box_w = (rng.standard_normal((FEATURES, 4 * ANCHORS)) * 0.05).astype(np.float32)
    centres = np.arange(ANCHORS, dtype=np.float32) * 40 + 20
    box_b = np.stack([centres, np.full(ANCHORS, 30.0), np.full(ANCHORS, 24.0), np.full(ANCHORS, 24.0)])
    inits = [
        numpy_helper.from_array(box_w, "box_w"),
        numpy_helper.from_array(score_w, "score_w"),
        numpy_helper.from_array(box_b.astype(np.float32)[None], "box_b"),
        numpy_helper.from_array(np.array([1, 4, ANCHORS], np.int64), "box_shape"),
        numpy_helper.from_array(np.array([1, 1, ANCHORS], np.int64), "score_shape"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "box_w"], ["bm"], name="backbone_box"),
        helper.make_node("Reshape", ["bm", "box_shape"], ["br"], name="head_box_reshape"),
        helper.make_node("Add", ["br", "box_b"], ["boxes"], name="head_box_add"),
        helper.make_node("MatMul", ["x", "score_w"], ["sm"], name="backbone_score"),
        helper.make_node("Reshape", ["sm", "score_shape"], ["sr"], name="head_score_reshape"),
        helper.make_node("Sigmoid", ["sr"], ["scores"], name="head_sigmoid"),
        helper.make_node("Concat", ["boxes", "scores"], ["out"], axis=1, name="head_concat"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, FEATURES])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 5, ANCHORS])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture
def int8_twice_as_fast(monkeypatch):
    """Time candidates as a target where a graph holding int8 runs at half fp32's latency: the
    speed gate passes, so only the accuracy evidence decides (timing here would be noise)."""

    def timing(fp32: Path, candidate: Path, feed) -> tuple[float, float]:
        holds_int8 = quantize.quantized_nodes(onnx.load(candidate, load_external_data=False)) > 0
        return 1e-3, 1e-3 * (0.5 if holds_int8 else 1.0)

    monkeypatch.setattr(quantize, "time_side_by_side", timing)


def _detector_build(tmp_path: Path, keypair, detections: int):
    _one_box_detector(tmp_path / "det.onnx")
    eye = np.eye(FEATURES, dtype=np.float32)
    np.savez(tmp_path / "calib.npz", x=eye[:, None, :])
    np.savez(tmp_path / "val.npz", x=eye[np.arange(detections) % ANCHORS][:, None, :])
    doc = {
        "name": "det",
        "version": "1.0.0",
        "model": {"path": "det.onnx"},
        "postprocess": {"kind": "detection", "format": "yolov8"},
        "quantize": {"mode": "static", "calibration": {"npz": "calib.npz"}},
        "validate": {"data": {"npz": "val.npz"}, "samples": detections},
    }
    return build(recipe_from_dict(doc, tmp_path), key_paths=[str(keypair[0])], output=tmp_path / "det.edgepkg")


def _signed_report(result) -> dict:
    with tarfile.open(result.output) as tar:
        return json.loads(tar.extractfile("report.json").read())


def test_a_detector_with_4_reference_detections_keeps_float_and_names_the_data_it_needs(
    tmp_path, keypair, int8_twice_as_fast
):
    result = _detector_build(tmp_path, keypair, 4)
    assert result.manifest.raw["model"]["precision"] == "fp32"
    report = _signed_report(result)["passes"]["quantize"]
    met = [c for c in report["candidates"] if c.get("budget_met")]
    assert met, "an int8 candidate keeps recall and precision 1 on the 4 detections"
    assert all(c["ships"] is False and c["decided"] is False for c in met)
    recall = met[0]["task"]["outputs"][0]["evidence"][0]
    assert (recall["name"], recall["n"], recall["unit"]) == ("recall", 4, "reference detections")
    assert recall["interval"] == [0.510109, 1.0] and recall["needed"] == 73
    line = (
        "4 reference detections: recall cannot be judged >= 0.95 (95% interval 0.5101..1, wilson); about 73 are needed"
    )
    assert line in report["reason"] and report["reason"].endswith("shipping fp32")
    assert any(line in warning for warning in result.warnings)
    assert report["stopped"] == "no int8 candidate can show recall on 4 reference detections"
    assert len(report["candidates"]) == report["candidates"].index(met[0]) + 1, "no int8 candidate after it"


def test_the_same_detector_with_73_reference_detections_ships_int8_with_its_bound_in_the_signed_report(
    tmp_path, keypair, int8_twice_as_fast
):
    result = _detector_build(tmp_path, keypair, 73)
    assert result.manifest.raw["model"]["precision"] == "int8"
    report = _signed_report(result)["passes"]["quantize"]
    assert report["evidence"].startswith("73 reference detections: recall >= 0.95 (95% interval 0.95..1, wilson)")
    chosen = next(c for c in report["candidates"] if c["ships"])
    assert chosen["decided"] is True and chosen["task"]["outputs"][0]["evidence"][0]["interval"][0] >= 0.95


def test_evidence_is_a_pure_module():
    source = Path(evidence.__file__).read_text()
    assert "import onnx" not in source and "open(" not in source


def test_the_fallback_line_names_the_thin_evidence_not_the_speed():
    entries = [
        {
            "kind": "int8",
            "budget_met": True,
            "decided": False,
            "quantized_nodes": 4,
            "speedup": 2.0,
            "evidence": "4 reference detections: recall cannot be judged >= 0.95; about 73 are needed",
        }
    ]
    line = quant_search.fallback_reason(entries, 1.0, None)
    assert line == (
        "int8 kept the accuracy budget on too little validation data to show it: 4 reference "
        "detections: recall cannot be judged >= 0.95; about 73 are needed; shipping fp32"
    )
    shown = [{**entries[0], "decided": True, "speedup": 0.8}]
    assert "was not faster than fp32" in quant_search.fallback_reason(shown, 1.0, None)
