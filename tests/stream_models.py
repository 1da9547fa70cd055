"""Models and clips for the stream tests, made from code.

- :func:`blob_detector`: a real ONNX detector in the YOLOv8 export's output format
  (``[1, 4 + classes, anchors]``, cx, cy, w, h in input pixels, then class scores) whose graph
  finds a red, a green and a blue object: per colour, a pixel mask, its extent by ArgMax over
  rows and columns (first and last index), and its presence as the score; anchor *c* holds
  colour *c*. onnxruntime runs it like any export, through the artifact's own letterbox
  preprocessing and the agent's YOLOv8 decoding, so the boxes a pipeline gets are what the
  packaged model really computes.
- :func:`moving_squares_clip`: an H.264 clip (PyAV/libx264) of coloured squares on straight
  paths, with the paths returned, so every line crossing and zone visit is known exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

LABELS = ("person", "car", "bicycle")  # red, green, blue
COLOURS = ((230, 30, 30), (30, 230, 30), (30, 30, 230))


def blob_detector(path: Path, size: int = 96) -> Path:
    nodes: list = []
    inits = [helper.make_tensor("half", TensorProto.FLOAT, [], [0.5]),
             helper.make_tensor("one_i", TensorProto.INT64, [], [1]),
             helper.make_tensor("two_f", TensorProto.FLOAT, [], [2.0]),
             helper.make_tensor("eye", TensorProto.FLOAT, [3, 3], np.eye(3, dtype=np.float32).ravel().tolist())]
    for c in range(3):
        nodes.append(helper.make_node("Gather", ["images", f"idx{c}"], [f"ch{c}"], axis=1))  # [1, S, S]
        inits.append(helper.make_tensor(f"idx{c}", TensorProto.INT64, [], [c]))
        nodes.append(helper.make_node("Greater", [f"ch{c}", "half"], [f"hi{c}"]))
        nodes.append(helper.make_node("Less", [f"ch{c}", "half"], [f"lo{c}"]))
    boxes, scores = [], []
    for c in range(3):
        a, b = [o for o in range(3) if o != c]
        nodes += [helper.make_node("And", [f"lo{a}", f"lo{b}"], [f"others{c}"]),
                  helper.make_node("And", [f"hi{c}", f"others{c}"], [f"m{c}"]),
                  helper.make_node("Cast", [f"m{c}"], [f"mf{c}"], to=TensorProto.FLOAT),
                  helper.make_node("ReduceMax", [f"mf{c}"], [f"col{c}"], axes=[1], keepdims=0),  # [1, S] over rows
                  helper.make_node("ReduceMax", [f"mf{c}"], [f"row{c}"], axes=[2], keepdims=0),
                  helper.make_node("ReduceMax", [f"col{c}"], [f"s{c}"], axes=[1], keepdims=0)]  # [1]
        for axis_name in ("col", "row"):
            nodes += [helper.make_node("ArgMax", [f"{axis_name}{c}"], [f"{axis_name}first{c}"], axis=1, keepdims=0),
                      helper.make_node("ArgMax", [f"{axis_name}{c}"], [f"{axis_name}lastraw{c}"], axis=1, keepdims=0,
                                       select_last_index=1),
                      helper.make_node("Add", [f"{axis_name}lastraw{c}", "one_i"], [f"{axis_name}last{c}"]),
                      helper.make_node("Cast", [f"{axis_name}first{c}"], [f"{axis_name}f{c}"], to=TensorProto.FLOAT),
                      helper.make_node("Cast", [f"{axis_name}last{c}"], [f"{axis_name}l{c}"], to=TensorProto.FLOAT),
                      helper.make_node("Add", [f"{axis_name}f{c}", f"{axis_name}l{c}"], [f"{axis_name}sum{c}"]),
                      helper.make_node("Div", [f"{axis_name}sum{c}", "two_f"], [f"{axis_name}mid{c}"]),
                      helper.make_node("Sub", [f"{axis_name}l{c}", f"{axis_name}f{c}"], [f"{axis_name}len{c}"])]
        nodes.append(helper.make_node("Concat", [f"colmid{c}", f"rowmid{c}", f"collen{c}", f"rowlen{c}"],
                                      [f"box{c}"], axis=0))  # [4]
        nodes.append(helper.make_node("Unsqueeze", [f"box{c}", "zero_axis"], [f"box2d{c}"]))  # [1, 4]
        boxes.append(f"box2d{c}")
        scores.append(f"s{c}")
    inits.append(helper.make_tensor("zero_axis", TensorProto.INT64, [1], [0]))
    inits.append(helper.make_tensor("one_axis", TensorProto.INT64, [1], [1]))
    nodes += [helper.make_node("Concat", boxes, ["boxes"], axis=0),  # [3, 4]
              helper.make_node("Concat", scores, ["scores"], axis=0),  # [3]
              helper.make_node("Unsqueeze", ["scores", "one_axis"], ["scores_col"]),  # [3, 1]
              helper.make_node("Mul", ["eye", "scores_col"], ["class_scores"]),  # [3 anchors, 3 classes]
              helper.make_node("Concat", ["boxes", "class_scores"], ["rows"], axis=1),  # [3, 7]
              helper.make_node("Transpose", ["rows"], ["columns"], perm=[1, 0]),  # [7, 3]
              helper.make_node("Unsqueeze", ["columns", "zero_axis"], ["output0"])]  # [1, 7, 3]
    graph = helper.make_graph(
        nodes, "blob_detector",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 7, 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def detector_recipe(folder: Path, size: int = 96, *, name: str = "detector", version: str = "1.0.0") -> Path:
    """A recipe packaging :func:`blob_detector` as an Ultralytics-style YOLOv8 detector; its
    validation and golden samples are frames of the clip (written by the caller to ``val/``)."""
    blob_detector(folder / "model.onnx", size)
    (folder / "labels.txt").write_text("\n".join(LABELS) + "\n")
    recipe = folder / f"{name}-{version}.yaml"
    recipe.write_text(
        f"name: {name}\nversion: {version}\nmodel: {{path: model.onnx}}\n"
        "preprocess: {kind: image, color: rgb, resize: {size: [" + f"{size}, {size}" + "], mode: letterbox, "
        "pad: center, pad_value: 0}, scale: 0.00392156862745098, layout: NCHW, dtype: float32}\n"
        "postprocess: {kind: detection, format: yolov8, score_threshold: 0.5, iou_threshold: 0.45, "
        "labels: labels.txt}\n"
        "validate: {data: {images: val/}}\ngolden: {count: 2}\ntargets: [x86, rpi]\n")
    return recipe


@dataclass(frozen=True)
class Path2D:
    """A square of ``side`` pixels of colour ``label`` whose top-left corner moves from ``start``
    by ``step`` pixels per frame."""

    label: str
    start: tuple[float, float]
    step: tuple[float, float]
    side: int = 24

    def corner(self, frame: int) -> tuple[float, float]:
        return self.start[0] + self.step[0] * frame, self.start[1] + self.step[1] * frame

    def drawn(self, frame: int) -> tuple[int, int]:
        """The corner's pixel as :func:`draw` paints it."""
        x, y = self.corner(frame)
        return round(x), round(y)

    def center(self, frame: int) -> tuple[float, float]:
        x, y = self.drawn(frame)
        return x + self.side / 2, y + self.side / 2


