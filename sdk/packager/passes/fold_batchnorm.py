"""The ``fold_batchnorm`` pass: BatchNormalization folded into the Conv before it."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from sdk.packager.passes.base import BuildContext, Pass, register


def _initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {init.name: init for init in model.graph.initializer}


@register
class FoldBatchNormPass(Pass):
    """Fold BatchNormalization into the Conv before it: w' = w * g / sqrt(v + e),
    b' = (b - m) * g / sqrt(v + e) + beta. Exact in float64, one node fewer per block."""

    name = "fold_batchnorm"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.optimize.graph_pass(ctx.recipe.optimize.fold_batchnorm)

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        graph = model.graph
        inits = _initializers(model)
        producers = {out: node for node in graph.node for out in node.output}
        consumers: dict[str, int] = {}
        for node in graph.node:
            for name in node.input:
                consumers[name] = consumers.get(name, 0) + 1
        folded = 0
        for bn in list(graph.node):
            if bn.op_type != "BatchNormalization" or len(bn.output) != 1:
                continue
            conv = producers.get(bn.input[0])
            if conv is None or conv.op_type != "Conv" or consumers.get(conv.output[0], 0) != 1:
                continue
            names = [conv.input[1], *bn.input[1:5]] + ([conv.input[2]] if len(conv.input) > 2 else [])
            if not all(n in inits for n in names):
                continue
            weight = numpy_helper.to_array(inits[conv.input[1]]).astype(np.float64)
            scale, beta, mean, var = (numpy_helper.to_array(inits[n]).astype(np.float64) for n in bn.input[1:5])
            epsilon = next((a.f for a in bn.attribute if a.name == "epsilon"), 1e-5)
            bias = (
                numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64)
                if len(conv.input) > 2
                else np.zeros(weight.shape[0])
            )
            factor = scale / np.sqrt(var + epsilon)
            new_weight = weight * factor.reshape(-1, *([1] * (weight.ndim - 1)))
            new_bias = (bias - mean) * factor + beta
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
        used = {name for node in graph.node for name in node.input}
        for init in list(graph.initializer):
            if init.name not in used:
                graph.initializer.remove(init)
        ctx.report[self.name] = {"folded": folded}
