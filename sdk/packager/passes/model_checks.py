"""Foundation passes: load the model, check it, convert or bound its opsets by what onnxruntime runs, infer
shapes, fix the I/O spec; and the last step, the artifact's real minimum onnxruntime (``runtime_compat``)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgepack_core.manifest import DTYPES, TensorSpec
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
from edgepack_core.postprocess import load_charset, normalize_postprocess
from edgepack_core.preprocess import normalize_preprocess
from edgepack_core.targets import profile_onnxruntime
from sdk.errors import BuildError, ModelError, RecipeError
from sdk.packager import ort_host
from sdk.packager.passes.base import BuildContext, Pass, register


def model_label(ctx: BuildContext) -> str:
    """The model's name in messages: its file name, or the recipe's name for an export."""
    source = ctx.recipe.data.get("model") or {}
    path = source.get("path") if isinstance(source, dict) else None
    return Path(str(path)).name if path else ctx.recipe.name


def opset_versions(model: onnx.ModelProto) -> dict[str, int]:
    """Opset imports by domain, the default domain always spelled ``ai.onnx``."""
    return {normalize_domain(entry.domain): int(entry.version) for entry in model.opset_import}


def default_opset(model: onnx.ModelProto) -> int:
    """The ``ai.onnx`` opset, 0 when the model imports none (an ``ai.onnx.ml``-only model)."""
    return opset_versions(model).get(DEFAULT_DOMAIN, 0)


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """A graph and every subgraph (If/Loop/Scan bodies) inside it."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    yield from _graphs(sub)


def all_nodes(model: onnx.ModelProto) -> Iterator[onnx.NodeProto]:
    """Every node: main graph, subgraphs, and model-local function bodies."""
    for graph in _graphs(model.graph):
        yield from graph.node
    for function in model.functions:
        yield from function.node


def used_op_types(model: onnx.ModelProto) -> set[tuple[str, str]]:
    """(domain, op_type) of every node, domains normalized; calls of model-local functions excluded
    (onnxruntime inlines them, so their bodies count instead)."""
    local = {(normalize_domain(f.domain), f.name) for f in model.functions}
    found = {(normalize_domain(n.domain), n.op_type) for n in all_nodes(model)}
    return found - local


def prune_opset_imports(model: onnx.ModelProto) -> list[str]:
    """Drop opset imports no node uses (onnxruntime's optimized-model save adds ai.onnx.ml,
    com.microsoft and others); an older onnxruntime refuses imports newer than it knows even when
    unused. Returns the pruned domains. The default domain stays when nothing else is imported."""
    used = {normalize_domain(n.domain) for n in all_nodes(model)}
    keep = [e for e in model.opset_import if normalize_domain(e.domain) in used]
    if not keep:
        keep = [e for e in model.opset_import if normalize_domain(e.domain) == DEFAULT_DOMAIN][:1]
    pruned = sorted(normalize_domain(e.domain) for e in model.opset_import if e not in keep)
    if pruned:
        kept = [onnx.OperatorSetIdProto(domain=e.domain, version=e.version) for e in keep]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return pruned


def drop_initializer_inputs(model: onnx.ModelProto) -> list[str]:
    """IR 3 lists every initializer as a graph input too. Edgepack never lets a caller override a
    weight, and onnxruntime's optimizer keeps such inputs after folding their initializers away
    (an input nobody feeds), so they are removed, and the IR raised to 4, where this is the rule."""
    initializers = {init.name for init in model.graph.initializer}
    dropped = [i.name for i in model.graph.input if i.name in initializers]
    if dropped:
        kept = [i for i in model.graph.input if i.name not in initializers]
        del model.graph.input[:]
        model.graph.input.extend(kept)
        model.ir_version = max(int(model.ir_version), 4)
    return dropped


# Element types every IR from 3 on knows (FLOAT .. BFLOAT16); float8, int4 and later types
# pin the IR version the model declares.
_CLASSIC_TYPES = frozenset(range(0, TensorProto.BFLOAT16 + 1))
_TYPE_ATTRIBUTES = frozenset({"to", "dtype", "output_dtype", "output_datatype"})


