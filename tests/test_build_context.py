"""A typed build context (issue 22, item 2): the facts passes hand each other are typed fields of
``BuildContext`` or typed results of the pass that made them, and the manifest is written from
them in one place (``pipeline.assemble_manifest``); the untyped ``manifest_extra`` is gone."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from sdk.packager.passes.base import BuildContext
from sdk.packager.passes.golden import GoldenSample, GoldenSet
from sdk.packager.passes.runtime_compat import RuntimeRequirement
from sdk.packager.pipeline import PIPELINE, assemble_manifest, run_passes
from sdk.recipe import recipe_from_dict

REPO = Path(__file__).resolve().parent.parent


def _model(path: Path, opset: int = 17) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    w = numpy_helper.from_array(np.full((4, 4), 0.5, np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _context(folder: Path, **sections) -> BuildContext:
    _model(folder / "m.onnx")
    document = {
        "name": "c",
        "version": "1.0.0",
        "model": {"path": "m.onnx"},
        "validate": {"data": "synthetic"},
        **sections,
    }
    return BuildContext(recipe=recipe_from_dict(document, folder), workdir=folder)


def test_the_passes_leave_typed_facts_and_the_manifest_is_written_from_them(tmp_path):
    ctx = _context(tmp_path, optimize={"fp16": True}, golden={"count": 2, "atol": 0.25})
    run_passes(ctx, [name for name in PIPELINE if name != "ort_format"])
    assert ctx.lossy == "fp16" and ctx.precision() == "fp16"
    assert isinstance(ctx.runtime, RuntimeRequirement) and ctx.runtime.opset == 17
    assert ctx.golden == GoldenSet(
        (
            GoldenSample("golden/000.inputs.npz", "golden/000.outputs.npz"),
            GoldenSample("golden/001.inputs.npz", "golden/001.outputs.npz"),
        ),
        0.01,
        0.25,
    )
    assert ctx.lowering is None and ctx.ort_member is None
    manifest = assemble_manifest(ctx)
    assert manifest["model"]["precision"] == "fp16"
    assert manifest["model"]["opset"] == 17 and manifest["model"]["opsets"] == {"ai.onnx": 17}
    assert manifest["model"]["min_onnxruntime"] == ctx.runtime.min_onnxruntime
    assert "ort_path" not in manifest["model"]
    assert manifest["golden"] == {
        "samples": [
            {"inputs": "golden/000.inputs.npz", "outputs": "golden/000.outputs.npz"},
            {"inputs": "golden/001.inputs.npz", "outputs": "golden/001.outputs.npz"},
        ],
        "rtol": 0.01,
        "atol": 0.25,
    }


def test_a_model_that_imports_no_ai_onnx_opset_states_none():
    requirement = RuntimeRequirement({"ai.onnx.ml": 3}, "1.16.0", "ai.onnx.ml opset 3")
    assert requirement.opset is None
    assert RuntimeRequirement({"ai.onnx": 13, "ai.onnx.ml": 3}, "1.16.0", "").opset == 13


def test_the_manifest_is_refused_before_the_runtime_pass_ran(tmp_path):
    ctx = _context(tmp_path)
    run_passes(ctx, ["load", "check", "io_spec"])
    assert ctx.lossy is None and ctx.precision() == "fp32"  # no lossy pass ran
    with pytest.raises(RuntimeError, match="runtime_compat"):
        assemble_manifest(ctx)


def test_no_module_hands_a_fact_through_an_untyped_manifest_extra():
    found = []
    for path in sorted((REPO / "sdk").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "manifest_extra":
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert found == []
    assert "manifest_extra" not in BuildContext.__dataclass_fields__
