"""YOLOv5, YOLOv8 and YOLOX detection heads built from code, shaped like the real exports, each
as the raw grid a head leaves before its decode and as the decoded output (issue 23, item 12).

Every head reads one 64x64 RGB image through three grid levels (strides 8, 16, 32): each level
average-pools the image to its grid and a 1x1 convolution makes every anchor's row, level
``l`` reading colour channel ``l`` only. :func:`scene` holds one square of each colour filling
exactly one cell of its level, so exactly one anchor per level fires, and the heads' biases put
that anchor's box at a chosen place and size: the model outputs :data:`KNOWN` boxes for the
scene (and nothing for a black image). The layouts:

- ``yolov5``: ``[1, 3 x cells, 5 + C]``, three anchors per cell (YOLOv5's P3-P5 anchor sizes),
  rows ``cx, cy, w, h, objectness, classes``; raw: the Detect layer's logits before its decode;
  decoded: ``xy = (2 sigmoid - 0.5 + cell) * stride``, ``wh = (2 sigmoid)^2 * anchor``;
- ``yolov8``: ``[1, 4 + C, cells]``, no objectness; decoded: boxes in pixels and sigmoid class
  scores; raw: the distribution-focal-loss bins (4 x 16) and class logits before the decode;
- ``yolox``: ``[1, cells, 5 + C]``; raw (YOLOX's own export, ``decode_in_inference`` off): grid
  offsets, log sizes, sigmoid objectness and class scores; decoded: ``xy = (offset + cell) *
  stride``, ``wh = exp(log size) * stride`` in the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

SIDE, CLASSES = 64, 3
STRIDES = (8, 16, 32)
DFL_BINS = 16
V5_ANCHORS = (((10, 13), (16, 30), (33, 23)), ((30, 61), (62, 45), (59, 119)), ((116, 90), (156, 198), (373, 326)))
FIRE, QUIET = 40.0, -20.0  # objectness (or v8 class) logit = FIRE * channel mean + QUIET
CLASS_LOGIT = 8.0


@dataclass(frozen=True)
class Target:
    """The one box level ``level`` reports for the scene: cell (col, row), size, class."""

    level: int
    cell: tuple[int, int]
    size: tuple[float, float]
    label: int

    @property
    def stride(self) -> int:
        return STRIDES[self.level]

    @property
    def box(self) -> tuple[float, float, float, float]:
        """x1, y1, x2, y2 in input pixels: the box centred on the cell."""
        cx, cy = (self.cell[0] + 0.5) * self.stride, (self.cell[1] + 0.5) * self.stride
        return cx - self.size[0] / 2, cy - self.size[1] / 2, cx + self.size[0] / 2, cy + self.size[1] / 2


TARGETS = (
    Target(0, (5, 2), (12.0, 10.0), 1),  # a red 8x8 square at x 40..48, y 16..24
    Target(1, (1, 2), (20.0, 24.0), 0),  # a green 16x16 square at x 16..32, y 32..48
    Target(2, (1, 1), (30.0, 28.0), 2),  # a blue 32x32 square at x 32..64, y 32..64
)
KNOWN = [(t.box, t.label) for t in TARGETS]


def scene(targets: tuple[Target, ...] = TARGETS) -> np.ndarray:
    """[64, 64, 3] uint8: black, with each target's cell filled in its level's colour."""
    pixels = np.zeros((SIDE, SIDE, 3), np.uint8)
    for t in targets:
        x0, y0 = t.cell[0] * t.stride, t.cell[1] * t.stride
        pixels[y0 : y0 + t.stride, x0 : x0 + t.stride, t.level] = 255
    return pixels


def save_png(pixels: np.ndarray, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels, "RGB").save(path)
    return path


def _cells(level: int) -> int:
    side = SIDE // STRIDES[level]
    return side * side


def _logit(p: float) -> float:
    return float(np.log(p / (1 - p)))


def _row_params(family: str, decoded: bool, level: int, anchor: int) -> tuple[np.ndarray, np.ndarray]:
    """(weight [K, 3], bias [K]) of one anchor's row at ``level``, before any activation."""
    t = TARGETS[level]
    width = {"yolov5": 5 + CLASSES, "yolox": 5 + CLASSES, "yolov8": 4 + CLASSES}[family]
    if family == "yolov8" and not decoded:
        width = 4 * DFL_BINS + CLASSES
    weight, bias = np.zeros((width, 3)), np.zeros(width)
    first_class = width - CLASSES
    bias[first_class:] = -CLASS_LOGIT
    if family == "yolov5":  # sigmoid(0) = 0.5 puts the centre mid-cell; (2 s)^2 * anchor is the size
        anchor_size = V5_ANCHORS[level][anchor]
        bias[2:4] = [_logit(np.sqrt(t.size[i] / anchor_size[i]) / 2) for i in (0, 1)]
    elif family == "yolox" or decoded:  # offset 0.5 of a cell, log size in strides
        bias[0:2] = 0.5
        bias[2:4] = np.log(np.array(t.size) / t.stride)
    if family == "yolov8":  # no objectness: the class score reads the colour
        weight[first_class + t.label, level], bias[first_class + t.label] = FIRE, QUIET
    elif anchor == 0:
        weight[4, level], bias[4] = FIRE, QUIET
        bias[first_class + t.label] = CLASS_LOGIT
    else:
        bias[4] = QUIET - 20.0  # YOLOv5's other anchors of the cell see nothing
    return weight, bias