def _value_types_classic(graph: onnx.GraphProto) -> bool:
    for info in [*graph.input, *graph.output, *graph.value_info]:
        if info.type.WhichOneof("value") != "tensor_type" or info.type.tensor_type.elem_type not in _CLASSIC_TYPES:
            return False
    return all(init.data_type in _CLASSIC_TYPES for init in graph.initializer) and not graph.sparse_initializer \
        and not graph.metadata_props


def _node_classic(node: onnx.NodeProto) -> bool:
    if node.overload or node.metadata_props or node.device_configurations:
        return False
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type not in _CLASSIC_TYPES:
            return False
        if attr.type in (onnx.AttributeProto.SPARSE_TENSOR, onnx.AttributeProto.SPARSE_TENSORS,
                         onnx.AttributeProto.TYPE_PROTO, onnx.AttributeProto.TYPE_PROTOS):
            return False
        if attr.name in _TYPE_ATTRIBUTES and attr.type == onnx.AttributeProto.INT and attr.i not in _CLASSIC_TYPES:
            return False
    return True


def lower_ir_version(model: onnx.ModelProto) -> int | None:
    """Lower the IR version to the least the graph needs, so an older onnxruntime loads it:
    onnx.helper stamps its newest IR on every model (IR 14 needs onnxruntime 1.32), while an
    opset-17 graph of classic tensors needs IR 8 (onnxruntime 1.9). The floor is the IR of the
    opsets (onnx's own table), 4 when an initializer is not a graph input. A model using anything
    a later IR brought (functions, training info, sparse or non-tensor values, float8/int4 types,
    overloads, metadata on nodes) keeps its IR. Returns the IR it had when lowered, else None."""
    graphs = list(_graphs(model.graph))
    if model.functions or model.training_info or not all(_value_types_classic(g) for g in graphs) \
            or not all(_node_classic(n) for g in graphs for n in g.node):
        return None
    floor = helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    inputs = {i.name for i in model.graph.input}
    if any(init.name not in inputs for init in model.graph.initializer):
        floor = max(floor, 4)
    if floor >= model.ir_version:
        return None
    before = int(model.ir_version)
    model.ir_version = floor
    return before


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


def tensor_dtype_name(elem_type: int) -> str:
    if elem_type == TensorProto.STRING:
        return "string"
    if elem_type == TensorProto.BFLOAT16:
        return "bfloat16"
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).name


def value_info_spec(info: onnx.ValueInfoProto, what: str = "input") -> TensorSpec:
    """A graph input/output as a TensorSpec. Dims: a size >= 0, or a name (named dims, and the
    literal -1 some exporters write for "any", become ``NAME_dimI``)."""
    kind = info.type.WhichOneof("value")
    if kind != "tensor_type":
        raise ModelError(what, f"{info.name} is a {kind or 'typeless value'}, not a tensor; Edgepack packages "
                               "models whose inputs and outputs are tensors (for scikit-learn exports: "
                               "options zipmap=False)")
    tensor = info.type.tensor_type
    try:
        dtype = tensor_dtype_name(tensor.elem_type)
    except (KeyError, TypeError, ValueError):
        dtype = ""
    if dtype not in DTYPES:
        type_name = TensorProto.DataType.Name(tensor.elem_type) if tensor.elem_type in \
            TensorProto.DataType.values() else str(tensor.elem_type)
        raise ModelError(what, f"{info.name} has element type {type_name}, which Edgepack cannot carry "
                               f"(supported: {', '.join(DTYPES)})")
    if not tensor.HasField("shape") and what.endswith("input"):
        raise ModelError(what, f"{info.name} declares no rank; declare its shape in the recipe: "
                               f"inputs: {{{info.name}: {{shape: [...]}}}}")
    dims: list[int | str] = []
    for i, dim in enumerate(tensor.shape.dim):
        if dim.HasField("dim_value") and dim.dim_value >= 0:
            dims.append(int(dim.dim_value))
        else:
            dims.append(dim.dim_param or f"{info.name}_dim{i}")
    return TensorSpec(info.name, dtype, tuple(dims))


