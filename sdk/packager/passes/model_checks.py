"""Foundation passes: load the model, check it, convert or bound its opsets by what onnxruntime runs, infer
shapes, fix the I/O spec; and the last step, the artifact's real minimum onnxruntime (``runtime_compat``)."""

from __future__ import annotations

import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from edgepack_core.ort_compat import (
    DEFAULT_DOMAIN,
    GUARANTEED_MIN_OPSET,
    ML_DOMAIN,
    SUPPORTED_DOMAINS,
    RuntimeRow,
    RuntimeTooOld,
    format_version,
    normalize_domain,
    ort_format_version,
    parse_version,
    required_onnxruntime,
    target_shortfalls,
    unsupported_domains,
)
from edgepack_core.postprocess import load_charset
from edgepack_core.postprocess_spec import PostprocessSpec
from edgepack_core.targets import profile_onnxruntime
from sdk.errors import BuildError, ModelError, RecipeError
from sdk.packager import ort_host
from sdk.packager.onnx_graph import (
    default_opset,
    drop_initializer_inputs,
    graph_io,
    lower_ir_version,
    opset_versions,
    prune_opset_imports,
    used_op_types,
)
from sdk.packager.options import option
from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.passes.export_pytorch import PytorchOptions
from sdk.packager.sources import InputOptions


@dataclass(frozen=True)
class ModelOptions:
    """``model``: read by load, check, convert_opset and shape_inference (``pytorch``: export_pytorch)."""

    DESCRIPTION = "Exactly one of path (an .onnx file) or pytorch (export a torch.nn.Module)."

    path: str | None = option(None, minLength=1)
    convert_opset: int | None = option(None, description="convert the model to this default-domain opset first; "
                                       "the result is validated against the original", minimum=1)
    strict_check: bool = option(False, description="onnx.checker findings become errors instead of warnings")
    pytorch: PytorchOptions | None = None


@dataclass(frozen=True)
class RuntimeRequirement:
    """What the final graph needs of onnxruntime (the runtime_compat pass's result, for the
    manifest): its opset imports by domain and the oldest onnxruntime that runs it, and why."""

    opsets: Mapping[str, int]
    min_onnxruntime: str
    reason: str

    @property
    def opset(self) -> int | None:
        """The ai.onnx opset; None for a model that imports only other domains (ai.onnx.ml)."""
        return self.opsets.get(DEFAULT_DOMAIN)


def model_label(ctx: BuildContext) -> str:
    """The model's name in messages: its file name, or the recipe's name for an export."""
    path = ctx.recipe.model.path
    return Path(path).name if path else ctx.recipe.name


_HOST_ROW: list[RuntimeRow | None] = []


def host_runtime_row() -> RuntimeRow | None:
    """The build host's onnxruntime as a compatibility-table row, asked of onnxruntime itself: it
    refuses a model stamped with opset/IR 999 and names the newest it runs. None when it answers
    otherwise. Cached per process."""
    if _HOST_ROW:
        return _HOST_ROW[0]
    import onnxruntime as ort

    def refusal(opsets: list[tuple[str, int]], ir_version: int) -> str:
        graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
        model.ir_version = ir_version
        options = ort.SessionOptions()
        options.log_severity_level = 4
        try:
            ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        except Exception as err:  # onnxruntime raises untyped errors; the text is what we parse
            return str(err)
        return ""

    opset = re.search(r"till opset (\d+)", refusal([("", 999)], 8))
    ml = re.search(r"till opset (\d+)", refusal([("", 13), (ML_DOMAIN, 999)], 8))
    ir = re.search(r"max supported IR version: (\d+)", refusal([("", 13)], 999))
    row = None
    if opset and ml and ir:
        version = format_version(parse_version(ort.__version__))
        row = RuntimeRow(version, int(opset.group(1)), int(ml.group(1)), int(ir.group(1)))
    _HOST_ROW.append(row)
    return row


def graph_requirement(model: onnx.ModelProto, *, ort_format: bool = False, ort_format_version: str | None = None
                      ) -> tuple[str, str]:
    """(minimum onnxruntime, reason) for what the graph holds. Raises RuntimeTooOld."""
    import onnxruntime as ort

    host = host_runtime_row()
    return required_onnxruntime(opset_versions(model), used_op_types(model), ort_format,
                                ort_format_version=ort_format_version, ir_version=int(model.ir_version),
                                extra_rows=[host] if host else [], builder=ort.__version__)


