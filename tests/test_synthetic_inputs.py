"""Made-up inputs that fit the spec (issue 23, item 8): with ``validate: {data: synthetic}`` the
build's samples follow the preprocessing spec (an audio frame plus its context, the size an image
resize produces, the dims the recipe gives) and the state declarations (zeros of the declared
shape, then the output carried back as the agent does), and every pass's self-check runs on the
recipe's real data when it gives some."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from sdk.errors import RecipeError
from sdk.packager.data import synthetic_options
from sdk.packager.passes.base import BuildContext
from sdk.packager.pipeline import build, run_passes
from sdk.packager.self_check import MADE_UP, REAL, check_feeds
from sdk.packager.sources import InputOptions
from sdk.packager.synthetic import synthetic_samples
from sdk.recipe import load_recipe
from tests import real_world_graphs as graphs

VAD_AUDIO = {
    "kind": "audio",
    "sample_rate": 16000,
    "frame": graphs.VAD_FRAME,
    "hop": graphs.VAD_FRAME,
    "context": graphs.VAD_CONTEXT,
}
VAD_INPUTS = {"input": {"role": "audio"}, "state": {"role": "state", "output": "stateN"}}


def _vad_recipe(folder: Path, **sections) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(graphs.streaming_vad(), folder / "model.onnx")
    recipe = {
        "name": "vad",
        "version": "1.0.0",
        "model": {"path": "model.onnx"},
        "inputs": VAD_INPUTS,
        "preprocess": VAD_AUDIO,
        "postprocess": {"kind": "raw"},
        "validate": {"data": "synthetic"},
        **sections,
    }
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder / "recipe.yaml"


def test_a_stateful_vad_validated_on_synthetic_data_builds(tmp_path, keypair):
    """main: ``Pad reflect requires axis length >= 2 ... Input shape:{1,1}`` (one made-up sample)."""
    recipe = _vad_recipe(tmp_path / "vad")
    result = build(load_recipe(recipe), key_paths=[str(keypair[0])], output=tmp_path / "vad.edgepkg")
    validate = result.report["passes"]["validate"]
    assert validate["budget_met"] is True and validate["fidelity"]["ok"] is True
    assert validate["state"] == {"fed": "carried", "sequences": 1}  # fed back frame to frame
    optimize = result.report["passes"]["ort_optimize"]
    assert optimize["applied"] is True and optimize["checked_on"] == MADE_UP


def _vad_context(folder: Path) -> BuildContext:
    recipe = _vad_recipe(folder)
    ctx = BuildContext(recipe=load_recipe(recipe), workdir=folder)
    run_passes(ctx, ["load", "check", "shape_inference", "io_spec"])
    return ctx


def test_synthetic_audio_is_a_frame_plus_its_context_and_the_state_starts_at_zeros_then_is_carried(tmp_path):
    ctx = _vad_context(tmp_path / "vad")
    samples = synthetic_samples(5, ctx.preprocess, ctx.inputs, **synthetic_options(ctx))
    assert len(samples) == 5
    assert {feed["input"].shape for feed in samples.feeds} == {(1, graphs.VAD_CONTEXT + graphs.VAD_FRAME)}
    assert samples.feeds[0]["input"][0, : graphs.VAD_CONTEXT].tolist() == [0.0] * graphs.VAD_CONTEXT  # no past yet
    # consecutive frames of one stream: frame 1's context is the end of frame 0
    np.testing.assert_array_equal(
        samples.feeds[1]["input"][0, : graphs.VAD_CONTEXT], samples.feeds[0]["input"][0, -graphs.VAD_CONTEXT :]
    )
    state = samples.feeds[0]["state"]
    assert state.shape == (2, 1, graphs.VAD_HIDDEN) and state.dtype == np.float32 and not state.any()
    assert samples.sequential and samples.sequences == [(0, 5)] and samples.carry == {"state": "stateN"}
    assert samples.starts() == [True, False, False, False, False]
    again = synthetic_samples(5, ctx.preprocess, ctx.inputs, **synthetic_options(ctx))
    np.testing.assert_array_equal(again.feeds[3]["input"], samples.feeds[3]["input"])  # deterministic


def test_a_state_declared_from_an_output_of_another_shape_is_refused_for_synthetic_data_too(tmp_path):
    ctx = _vad_context(tmp_path / "vad")
    options = synthetic_options(ctx)
    options["declared"] = {**options["declared"], "state": InputOptions(role="state", output="output")}
    with pytest.raises(RecipeError, match=r"inputs\.state\.output"):
        synthetic_samples(2, ctx.preprocess, ctx.inputs, **options)


def _image_model(folder: Path, side: int) -> Path:
    """images [1, 3, H, W] (dims named) -> Reshape to [1, 3 * side * side] -> MatMul: runs only
    on the size the recipe's resize produces."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Reshape", ["images", "flat_shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "W"], ["logits"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([1, 3 * side * side], np.int64), "flat_shape"),
        numpy_helper.from_array(rng.normal(size=(3 * side * side, 4)).astype(np.float32), "W"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, "height", "width"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    recipe = {
        "name": "img",
        "version": "1.0.0",
        "model": {"path": "model.onnx"},
        "preprocess": {"kind": "image", "resize": {"size": [side, side]}, "scale": 0.00392156862745098},
        "postprocess": {"kind": "topk", "k": 1},
        "validate": {"data": "synthetic"},
    }
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder / "recipe.yaml"


def test_the_self_checks_made_up_images_have_the_size_the_resize_produces(tmp_path, keypair):
    """main: ``ort_optimize: kept the unoptimized graph`` (its self-check fed 1x1 images)."""
    recipe = _image_model(tmp_path / "img", side=12)
    result = build(load_recipe(recipe), key_paths=[str(keypair[0])], output=tmp_path / "img.edgepkg")
    optimize = result.report["passes"]["ort_optimize"]
    assert optimize["applied"] is True and optimize["checked_on"] == MADE_UP
    assert not [w for w in result.warnings if "ort_optimize" in w]


def test_made_up_inputs_take_the_dims_the_recipe_gives(tmp_path):
    folder = tmp_path / "dims"
    _image_model(folder, side=4)
    doc = yaml.safe_load((folder / "recipe.yaml").read_text())
    doc["preprocess"] = {"kind": "tensor"}
    doc["inputs"] = {"images": {"shape": [1, 3, 4, 4]}}
    (folder / "recipe.yaml").write_text(yaml.safe_dump(doc))
    ctx = BuildContext(recipe=load_recipe(folder / "recipe.yaml"), workdir=folder)
    run_passes(ctx, ["load", "check", "shape_inference", "io_spec"])
    feeds, checked_on = check_feeds(ctx, 2)
    assert checked_on == MADE_UP and [f["images"].shape for f in feeds] == [(1, 3, 4, 4)] * 2


def test_the_self_check_uses_the_recipes_real_data_when_it_gives_some(tmp_path):
    ctx = _vad_context(tmp_path / "vad")
    assert check_feeds(ctx, 2)[1] == MADE_UP
    clips = tmp_path / "vad" / "clips"
    from tools.demos.vad import write_wav

    write_wav(clips / "a.wav", np.linspace(-0.5, 0.5, 3 * graphs.VAD_FRAME), 16000)
    doc = yaml.safe_load((tmp_path / "vad" / "recipe.yaml").read_text())
    doc["validate"] = {"data": {"audio": "clips"}}
    (tmp_path / "vad" / "recipe.yaml").write_text(yaml.safe_dump(doc))
    ctx = BuildContext(recipe=load_recipe(tmp_path / "vad" / "recipe.yaml"), workdir=tmp_path / "vad")
    run_passes(ctx, ["load", "check", "shape_inference", "io_spec"])
    feeds, checked_on = check_feeds(ctx, 2)
    assert checked_on == REAL and len(feeds) == 2
    wave_form = np.linspace(-0.5, 0.5, 3 * graphs.VAD_FRAME)
    second = wave_form[graphs.VAD_FRAME : 2 * graphs.VAD_FRAME]  # the clip's second frame, as PCM16 holds it
    np.testing.assert_allclose(feeds[1]["input"][0, graphs.VAD_CONTEXT :], second, atol=1e-4)


def _fixed_batch_with_a_named_window(folder: Path) -> Path:
    """x [10, 4] (an export's fixed batch) and window [1, "steps"] whose Reshape to [1, 8, 4]
    only runs with 32 steps; the recipe opens x's batch to 1 and validates on npz data."""
    nodes = [
        helper.make_node("ReduceSum", ["x", "axis0"], ["summed"], keepdims=1),
        helper.make_node("Reshape", ["window", "blocks"], ["framed"]),
        helper.make_node("Mul", ["framed", "summed"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(np.array([1, 8, 4], np.int64), "blocks"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [10, 4]),
            helper.make_tensor_value_info("window", TensorProto.FLOAT, [1, "steps"]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    rng = np.random.default_rng(0)
    np.savez(
        folder / "val.npz",
        x=rng.normal(size=(3, 1, 4)).astype(np.float32),
        window=rng.normal(size=(3, 1, 32)).astype(np.float32),
    )
    recipe = {
        "name": "opened",
        "version": "1.0.0",
        "model": {"path": "model.onnx"},
        "inputs": {"x": {"shape": [1, 4]}},
        "postprocess": {"kind": "raw"},
        "validate": {"data": {"npz": "val.npz"}},
    }
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return folder / "recipe.yaml"


def test_opening_a_fixed_dim_is_checked_on_the_recipes_real_data_not_on_named_dims_of_1(tmp_path, keypair):
    """main: ``inputs.x.shape: dimension 0 of x (10 in the model) cannot become 1: onnxruntime
    cannot run the graph so`` (its check fed ``window`` one made-up step)."""
    recipe = _fixed_batch_with_a_named_window(tmp_path / "opened")
    result = build(load_recipe(recipe), key_paths=[str(keypair[0])], output=tmp_path / "opened.edgepkg")
    assert result.report["passes"]["shape_inference"]["opened"] == ["x[0]: 10 -> 1"]
    assert result.report["passes"]["shape_inference"]["checked_on"] == REAL
