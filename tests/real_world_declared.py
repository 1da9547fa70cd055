"""Models whose recipe declares something the model contradicts, built from code, for
tests/test_real_world_declared.py (issue 23, item 7): a ``preprocess.shape`` unlike the input's,
and float32 image preprocessing in front of a float16 input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from PIL import Image

from sdk.packager.pipeline import build
from sdk.recipe import load_recipe


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def wide_vector_model(path: Path, width: int = 2048) -> Path:
    """x float32 [N, width] -> ReduceMean -> y [N, 1]: an embedding head on a fixed width."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])
    node = helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=1)
    return _save(helper.make_graph([node], "wide_vector", [x], [y]), path)


def half_image_model(path: Path, size: int = 8) -> Path:
    """x float16 [1, 3, size, size] -> ReduceMean -> y float16 [1, 3]: a float16 export."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 3, size, size])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 3])
    node = helper.make_node("ReduceMean", ["x"], ["y"], axes=[2, 3], keepdims=0)
    return _save(helper.make_graph([node], "half_image", [x], [y]), path)


def png(path: Path, size: int = 8, seed: int = 0) -> Path:
    """An RGB PNG of ``size`` x ``size`` with reproducible pixels."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    Image.fromarray(pixels, "RGB").save(path)
    return path


def build_recipe(folder: Path, key: Path, name: str, body: str) -> Path:
    """Package ``body`` (the recipe after its header) as ``name``; returns the artifact."""
    recipe = folder / f"{name}.yaml"
    recipe.write_text(f"name: {name}\nversion: 1.0.0\ntargets: [x86]\n{body}")
    out = folder / f"{name}.edgepkg"
    build(load_recipe(recipe), key_paths=[str(key)], output=out)
    return out


def build_wide_vector(folder: Path, key: Path, shape: str, batch: bool = False) -> Path:
    """The [N, 2048] model with ``preprocess: {kind: tensor, shape: <shape>}``."""
    folder.mkdir(parents=True, exist_ok=True)
    wide_vector_model(folder / "wide.onnx")
    return build_recipe(
        folder,
        key,
        "wide",
        "model: {path: wide.onnx}\n"
        f"preprocess: {{kind: tensor, shape: {shape}, batch: {str(batch).lower()}}}\n"
        "postprocess: {kind: raw}\nvalidate: {data: synthetic}\n",
    )


def build_half_image(folder: Path, key: Path, dtype: str) -> Path:
    """The float16 model with image preprocessing producing ``dtype``, validated on two PNGs."""
    folder.mkdir(parents=True, exist_ok=True)
    half_image_model(folder / "half.onnx")
    (folder / "val").mkdir(exist_ok=True)
    for seed in range(2):
        png(folder / "val" / f"{seed}.png", seed=seed)
    return build_recipe(
        folder,
        key,
        "half",
        "model: {path: half.onnx}\n"
        f"preprocess: {{kind: image, resize: {{size: [8, 8]}}, scale: 0.00392156862745098, dtype: {dtype}}}\n"
        "postprocess: {kind: raw}\nvalidate: {data: {images: val}}\n",
    )
