"""Pre-quantized models keep their int8 form and say so (issue 23, item 5).

Each model of ``tests.real_world_quant`` is built through the real pipeline with the recipe a
user writes first (model, validation data, targets); the artifact's model must stay about the
input's size (never the ~4x of weights folded back to float), its manifest must say ``int8``,
and it must answer like bare onnxruntime on the original file.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from sdk.packager.artifact_size import SIZE_RATIO, SIZE_SLACK, size_findings
from sdk.packager.pipeline import build
from sdk.packager.quant_facts import quant_facts
from sdk.recipe import load_recipe
from tests import real_world_quant as models

pytestmark = pytest.mark.slow


def _build(folder: Path, model: Path, key: Path, feeds: dict[str, np.ndarray], extra: str = ""):
    np.savez(folder / "val.npz", **feeds)
    recipe = folder / "r.yaml"
    recipe.write_text(
        f"name: q\nversion: 1.0.0\nmodel: {{path: {model.name}}}\ntargets: [x86, rpi]\n"
        f"validate: {{data: {{npz: val.npz}}}}\n{extra}"
    )
    return build(load_recipe(recipe), key_paths=[str(key)], output=folder / "q.edgepkg")


def _member(artifact: Path, name: str) -> bytes:
    with tarfile.open(artifact) as tar:
        member = tar.extractfile(name)
        assert member is not None
        return member.read()


def _answers_like_the_original(artifact: Path, original: Path, feeds: dict[str, np.ndarray]) -> None:
    """Task results equal: the packaged model's outputs are the original's (same argmax, and
    within float rounding: constant folding of float scales may reorder one multiplication)."""
    packaged = ort.InferenceSession(_member(artifact, "model/model.onnx"), providers=["CPUExecutionProvider"])
    bare = ort.InferenceSession(str(original), providers=["CPUExecutionProvider"])
    for index in range(len(next(iter(feeds.values())))):
        feed = {name: value[index] for name, value in feeds.items()}
        for got, want in zip(packaged.run(None, feed), bare.run(None, feed), strict=True):
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_int8_weights_dequantized_by_cast_mul_are_not_folded_back_to_fp32(tmp_path: Path, keypair):
    model = models.cast_mul_model(tmp_path / "m.onnx")
    feeds = {"x": np.random.default_rng(1).normal(size=(4, 1, 256)).astype(np.float32)}
    result = _build(tmp_path, model, keypair[0], feeds)
    packaged = _member(result.output, "model/model.onnx")
    # about the input's size: folding the three 256x256 int8 weights to float would add 589,824 bytes
    assert len(packaged) <= 1.1 * model.stat().st_size, (len(packaged), model.stat().st_size)
    kept = onnx.load_from_string(packaged)
    assert sorted(i.name for i in kept.graph.initializer if i.data_type == onnx.TensorProto.INT8) == [
        "w0_q",
        "w1_q",
        "w2_q",
    ]
    assert result.manifest.raw["model"]["precision"] == "int8"
    report = json.loads(_member(result.output, "report.json"))
    assert report["passes"]["ort_optimize"]["quantized_weights_kept"] is True
    assert not [w for w in result.warnings if "bytes" in w and "model.onnx" in w]
    _answers_like_the_original(result.output, model, feeds)


def test_a_graph_of_conv_integer_and_matmul_integer_nodes_is_labelled_precision_int8(tmp_path: Path, keypair):
    model = models.integer_ops_model(tmp_path / "m.onnx")
    feeds = {"x": models.images()}
    result = _build(tmp_path, model, keypair[0], feeds)
    assert result.manifest.raw["model"]["precision"] == "int8"
    report = json.loads(_member(result.output, "report.json"))
    facts = report["passes"]["precision"]
    assert facts["precision"] == "int8"
    assert facts["int8_nodes"] == {"ConvInteger": 1, "DynamicQuantizeLinear": 2, "MatMulInteger": 1}
    _answers_like_the_original(result.output, model, feeds)


def test_a_qdq_model_from_quantize_static_stays_int8_and_small(tmp_path: Path, keypair):
    model = models.qdq_model(tmp_path)
    feeds = {"x": models.images()}
    result = _build(tmp_path, model, keypair[0], feeds)
    packaged = _member(result.output, "model/model.onnx")
    assert len(packaged) <= 1.1 * model.stat().st_size, (len(packaged), model.stat().st_size)
    assert len(packaged) < 0.5 * (tmp_path / "float.onnx").stat().st_size
    assert result.manifest.raw["model"]["precision"] == "int8"
    _answers_like_the_original(result.output, model, feeds)


def test_the_quantize_pass_does_not_requantize_an_already_quantized_model(tmp_path: Path, keypair):
    model = models.qdq_model(tmp_path)
    feeds = {"x": models.images()}
    result = _build(tmp_path, model, keypair[0], feeds, extra="quantize: {mode: static, calibration: {npz: val.npz}}\n")
    report = json.loads(_member(result.output, "report.json"))
    assert report["passes"]["quantize"] == {
        "applied": False,
        "already_quantized": True,
        "reason": report["passes"]["quantize"]["reason"],
    }
    assert "already quantized" in report["passes"]["quantize"]["reason"]
    assert result.manifest.raw["model"]["precision"] == "int8"
    _answers_like_the_original(result.output, model, feeds)


def test_a_float_model_is_fp32_and_a_partly_quantized_one_reports_its_split(tmp_path: Path):
    float_facts = quant_facts(onnx.load(models.float_model(tmp_path / "f.onnx")))
    assert float_facts.precision is None and float_facts.int8_nodes == {}
    facts = quant_facts(onnx.load(models.integer_ops_model(tmp_path / "i.onnx")))
    assert facts.precision == "int8"
    assert facts.float_compute == {} and facts.to_json()["split"] == "int8"
    cast_mul = quant_facts(onnx.load(models.cast_mul_model(tmp_path / "c.onnx")))
    assert cast_mul.int8_nodes == {"Cast": 3} and cast_mul.float_compute == {}
    assert cast_mul.int8_weight_bytes >= 3 * 256 * 256


# --- the size rule: at most 1.1x the model's bytes plus golden samples without a warning ----------


def test_an_artifact_at_the_size_limit_passes_and_one_byte_over_is_warned_naming_why():
    members = {"model/model.onnx": 100_000, "golden/in_0.npy": 5_000_000}  # golden samples do not count
    limit = int(SIZE_RATIO * 100_000) + SIZE_SLACK
    assert size_findings(100_000, {**members, "model/model.onnx": limit}, growth={}) == []
    (found,) = size_findings(100_000, {**members, "model/model.onnx": limit + 1}, growth={"ort_optimize": 589_759})
    assert "model/model.onnx" in found and f"{limit + 1:,}" in found and "100,000" in found
    assert "ort_optimize +589,759 bytes" in found


def test_an_ort_member_beyond_the_size_limit_is_named():
    (found,) = size_findings(100_000, {"model/model.onnx": 100_000, "model/model.ort": 90_000}, growth={})
    assert "model/model.ort" in found and "optimize.ort_format" in found


def test_an_artifact_shipping_the_model_twice_warns_naming_the_ort_copy(tmp_path: Path, keypair):
    model = models.cast_mul_model(tmp_path / "m.onnx")
    feeds = {"x": np.random.default_rng(1).normal(size=(2, 1, 256)).astype(np.float32)}
    result = _build(tmp_path, model, keypair[0], feeds, extra="optimize: {ort_format: true}\n")
    (warning,) = [w for w in result.warnings if w.startswith("artifact_size:")]
    assert "model/model.ort" in warning and "optimize.ort_format" in warning
    report = json.loads(_member(result.output, "report.json"))
    assert report["passes"]["artifact_size"]["within"] is False


def test_qoperator_and_dynamic_graphs_from_onnxruntime_quantization_are_int8_with_their_split(tmp_path: Path):
    qop = quant_facts(onnx.load(models.qoperator_model(tmp_path)))
    assert qop.precision == "int8" and qop.int8_nodes["QLinearConv"] == 1 and qop.int8_nodes["QLinearMatMul"] == 3
    assert qop.to_json()["split"] == "int8"
    dynamic = quant_facts(onnx.load(models.dynamic_model(tmp_path)))
    assert dynamic.precision == "int8" and dynamic.int8_nodes["MatMulInteger"] == 3
    assert dynamic.float_compute == {"Conv": 1} and dynamic.to_json()["split"] == "mixed"


def test_a_dynamic_quantize_lstm_inside_a_loop_body_is_int8():
    lstm = onnx.helper.make_node("DynamicQuantizeLSTM", ["x", "w", "r"], ["y"], domain="com.microsoft", hidden_size=4)
    body = onnx.helper.make_graph([lstm], "body", [], [])
    loop = onnx.helper.make_node("Loop", ["n", ""], [], body=body)
    model = onnx.helper.make_model(onnx.helper.make_graph([loop], "g", [], []))
    facts = quant_facts(model)
    assert facts.precision == "int8" and facts.int8_nodes == {"DynamicQuantizeLSTM": 1}
