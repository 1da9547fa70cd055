"""What a graph holds in int8 (pure): the facts behind the manifest's ``precision`` for a model
that came quantized, and the check that a graph rewrite kept its quantized weights.

A model quantized before it reached Edgepack is int8 whatever the recipe asks: QDQ pairs,
QOperator nodes (QLinearConv...), ConvInteger/MatMulInteger, DynamicQuantize* (DynamicQuantizeLinear,
com.microsoft's DynamicQuantizeLSTM/MatMul) or int8 weights dequantized by Cast (+ Mul by a
scale), the weight-only form some exporters write. The float nodes left next to them are the
report's split, so "int8" never hides a graph that mostly computes in float.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import onnx

# Nodes that compute or carry int8 (besides the QLinear*, DynamicQuantize* and *Integer* families).
INT8_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "QGemm",
        "QAttention",
        "QOrderedMatMul",
        "MatMulIntegerToFloat",
        "MatMulNBits",
        "MatMulBnb4",
        "GatherBlockQuantized",
    }
)
INT8_PREFIXES = ("QLinear", "DynamicQuantize")
# Heavy float ops: the ones whose weights a quantizer turns int8. Left float, they are the split.
FLOAT_COMPUTE = frozenset(
    {
        "Conv",
        "ConvTranspose",
        "Gemm",
        "MatMul",
        "LSTM",
        "GRU",
        "RNN",
        "Attention",
        "FusedConv",
        "FusedMatMul",
        "FusedGemm",
    }
)
INT8_WEIGHT_TYPES = frozenset(
    {onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT4, onnx.TensorProto.UINT4}
)


def is_int8_op(op_type: str) -> bool:
    return op_type in INT8_OPS or op_type.startswith(INT8_PREFIXES) or op_type.endswith("Integer")


def graphs(model: onnx.ModelProto) -> Iterator[onnx.GraphProto]:
    """The main graph and every If/Loop/Scan body, depth first."""
    pending = [model.graph]
    while pending:
        graph = pending.pop()
        yield graph
        for node in graph.node:
            for attr in node.attribute:
                pending.extend([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs)


def _int8_weight_names(model: onnx.ModelProto) -> set[str]:
    return {
        init.name
        for graph in graphs(model)
        for init in graph.initializer
        if init.data_type in INT8_WEIGHT_TYPES and len(init.dims) >= 1
    }


def int8_weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of int8/uint8 (and 4-bit) tensors with at least one axis: quantized weights (a
    zero point is a scalar). A rewrite that lowers this turned quantized weights into float."""
    return sum(
        init.ByteSize()
        for graph in graphs(model)
        for init in graph.initializer
        if init.data_type in INT8_WEIGHT_TYPES and len(init.dims) >= 1
    )


@dataclass(frozen=True)
class QuantFacts:
    """``int8_nodes``: int8 ops by type, ``Cast`` counted when it dequantizes an int8 weight;
    ``float_compute``: heavy float ops whose weight is not a dequantized int8 tensor."""

    int8_nodes: dict[str, int]
    float_compute: dict[str, int]
    int8_weight_bytes: int

    @property
    def precision(self) -> str | None:
        """``int8`` when the graph holds any quantized part, else None (the float precision decides)."""
        return "int8" if self.int8_nodes else None

    def to_json(self) -> dict[str, object]:
        split = "int8" if not self.float_compute else "mixed"
        return {
            "precision": self.precision or "float",
            "split": split if self.int8_nodes else "float",
            "int8_nodes": dict(self.int8_nodes),
            "float_compute": dict(self.float_compute),
            "int8_weight_bytes": self.int8_weight_bytes,
        }


def _dequantized(graph: onnx.GraphProto, weights: set[str]) -> set[str]:
    """Tensors that are int8 weights made float: DequantizeLinear or Cast of one, and a Mul/Sub
    of such a tensor (the scale and zero point), followed through Reshape/Transpose."""
    made = set(weights)
    for node in graph.node:  # nodes are topologically sorted
        ops = ("DequantizeLinear", "Cast", "Mul", "Sub", "Reshape", "Transpose", "Unsqueeze")
        if node.op_type in ops and node.input and node.input[0] in made:
            made.update(node.output)
    return made - weights


def quant_facts(model: onnx.ModelProto) -> QuantFacts:
    """Count the graph's int8 and float parts (subgraphs included). Pure."""
    weights = _int8_weight_names(model)
    int8: Counter[str] = Counter()
    floats: Counter[str] = Counter()
    for graph in graphs(model):
        dequantized = _dequantized(graph, weights)
        for node in graph.node:
            if is_int8_op(node.op_type):
                int8[node.op_type] += 1
            elif node.op_type == "Cast" and node.input[0] in weights:
                int8["Cast"] += 1
            elif node.op_type in FLOAT_COMPUTE and not any(name in dequantized for name in node.input[1:]):
                floats[node.op_type] += 1
    return QuantFacts(dict(sorted(int8.items())), dict(sorted(floats.items())), int8_weight_bytes(model))
