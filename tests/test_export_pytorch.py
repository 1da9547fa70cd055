"""The PyTorch seed workflow: export done right (eval, dynamic batch, opset 17, checked against
torch), from the Python API and from a recipe; a clear error without torch."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from sdk.errors import BuildError

torch = pytest.importorskip("torch")  # CI installs torch==2.13.0 (CPU); users without it get a clear error


def test_export_forces_eval_mode_adds_a_dynamic_batch_and_matches_torch(tmp_path):
    from sdk.export import export_pytorch
    from tests.torch_models import make_classifier

    module = make_classifier()
    assert module.training
    report = export_pytorch(module, [1, 3, 16, 16], tmp_path / "m.onnx")
    assert report["max_abs_diff_vs_torch"] <= 1e-5 and report["opset"] == 17
    model = onnx.load(tmp_path / "m.onnx")
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "batch"
    assert not any(n.op_type == "Dropout" for n in model.graph.node), "eval mode exports no Dropout"
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        expected = module.eval()(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(session.run(None, {"input": x})[0], expected, atol=1e-5)


def test_recipe_with_a_pytorch_section_builds_a_signed_artifact(tmp_path, keypair):
    from sdk.packager.pipeline import build
    from sdk.recipe import load_recipe

    (tmp_path / "r.yaml").write_text(
        "name: torch-demo\nversion: 1.0.0\n"
        "model: {pytorch: {factory: 'tests.torch_models:make_classifier', input_shape: [1, 3, 16, 16]}}\n"
        "targets: [x86]\nvalidate: {data: synthetic}\n")
    result = build(load_recipe(tmp_path / "r.yaml"), key_paths=[str(keypair[0])], output=tmp_path / "t.edgepkg")
    assert result.report["passes"]["export_pytorch"]["max_abs_diff_vs_torch"] <= 1e-5
    assert result.manifest.inputs[0].shape == ("batch", 3, 16, 16)
    assert result.report["passes"]["validate"]["budget_met"]


def test_without_torch_the_error_is_one_clear_sentence(tmp_path, monkeypatch):
    from sdk.export import export_pytorch

    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with pytest.raises(BuildError, match="PyTorch is not installed"):
        export_pytorch(object(), [1, 3], tmp_path / "m.onnx")
