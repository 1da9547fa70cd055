"""Real-world shapes (issue 23, items 1 and 4): models built from code as exporters write them
(tests/real_world_shapes.py), built with ``edgepack build`` and served with
``edgepack-agent predict`` (whose load runs the device's smoke test), answers compared with
bare onnxruntime on the original model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml

from edgepack_core.postprocess_spec import parse_postprocess
from sdk.errors import ContractError
from sdk.packager.output_contract import real_contract, real_output_shape
from sdk.packager.passes.io_spec import resolve_apply_softmax
from sdk.packager.probabilities import detection_scores, is_distribution, outside_unit_interval, producer
from tests import real_world_shapes as shapes
from tests.conftest import run_cli


def _bare(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _build(
    tmp_path: Path,
    model: onnx.ModelProto,
    data: dict[str, np.ndarray],
    post: dict[str, Any],
    keypair: tuple[Path, Path],
) -> tuple[Any, Path]:
    onnx.save(model, tmp_path / "model.onnx")
    np.savez(tmp_path / "val.npz", **data)
    recipe = {
        "name": "m",
        "version": "1.0.0",
        "model": {"path": "model.onnx"},
        "postprocess": post,
        "validate": {"data": {"npz": "val.npz"}},
        "golden": {"count": 2},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    artifact = tmp_path / "m.edgepkg"
    result = run_cli(
        "edgepack", "build", str(tmp_path / "recipe.yaml"), "--key", str(keypair[0]), "-o", str(artifact), timeout=300
    )
    return result, artifact


def _predict(artifact: Path, keypair: tuple[Path, Path], tmp_path: Path, value: np.ndarray) -> dict[str, Any]:
    np.save(tmp_path / "in.npy", value)
    result = run_cli(
        "edgepack-agent",
        "predict",
        "--artifact",
        str(artifact),
        "--trust",
        str(keypair[1]),
        "--input",
        str(tmp_path / "in.npy"),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _manifest(artifact: Path) -> dict[str, Any]:
    from tests.model_kinds import artifact_member

    return json.loads(artifact_member(artifact, "manifest.json"))


def _report(artifact: Path) -> dict[str, Any]:
    from tests.model_kinds import artifact_member

    return json.loads(artifact_member(artifact, "report.json"))


def test_an_output_declared_1_seqlen_that_returns_seqlen_1_c_builds_passes_the_smoke_test_and_answers_like_ort(
    tmp_path, keypair
):
    model = shapes.misdeclared_sequence_head()
    rng = np.random.default_rng(1)
    result, artifact = _build(
        tmp_path, model, {"x": rng.standard_normal((4, 1, 6, 8)).astype(np.float32)}, {"kind": "raw"}, keypair
    )
    assert result.returncode == 0, result.stderr
    manifest = _manifest(artifact)
    assert manifest["outputs"] == [{"name": "logits", "dtype": "float32", "shape": ["seqlen", 1, 5]}]
    passes = _report(artifact)["passes"]
    assert "repaired_outputs" not in passes["golden"]  # the validation data repaired it; golden agrees
    repaired = passes["validate"]["repaired_outputs"]
    assert repaired == [{"output": "logits", "declared": [1, "seqlen"], "real": ["seqlen", 1, 5]}]
    shipped = onnx.load_from_string(
        __import__("tests.model_kinds", fromlist=["x"]).artifact_member(artifact, "model/model.onnx")
    )
    dims = shipped.graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["seqlen", 1, 5]
    value = rng.standard_normal((1, 9, 8)).astype(np.float32)  # another length than the build saw
    answer = _predict(artifact, keypair, tmp_path, value)
    (want,) = _bare(model, {"x": value})
    assert want.shape == (9, 1, 5)
    np.testing.assert_allclose(np.array(answer["outputs"]["logits"], np.float32), want, rtol=1e-5, atol=1e-6)


def test_a_dim_that_varies_over_the_validation_data_is_declared_symbolic_though_golden_saw_one_length(
    tmp_path, keypair
):
    model = shapes.misdeclared_sequence_head(declared=(1, 5))  # an export that froze the wrong shape
    onnx.save(model, tmp_path / "model.onnx")
    rng = np.random.default_rng(7)
    for n, length in enumerate((6, 9, 4)):
        folder = tmp_path / "val" / f"test_data_set_{n}"
        folder.mkdir(parents=True)
        tensor = onnx.numpy_helper.from_array(rng.standard_normal((1, length, 8)).astype(np.float32), "x")
        (folder / "input_0.pb").write_bytes(tensor.SerializeToString())
    recipe = {
        "name": "m",
        "version": "1.0.0",
        "model": {"path": "model.onnx"},
        "postprocess": {"kind": "raw"},
        "validate": {"data": {"test_data": "val"}},
        "golden": {"count": 1},
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    artifact = tmp_path / "m.edgepkg"
    result = run_cli("edgepack", "build", str(tmp_path / "recipe.yaml"), "--key", str(keypair[0]), "-o", str(artifact))
    assert result.returncode == 0, result.stderr
    assert _manifest(artifact)["outputs"][0]["shape"] == ["seqlen", 1, 5]
    value = rng.standard_normal((1, 12, 8)).astype(np.float32)
    (want,) = _bare(model, {"x": value})
    answer = _predict(artifact, keypair, tmp_path, value)
    np.testing.assert_allclose(np.array(answer["outputs"]["logits"], np.float32), want, rtol=1e-5, atol=1e-6)


def test_a_real_shape_keeps_a_declared_dim_symbolic_where_it_varies_and_names_it_when_new():
    seen = [(6, 1, 5), (9, 1, 5)]
    assert real_output_shape("logits", [1, "seqlen"], seen, {"seqlen": [6, 9]}) == ["seqlen", 1, 5]
    assert real_output_shape("logits", [1, "seqlen"], seen, {}) == ["logits_dim0", 1, 5]
    # a fixed value that a declared symbol also takes keeps the symbol (the device's input decides it)
    assert real_output_shape("logits", [1, "seqlen"], [(6, 1, 5)], {"seqlen": [6]}) == ["seqlen", 1, 5]
    assert real_output_shape("y", [2, 3], [(2, 3)], {}) == [2, 3]


def _classify(
    tmp_path: Path, keypair: tuple[Path, Path], model: onnx.ModelProto, seed: int
) -> tuple[Path, np.ndarray, dict[str, Any]]:
    """Build a topk classifier from 4 validation samples; (artifact, bare onnxruntime's output on
    a new sample, the artifact's top answer for it through ``edgepack-agent predict``)."""
    rng = np.random.default_rng(seed)
    data = {"x": rng.standard_normal((4, 1, 8)).astype(np.float32)}
    result, artifact = _build(tmp_path, model, data, {"kind": "topk", "k": 2}, keypair)
    assert result.returncode == 0, result.stderr
    value = rng.standard_normal((1, 8)).astype(np.float32)
    (bare,) = _bare(model, {"x": value})
    return artifact, bare, _predict(artifact, keypair, tmp_path, value)["result"][0]


def test_a_softmax_written_out_as_exp_reducesum_div_answers_the_models_own_probability(tmp_path, keypair):
    artifact, probs, top = _classify(tmp_path, keypair, shapes.handwritten_softmax_classifier(), 2)
    assert top["index"] == 0 and probs[0, 0] > 0.9999
    assert top["score"] == pytest.approx(float(probs[0, 0]), abs=1e-6)  # main answered 0.0135
    note = _report(artifact)["passes"]["io_spec"]["apply_softmax"]
    assert note["value"] is False and "Exp/ReduceSum/Div" in note["why"]


def test_a_distribution_no_pattern_names_is_recognised_from_the_validation_outputs(tmp_path, keypair):
    artifact, probs, top = _classify(tmp_path, keypair, shapes.reciprocal_softmax_classifier(), 3)
    assert _manifest(artifact)["postprocess"]["apply_softmax"] is False
    assert top["score"] == pytest.approx(float(probs[0, 0]), abs=1e-6)
    assert "validation data" in _report(artifact)["passes"]["io_spec"]["apply_softmax"]["why"]


def test_logits_still_get_their_softmax(tmp_path, keypair):
    artifact, logits, top = _classify(tmp_path, keypair, shapes.logits_classifier(), 4)
    assert _manifest(artifact)["postprocess"]["apply_softmax"] is True
    exp = np.exp(logits[0].astype(np.float64) - logits[0].max())
    assert top["score"] == pytest.approx(float(exp[0] / exp.sum()), abs=1e-6)


@pytest.mark.parametrize("make", [shapes.handwritten_softmax_classifier, shapes.reciprocal_softmax_classifier])
@pytest.mark.parametrize(
    ("post", "key"),
    [
        ({"kind": "topk", "k": 1, "apply_softmax": True}, "postprocess.apply_softmax"),
        ({"kind": "softmax"}, "postprocess.kind"),
    ],
)
def test_an_explicit_softmax_on_a_distribution_is_refused_naming_the_output(tmp_path, keypair, make, post, key):
    rng = np.random.default_rng(5)
    result, _ = _build(tmp_path, make(), {"x": rng.standard_normal((4, 1, 8)).astype(np.float32)}, post, keypair)
    assert result.returncode == 2  # a recipe error
    assert result.stderr.strip().count("\n") == 0 and "output probs" in result.stderr
    assert key in result.stderr and "already a probability distribution" in result.stderr


def test_kind_softmax_on_logits_still_builds(tmp_path, keypair):
    rng = np.random.default_rng(6)
    data = {"x": rng.standard_normal((4, 1, 8)).astype(np.float32)}
    result, _ = _build(tmp_path, shapes.logits_classifier(), data, {"kind": "softmax"}, keypair)
    assert result.returncode == 0, result.stderr


def test_a_distribution_sums_to_1_within_the_tolerance_and_no_further():
    row = np.full((1, 4), 0.25)
    assert is_distribution([row]) and is_distribution([row + 0.00999 / 4])  # sums to 1.00999: inside
    assert not is_distribution([row + 0.0101 / 4])  # the sum is 1.0101: one step past the tolerance
    assert not is_distribution([np.array([[1.2, -0.2]])])  # sums to 1, but a negative value is no probability
    assert not is_distribution([np.array([[1.0]])])  # one class: any sigmoid output would pass
    assert not is_distribution([np.array([[0, 1]], np.int64)])


@pytest.mark.parametrize(
    ("op", "kind", "value"),
    [("Softmax", "distribution", False), ("LogSoftmax", "log", True), ("Sigmoid", "independent", False)],
)
def test_softmax_logsoftmax_and_sigmoid_heads_decide_apply_softmax(op, kind, value):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node(op, ["x"], ["y"], name="head"), helper.make_node("Flatten", ["y"], ["probs"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 3])],
    )
    model = helper.make_model(graph)
    assert producer(model, "probs").kind == kind
    post, note = resolve_apply_softmax(model, parse_postprocess({"kind": "topk", "k": 1}))
    assert post.apply_softmax is value and op in note["why"]


