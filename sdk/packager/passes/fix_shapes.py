"""The ``fix_shapes`` pass: symbolic input dims fixed (batch 1) for accelerators that need static shapes."""

from __future__ import annotations

import onnx

from edgepack_core.targets import STATIC_SHAPE_TARGETS
from sdk.packager.onnx_graph import graph_io
from sdk.packager.passes.base import BuildContext, Pass, model_label, register


@register
class FixShapesPass(Pass):
    """Give symbolic input dims fixed sizes (batch 1) when a target's accelerator (NNAPI,
    CoreML) needs static shapes, or when the recipe asks for it."""

    name = "fix_shapes"

    def applies(self, ctx: BuildContext) -> bool:
        wanted = ctx.recipe.optimize.fixed_shapes
        return wanted if wanted is not None else bool(set(ctx.recipe.targets) & STATIC_SHAPE_TARGETS)

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        fixed = {}
        for graph_input in model.graph.input:
            for dim in graph_input.type.tensor_type.shape.dim:
                if not dim.HasField("dim_value"):
                    fixed[dim.dim_param or "?"] = 1
                    dim.dim_value = 1
        for output in model.graph.output:
            for dim in output.type.tensor_type.shape.dim:
                if not dim.HasField("dim_value") and dim.dim_param in fixed:
                    dim.dim_value = 1
        ctx.model = onnx.shape_inference.infer_shapes(model)
        ctx.inputs, ctx.outputs = graph_io(ctx.model, model_label(ctx))
        ctx.report[self.name] = {"fixed": sorted(fixed)}
