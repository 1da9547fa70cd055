"""Foundation passes: load the model, check it, bound its opset, infer shapes, fix the I/O spec."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgepack_core.manifest import TensorSpec
from edgepack_core.postprocess import normalize_postprocess
from edgepack_core.preprocess import normalize_preprocess
from sdk.errors import ModelError, RecipeError
from sdk.packager.passes.base import BuildContext, Pass, register

# onnxruntime releases that first implemented each default-domain opset. The manifest records
# the minimum a device needs, so an old runtime refuses the artifact up front instead of
# failing on an unknown op at load time.
MIN_ORT_FOR_OPSET = {
    11: "1.10.0", 12: "1.10.0", 13: "1.10.0", 14: "1.10.0", 15: "1.10.0", 16: "1.11.0",
    17: "1.13.0", 18: "1.14.0", 19: "1.16.0", 20: "1.17.0", 21: "1.20.0",
}
MIN_OPSET, MAX_OPSET = min(MIN_ORT_FOR_OPSET), max(MIN_ORT_FOR_OPSET)


def default_opset(model: onnx.ModelProto) -> int:
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    raise ModelError("model", "imports no default-domain opset")


def tensor_dtype_name(elem_type: int) -> str:
    if elem_type == TensorProto.STRING:
        return "string"
    if elem_type == TensorProto.BFLOAT16:
        return "bfloat16"
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def value_info_spec(info: onnx.ValueInfoProto) -> TensorSpec:
    tensor = info.type.tensor_type
    dims: list[int | str] = []
    for i, dim in enumerate(tensor.shape.dim):
        if dim.HasField("dim_value"):
            dims.append(int(dim.dim_value))
        else:
            dims.append(dim.dim_param or f"{info.name}_dim{i}")
    return TensorSpec(info.name, tensor_dtype_name(tensor.elem_type), tuple(dims))


def graph_io(model: onnx.ModelProto) -> tuple[list[TensorSpec], list[TensorSpec]]:
    initializers = {init.name for init in model.graph.initializer}
    inputs = [value_info_spec(i) for i in model.graph.input if i.name not in initializers]
    outputs = [value_info_spec(o) for o in model.graph.output]
    return inputs, outputs


@register
class LoadPass(Pass):
    """Load the ONNX file named by the recipe (a PyTorch export section is handled by the
    ``export_pytorch`` pass, which runs first and leaves ``ctx.model`` set)."""

    name = "load"

    def run(self, ctx: BuildContext) -> None:
        if ctx.model is None:
            path = ctx.recipe.data["model"]["path"]
            try:
                ctx.model = onnx.load(path)
            except Exception as err:  # onnx raises DecodeError, OSError, ValueError...
                raise ModelError(path, f"cannot be loaded as ONNX ({type(err).__name__}: {err})") from None
        ctx.original = onnx.ModelProto()
        ctx.original.CopyFrom(ctx.model)
        size = ctx.model.ByteSize()
        ctx.report[self.name] = {"bytes": size, "nodes": len(ctx.model.graph.node)}


@register
class CheckPass(Pass):
    """onnx.checker over the whole model (full_check also runs strict shape inference)."""

    name = "check"

    def run(self, ctx: BuildContext) -> None:
        try:
            onnx.checker.check_model(ctx.require_model(), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ModelError(ctx.recipe.name, f"onnx.checker refused the model: {first}") from None
        ctx.report[self.name] = {"ok": True}


@register
class OpsetPass(Pass):
    """Refuse opsets outside the range the supported onnxruntime versions run."""

    name = "opset"

    def run(self, ctx: BuildContext) -> None:
        opset = default_opset(ctx.require_model())
        if not MIN_OPSET <= opset <= MAX_OPSET:
            raise ModelError(
                ctx.recipe.name,
                f"opset {opset} is outside the supported range {MIN_OPSET}-{MAX_OPSET} "
                "(convert it with onnx.version_converter)",
            )
        ctx.manifest_extra["opset"] = opset
        ctx.manifest_extra["min_onnxruntime"] = MIN_ORT_FOR_OPSET[opset]
        ctx.report[self.name] = {"opset": opset, "min_onnxruntime": MIN_ORT_FOR_OPSET[opset]}


def _override_shapes(model: onnx.ModelProto, overrides: dict[str, Any], recipe: str) -> None:
    by_name = {i.name: i for i in model.graph.input}
    for name, override in overrides.items():
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            raise RecipeError(f"inputs.{name}", f"the model has no such input (inputs: {known})", recipe=recipe)
        tensor = by_name[name].type.tensor_type
        if "shape" in override:
            shape = override["shape"]
            if len(shape) != len(tensor.shape.dim):
                raise RecipeError(f"inputs.{name}.shape",
                                  f"has rank {len(shape)}, the model input has rank {len(tensor.shape.dim)}",
                                  recipe=recipe)
            for dim, value in zip(tensor.shape.dim, shape, strict=True):
                if isinstance(value, int):
                    if dim.HasField("dim_value") and dim.dim_value != value:
                        raise RecipeError(f"inputs.{name}.shape",
                                          f"dimension {dim.dim_value} of the model cannot become {value}",
                                          recipe=recipe)
                    dim.dim_value = value
                else:
                    dim.dim_param = value


@register
class ShapeInferencePass(Pass):
    """Apply the recipe's input shape overrides and run ONNX shape inference."""

    name = "shape_inference"
    section = "inputs"

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        _override_shapes(model, dict(self.options(ctx)), str(ctx.recipe.path))
        try:
            ctx.model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as err:
            first = str(err).strip().splitlines()[0]
            raise ModelError(ctx.recipe.name, f"shape inference failed: {first}") from None
        ctx.report[self.name] = {"value_infos": len(ctx.model.graph.value_info)}


