"""Real-world graph shapes (tests/real_world_graphs.py) through ``edgepack build`` with the recipe
a user writes first, answers compared with bare onnxruntime on the original (issue 23, items 2,
3 and 8)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from sdk.errors import RecipeError
from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.pipeline import build, run_passes
from sdk.recipe import load_recipe
from tests import real_world_graphs as graphs


def _write_recipe(folder: Path, model: onnx.ModelProto, feeds: dict[str, np.ndarray], **sections) -> Path:
    """The model, its npz validation data and a first recipe naming them (plus ``sections``)."""
    graphs.save_with_npz(model, folder, feeds)
    recipe = {
        "name": folder.name,
        "version": "1.0.0",
        "model": {"path": "model.onnx"},
        "preprocess": {"kind": "tensor"},
        "validate": {"data": {"npz": "val.npz"}},
        "targets": ["rpi"],
        **sections,
    }
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder / "recipe.yaml"


def _build(folder: Path, key: Path, model: onnx.ModelProto, feeds: dict[str, np.ndarray], **sections):
    """Build ``model`` with a first recipe: the model, its npz validation data, and ``sections``."""
    recipe = _write_recipe(folder, model, feeds, **sections)
    return build(load_recipe(recipe), key_paths=[str(key)], output=folder / "out.edgepkg")


def _packaged(result) -> onnx.ModelProto:
    with tarfile.open(result.output) as tar:
        return onnx.load_from_string(tar.extractfile("model/model.onnx").read())


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)


def test_an_if_whose_branch_reads_outer_scope_initializers_builds_with_the_default_options(tmp_path, keypair):
    model = graphs.if_reading_outer_initializers()
    rng = np.random.default_rng(3)
    samples = rng.normal(size=(6, 1, 8)).astype(np.float32)
    result = _build(tmp_path / "if", keypair[0], model, {"x": samples})
    packaged = _packaged(result)
    onnx.checker.check_model(packaged, full_check=True)
    for sample in samples:
        want, got = _run(model, {"x": sample}), _run(packaged, {"x": sample})
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert result.report["passes"]["validate"]["budget_met"] is True
    assert result.report["passes"]["eliminate_identity"]["removed"] >= 1  # the subgraphs' Identities too


@pytest.mark.parametrize("optimize", [{}, {"level": "none"}])
def test_an_ir4_export_with_initializer_inputs_and_batchnorm_passes_its_default_fp32_validation(
    tmp_path, keypair, optimize
):
    model = graphs.ir4_initializers_as_inputs()
    samples = np.random.default_rng(1).normal(size=(2, 10, 3, 32, 32)).astype(np.float32)
    result = _build(
        tmp_path / "ir4", keypair[0], model, {"input": samples}, **({"optimize": optimize} if optimize else {})
    )
    validate = result.report["passes"]["validate"]
    assert validate["budget_met"] is True and validate["fidelity"]["ok"] is True
    # like with like: the reference is the original with its initializers constant, as packaged
    assert validate["reference"]["initializer_inputs_constant"] == 20
    assert "BatchNorm" in validate["reference"]["why"]
    packaged = _packaged(result)
    assert not {i.name for i in packaged.graph.input} & {t.name for t in packaged.graph.initializer}
    want, got = _run(model, {"input": samples[0]})[0], _run(packaged, {"input": samples[0]})[0]
    assert (want.argmax(axis=1) == got.argmax(axis=1)).all()  # the task's answer equals bare onnxruntime's


def test_an_ir4_export_with_a_fixed_batch_of_10_opens_to_batch_1_from_the_recipe(tmp_path, keypair):
    model = graphs.ir4_initializers_as_inputs()
    samples = np.random.default_rng(2).normal(size=(4, 1, 3, 32, 32)).astype(np.float32)
    result = _build(
        tmp_path / "open", keypair[0], model, {"input": samples}, inputs={"input": {"shape": [1, 3, 32, 32]}}
    )
    assert result.manifest.raw["inputs"][0]["shape"] == [1, 3, 32, 32]
    assert result.report["passes"]["validate"]["budget_met"] is True
    packaged = _packaged(result)
    batch10 = np.concatenate([samples[0]] * 10)
    want = _run(model, {"input": batch10})[0][0]
    got = _run(packaged, {"input": samples[0]})[0][0]
    assert (want.argmax() == got.argmax()) and np.allclose(got, want, rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize(
    ("shape", "sample"), [(["batch", 3, 32, 32], (3, 3, 32, 32)), ([1, 3, 48, 64], (1, 3, 48, 64))]
)
def test_an_ir4_export_opens_its_batch_to_a_named_dim_and_its_spatial_dims(tmp_path, keypair, shape, sample):
    model = graphs.ir4_initializers_as_inputs()
    samples = np.random.default_rng(2).normal(size=(2, *sample)).astype(np.float32)
    result = _build(tmp_path / "dyn", keypair[0], model, {"input": samples}, inputs={"input": {"shape": shape}})
    assert result.manifest.raw["inputs"][0]["shape"] == shape
    assert result.report["passes"]["validate"]["budget_met"] is True


def _fixed_reshape_model() -> onnx.ModelProto:
    """x[10, 4] -> Reshape to the constant [10, 2, 2]: its batch of 10 is written into the graph."""
    shape = numpy_helper.from_array(np.array([10, 2, 2], dtype=np.int64), "shape")
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [10, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [10, 2, 2])],
        [shape],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_fixed_dim_the_graph_depends_on_is_refused_naming_the_dim_and_the_reason(tmp_path, keypair):
    samples = np.zeros((2, 1, 4), dtype=np.float32)
    with pytest.raises(RecipeError) as caught:
        _build(tmp_path / "fixed", keypair[0], _fixed_reshape_model(), {"x": samples}, inputs={"x": {"shape": [1, 4]}})
    message = str(caught.value)
    assert "inputs.x.shape" in message and "dimension 0 of x (10 in the model) cannot become 1" in message
    assert "Reshape" in message or "reshape" in message


def _reshape_by_four() -> onnx.ModelProto:
    """x[1, n] -> Reshape [-1, 4] -> MatMul: runs for n a multiple of 4 only (never for n = 1)."""
    weight = numpy_helper.from_array(np.arange(8, dtype=np.float32).reshape(4, 2) / 8, "w")
    shape = numpy_helper.from_array(np.array([-1, 4], dtype=np.int64), "shape")
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("MatMul", ["r", "w"], ["m"]),
        helper.make_node("Add", ["m", "m"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["k", 2])],
        [weight, shape],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_ort_optimize_checks_itself_on_the_real_validation_data_not_on_made_up_dims_of_1(tmp_path, keypair):
    samples = np.random.default_rng(4).normal(size=(3, 1, 8)).astype(np.float32)
    result = _build(tmp_path / "opt", keypair[0], _reshape_by_four(), {"x": samples})
    optimize = result.report["passes"]["ort_optimize"]
    assert optimize["applied"] is True, optimize
    assert optimize["checked_on"] == "validation data"
    assert not [w for w in result.warnings if "ort_optimize" in w]


def test_fp16_of_an_if_reading_outer_scope_weights_builds_and_keeps_the_answers(tmp_path, keypair):
    model = graphs.if_reading_outer_initializers()
    samples = np.random.default_rng(5).normal(size=(6, 1, 8)).astype(np.float32)
    result = _build(tmp_path / "fp16", keypair[0], model, {"x": samples}, optimize={"fp16": True})
    packaged = _packaged(result)
    onnx.checker.check_model(packaged, full_check=True)
    for sample in samples:
        want, got = _run(model, {"x": sample})[0], _run(packaged, {"x": sample})[0]
        assert want.argmax() == got.argmax()
    assert result.report["passes"]["validate"]["budget_met"] is True


def _drop_a_weight_a_branch_reads(graph: onnx.GraphProto) -> None:
    """A lossless rewrite gone wrong: drops the weight a subgraph reads (the old fold_batchnorm)."""
    graph.initializer.remove(next(i for i in graph.initializer if i.name == "W1"))


def _scale_the_branch_weights(graph: onnx.GraphProto) -> None:
    """A lossless rewrite that is not: scales the branches' weights by 1.01."""
    for init in graph.initializer:
        if init.name in ("W1", "W2"):
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) * 1.01, init.name))


