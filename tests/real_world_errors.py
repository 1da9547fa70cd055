"""Models as users bring them, built from code, for the client-error tests
(tests/test_real_world_errors.py): a dynamic-width image model whose graph needs a width of 32k
(Conv + a Reshape that folds the width into blocks of 32), and an audio model; each packaged
with the recipe a user writes first."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

from tests.real_world_declared import build_recipe

HEIGHT = 32
BLOCK = 32  # the width must be a multiple of this


def dynamic_width_model(path: Path) -> Path:
    """x float32 [1, 1, 32, 'width'] -> Conv 3x3 (4 channels) -> Reshape [0, 0, 0, -1, 32]
    (fails at run time unless width % 32 == 0) -> ReduceMean -> y [1, 4, 32]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, HEIGHT, "width"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, HEIGHT])
    weights = numpy_helper.from_array(np.linspace(-1, 1, 36, dtype=np.float32).reshape(4, 1, 3, 3), "w")
    blocks = numpy_helper.from_array(np.array([0, 0, 0, -1, BLOCK], np.int64), "blocks")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Reshape", ["c", "blocks"], ["r"], name="fold_width"),
        helper.make_node("ReduceMean", ["r"], ["y"], axes=[3, 4], keepdims=0, name="mean"),
    ]
    graph = helper.make_graph(nodes, "dynamic_width", [x], [y], [weights, blocks])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def audio_model(path: Path, frame: int = 512) -> Path:
    """x float32 [1, frame] -> ReduceMean -> y [1, 1]: the shape of a frame classifier's input."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, frame])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])
    graph = helper.make_graph(
        [helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=1)], "audio_mean", [x], [y]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def png(path: Path, width: int, height: int = HEIGHT, seed: int = 0) -> Path:
    """A gray PNG of ``width`` x ``height`` with reproducible pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width), dtype=np.uint8)
    Image.fromarray(pixels, "L").save(path)
    return path


def build_dynamic_width(folder: Path, key: Path) -> Path:
    """The dynamic-width model packaged with gray images kept at their size, validated on
    images 32 and 64 wide."""
    folder.mkdir(parents=True, exist_ok=True)
    dynamic_width_model(folder / "wide.onnx")
    (folder / "val").mkdir(exist_ok=True)
    for seed, width in enumerate((32, 64)):
        png(folder / "val" / f"{width}.png", width, seed=seed)
    return build_recipe(
        folder,
        key,
        "wide",
        "model: {path: wide.onnx}\n"
        "preprocess: {kind: image, color: gray, scale: 0.00392156862745098}\n"
        "postprocess: {kind: raw}\nvalidate: {data: {images: val}}\n",
    )


def build_audio(folder: Path, key: Path) -> Path:
    """The audio model packaged with 16 kHz frames of 512 samples (synthetic validation)."""
    folder.mkdir(parents=True, exist_ok=True)
    audio_model(folder / "frames.onnx")
    return build_recipe(
        folder,
        key,
        "frames",
        "model: {path: frames.onnx}\n"
        "preprocess: {kind: audio, sample_rate: 16000, frame: 512}\n"
        "postprocess: {kind: raw}\nvalidate: {data: synthetic}\n",
    )
