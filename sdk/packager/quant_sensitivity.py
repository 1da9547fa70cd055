"""Where int8 hurts a graph: its output head, Concats that join very different ranges, and the
tensors whose quantization loses most signal on the calibration data. Pure: graphs in, names
out; measured arrays in, a ranking out. The sessions that measure live in the quantize pass,
which runs them in the onnxruntime worker.

Why these and not weights: on a YOLOv8n, excluding the layers whose *weights* round worst gave
no consistent gain, while keeping the float head plus the 16 worst *activations* float reached
recall 1.0 against fp32 (issue 15). An activation is kept float by excluding its producer and
every consumer (:func:`keep_float_nodes`): excluding one node alone leaves its output quantized
by the nodes after it.

The error of a tensor is its own rounding: the fp32 model's value against the same value
quantized and dequantized with the scale and zero point the QDQ model gives that tensor, as a
signal-to-quantization-noise ratio per channel (axis 1 and the last axis), averaged in dB over
channels, the lower of the two. The fp32 value, not the QDQ model's: there a tensor after a
damaged one is already damaged and rounds cleanly, so only the first would be found. Per
channel, because one outlier channel sets the scale of the whole tensor: its SQNR over the
whole tensor stays high while every other channel rounds to nothing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

HEAVY_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})
# A Concat whose inputs' ranges differ by this factor or more is kept float: under one uint8
# scale its smallest input keeps at most 256 / 10 levels (boxes in pixels next to scores in [0, 1]
# keep one or two).
WIDE_RANGE_RATIO = 10.0
# SQNR is clamped to this window (dB): a silent channel (no signal, some noise) would be -inf,
# an exact one +inf; both are extremes, not measurements.
SQNR_FLOOR_DB, SQNR_CEILING_DB = -60.0, 140.0
QUANT_INPUT_SUFFIX = "_QuantizeLinear_Input"  # onnxruntime renames a quantized graph output's producer output


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    users: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            if name:
                users.setdefault(name, []).append(node)
    return users


def head_nodes(graph: onnx.GraphProto) -> tuple[str, ...]:
    """The nodes between the last heavy op (Conv, ConvTranspose, MatMul, Gemm) and the graph's
    outputs: walking back from every output, stopping at heavy nodes and graph inputs. In graph
    order. Empty for a model that ends in a heavy op."""
    producers = {out: node for node in graph.node for out in node.output if out}
    seen: set[str] = set()
    pending = [o.name for o in graph.output]
    while pending:
        node = producers.get(pending.pop())
        if node is None or node.op_type in HEAVY_OPS or node.name in seen:
            continue
        seen.add(node.name)
        pending.extend(node.input)
    return tuple(node.name for node in graph.node if node.name in seen)


def keep_float_nodes(graph: onnx.GraphProto, tensor: str) -> tuple[str, ...]:
    """The nodes to exclude so ``tensor`` stays float: its producer and every consumer (a
    graph input has no producer, a graph output may have no consumer). In graph order."""
    users = _consumers(graph)
    names = {node.name for node in graph.node if tensor in node.output}
    names.update(node.name for node in users.get(tensor, []))
    return tuple(node.name for node in graph.node if node.name in names)


def quantization_span(low: float, high: float) -> float:
    """The range one uint8 scale must cover: zero is always representable."""
    return max(high, 0.0) - min(low, 0.0)


def wide_range_concats(graph: onnx.GraphProto, ranges: Mapping[str, tuple[float, float]],
                       ratio: float = WIDE_RANGE_RATIO) -> list[tuple[str, float]]:
    """Concat outputs whose measured inputs' spans differ by ``ratio`` or more, with the factor;
    widest first. Inputs not measured (constants) and empty spans are left out."""
    found = []
    for node in graph.node:
        if node.op_type != "Concat":
            continue
        spans = [quantization_span(*ranges[name]) for name in node.input if name in ranges]
        spans = [s for s in spans if s > 0 and math.isfinite(s)]
        if len(spans) >= 2 and max(spans) / min(spans) >= ratio:
            found.append((node.output[0], max(spans) / min(spans)))
    return sorted(found, key=lambda item: -item[1])


def _sqnr_db(signal: np.ndarray, noise: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = 10.0 * np.log10(signal / noise)
    ratio = np.where(noise == 0, SQNR_CEILING_DB, ratio)
    ratio = np.where((signal == 0) & (noise > 0), SQNR_FLOOR_DB, ratio)
    return np.clip(ratio, SQNR_FLOOR_DB, SQNR_CEILING_DB)


@dataclass
class ErrorTally:
    """Signal and noise power of one tensor over samples, per channel of axis 1 and of the
    last axis. Samples whose channel counts differ from the first are folded into the whole-
    tensor sums only."""

    signal: float = 0.0
    noise: float = 0.0
    samples: int = 0
    per_axis: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def add(self, reference: np.ndarray, observed: np.ndarray) -> None:
        ref, seen = np.asarray(reference, np.float64), np.asarray(observed, np.float64)
        if ref.shape != seen.shape:
            raise ValueError(f"shapes differ: {ref.shape} and {seen.shape}")
        err = seen - ref
        finite = np.isfinite(ref) & np.isfinite(err)
        ref, err = np.where(finite, ref, 0.0), np.where(finite, err, 0.0)
        self.signal += float(np.sum(ref * ref))
        self.noise += float(np.sum(err * err))
        self.samples += 1
        for axis in sorted({1, ref.ndim - 1}) if ref.ndim >= 2 else []:
            others = tuple(a for a in range(ref.ndim) if a != axis)
            sums = (np.sum(ref * ref, axis=others), np.sum(err * err, axis=others))
            known = self.per_axis.get(axis)
            if known is None and self.samples == 1:
                self.per_axis[axis] = sums
            elif known is not None and known[0].shape == sums[0].shape:
                self.per_axis[axis] = (known[0] + sums[0], known[1] + sums[1])
            else:
                self.per_axis.pop(axis, None)

    @property
    def sqnr_db(self) -> float:
        """The lower of the per-channel mean SQNR over axis 1 and over the last axis (dB); the
        whole tensor's SQNR for a vector or when channel counts changed between samples."""
        if not self.per_axis:
            return float(_sqnr_db(np.array(self.signal), np.array(self.noise)))
        return min(float(np.mean(_sqnr_db(signal, noise))) for signal, noise in self.per_axis.values())