def graph_io(model: onnx.ModelProto, label: str = "graph") -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Inputs a caller feeds (initializers excluded: IR-3 models list them as inputs too) and outputs."""
    initializers = {init.name for init in model.graph.initializer}
    inputs = [value_info_spec(i, f"{label}: input") for i in model.graph.input if i.name not in initializers]
    outputs = [value_info_spec(o, f"{label}: output") for o in model.graph.output]
    return inputs, outputs


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
            path = ctx.recipe.data["model"]["path"]
            try:
                ctx.model = onnx.load(path)
            except Exception as err:  # onnx raises DecodeError, OSError, ValueError...
                raise ModelError(path, f"cannot be loaded as ONNX ({type(err).__name__}: {err})") from None
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
            if ctx.recipe.data["model"].get("strict_check"):
                raise ModelError(label, f"onnx.checker refused it (model.strict_check is on): {finding}") from None
            try:
                ort_host.describe(ctx.model_bytes(), label=label)
            except BuildError as ort_err:
                raise ModelError(label, f"onnx.checker refused it ({finding}) and onnxruntime cannot load it "
                                        f"({ort_err.problem})") from None
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
        return ctx.recipe.data["model"].get("convert_opset") is not None

    def run(self, ctx: BuildContext) -> None:
        from onnx import version_converter

        label = model_label(ctx)
        target = int(ctx.recipe.data["model"]["convert_opset"])
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
                                    f"{_checker_text(err)}") from None
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
            raise ModelError(label, str(err)) from None
        default = opsets.get(DEFAULT_DOMAIN)
        if default is not None and default < GUARANTEED_MIN_OPSET:
            ctx.warn(f"{label} uses ai.onnx opset {default}; onnxruntime guarantees opsets "
                     f"{GUARANTEED_MIN_OPSET} and later")
        ctx.report[self.name] = {"opsets": opsets, "min_onnxruntime": version, "reason": reason}


def _override_shapes(model: onnx.ModelProto, overrides: dict[str, Any], recipe: str) -> None:
    by_name = {i.name: i for i in model.graph.input}
    for name, override in overrides.items():
        if name not in by_name:
            known = ", ".join(sorted(by_name))
            raise RecipeError(f"inputs.{name}", f"the model has no such input (inputs: {known})", recipe=recipe)
        tensor = by_name[name].type.tensor_type
        if "shape" in override:
            shape = override["shape"]
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
    section = "inputs"

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        _override_shapes(model, dict(self.options(ctx)), str(ctx.recipe.path))
        try:
            ctx.model = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError) as err:
            # onnxruntime infers shapes itself at load time; ONNX's strict inference refuses graphs
            # it runs (ops whose inference ONNX lacks), so this is a finding like onnx.checker's.
            label = model_label(ctx)
            if ctx.recipe.data["model"].get("strict_check"):
                raise ModelError(label, f"shape inference failed (model.strict_check is on): "
                                        f"{_checker_text(err)}") from None
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


def resolve_apply_softmax(model: onnx.ModelProto, post: dict[str, Any]) -> dict[str, Any] | None:
    """topk/ctc: write the resolved ``apply_softmax`` into ``post`` and say why (for the report).

    Why: a classifier that already ends in Softmax scored by a second softmax reports 0.45
    where the model says 0.92; the recipe's explicit value always wins."""
    if post.get("kind") not in ("topk", "ctc"):
        return None
    output = post.get("output") or model.graph.output[0].name
    if "apply_softmax" in post:
        return {"value": post["apply_softmax"], "output": output, "why": "set in the recipe"}
    node = _softmax_producer(model, output)
    post["apply_softmax"] = node is None
    why = (f"output {output} comes from Softmax node {node.name or '(unnamed)'}: scores are its probabilities"
           if node is not None else f"output {output} does not come from a Softmax: scores are its softmax")
    return {"value": post["apply_softmax"], "output": output, "why": why}


