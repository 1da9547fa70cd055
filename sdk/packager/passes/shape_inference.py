"""The ``shape_inference`` pass: the recipe's input shape overrides, then ONNX shape inference."""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from sdk.errors import ModelError, RecipeError
from sdk.packager.onnx_graph import (
    checker_text,
)
from sdk.packager.passes.base import BuildContext, Pass, model_label, register
from sdk.packager.sources import InputOptions


def _override_shapes(model: onnx.ModelProto, overrides: Mapping[str, InputOptions], recipe: str) -> None:
    by_name = {i.name: i for i in model.graph.input}
    for name, override in overrides.items():
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            raise RecipeError(f"inputs.{name}", f"the model has no such input (inputs: {known})", recipe=recipe)
        tensor = by_name[name].type.tensor_type
        if override.shape is not None:
            shape = override.shape
            if not tensor.HasField("shape"):  # unknown rank: the recipe's shape gives it
                tensor.shape.dim.extend(onnx.TensorShapeProto.Dimension() for _ in shape)
            if len(shape) != len(tensor.shape.dim):
                raise RecipeError(
                    f"inputs.{name}.shape",
                    f"has rank {len(shape)}, the model input has rank {len(tensor.shape.dim)}",
                    recipe=recipe,
                )
            for dim, value in zip(tensor.shape.dim, shape, strict=True):
                if isinstance(value, int):
                    if dim.HasField("dim_value") and dim.dim_value != value:
                        raise RecipeError(
                            f"inputs.{name}.shape",
                            f"dimension {dim.dim_value} of the model cannot become {value}",
                            recipe=recipe,
                        )
                    dim.dim_value = value
                else:
                    dim.dim_param = value


@register
class ShapeInferencePass(Pass):
    """Apply the recipe's input shape overrides and run ONNX shape inference."""

    name = "shape_inference"

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        _override_shapes(model, ctx.recipe.inputs, str(ctx.recipe.path))
        try:
            ctx.model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as err:
            # onnxruntime infers shapes itself at load time; ONNX's strict inference refuses graphs
            # it runs (ops whose inference ONNX lacks), so this is a finding like onnx.checker's.
            label = model_label(ctx)
            if ctx.recipe.model.strict_check:
                raise ModelError(
                    label, f"shape inference failed (model.strict_check is on): {checker_text(err)}"
                ) from err
            ctx.warn(f"ONNX shape inference: {checker_text(err)}; keeping {label}'s declared shapes")
            try:
                ctx.model = onnx.shape_inference.infer_shapes(model)
            except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
                ctx.model = model
        ctx.report[self.name] = {"value_infos": len(ctx.model.graph.value_info)}