def test_exp_sum_div_is_a_written_out_softmax_and_a_div_by_anything_else_is_not():
    model = shapes.handwritten_softmax_classifier()
    assert producer(model, "probs").pattern == "Exp/ReduceSum/Div"
    for node in model.graph.node:
        if node.op_type == "ReduceSum":  # Sum of the Exp with itself: the Exp/Sum form
            node.op_type, node.input[:] = "Sum", ["exp", "exp"]
            node.ClearField("attribute")
    assert producer(model, "probs").pattern == "Exp/Sum/Div"
    div = next(n for n in model.graph.node if n.op_type == "Div")
    div.input[1] = "logits"  # Exp divided by the logits: no softmax
    assert producer(model, "probs") is None


def test_an_output_whose_dtype_or_rank_the_model_does_not_keep_is_refused_naming_it():
    from edgepack_core.manifest import TensorSpec

    spec = TensorSpec("y", "float32", (1, "n"))
    with pytest.raises(ContractError, match="output y is declared float32 but the model returns int64"):
        real_contract([spec], [], [{}], [{"y": np.zeros((1, 2), np.int64)}])
    with pytest.raises(ContractError, match="output y returns rank 2 and 3"):
        real_contract(
            [spec], [], [{}, {}], [{"y": np.zeros((1, 2), np.float32)}, {"y": np.zeros((1, 2, 1), np.float32)}]
        )
    assert real_contract([spec], [], [{}], [{"y": np.zeros((1, 2), np.float32)}])[1] == []