def _bundle_assets(ctx: BuildContext, post: dict[str, Any], recipe: str) -> dict[str, Any]:
    """Labels and charset files travel in the artifact; the spec names them by member path."""
    for key, member in (("labels", "assets/labels.txt"), ("charset", "assets/charset.txt")):
        if not post.get(key):
            continue
        with open(post[key], "rb") as handle:
            data = handle.read()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RecipeError(f"postprocess.{key}", f"{post[key]} is not UTF-8 text ({err.reason} at byte "
                              f"{err.start})", recipe=recipe) from None
        ctx.files[member] = data
        post[key] = member
    return post


def _check_postprocess_outputs(ctx: BuildContext, recipe: str) -> None:
    """Named outputs exist; a ctc charset has one symbol per class but the blank."""
    post, outputs = ctx.postprocess, {o.name: o for o in ctx.outputs}
    for role, name in (post.get("outputs") or {}).items():
        if name not in outputs:
            raise RecipeError(f"postprocess.outputs.{role}", f"no model output named {name!r} (outputs: "
                              f"{', '.join(outputs)})", recipe=recipe)
    if post.get("kind") != "ctc" or not post.get("charset"):
        return
    symbols = load_charset(ctx.files["assets/charset.txt"].decode("utf-8"), append_space=post["append_space"])
    output = outputs[post.get("output") or ctx.outputs[0].name]
    classes = output.shape[-1] if output.shape else None
    if isinstance(classes, int) and classes != len(symbols) + 1:
        raise RecipeError("postprocess.charset", f"has {len(symbols)} symbols"
                          f"{' with the appended space' if post['append_space'] else ''}, but output "
                          f"{output.name} has {classes} classes: the charset plus the blank must be {classes}",
                          recipe=recipe)


@register
class IoSpecPass(Pass):
    """Record inputs/outputs and the normalized pre/postprocessing specs; check they fit."""

    name = "io_spec"

    def run(self, ctx: BuildContext) -> None:
        ctx.inputs, ctx.outputs = graph_io(ctx.require_model(), model_label(ctx))
        recipe = str(ctx.recipe.path)
        ctx.preprocess = normalize_preprocess(ctx.recipe.data.get("preprocess"))
        post = _bundle_assets(ctx, dict(ctx.recipe.data.get("postprocess") or {"kind": "raw"}), recipe)
        softmax_note = resolve_apply_softmax(ctx.require_model(), post)
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
        ort_bytes = ctx.files.get(ctx.manifest_extra.get("ort_path", ""))
        try:
            version, reason = graph_requirement(model, ort_format=ort_bytes is not None,
                                                ort_format_version=ort_format_version(ort_bytes or b""))
        except RuntimeTooOld as err:
            raise ModelError(label, str(err)) from None
        declared = ctx.recipe.data.get("target_onnxruntime") or {}
        runtimes = {t: declared.get(t) or profile_onnxruntime(t, format_version(parse_version(ort.__version__)))
                    for t in ctx.recipe.targets}
        shortfalls = target_shortfalls(version, reason, runtimes)
        if shortfalls:
            raise BuildError(self.name, f"{label}: {shortfalls[0]}" + (f" (and {len(shortfalls) - 1} more target(s))"
                                                                      if len(shortfalls) > 1 else ""))
        opsets = opset_versions(model)
        if DEFAULT_DOMAIN in opsets:
            ctx.manifest_extra["opset"] = opsets[DEFAULT_DOMAIN]
        ctx.manifest_extra["opsets"] = opsets
        ctx.manifest_extra["min_onnxruntime"] = version
        ctx.report[self.name] = {"opsets": opsets, "pruned_opset_imports": pruned, "ir_version": int(model.ir_version),
                                 "ir_lowered_from": lowered_from, "min_onnxruntime": version, "reason": reason,
                                 "targets_onnxruntime": runtimes}
