"""The ``eliminate_identity`` pass: Identity nodes (export leftovers) removed."""

from __future__ import annotations

from sdk.packager.onnx_graph import rename_uses
from sdk.packager.passes.base import BuildContext, Pass, register


@register
class EliminateIdentityPass(Pass):
    """Remove Identity nodes (export leftovers) by rewiring their consumers."""

    name = "eliminate_identity"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.optimize.graph_pass()

    def run(self, ctx: BuildContext) -> None:
        graph = ctx.require_model().graph
        outputs = {o.name for o in graph.output}
        removed = 0
        for node in list(graph.node):
            if node.op_type != "Identity" or node.output[0] in outputs:
                continue
            graph.node.remove(node)
            rename_uses(graph, node.output[0], node.input[0], "input")
            removed += 1
        ctx.report[self.name] = {"removed": removed}