def test_a_detection_head_whose_scores_are_logits_is_refused_naming_the_output(tmp_path, keypair):
    rng = np.random.default_rng(8)
    data = {"x": rng.standard_normal((4, 1, 8)).astype(np.float32)}
    post = {"kind": "detection", "format": "yolov8"}
    result, _ = _build(tmp_path, shapes.yolov8_head_without_sigmoid(), data, post, keypair)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "postprocess.format" in result.stderr
    assert "scores of output output0 are not probabilities" in result.stderr


def test_scores_in_the_unit_interval_pass_and_a_step_outside_is_refused():
    head = np.zeros((1, 6, 3))
    head[:, 4:] = [[0.0, 0.5, 1.0], [1.0, 0.0, 0.25]]
    head[:, :4] = 300.0  # box coordinates are pixels: never read as scores
    assert outside_unit_interval([detection_scores("yolov8", head)]) is None
    head[0, 5, 2] = 1.0001
    assert outside_unit_interval([detection_scores("yolov8", head)]) == (0.0, 1.0001)
    rows = np.full((1, 3, 7), 0.5)  # yolov5: objectness from column 4
    rows[0, 0, 4] = -0.001
    assert outside_unit_interval([detection_scores("yolov5", rows)]) == (-0.001, 0.5)
    assert detection_scores("yolov8", np.zeros((2, 2, 2, 2))) is None