def _checker_text(err: Exception) -> str:
    """The lines of an onnx.checker/shape-inference error that say what is wrong, on one line."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return "; ".join(lines[:4]) or type(err).__name__


@register
class LoadPass(Pass):
    """Load the ONNX file named by the recipe (a PyTorch export section is handled by the
    ``export_pytorch`` pass, which runs first and leaves ``ctx.model`` set)."""

    name = "load"

    def run(self, ctx: BuildContext) -> None:
        if ctx.model is None:
            path = str(ctx.recipe.model.path)
            try:
                ctx.model = onnx.load(path)
            except Exception as err:  # onnx raises DecodeError, OSError, ValueError...
                raise ModelError(path, f"cannot be loaded as ONNX ({type(err).__name__}: {err})") from err
        ctx.original = onnx.ModelProto()
        ctx.original.CopyFrom(ctx.model)
        dropped = drop_initializer_inputs(ctx.model)
        size = ctx.model.ByteSize()
        ctx.report[self.name] = {"bytes": size, "nodes": len(ctx.model.graph.node), "ir_version": ctx.model.ir_version,
                                 "initializer_inputs_dropped": len(dropped)}


@register
class CheckPass(Pass):
    """onnx.checker over the whole model (full_check also runs strict shape inference). A finding
    onnxruntime tolerates (it creates a session on the model) is a warning, because onnxruntime is
    what runs the artifact; ``model.strict_check: true`` makes every finding an error."""

    name = "check"

    def run(self, ctx: BuildContext) -> None:
        label = model_label(ctx)
        try:
            onnx.checker.check_model(ctx.require_model(), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
            finding = _checker_text(err)
            if ctx.recipe.model.strict_check:
                raise ModelError(label, f"onnx.checker refused it (model.strict_check is on): {finding}") from err
            try:
                ort_host.describe(ctx.model_bytes(), label=label)
            except BuildError as ort_err:
                raise ModelError(label, f"onnx.checker refused it ({finding}) and onnxruntime cannot load it "
                                        f"({ort_err.problem})") from ort_err
            ctx.warn(f"onnx.checker: {finding} (onnxruntime loads {label}; model.strict_check: true makes this "
                     "an error)")
            ctx.report[self.name] = {"ok": False, "finding": finding, "onnxruntime_loads": True}
            return
        ctx.report[self.name] = {"ok": True}


@register
class ConvertOpsetPass(Pass):
    """``model.convert_opset: N``: onnx.version_converter to opset N, as an explicit step whose
    result the validate pass compares with the original like any other pass's."""

    name = "convert_opset"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.model.convert_opset is not None

    def run(self, ctx: BuildContext) -> None:
        from onnx import version_converter

        label = model_label(ctx)
        target = int(ctx.recipe.model.convert_opset or 0)
        model = ctx.require_model()
        source = default_opset(model)
        if not source:
            raise ModelError(label, f"model.convert_opset: {target} converts the ai.onnx opset, which {label} "
                                    "does not import")
        try:
            converted = version_converter.convert_version(model, target)
            onnx.checker.check_model(converted)
        except Exception as err:  # the converter raises RuntimeError, ValidationError, IndexError...
            raise ModelError(label, f"onnx.version_converter cannot convert opset {source} to {target}: "
                                    f"{_checker_text(err)}") from err
        ctx.model = converted
        ctx.report[self.name] = {"from": source, "to": target}


