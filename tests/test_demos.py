"""Demo models: built from code, deterministic, correct shapes, and the trained ones accurate."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tools.demos import build_all


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    out = tmp_path_factory.mktemp("demos")
    return out, build_all(out)


def _session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_every_demo_passes_the_checker_and_runs_with_a_batch_of_two(demos):
    _, models = demos
    for name, path in models.items():
        onnx.checker.check_model(onnx.load(path), full_check=True)
        session = _session(path)
        feed = {}
        for spec in session.get_inputs():
            shape = [2 if not isinstance(d, int) else d for d in spec.shape]
            feed[spec.name] = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        outputs = session.run(None, feed)
        assert all(np.all(np.isfinite(o)) for o in outputs), name
        if name != "tiny":
            assert outputs[0].shape[0] == 2, f"{name}: the batch axis must be dynamic"


def test_mobilenet_has_the_mobilenet_building_blocks(demos):
    _, models = demos
    model = onnx.load(models["mobilenet"])
    ops = {n.op_type for n in model.graph.node}
    assert {"Conv", "BatchNormalization", "Clip", "GlobalAveragePool", "Gemm"} <= ops
    depthwise = [n for n in model.graph.node if n.op_type == "Conv"
                 and any(a.name == "group" and a.i > 1 for a in n.attribute)]
    assert len(depthwise) >= 5
    dims = model.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and [d.dim_value for d in dims[1:]] == [3, 224, 224]


def test_digits_cnn_reaches_95_percent_on_held_out_data_with_onnxruntime(demos):
    out, models = demos
    metrics = json.loads((out / "digits" / "metrics.json").read_text())
    val = np.load(out / "digits" / "val.npz")
    logits = _session(models["digits"]).run(None, {"image": val["image"]})[0]
    accuracy = float((logits.argmax(1) == val["label"]).mean())
    assert accuracy >= 0.95
    assert abs(accuracy - metrics["test_accuracy"]) < 1e-3, "numpy training and the ONNX export must agree"
    assert metrics["n_test"] == len(val["label"]) == len(list((out / "digits" / "val").glob("*.png")))


def test_digits_pngs_preprocess_to_exactly_the_validation_tensors(demos):
    from edgepack_core.preprocess import Preprocessor

    out, _ = demos
    spec = {"kind": "image", "color": "gray", "resize": {"size": [8, 8], "mode": "stretch"},
            "scale": 1 / 255, "layout": "NCHW", "dtype": "float32"}
    pre = Preprocessor(spec)
    val = np.load(out / "digits" / "val.npz")
    for i in (0, 17, 449):
        got = pre.from_path(out / "digits" / "val" / f"digit_{i:04d}.png")
        np.testing.assert_allclose(got[0], val["image"][i], atol=1e-6)


def test_tabular_model_is_accurate(demos):
    out, models = demos
    val = np.load(out / "tabular" / "val.npz")
    logits = _session(models["tabular"]).run(None, {"features": val["features"]})[0]
    assert float((logits.argmax(1) == val["label"]).mean()) >= 0.95


def test_builds_are_deterministic(demos, tmp_path):
    _, models = demos
    again = build_all(tmp_path, ["mobilenet", "tiny", "tabular"])
    for name in ("mobilenet", "tiny", "tabular"):
        assert again[name].read_bytes() == models[name].read_bytes(), name
