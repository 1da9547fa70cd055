"""Lossy builds judged by the task, on small onnx.helper models built here: a detector whose
int8 head collapses while its whole-tensor cosine stays above 0.99, a [1, T, C] sequence model
measured per step, a state output left out with validate.outputs, exclude_nodes globs, and a
precision that says what the graph holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from sdk.errors import RecipeError, ValidationFailed
from sdk.packager.pipeline import build
from sdk.recipe import recipe_from_dict
from tests.conftest import run_cli

ANCHORS, CLASSES, FEATURES = 60, 3, 16


def _save(path: Path, nodes, inputs, outputs, inits) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _detector(path: Path) -> Path:
    """A YOLOv8-style head [1, 4 + classes, anchors]: boxes in pixels (cx, cy ~ 50..600) joined
    by Concat with sigmoid class scores, as the exported detectors of the issue are."""
    rng = np.random.default_rng(7)
    box_w = (rng.standard_normal((FEATURES, 4 * ANCHORS)) * 2).astype(np.float32)
    box_b = np.concatenate([rng.uniform(50, 600, (2, ANCHORS)), rng.uniform(20, 60, (2, ANCHORS))])
    score_w = (rng.standard_normal((FEATURES, CLASSES * ANCHORS)) * 0.8).astype(np.float32)
    inits = [numpy_helper.from_array(box_w, "box_w"), numpy_helper.from_array(score_w, "score_w"),
             numpy_helper.from_array(box_b.astype(np.float32)[None], "box_b"),
             numpy_helper.from_array(np.array([1, 4, ANCHORS], np.int64), "box_shape"),
             numpy_helper.from_array(np.array([1, CLASSES, ANCHORS], np.int64), "score_shape")]
    nodes = [helper.make_node("MatMul", ["x", "box_w"], ["bm"], name="backbone_box"),
             helper.make_node("Reshape", ["bm", "box_shape"], ["br"], name="head_box_reshape"),
             helper.make_node("Add", ["br", "box_b"], ["boxes"], name="head_box_add"),
             helper.make_node("MatMul", ["x", "score_w"], ["sm"], name="backbone_score"),
             helper.make_node("Reshape", ["sm", "score_shape"], ["sr"], name="head_score_reshape"),
             helper.make_node("Sigmoid", ["sr"], ["scores"], name="head_sigmoid"),
             helper.make_node("Concat", ["boxes", "scores"], ["out"], axis=1, name="head_concat")]
    return _save(path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, FEATURES])],
                 [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 4 + CLASSES, ANCHORS])], inits)


def _detector_recipe(tmp_path: Path, **validate) -> dict:
    _detector(tmp_path / "det.onnx")
    x = np.random.default_rng(3).standard_normal((24, 1, FEATURES)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x)
    return {"name": "det", "version": "1.0.0", "model": {"path": "det.onnx"},
            "quantize": {"mode": "static", "calibration": {"npz": "d.npz"}},
            "validate": {"data": {"npz": "d.npz"}, **validate}}


def _build(tmp_path: Path, doc: dict, keypair, name: str = "a"):
    return build(recipe_from_dict(doc, tmp_path), key_paths=[str(keypair[0])], output=tmp_path / f"{name}.edgepkg")


def test_a_collapsed_detector_head_fools_the_cosine_but_not_the_detection_metric(tmp_path, keypair):
    fooled = _build(tmp_path, _detector_recipe(tmp_path, metric="cosine", min_cosine=0.99), keypair, "fooled")
    assert fooled.manifest.raw["model"]["precision"] == "int8", "the whole-tensor cosine lets the broken head through"
    first = fooled.report["passes"]["quantize"]["candidates"][0]
    assert first["task"]["outputs"][0]["cosine"] > 0.99

    honest_doc = _detector_recipe(tmp_path)  # no metric named: the detection postprocess sets it
    honest_doc["postprocess"] = {"kind": "detection", "format": "yolov8"}
    honest = _build(tmp_path, honest_doc, keypair, "honest")
    quantize = honest.report["passes"]["quantize"]
    assert honest.manifest.raw["model"]["precision"] == "fp32" and quantize["applied"] is False
    assert quantize["candidates"][0]["metric"] == "detection"
    for entry in quantize["candidates"]:
        if "error" in entry:
            continue
        recall = entry["task"]["outputs"][0]["recall"]
        assert recall < 0.95 and entry["budget_met"] is False
        assert entry["bytes"] > 0 and entry["latency_ms"] > 0 and "speedup" in entry
    warning = next(w for w in honest.warnings if "could not meet the accuracy budget" in w)
    assert "\n" not in warning and "output out: detection recall" in warning and "short by" in warning


def _sequence_model(path: Path) -> Path:
    """logits [1, 10, 3] = x @ W: classes 0 and 1 differ by 1e-5 (one fp16 value), class 2 is
    clear. Steps fed e_0 tie in fp16 (fp32 picks class 1); steps fed e_1 pick class 2 in both."""
    weight = np.array([[1.0, 1.0 + 1e-5, 0.0], [0.0, 0.0, 2.0], [0, 0, 0], [0, 0, 0]], np.float32)
    return _save(path, [helper.make_node("MatMul", ["x", "w"], ["logits"], name="proj")],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 10, 4])],
                 [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 10, 3])],
                 [numpy_helper.from_array(weight, "w")])


def test_a_sequence_model_is_judged_per_step_and_the_cli_names_the_output_and_the_shortfall(tmp_path, keypair):
    _sequence_model(tmp_path / "seq.onnx")
    x = np.zeros((1, 10, 4), np.float32)
    x[0, :3, 1] = 1.0   # 3 clear steps
    x[0, 3:, 0] = 1.0   # 7 near-tie steps that fp16 flips
    np.savez(tmp_path / "d.npz", x=x)
    doc = {"name": "seq", "version": "1.0.0", "model": {"path": "seq.onnx"}, "optimize": {"fp16": True},
           "postprocess": {"kind": "ctc", "blank": 0}, "validate": {"data": {"npz": "d.npz"}}}
    with pytest.raises(ValidationFailed, match=r"output logits: per-step agreement 0\.3 \(required >= 0\.99\), "
                                               r"decoded strings equal 0\.00%, short by 0\.69"):
        _build(tmp_path, doc, keypair)
    (tmp_path / "seq.yaml").write_text(yaml.safe_dump(doc))
    result = run_cli("edgepack", "build", str(tmp_path / "seq.yaml"), "--key", str(keypair[0]),
                     "-o", str(tmp_path / "cli.edgepkg"))
    assert result.returncode == 1 and not (tmp_path / "cli.edgepkg").exists()
    assert result.stderr.strip().count("\n") == 0 and "output logits: per-step agreement 0.3" in result.stderr
    doc["validate"]["min_agreement"] = 0.3
    report = _build(tmp_path, doc, keypair).report["passes"]["validate"]
    task = report["task"]["outputs"][0]
    assert report["budget_met"] is True and report["metric"] == "sequence"
    assert (task["steps"], task["sequences"], task["string_match"]) == (10, 1, 0.0)


def _stateful(path: Path) -> Path:
    """output = 2x (exact in fp16); stateN = 1.0001x (fp16 rounds the factor to 1)."""
    return _save(path, [helper.make_node("Mul", ["x", "two"], ["output"]),
                        helper.make_node("Mul", ["x", "drift"], ["stateN"])],
                 [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                 [helper.make_tensor_value_info("output", TensorProto.FLOAT, [1, 8]),
                  helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [1, 8])],
                 [numpy_helper.from_array(np.float32([2.0]), "two"),
                  numpy_helper.from_array(np.float32([1.0001]), "drift")])


@pytest.mark.parametrize(("outputs", "passes"), [(None, False), (["output"], True)])
def test_validate_outputs_leaves_a_state_output_out(tmp_path, keypair, outputs, passes):
    _stateful(tmp_path / "s.onnx")
    np.savez(tmp_path / "d.npz", x=(np.arange(16, dtype=np.float32).reshape(2, 1, 8) / 8))
    validate = {"data": {"npz": "d.npz"}, "metric": "max_abs", "max_abs": 1e-6}
    doc = {"name": "s", "version": "1.0.0", "model": {"path": "s.onnx"}, "optimize": {"fp16": True},
           "validate": {**validate, **({"outputs": outputs} if outputs else {})}}
    if not passes:
        with pytest.raises(ValidationFailed, match=r"output stateN: max abs diff"):
            _build(tmp_path, doc, keypair)
        return
    report = _build(tmp_path, doc, keypair).report["passes"]["validate"]
    assert [o["output"] for o in report["task"]["outputs"]] == ["output"] and report["budget_met"]


def test_validate_outputs_refuses_a_name_the_model_does_not_have(tmp_path, keypair):
    _stateful(tmp_path / "s.onnx")
    doc = {"name": "s", "version": "1.0.0", "model": {"path": "s.onnx"},
           "validate": {"data": "synthetic", "outputs": ["output", "state"]}}
    with pytest.raises(RecipeError, match=r"validate\.outputs: the model has no output named 'state' "
                                          r"\(outputs: output, stateN\)"):
        _build(tmp_path, doc, keypair)


def _int8_weight(model: onnx.ModelProto, node_name: str) -> bool:
    """Whether the node's weight (input 1) comes out of a DequantizeLinear (its activation
    input is shared with a quantized node, which quantizes it for both)."""
    producers = {out: node.op_type for node in model.graph.node for out in node.output}
    node = next(n for n in model.graph.node if n.name == node_name)
    return producers.get(node.input[1]) == "DequantizeLinear"


def test_exclude_nodes_takes_globs_and_refuses_a_pattern_matching_nothing(tmp_path, keypair):
    doc = _detector_recipe(tmp_path, metric="cosine", min_cosine=0.9)
    doc["quantize"].update(exclude_nodes=["backbone_s*"], search=False)
    result = _build(tmp_path, doc, keypair)
    quantize = result.report["passes"]["quantize"]
    assert quantize["requested"]["excluded_nodes"] == ["backbone_score"]
    import tarfile

    with tarfile.open(result.output) as tar:
        model = onnx.load_from_string(tar.extractfile("model/model.onnx").read())
    assert _int8_weight(model, "backbone_box") and not _int8_weight(model, "backbone_score")

    doc["quantize"]["exclude_nodes"] = ["backbone_*", "neck_*"]
    with pytest.raises(RecipeError, match=r"quantize\.exclude_nodes: 'neck_\*' matches no node of the model"):
        _build(tmp_path, doc, keypair, "b")


def test_dynamic_int8_that_quantized_nothing_ships_as_fp32(tmp_path, keypair):
    _stateful(tmp_path / "s.onnx")  # Mul only: nothing dynamic quantization touches
    doc = {"name": "s", "version": "1.0.0", "model": {"path": "s.onnx"}, "quantize": {"mode": "dynamic"},
           "validate": {"data": "synthetic"}}
    result = _build(tmp_path, doc, keypair)
    assert result.manifest.raw["model"]["precision"] == "fp32"
    quantize = result.report["passes"]["quantize"]
    assert quantize["applied"] is False and quantize["candidates"][0]["quantized_nodes"] == 0
    assert any("changed no node" in w for w in result.warnings)


def test_a_search_in_a_non_tty_log_prints_one_line_per_candidate(tmp_path, keypair):
    doc = _detector_recipe(tmp_path, metric="detection")
    (tmp_path / "det.yaml").write_text(yaml.safe_dump(doc))
    result = run_cli("edgepack", "build", str(tmp_path / "det.yaml"), "--key", str(keypair[0]),
                     "-o", str(tmp_path / "log.edgepkg"), timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stderr.splitlines() if "candidate" in line]
    assert len(lines) >= 4 and all("misses the budget" in line and "bytes" in line and " ms (" in line
                                   for line in lines), "one verdict line per candidate, nothing else"
    assert lines[0].startswith(f"quantize: candidate 1/{len(lines)} (static minmax per-channel) misses")
    assert "trying" not in result.stderr and "quantize ..." not in result.stderr


def test_a_detection_metric_on_an_output_that_is_no_detection_head_is_one_error_naming_the_key(tmp_path, keypair):
    _stateful(tmp_path / "s.onnx")  # outputs [1, 8]: no [batch, 4 + classes, anchors] head
    doc = {"name": "s", "version": "1.0.0", "model": {"path": "s.onnx"}, "optimize": {"fp16": True},
           "validate": {"data": "synthetic", "metric": "detection", "outputs": ["output"]}}
    with pytest.raises(RecipeError, match=r"validate\.metric: metric detection cannot read output output: a yolov8 "
                                          r"head is \[batch, 4 \+ classes, anchors\], got \[1, 8\]"):
        _build(tmp_path, doc, keypair)
