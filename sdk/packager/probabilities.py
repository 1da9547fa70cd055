"""Whether an output already holds probabilities (issue 23, item 4): from what the graph
computes and from what the model returned on validation data.

``topk`` and ``ctc`` score with the softmax of the output unless it is already a
distribution; a second softmax over probabilities flattens them (0.9999 becomes 0.0126 over 200
classes) without a word. Exporters write softmax in many ways, so the graph is read for
Softmax, LogSoftmax, Sigmoid and a softmax written out (Exp, then a ReduceSum or Sum of it,
then a Div), and the validation outputs settle what no pattern names. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx

# Ops that only move or reshape values: an output behind them still holds its producer's values.
SHAPE_ONLY_OPS = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Cast"}
# How far a row's sum may be from 1 and still be a distribution (fp16 exports round to ~1e-3).
SUM_TOLERANCE = 1e-2


@dataclass(frozen=True)
class Producer:
    """What computes an output's values: ``kind`` is ``distribution`` (Softmax or a written-out
    softmax: rows sum to 1), ``log`` (LogSoftmax: log-probabilities, whose softmax is the
    probabilities themselves) or ``independent`` (Sigmoid: one probability per class)."""

    kind: str
    pattern: str
    node: str


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {name: node for node in graph.node for name in node.output}


def _through_shape_ops(producers: Mapping[str, onnx.NodeProto], name: str) -> onnx.NodeProto | None:
    node = producers.get(name)
    while node is not None and node.op_type in SHAPE_ONLY_OPS and node.input:
        node = producers.get(node.input[0])
    return node


def _written_out_softmax(producers: Mapping[str, onnx.NodeProto], div: onnx.NodeProto) -> str | None:
    """``Exp/ReduceSum/Div`` or ``Exp/Sum/Div`` when ``div`` divides an Exp by a sum of that Exp."""
    if div.op_type != "Div" or len(div.input) != 2:
        return None
    exp = _through_shape_ops(producers, div.input[0])
    total = _through_shape_ops(producers, div.input[1])
    if exp is None or exp.op_type != "Exp" or total is None or total.op_type not in ("ReduceSum", "Sum"):
        return None
    summed = total.input[:1] if total.op_type == "ReduceSum" else total.input
    if any(_through_shape_ops(producers, name) is exp for name in summed):
        return f"Exp/{total.op_type}/Div"
    return None


_KINDS = {"Softmax": "distribution", "LogSoftmax": "log", "Sigmoid": "independent"}


def producer(model: onnx.ModelProto, output: str) -> Producer | None:
    """What the graph computes ``output`` with, when it is a recognised probability. Pure."""
    producers = _producers(model.graph)
    node = _through_shape_ops(producers, output)
    if node is None:
        return None
    if node.op_type in _KINDS:
        return Producer(_KINDS[node.op_type], node.op_type, node.name or "(unnamed)")
    pattern = _written_out_softmax(producers, node)
    return Producer("distribution", pattern, node.name or "(unnamed)") if pattern else None


def is_distribution(values: Sequence[np.ndarray], axis: int = -1, tolerance: float = SUM_TOLERANCE) -> bool:
    """True when every sample is non-negative and sums to 1 (within ``tolerance``) along the
    class ``axis``, with at least two classes: probabilities, not logits. Pure."""
    arrays = [np.asarray(value) for value in values]
    if not arrays or any(a.dtype.kind != "f" or a.ndim == 0 or a.shape[axis] < 2 or a.size == 0 for a in arrays):
        return False
    for array in arrays:
        as64 = array.astype(np.float64)
        if not np.all(np.isfinite(as64)) or np.any(as64 < 0):
            return False
        if np.any(np.abs(as64.sum(axis=axis) - 1.0) > tolerance):
            return False
    return True


def detection_scores(fmt: str, output: np.ndarray) -> np.ndarray | None:
    """The score values of a ``yolov8`` (``[batch, 4 + classes, anchors]``) or ``yolov5``
    (``[batch, anchors, 5 + classes]``: objectness and class scores) head, or of a decoded
    ``boxes_scores`` scores output; None when the shape is not the format's (the decoder names
    that). Pure."""
    array = np.asarray(output)
    if fmt == "boxes_scores":
        return array
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3 or array.dtype.kind != "f":
        return None
    scores = array[:, 4:, :] if fmt == "yolov8" else array[:, :, 4:]
    return scores if scores.size else None


def outside_unit_interval(values: Sequence[np.ndarray]) -> tuple[float, float] | None:
    """(least, greatest) when some value lies outside [0, 1]: these are no probabilities
    (logits of a head exported without its Sigmoid). None when every value is in [0, 1]. Pure."""
    arrays = [np.asarray(v, np.float64).ravel() for v in values if np.asarray(v).size]
    if not arrays:
        return None
    joined = np.concatenate(arrays)
    least, greatest = float(np.nanmin(joined)), float(np.nanmax(joined))
    return (least, greatest) if least < 0.0 or greatest > 1.0 else None