@register
class OpsetPass(Pass):
    """The operator domains and opsets onnxruntime runs: ai.onnx, ai.onnx.ml and com.microsoft,
    any opset a known onnxruntime release runs (the build host's included). The artifact's real
    minimum onnxruntime is computed at the end of the build (``runtime_compat``)."""

    name = "opset"

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        label = model_label(ctx)
        local = {normalize_domain(f.domain) for f in model.functions}
        custom = {d: op for d, op in sorted(used_op_types(model)) if d not in local}
        foreign = [d for d in unsupported_domains(custom) if d not in local]
        if foreign:
            uses = ", ".join(f"{custom[d]} ({d})" for d in foreign)
            raise ModelError(label, f"uses custom operators {uses}: a stock onnxruntime runs only the domains "
                                    f"{', '.join(sorted(SUPPORTED_DOMAINS))}")
        opsets = opset_versions(model)
        if not opsets:
            raise ModelError(label, "imports no opset")
        try:
            version, reason = graph_requirement(model)
        except RuntimeTooOld as err:
            raise ModelError(label, str(err)) from err
        default = opsets.get(DEFAULT_DOMAIN)
        if default is not None and default < GUARANTEED_MIN_OPSET:
            ctx.warn(f"{label} uses ai.onnx opset {default}; onnxruntime guarantees opsets "
                     f"{GUARANTEED_MIN_OPSET} and later")
        ctx.report[self.name] = {"opsets": opsets, "min_onnxruntime": version, "reason": reason}


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
                raise ModelError(label, f"shape inference failed (model.strict_check is on): "
                                        f"{_checker_text(err)}") from err
            ctx.warn(f"ONNX shape inference: {_checker_text(err)}; keeping {label}'s declared shapes")
            try:
                ctx.model = onnx.shape_inference.infer_shapes(model)
            except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
                ctx.model = model
        ctx.report[self.name] = {"value_infos": len(ctx.model.graph.value_info)}


# Ops that only move or reshape values: an output behind them still holds a Softmax's probabilities.
_SHAPE_ONLY_OPS = {"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"}


def _softmax_producer(model: onnx.ModelProto, output: str) -> onnx.NodeProto | None:
    """The Softmax node whose values ``output`` carries (through shape-only ops), or None."""
    producers = {name: node for node in model.graph.node for name in node.output}
    node = producers.get(output)
    while node is not None and node.op_type in _SHAPE_ONLY_OPS and node.input:
        node = producers.get(node.input[0])
    return node if node is not None and node.op_type == "Softmax" else None


def resolve_apply_softmax(model: onnx.ModelProto, post: PostprocessSpec) -> tuple[PostprocessSpec,
                                                                                  dict[str, Any] | None]:
    """topk/ctc: ``post`` with ``apply_softmax`` resolved, and why (for the report).

    Why: a classifier that already ends in Softmax scored by a second softmax reports 0.45
    where the model says 0.92; the recipe's explicit value always wins."""
    if post.kind not in ("topk", "ctc"):
        return post, None
    output = post.output or model.graph.output[0].name
    if post.apply_softmax is not None:
        return post, {"value": post.apply_softmax, "output": output, "why": "set in the recipe"}
    node = _softmax_producer(model, output)
    why = (f"output {output} comes from Softmax node {node.name or '(unnamed)'}: scores are its probabilities"
           if node is not None else f"output {output} does not come from a Softmax: scores are its softmax")
    return replace(post, apply_softmax=node is None), {"value": node is None, "output": output, "why": why}


def _bundle_assets(ctx: BuildContext, post: PostprocessSpec, recipe: str) -> PostprocessSpec:
    """Labels and charset files travel in the artifact; the spec names them by member path."""
    members: dict[str, str] = {}
    for key, member in (("labels", "assets/labels.txt"), ("charset", "assets/charset.txt")):
        source = getattr(post, key)
        if not source:
            continue
        with open(source, "rb") as handle:
            data = handle.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RecipeError(f"postprocess.{key}", f"{source} is not UTF-8 text ({err.reason} at byte "
                              f"{err.start})", recipe=recipe) from err
        ctx.files[member] = data
        members[key] = member
    return replace(post, labels=members.get("labels", post.labels), charset=members.get("charset", post.charset))


def _check_postprocess_outputs(ctx: BuildContext, recipe: str) -> None:
    """Named outputs exist; a ctc charset has one symbol per class but the blank."""
    post, outputs = ctx.postprocess, {o.name: o for o in ctx.outputs}
    named = post.outputs.to_json() if post.outputs is not None else {}
    for role, name in named.items():
        if name not in outputs:
            raise RecipeError(f"postprocess.outputs.{role}", f"no model output named {name!r} (outputs: "
                              f"{', '.join(outputs)})", recipe=recipe)
    if post.kind != "ctc" or not post.charset:
        return
    symbols = load_charset(ctx.files["assets/charset.txt"].decode("utf-8"), append_space=post.append_space)
    output = outputs[post.output or ctx.outputs[0].name]
    classes = output.shape[-1] if output.shape else None
    if isinstance(classes, int) and classes != len(symbols) + 1:
        raise RecipeError("postprocess.charset", f"has {len(symbols)} symbols"
                          f"{' with the appended space' if post.append_space else ''}, but output "
                          f"{output.name} has {classes} classes: the charset plus the blank must be {classes}",
                          recipe=recipe)


