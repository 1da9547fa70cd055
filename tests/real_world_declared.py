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


SIDE = 32  # the detector's input is SIDE x SIDE


def _constant_head(path: Path, head: np.ndarray) -> Path:
    """images float32 [1, 3, SIDE, SIDE] -> ``head`` (a constant, plus 0 x the image mean so the
    graph reads its input): the output of a detector whose values are chosen."""
    x = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, SIDE, SIDE])
    y = helper.make_tensor_value_info("output0", TensorProto.FLOAT, list(head.shape))
    nodes = [
        helper.make_node("ReduceMean", ["images"], ["mean"], axes=[1, 2, 3], keepdims=0),
        helper.make_node("Mul", ["mean", "zero"], ["nothing"]),
        helper.make_node("Add", ["head", "nothing"], ["output0"]),
    ]
    inits = [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
             onnx.numpy_helper.from_array(head.astype(np.float32), "head")]
    return _save(helper.make_graph(nodes, "detector", [x], [y], inits), path)


def decoded_yolov5_head(anchors: int = 12, classes: int = 2) -> np.ndarray:
    """[1, anchors, 5 + classes]: boxes in input pixels, objectness and class probabilities."""
    rng = np.random.default_rng(5)
    head = np.empty((1, anchors, 5 + classes), np.float32)
    head[0, :, 0:2] = rng.uniform(0, SIDE, (anchors, 2))
    head[0, :, 2:4] = rng.uniform(1, SIDE / 2, (anchors, 2))
    head[0, :, 4:] = rng.uniform(0, 1, (anchors, 1 + classes))
    return head


def raw_yolox_grid(anchors: int = 12, classes: int = 2) -> np.ndarray:
    """[1, anchors, 5 + classes] as a YOLOX export without its decode step leaves it: grid
    offsets, log-space sizes, then objectness and class scores through their Sigmoid (YOLOX's
    head applies it in export): scores in [0, 1], boxes not in pixels."""
    rng = np.random.default_rng(6)
    head = np.empty((1, anchors, 5 + classes), np.float32)
    head[0, :, 0:2] = rng.uniform(-0.5, 1.5, (anchors, 2))
    head[0, :, 2:4] = rng.uniform(-2.0, 1.0, (anchors, 2))
    head[0, :, 4:] = 1 / (1 + np.exp(-rng.uniform(-6.0, 3.0, (anchors, 1 + classes))))
    return head


def build_detector(folder: Path, key: Path, head: np.ndarray, fmt: str) -> Path:
    """A detector returning ``head``, declared as ``fmt``, validated on synthetic images."""
    folder.mkdir(parents=True, exist_ok=True)
    _constant_head(folder / "det.onnx", head)
    return build_recipe(
        folder, key, "det",
        "model: {path: det.onnx}\n"
        f"preprocess: {{kind: image, resize: {{size: [{SIDE}, {SIDE}]}}, scale: 0.00392156862745098}}\n"
        f"postprocess: {{kind: detection, format: {fmt}}}\nvalidate: {{data: synthetic}}\n",
    )


STEPS, CLASSES = 40, 4
# class 3 wins frames 0..29, class 1 frames 30..39 (whatever the input): class 3 acts as the blank
CTC_BIAS = np.zeros((1, STEPS, CLASSES), np.float32)
CTC_BIAS[0, :30, 3] = 20.0
CTC_BIAS[0, 30:, 1] = 20.0


def ctc_recognizer(path: Path) -> Path:
    """x float32 [1, STEPS, CLASSES] -> Softmax(x + CTC_BIAS) -> y: a recogniser whose blank is 3."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, STEPS, CLASSES])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, STEPS, CLASSES])
    nodes = [helper.make_node("Add", ["x", "bias"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["y"], axis=-1)]
    bias = onnx.numpy_helper.from_array(CTC_BIAS, "bias")
    return _save(helper.make_graph(nodes, "ctc", [x], [y], [bias]), path)


def build_ctc(folder: Path, key: Path, blank: int) -> Path:
    """The recogniser declared with ``blank``, validated on synthetic inputs."""
    folder.mkdir(parents=True, exist_ok=True)
    ctc_recognizer(folder / "ctc.onnx")
    return build_recipe(
        folder, key, "ctc",
        "model: {path: ctc.onnx}\n"
        f"postprocess: {{kind: ctc, blank: {blank}}}\nvalidate: {{data: synthetic}}\n",
    )