def _guarded_pass(name: str, rewrite) -> None:
    """Register a lossless-guarded pass that applies ``rewrite`` to the main graph."""
    register(
        type(
            name,
            (Pass,),
            {"name": name, "guard": "lossless", "run": lambda self, ctx: rewrite(ctx.require_model().graph)},
        )
    )


_guarded_pass("test_drops_a_weight_a_branch_reads", _drop_a_weight_a_branch_reads)
_guarded_pass("test_scales_a_weight", _scale_the_branch_weights)


def _context(folder: Path, model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> BuildContext:
    ctx = BuildContext(recipe=load_recipe(_write_recipe(folder, model, feeds)), workdir=folder)
    run_passes(ctx, ["load", "check", "shape_inference", "io_spec"])
    return ctx


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("test_drops_a_weight_a_branch_reads", "onnx.checker refuses the result"),
        ("test_scales_a_weight", "differs by up to"),
    ],
)
def test_a_graph_pass_that_breaks_the_graph_or_moves_an_output_is_skipped_with_one_warning(tmp_path, name, why):
    model = graphs.if_reading_outer_initializers()
    samples = np.random.default_rng(6).normal(size=(3, 1, 8)).astype(np.float32)
    ctx = _context(tmp_path, model, {"x": samples})
    before = ctx.model_bytes()
    run_passes(ctx, [name])
    assert ctx.model_bytes() == before  # the graph before the pass goes on
    assert len(ctx.warnings) == 1 and ctx.warnings[0].startswith(f"{name}: skipped") and why in ctx.warnings[0]
    assert "validation data" in ctx.warnings[0] or why.startswith("onnx.checker")
    assert ctx.report[name]["applied"] is False


def test_a_lossless_pass_within_tolerance_is_kept(tmp_path):
    ctx = _context(tmp_path, graphs.if_reading_outer_initializers(), {"x": np.ones((2, 1, 8), np.float32)})
    run_passes(ctx, ["eliminate_identity", "fold_batchnorm"])
    assert ctx.warnings == [] and ctx.report["eliminate_identity"]["removed"] == 1