def draw(paths: Sequence[Path2D], frame: int, width: int, height: int) -> np.ndarray:
    image = np.zeros((height, width, 3), np.uint8)
    for path in paths:
        x, y = path.drawn(frame)
        colour = COLOURS[LABELS.index(path.label)]
        image[max(0, y):max(0, y + path.side), max(0, x):max(0, x + path.side)] = colour
    return image


def moving_squares_clip(out: Path, paths: Sequence[Path2D], frames: int, *, width: int = 320, height: int = 240,
                        fps: int = 10) -> Path:
    """Encode the scene as H.264 (yuv420p, a keyframe every second)."""
    import av

    with av.open(str(out), "w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        # as cameras encode: a keyframe a second, no B-frames (zerolatency)
        stream.options = {"crf": "18", "preset": "veryfast", "g": str(fps), "tune": "zerolatency"}
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(draw(paths, index, width, height), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out


COLOUR_NAMES = ("red", "green", "blue")


def colour_classifier(path: Path, size: int = 16) -> Path:
    """A classifier of a crop's dominant colour: the mean of each channel, x10, through a
    softmax (``probs [1, 3]``: red, green, blue), for the crop stage of a chain."""
    nodes = [helper.make_node("ReduceMean", ["input"], ["means"], axes=[2, 3], keepdims=0),  # [1, 3]
             helper.make_node("Mul", ["means", "ten"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=1)]
    graph = helper.make_graph(nodes, "colour", [helper.make_tensor_value_info("input", TensorProto.FLOAT,
                                                                              ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor("ten", TensorProto.FLOAT, [], [10.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def classifier_recipe(folder: Path, size: int = 16, *, version: str = "1.0.0") -> Path:
    colour_classifier(folder / "colour.onnx", size)
    (folder / "colours.txt").write_text("\n".join(COLOUR_NAMES) + "\n")
    recipe = folder / f"colour-{version}.yaml"
    recipe.write_text(
        f"name: colour\nversion: {version}\nmodel: {{path: colour.onnx}}\n"
        "preprocess: {kind: image, color: rgb, resize: {size: [" + f"{size}, {size}" + "], mode: stretch}, "
        "scale: 0.00392156862745098, layout: NCHW, dtype: float32}\n"
        "postprocess: {kind: topk, k: 1, labels: colours.txt}\n"
        "validate: {data: {images: val/}}\ngolden: {count: 2}\ntargets: [x86, rpi]\n")
    return recipe