@register
class IoSpecPass(Pass):
    """Record inputs/outputs and the normalized pre/postprocessing specs; check they fit."""

    name = "io_spec"

    def run(self, ctx: BuildContext) -> None:
        ctx.inputs, ctx.outputs = graph_io(ctx.require_model())
        recipe = str(ctx.recipe.path)
        ctx.preprocess = normalize_preprocess(ctx.recipe.data.get("preprocess"))
        post = dict(ctx.recipe.data.get("postprocess") or {"kind": "raw"})
        if post.get("labels"):
            with open(post["labels"], "rb") as labels:
                ctx.files["assets/labels.txt"] = labels.read()
            post["labels"] = "assets/labels.txt"
        ctx.postprocess = normalize_postprocess(post)
        names = [i.name for i in ctx.inputs]
        target = ctx.preprocess.get("input")
        if target is not None and target not in names:
            raise RecipeError("preprocess.input", f"no model input named {target!r} (inputs: {', '.join(names)})",
                              recipe=recipe)
        if ctx.preprocess.get("kind") == "image":
            self._check_image_input(ctx, target or names[0], recipe)
        output = ctx.postprocess.get("output")
        if output is not None and output not in [o.name for o in ctx.outputs]:
            raise RecipeError("postprocess.output", f"no model output named {output!r}", recipe=recipe)
        ctx.report[self.name] = {
            "inputs": [i.to_json() for i in ctx.inputs],
            "outputs": [o.to_json() for o in ctx.outputs],
        }

    @staticmethod
    def _check_image_input(ctx: BuildContext, name: str, recipe: str) -> None:
        spec = ctx.preprocess
        model_input = next(i for i in ctx.inputs if i.name == name)
        height, width = spec["resize"]["size"] if spec.get("resize") else (None, None)
        channels = 1 if spec.get("color") == "gray" else 3
        if spec.get("layout", "NCHW") == "NCHW":
            expected: list[int | None] = [channels, height, width]
        else:
            expected = [height, width, channels]
        shape = list(model_input.shape)
        if spec.get("batch", True):
            shape = shape[1:]
        if len(shape) != 3:
            raise RecipeError("preprocess", f"input {name} has shape {list(model_input.shape)}, "
                              "not an image tensor for this layout", recipe=recipe)
        for got, want in zip(shape, expected, strict=True):
            if isinstance(got, int) and want is not None and got != want:
                raise RecipeError("preprocess", f"produces {expected} per image but input {name} "
                                  f"expects {shape}", recipe=recipe)


@register
class ExportPytorchPass(Pass):
    """The recipe's ``model.pytorch`` section: build the module and export it (sdk.export)."""

    name = "export_pytorch"

    def applies(self, ctx: BuildContext) -> bool:
        return "pytorch" in ctx.recipe.data["model"]

    def run(self, ctx: BuildContext) -> None:
        from sdk.export import DEFAULT_OPSET, export_pytorch, load_factory

        options = ctx.recipe.data["model"]["pytorch"]
        module = load_factory(options["factory"])()
        if options.get("weights"):
            import torch

            module.load_state_dict(torch.load(options["weights"], map_location="cpu", weights_only=True))
        path = ctx.workdir / "exported.onnx"
        report = export_pytorch(module, options["input_shape"], path, opset=options.get("opset", DEFAULT_OPSET),
                                input_name=options.get("input_name", "input"),
                                output_names=options.get("output_names", ["output"]),
                                dynamic_batch=options.get("dynamic_batch", True))
        ctx.model = onnx.load(path)
        ctx.report[self.name] = report