@register
class IoSpecPass(Pass):
    """Record inputs/outputs and the normalized pre/postprocessing specs; check they fit."""

    name = "io_spec"

    def run(self, ctx: BuildContext) -> None:
        ctx.inputs, ctx.outputs = graph_io(ctx.require_model(), model_label(ctx))
        recipe = str(ctx.recipe.path)
        ctx.preprocess = ctx.recipe.preprocess
        post = _bundle_assets(ctx, ctx.recipe.postprocess, recipe)
        ctx.postprocess, softmax_note = resolve_apply_softmax(ctx.require_model(), post)
        names = [i.name for i in ctx.inputs]
        target = ctx.preprocess.input
        if target is not None and target not in names:
            raise RecipeError("preprocess.input", f"no model input named {target!r} (inputs: {', '.join(names)})",
                              recipe=recipe)
        if ctx.preprocess.kind == "image":
            self._check_image_input(ctx, target or names[0], recipe)
        output = ctx.postprocess.output
        if output is not None and output not in [o.name for o in ctx.outputs]:
            raise RecipeError("postprocess.output", f"no model output named {output!r}", recipe=recipe)
        _check_postprocess_outputs(ctx, recipe)
        ctx.report[self.name] = {
            "inputs": [i.to_json() for i in ctx.inputs],
            "outputs": [o.to_json() for o in ctx.outputs],
            **({"apply_softmax": softmax_note} if softmax_note else {}),
        }

    @staticmethod
    def _check_image_input(ctx: BuildContext, name: str, recipe: str) -> None:
        spec = ctx.preprocess
        model_input = next(i for i in ctx.inputs if i.name == name)
        height, width = spec.resize.size if spec.resize is not None else (None, None)
        channels = spec.channels
        if spec.layout == "NCHW":
            expected: list[int | None] = [channels, height, width]
        else:
            expected = [height, width, channels]
        shape = list(model_input.shape)
        if spec.batch:
            shape = shape[1:]
        if len(shape) != 3:
            raise RecipeError("preprocess", f"input {name} has shape {list(model_input.shape)}, "
                              "not an image tensor for this layout", recipe=recipe)
        for got, want in zip(shape, expected, strict=True):
            if isinstance(got, int) and want is not None and got != want:
                raise RecipeError("preprocess", f"produces {expected} per image but input {name} "
                                  f"expects {shape}", recipe=recipe)


@register
class RuntimeCompatPass(Pass):
    """The last step before signing: prune opset imports no node uses, compute the artifact's
    real minimum onnxruntime from the final graph (opsets, IR, contrib ops, .ort format), and
    refuse a build that a target's onnxruntime cannot run, naming what needs a newer one."""

    name = "runtime_compat"

    def run(self, ctx: BuildContext) -> None:
        import onnxruntime as ort

        model = ctx.require_model()
        label = model_label(ctx)
        pruned = prune_opset_imports(model)
        lowered_from = lower_ir_version(model)
        ort_bytes = ctx.files.get(ctx.ort_member) if ctx.ort_member else None
        try:
            version, reason = graph_requirement(model, ort_format=ort_bytes is not None,
                                                ort_format_version=ort_format_version(ort_bytes or b""))
        except RuntimeTooOld as err:
            raise ModelError(label, str(err)) from err
        declared = ctx.recipe.target_onnxruntime
        runtimes = {t: declared.get(t) or profile_onnxruntime(t, format_version(parse_version(ort.__version__)))
                    for t in ctx.recipe.targets}
        shortfalls = target_shortfalls(version, reason, runtimes)
        if shortfalls:
            raise BuildError(self.name, f"{label}: {shortfalls[0]}" + (f" (and {len(shortfalls) - 1} more target(s))"
                                                                      if len(shortfalls) > 1 else ""))
        opsets = opset_versions(model)
        ctx.runtime = RuntimeRequirement(types.MappingProxyType(opsets), version, reason)
        ctx.report[self.name] = {"opsets": opsets, "pruned_opset_imports": pruned, "ir_version": int(model.ir_version),
                                 "ir_lowered_from": lowered_from, "min_onnxruntime": version, "reason": reason,
                                 "targets_onnxruntime": runtimes}
