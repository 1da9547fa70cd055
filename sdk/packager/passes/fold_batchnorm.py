"""The ``fold_batchnorm`` pass: BatchNormalization folded into the Conv before it, in the main
graph and in every If/Loop/Scan body."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from sdk.packager.onnx_graph import all_graphs, names_read
from sdk.packager.passes.base import BuildContext, Pass, register


def _visible_initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """Initializers by name, of every graph (a subgraph may fold weights of the outer graph)."""
    return {init.name: init for graph in all_graphs(model) for init in graph.initializer}


def _readers(model: onnx.ModelProto) -> Counter[str]:
    """How many nodes read each name, across the main graph and every subgraph."""
    return Counter(name for graph in all_graphs(model) for node in graph.node for name in node.input)


def _foldable(
    bn: onnx.NodeProto, conv: onnx.NodeProto | None, readers: Counter[str], inits: Mapping[str, onnx.TensorProto]
) -> bool:
    if conv is None or conv.op_type != "Conv" or readers[conv.output[0]] != 1:
        return False
    names = [conv.input[1], *bn.input[1:5]] + ([conv.input[2]] if len(conv.input) > 2 else [])
    return all(n in inits for n in names)


def _folded_weights(
    conv: onnx.NodeProto, bn: onnx.NodeProto, inits: Mapping[str, onnx.TensorProto]
) -> tuple[np.ndarray, np.ndarray]:
    """w' = w * g / sqrt(v + e), b' = (b - m) * g / sqrt(v + e) + beta, in float64."""
    weight = numpy_helper.to_array(inits[conv.input[1]]).astype(np.float64)
    scale, beta, mean, var = (numpy_helper.to_array(inits[n]).astype(np.float64) for n in bn.input[1:5])
    epsilon = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
    bias = (
        numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64)
        if len(conv.input) > 2
        else np.zeros(weight.shape[0])
    )
    factor = scale / np.sqrt(var + epsilon)
    return weight * factor.reshape(-1, *([1] * (weight.ndim - 1))), (bias - mean) * factor + beta


def _fold_graph(graph: onnx.GraphProto, readers: Counter[str], inits: Mapping[str, onnx.TensorProto]) -> int:
    """Fold every Conv -> BatchNormalization pair of ``graph`` (new weights kept in it)."""
    producers = {out: node for node in graph.node for out in node.output}
    folded = 0
    for bn in list(graph.node):
        if bn.op_type != "BatchNormalization" or len(bn.output) != 1:
            continue
        conv = producers.get(bn.input[0])
        if conv is None or not _foldable(bn, conv, readers, inits):
            continue
        new_weight, new_bias = _folded_weights(conv, bn, inits)
        stem = conv.name or conv.output[0]
        weight_name, bias_name = f"{stem}.folded_w", f"{stem}.folded_b"
        graph.initializer.extend(
            [
                numpy_helper.from_array(new_weight.astype(np.float32), weight_name),
                numpy_helper.from_array(new_bias.astype(np.float32), bias_name),
            ]
        )
        del conv.input[1:]
        conv.input.extend([weight_name, bias_name])
        conv.output[0] = bn.output[0]
        graph.node.remove(bn)
        folded += 1
    return folded


def _drop_unread(graph: onnx.GraphProto) -> None:
    """Initializers nothing reads any more; a read from a subgraph (outer scope) counts."""
    read = names_read(graph)
    for init in list(graph.initializer):
        if init.name not in read:
            graph.initializer.remove(init)


@register
class FoldBatchNormPass(Pass):
    """Fold BatchNormalization into the Conv before it. Exact in float64, one node fewer per
    block; If/Loop/Scan bodies are folded too, and a weight a subgraph reads stays."""

    name = "fold_batchnorm"
    guard = "lossless"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.optimize.graph_pass(ctx.recipe.optimize.fold_batchnorm)

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        folded = 0
        for graph in all_graphs(model):
            folded += _fold_graph(graph, _readers(model), _visible_initializers(model))
        for graph in all_graphs(model):
            _drop_unread(graph)
        ctx.report[self.name] = {"folded": folded}
