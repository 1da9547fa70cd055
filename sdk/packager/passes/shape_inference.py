"""The ``shape_inference`` pass: the recipe's input shape overrides, then ONNX shape inference."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import onnx

from sdk.errors import BuildError, ModelError, RecipeError
from sdk.packager import ort_host
from sdk.packager.onnx_graph import checker_text, graph_io
from sdk.packager.passes.base import BuildContext, Pass, model_label, register
from sdk.packager.passes.ort_optimize import probe_feeds
from sdk.packager.self_check import check_feeds
from sdk.packager.sources import InputOptions


def _override_input(name: str, tensor: onnx.TypeProto.Tensor, shape: Sequence[int | str], recipe: str
                    ) -> list[str]:
    """Set one input's dims to the recipe's; returns the fixed dims it opened (``NAME[i]: a -> b``)."""
    if not tensor.HasField("shape"):  # unknown rank: the recipe's shape gives it
        tensor.shape.dim.extend(onnx.TensorShapeProto.Dimension() for _ in shape)
    if len(shape) != len(tensor.shape.dim):
        raise RecipeError(f"inputs.{name}.shape",
                          f"has rank {len(shape)}, the model input has rank {len(tensor.shape.dim)}", recipe=recipe)
    opened = []
    for index, (dim, value) in enumerate(zip(tensor.shape.dim, shape, strict=True)):
        if dim.HasField("dim_value") and dim.dim_value != value:
            opened.append(f"{name}[{index}]: {dim.dim_value} -> {value}")
        if isinstance(value, int):
            dim.dim_value = value
        else:
            dim.dim_param = value
    return opened


def _override_shapes(model: onnx.ModelProto, overrides: Mapping[str, InputOptions], recipe: str) -> list[str]:
    """Apply the recipe's input shapes; returns the fixed dims they opened."""
    by_name = {i.name: i for i in model.graph.input}
    opened: list[str] = []
    for name, override in overrides.items():
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            raise RecipeError(f"inputs.{name}", f"the model has no such input (inputs: {known})", recipe=recipe)
        if override.shape is not None:
            opened += _override_input(name, by_name[name].type.tensor_type, override.shape, recipe)
    if opened:  # shapes written for the fixed dims no longer hold: inference writes them anew
        del model.graph.value_info[:]
        for output in model.graph.output:
            for dim in output.type.tensor_type.shape.dim:
                dim.Clear()
    return opened


def _check_opened(ctx: BuildContext, model: onnx.ModelProto, opened: list[str], recipe: str) -> str | None:
    """A fixed dim opens only when the graph stays valid with it (strict shape inference) and
    onnxruntime runs it on inputs of the new shape: the recipe's real data when it gives some,
    made-up inputs only without (whose named dims of 1 a real graph may not run). Else the
    message names the dims and why. Returns what it ran on (None: nothing numpy can make)."""
    key = f"inputs.{opened[0].split('[')[0]}.shape"
    try:
        onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as err:
        raise RecipeError(key, f"{_dims_text(opened)}: shape inference says {checker_text(err)}",
                          recipe=recipe) from err
    inputs, _ = graph_io(model)
    try:
        made_up = probe_feeds(inputs, 1)
    except ValueError:  # an input numpy cannot make (bfloat16): validation runs the real data
        made_up = []
    feeds, checked_on = check_feeds(ctx, 1, made_up, inputs=inputs)
    if not feeds:
        return None
    try:
        ort_host.run_feeds(model.SerializeToString(), feeds)
    except BuildError as err:
        raise RecipeError(key, f"{_dims_text(opened)}: onnxruntime cannot run the graph so on the {checked_on}: "
                          f"{err.problem}", recipe=recipe) from err
    return checked_on


def _dims_text(opened: list[str]) -> str:
    """``x[0]: 10 -> 1`` as ``dimension 0 of x (10 in the model) cannot become 1``, joined."""
    parts = []
    for entry in opened:
        where, change = entry.split(": ")
        name, index = where[:-1].split("[")
        old, new = change.split(" -> ")
        parts.append(f"dimension {index} of {name} ({old} in the model) cannot become {new}")
    return "; ".join(parts)


@register
class ShapeInferencePass(Pass):
    """Apply the recipe's input shape overrides and run ONNX shape inference."""

    name = "shape_inference"

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        recipe = str(ctx.recipe.path)
        opened = _override_shapes(model, ctx.recipe.inputs, recipe)
        checked_on = _check_opened(ctx, model, opened, recipe) if opened else None
        if opened and ctx.original is not None:  # the reference takes the same inputs
            _override_shapes(ctx.original, ctx.recipe.inputs, recipe)
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
        if opened:
            ctx.report[self.name]["opened"] = opened
            ctx.report[self.name]["checked_on"] = checked_on