def _anchors(family: str) -> int:
    return 3 if family == "yolov5" else 1


def _level_nodes(family: str, decoded: bool, level: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """images -> AveragePool(stride) -> 1x1 Conv -> ``rows{level}`` [1, anchors x cells, K]."""
    stride, count = STRIDES[level], _anchors(family)
    params = [_row_params(family, decoded, level, a) for a in range(count)]
    width = params[0][1].shape[0]
    weight = np.concatenate([w for w, _ in params])[:, :, None, None].astype(np.float32)
    bias = np.concatenate([b for _, b in params]).astype(np.float32)
    cells = _cells(level)
    names = [f"w{level}", f"b{level}", f"split_shape{level}", f"rows_shape{level}"]
    inits = [
        numpy_helper.from_array(weight, names[0]),
        numpy_helper.from_array(bias, names[1]),
        numpy_helper.from_array(np.array([1, count, width, cells], np.int64), names[2]),
        numpy_helper.from_array(np.array([1, count * cells, width], np.int64), names[3]),
    ]
    nodes = [
        helper.make_node(
            "AveragePool", ["images"], [f"pool{level}"], kernel_shape=[stride, stride], strides=[stride, stride]
        ),
        helper.make_node("Conv", [f"pool{level}", names[0], names[1]], [f"head{level}"]),
        helper.make_node("Reshape", [f"head{level}", names[2]], [f"split{level}"]),
        helper.make_node("Transpose", [f"split{level}"], [f"anchor_major{level}"], perm=[0, 1, 3, 2]),
        helper.make_node("Reshape", [f"anchor_major{level}", names[3]], [f"rows{level}"]),
    ]
    return nodes, inits


def anchor_table(family: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per anchor of the concatenated rows: cell (col, row), stride, YOLOv5 anchor size."""
    cells, strides, sizes = [], [], []
    for level, stride in enumerate(STRIDES):
        side = SIDE // stride
        for anchor in range(_anchors(family)):
            for row in range(side):
                for col in range(side):
                    cells.append((col, row))
                    strides.append(stride)
                    sizes.append(V5_ANCHORS[level][anchor] if family == "yolov5" else (0, 0))
    return np.array(cells, np.float32), np.array(strides, np.float32)[:, None], np.array(sizes, np.float32)


def _slice(name: str, out: str, start: int, end: int) -> onnx.NodeProto:
    return helper.make_node("Slice", [name, f"s{start}", f"e{end}", "axis2"], [out])


def _decode_nodes(family: str, decoded: bool) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """rows [1, N, K] -> output0 in the family's exported layout."""
    cells, strides, sizes = anchor_table(family)
    consts = {
        "axis2": np.array([2], np.int64),
        "cell": cells,
        "stride": strides,
        "anchor": sizes,
        "cell_v5": cells - 0.5,
        "two": np.float32(2.0),
    }
    for bound in (0, 2, 4, 1 << 20):
        consts[f"s{bound}"] = consts[f"e{bound}"] = np.array([bound], np.int64)
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    if family == "yolov8" and not decoded:
        return [helper.make_node("Transpose", ["rows"], ["output0"], perm=[0, 2, 1])], inits
    if family == "yolov5" and not decoded:
        return [helper.make_node("Identity", ["rows"], ["output0"])], inits
    nodes = [
        _slice("rows", "xy", 0, 2),
        _slice("rows", "wh", 2, 4),
        _slice("rows", "rest", 4, 1 << 20),
        helper.make_node("Sigmoid", ["rest"], ["scores"]),
    ]
    if family == "yolov5":
        nodes += [
            helper.make_node("Sigmoid", ["xy"], ["sxy"]),
            helper.make_node("Sigmoid", ["wh"], ["swh"]),
            helper.make_node("Mul", ["sxy", "two"], ["xy2"]),
            helper.make_node("Add", ["xy2", "cell_v5"], ["xy_cells"]),
            helper.make_node("Mul", ["xy_cells", "stride"], ["xy_out"]),
            helper.make_node("Mul", ["swh", "two"], ["wh2"]),
            helper.make_node("Mul", ["wh2", "wh2"], ["wh4"]),
            helper.make_node("Mul", ["wh4", "anchor"], ["wh_out"]),
        ]
    elif decoded:  # yolox and yolov8 decoded: offsets and log sizes in strides
        nodes += [
            helper.make_node("Add", ["xy", "cell"], ["xy_cells"]),
            helper.make_node("Mul", ["xy_cells", "stride"], ["xy_out"]),
            helper.make_node("Exp", ["wh"], ["wh_strides"]),
            helper.make_node("Mul", ["wh_strides", "stride"], ["wh_out"]),
        ]
    else:  # the raw YOLOX grid keeps offsets and log sizes
        nodes += [helper.make_node("Identity", ["xy"], ["xy_out"]), helper.make_node("Identity", ["wh"], ["wh_out"])]
    last = "output0" if family != "yolov8" else "rows_out"
    nodes.append(helper.make_node("Concat", ["xy_out", "wh_out", "scores"], [last], axis=2))
    if family == "yolov8":
        nodes.append(helper.make_node("Transpose", ["rows_out"], ["output0"], perm=[0, 2, 1]))
    return nodes, inits


def output_shape(family: str, decoded: bool) -> list[int]:
    anchors = _anchors(family) * sum(_cells(level) for level in range(len(STRIDES)))
    if family == "yolov8":
        return [1, (4 if decoded else 4 * DFL_BINS) + CLASSES, anchors]
    return [1, anchors, 5 + CLASSES]


def head_model(family: str, decoded: bool) -> onnx.ModelProto:
    """``images [1, 3, 64, 64]`` -> ``output0`` of ``family`` (yolov5, yolov8, yolox), raw or decoded."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    for level in range(len(STRIDES)):
        level_nodes, level_inits = _level_nodes(family, decoded, level)
        nodes += level_nodes
        inits += level_inits
    nodes.append(helper.make_node("Concat", [f"rows{level}" for level in range(len(STRIDES))], ["rows"], axis=1))
    tail, tail_inits = _decode_nodes(family, decoded)
    used = {name for node in nodes + tail for name in node.input}
    graph = helper.make_graph(
        nodes + tail,
        f"{family}_{'decoded' if decoded else 'raw'}",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, SIDE, SIDE])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, output_shape(family, decoded))],
        [i for i in inits + tail_inits if i.name in used],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def image_tensor(pixels: np.ndarray) -> np.ndarray:
    """What ``preprocess: {kind: image, resize: {size: [64, 64]}, scale: 1/255}`` makes of a 64x64 image."""
    return (pixels.astype(np.float32) / 255.0).transpose(2, 0, 1)[None]


# ----------------------------------------------------------------------------- raw per-level exports

RAW_LAYOUTS = ("conv", "view")  # yolov5-raw: [1, na*(5+C), H, W] or the Detect layer's [1, na, H, W, 5+C]
DFL_FLOOR = -40.0  # logit of a bin outside a side's distance: exp(-40) adds nothing


def dfl_logits(distance: float) -> np.ndarray:
    """``DFL_BINS`` logits whose softmax expectation is ``distance`` (< 1 cell): two bins."""
    logits = np.full(DFL_BINS, DFL_FLOOR)
    logits[0], logits[1] = np.log(1.0 - distance), np.log(distance)
    return logits


def _raw_level_params(family: str, level: int) -> tuple[np.ndarray, np.ndarray]:
    """(weight [channels, 3], bias) of one level's 1x1 convolution: YOLOv5's three anchors'
    rows one after the other, or YOLOv8's DFL bins (l, t, r, b) then class logits."""
    params = [_row_params(family, False, level, anchor) for anchor in range(_anchors(family))]
    weight, bias = np.concatenate([w for w, _ in params]), np.concatenate([b for _, b in params])
    if family == "yolov8":
        t = TARGETS[level]
        half = (t.size[0] / 2 / t.stride, t.size[1] / 2 / t.stride)
        bias[: 4 * DFL_BINS] = np.concatenate([dfl_logits(half[side % 2]) for side in range(4)])
    return weight, bias


def raw_level_model(family: str, layout: str = "conv", sigmoid: bool = False) -> onnx.ModelProto:
    """``images [1, 3, 64, 64]`` -> ``p3, p4, p5``: the undecoded level outputs of a YOLOv5
    (``layout`` conv or view, ``sigmoid`` in the graph or not) or YOLOv8 (conv) head."""
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    outputs = []
    for level, stride in enumerate(STRIDES):
        weight, bias = _raw_level_params(family, level)
        side, name = SIDE // stride, f"p{level + 3}"
        inits += [
            numpy_helper.from_array(weight[:, :, None, None].astype(np.float32), f"w{level}"),
            numpy_helper.from_array(bias.astype(np.float32), f"b{level}"),
        ]
        nodes += [
            helper.make_node(
                "AveragePool", ["images"], [f"pool{level}"], kernel_shape=[stride, stride], strides=[stride, stride]
            ),
            helper.make_node("Conv", [f"pool{level}", f"w{level}", f"b{level}"], [f"conv{level}"]),
        ]
        last, shape = f"conv{level}", [1, weight.shape[0], side, side]
        if layout == "view":
            width = weight.shape[0] // 3
            inits.append(numpy_helper.from_array(np.array([1, 3, width, side, side], np.int64), f"view{level}"))
            nodes += [
                helper.make_node("Reshape", [last, f"view{level}"], [f"split{level}"]),
                helper.make_node("Transpose", [f"split{level}"], [f"perm{level}"], perm=[0, 1, 3, 4, 2]),
            ]
            last, shape = f"perm{level}", [1, 3, side, side, width]
        nodes.append(helper.make_node("Sigmoid" if sigmoid else "Identity", [last], [name]))
        outputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
    graph = helper.make_graph(
        nodes,
        f"{family}_raw_levels",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, SIDE, SIDE])],
        outputs,
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model