def rank_tensors(tallies: Mapping[str, ErrorTally]) -> list[tuple[str, float]]:
    """Tensors by measured error, most signal lost (lowest SQNR) first; ties by name."""
    scored = [(name, tally.sqnr_db) for name, tally in tallies.items() if tally.samples]
    return sorted(scored, key=lambda item: (item[1], item[0]))


def tally_arrays(pairs: Mapping[str, Iterable[tuple[np.ndarray, np.ndarray]]]) -> dict[str, ErrorTally]:
    """An :class:`ErrorTally` per tensor from ``(before, after)`` array pairs, one per sample."""
    tallies: dict[str, ErrorTally] = {}
    for name, samples in pairs.items():
        tally = tallies.setdefault(name, ErrorTally())
        for reference, observed in samples:
            tally.add(reference, observed)
    return tallies


@dataclass(frozen=True)
class QuantParams:
    """How the QDQ graph quantizes one activation: scale, zero point, and the integer range."""

    scale: np.ndarray
    zero_point: np.ndarray
    low: int
    high: int

    def round_trip(self, value: np.ndarray) -> np.ndarray:
        """``value`` quantized and dequantized as the QDQ graph does it (per tensor, or per
        channel of axis 1 when the scale is a vector)."""
        scale, zero = self.scale.astype(np.float64), self.zero_point.astype(np.float64)
        if scale.ndim == 1 and scale.size > 1 and value.ndim >= 2:
            shape = [1] * value.ndim
            shape[1] = scale.size
            scale, zero = scale.reshape(shape), zero.reshape(shape)
        levels = np.clip(np.round(np.asarray(value, np.float64) / scale) + zero, self.low, self.high)
        return (levels - zero) * scale


def activation_quantization(qdq_graph: onnx.GraphProto) -> dict[str, QuantParams]:
    """For each activation the QDQ graph quantizes (its fp32 name), the scale and zero point of
    its QuantizeLinear. Weights (initializer inputs) are left out; a graph output's producer
    output carries onnxruntime's ``_QuantizeLinear_Input`` suffix, which is removed."""
    constants = {init.name: init for init in qdq_graph.initializer}
    params: dict[str, QuantParams] = {}
    for node in qdq_graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in constants or len(node.input) < 3:
            continue
        scale, zero = constants.get(node.input[1]), constants.get(node.input[2])
        if scale is None or zero is None:
            continue
        zero_point = numpy_helper.to_array(zero)
        info = np.iinfo(zero_point.dtype)
        name = node.input[0].removesuffix(QUANT_INPUT_SUFFIX)
        params.setdefault(name, QuantParams(numpy_helper.to_array(scale), zero_point, int(info.min), int(info.max)))
    return params


def float_tensors(graph: onnx.GraphProto) -> list[str]:
    """Node outputs of the graph, in order (their element types are checked when measured)."""
    return [name for node in graph.node for name in node.output if name]


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> onnx.ModelProto:
    """A copy of ``model`` that also returns ``names`` (intermediate tensors) as outputs."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    for name in dict.fromkeys(names):
        if name not in known:
            probe.graph.output.append(helper.make_empty_tensor_value_info(name))
    return probe
