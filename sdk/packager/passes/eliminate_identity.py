"""The ``eliminate_identity`` pass: Identity nodes (export leftovers) removed."""

from __future__ import annotations

import onnx

from sdk.packager.onnx_graph import all_graphs, rename_uses
from sdk.packager.passes.base import BuildContext, Pass, register


@register
class EliminateIdentityPass(Pass):
    """Remove Identity nodes (export leftovers) by rewiring their consumers, in the main graph
    and in every If/Loop/Scan body (whose readers of outer-scope names are rewired too). An
    Identity that makes a graph's output stays: the output's name is the contract."""

    name = "eliminate_identity"
    guard = "lossless"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.optimize.graph_pass()

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        removed = sum(_remove_identities(graph) for graph in all_graphs(model))
        ctx.report[self.name] = {"removed": removed}


def _remove_identities(graph: onnx.GraphProto) -> int:
    outputs = {o.name for o in graph.output}
    removed = 0
    for node in list(graph.node):
        if node.op_type != "Identity" or node.output[0] in outputs:
            continue
        graph.node.remove(node)
        rename_uses(graph, node.output[0], node.input[0], "input")
        removed += 1
    return removed
