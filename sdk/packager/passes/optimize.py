"""Optimization passes. Each is a small registered unit reading the ``optimize`` section.

Order matters and is fixed by the pipeline: fixed shapes (for accelerators that need them),
identity elimination, BatchNorm folding, onnxruntime's offline graph optimization, then fp16
(after the folding: an unfolded BatchNorm variance can overflow fp16, measured on a real
detector), then quantization.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgepack_core.manifest import TensorSpec
from edgepack_core.targets import STATIC_SHAPE_TARGETS
from sdk.errors import BuildError
from sdk.packager import ort_host
from sdk.packager.onnx_graph import graph_io, lower_ir_version, prune_opset_imports
from sdk.packager.options import option
from sdk.packager.ort_worker import session_workarounds
from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.passes.model_checks import model_label

FP16_MAX = 65504.0
ORT_MEMBER = "model/model.ort"
# Targets whose providers share one CPU family, so "extended" offline optimizations (fusions
# written for the CPU execution provider) stay valid on every one of them.
_CPU_ONLY_TARGETS = {"x86"}


@dataclass(frozen=True)
class OptimizeOptions:
    """``optimize``: read by fix_shapes, eliminate_identity, fold_batchnorm, ort_optimize, fp16, ort_format."""

    level: Literal["none", "basic", "extended", "all"] | None = option(
        None, description="onnxruntime offline optimization; none also turns the graph clean-ups off (default: "
        "basic, extended when every target is x86 and the build does not quantize)")
    fold_batchnorm: bool = option(True, description="fold BatchNormalization into the Conv before it")
    constant_folding: bool = option(True, description="run onnxruntime's offline optimizer")
    fp16: bool = option(False, description="convert to fp16 keeping fp32 inputs and outputs")
    fixed_shapes: bool | None = option(None, description="give symbolic input dims size 1 (default: on for "
                                       "targets whose accelerator needs static shapes: android, apple)")
    ort_format: bool = option(False, description="add the .ort format (model/model.ort) for onnxruntime mobile")

    def graph_pass(self, flag: bool = True) -> bool:
        """Graph clean-ups run unless ``level: none`` or their own flag turns them off."""
        return self.level != "none" and flag


def _rename(graph: onnx.GraphProto, old: str, new: str, field: str) -> None:
    """Point every node's ``field`` ("input" or "output") that names ``old`` at ``new``."""
    for node in graph.node:
        names = getattr(node, field)
        for i, name in enumerate(names):
            if name == old:
                names[i] = new


def _initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {init.name: init for init in model.graph.initializer}


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
            _rename(graph, node.output[0], node.input[0], "input")
            removed += 1
        ctx.report[self.name] = {"removed": removed}


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
            bias = numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64) if len(conv.input) > 2 \
                else np.zeros(weight.shape[0])
            factor = scale / np.sqrt(var + epsilon)
            new_weight = weight * factor.reshape(-1, *([1] * (weight.ndim - 1)))
            new_bias = (bias - mean) * factor + beta
            stem = conv.name or conv.output[0]
            weight_name, bias_name = f"{stem}.folded_w", f"{stem}.folded_b"
            graph.initializer.extend([numpy_helper.from_array(new_weight.astype(np.float32), weight_name),
                                      numpy_helper.from_array(new_bias.astype(np.float32), bias_name)])
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


@register
class OrtOptimizePass(Pass):
    """onnxruntime's offline graph optimization (constant folding, redundant node removal,
    fusions). Level ``basic`` by default, because higher levels may produce nodes only one
    execution provider runs; ``extended`` only when every target runs the CPU provider alone.
    The result must prove itself (``check_optimized``): an optimizer bug or an IR-3 leftover
    would otherwise ship a broken graph, while the unoptimized one is always right (onnxruntime
    optimizes again when the device loads it). Unused opset imports the save adds are pruned."""

    name = "ort_optimize"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.optimize.graph_pass(ctx.recipe.optimize.constant_folding)

    def level(self, ctx: BuildContext) -> str:
        requested = ctx.recipe.optimize.level
        portable = set(ctx.recipe.targets) <= _CPU_ONLY_TARGETS
        if requested in ("extended", "all") and not portable:
            ctx.warn(f"optimize.level {requested} is not portable across targets {', '.join(ctx.recipe.targets)}; "
                     "using basic")
            return "basic"
        # A build that quantizes stays at basic unless asked: extended fusions make com.microsoft
        # ops (FusedConv) that onnxruntime.quantization leaves float, and the device's onnxruntime
        # applies them (and the QDQ fusions) when it loads the model anyway.
        quantizes = ctx.recipe.quantize.mode != "none"
        return requested or ("extended" if portable and not quantizes else "basic")

    def run(self, ctx: BuildContext) -> None:
        level = self.level(ctx)
        model = ctx.require_model()
        before = len(model.graph.node)
        label = model_label(ctx)
        report: dict[str, Any] = {"level": level, "nodes_before": before}
        try:
            optimized = onnx.load_from_string(ort_host.optimize_offline(ctx.model_bytes(), level, label=label))
        except BuildError as err:  # the optimizer failed (or crashed): the graph itself may still run
            problem: str | None = f"onnxruntime's optimizer failed: {err.problem}"
        else:
            prune_opset_imports(optimized)
            problem = check_optimized(model, optimized, ctx.inputs)
        if problem is not None:
            ctx.warn(f"ort_optimize: kept the unoptimized graph: {problem}")
            ctx.report[self.name] = {**report, "applied": False, "reason": problem}
            return
        ctx.model = optimized
        ctx.report[self.name] = {**report, "applied": True, "nodes_after": len(optimized.graph.node)}


# The optimizer's result must reproduce its input graph on made-up inputs within these bounds
# (fusions reorder float arithmetic; anything beyond this is a broken rewrite, not rounding).
CHECK_SAMPLES = 3
CHECK_RTOL, CHECK_ATOL = 1e-3, 1e-4


def dangling_inputs(model: onnx.ModelProto, fed: set[str]) -> list[str]:
    """Graph inputs nobody feeds and no initializer gives, and node inputs no one produces."""
    graph = model.graph
    known = fed | {i.name for i in graph.initializer} | {""}
    missing = [i.name for i in graph.input if i.name not in known]
    produced = known | {i.name for i in graph.input} | {o for n in graph.node for o in n.output}
    missing += sorted({name for n in graph.node for name in n.input if name not in produced})
    return missing


def probe_feeds(inputs: list[TensorSpec], count: int, seed: int = 11) -> list[dict[str, np.ndarray]]:
    """Made-up inputs for comparing two forms of one graph (never for accuracy claims): floats in
    [0, 1), integers 0 (a valid index on any non-empty axis), False, "a"; named dims of size 1."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(count):
        feed: dict[str, np.ndarray] = {}
        for spec in inputs:
            shape = tuple(d if isinstance(d, int) else 1 for d in spec.shape)
            if spec.dtype == "string":
                feed[spec.name] = np.full(shape, "a", dtype=object)
            elif spec.dtype == "bfloat16":
                raise ValueError(f"input {spec.name} is bfloat16, which numpy cannot make")
            elif np.dtype(spec.dtype).kind == "f":
                feed[spec.name] = rng.random(shape).astype(spec.dtype)
            else:
                feed[spec.name] = np.zeros(shape, dtype=spec.dtype)
        feeds.append(feed)
    return feeds


def outputs_differ(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> str | None:
    """The first output where ``candidate`` departs from ``reference``, or None. Pure."""
    for name, want in reference.items():
        got = candidate.get(name)
        if got is None:
            return f"output {name} is missing"
        want, got = np.asarray(want), np.asarray(got)
        if want.shape != got.shape or want.dtype != got.dtype:
            return f"output {name} is {got.dtype}{list(got.shape)}, was {want.dtype}{list(want.shape)}"
        if want.dtype.kind in "fc":
            if not np.allclose(got, want, rtol=CHECK_RTOL, atol=CHECK_ATOL, equal_nan=True):
                worst = float(np.nanmax(np.abs(got.astype(np.float64) - want.astype(np.float64)), initial=0.0))
                return f"output {name} differs by up to {worst:.3g} (rtol {CHECK_RTOL}, atol {CHECK_ATOL})"
        elif not np.array_equal(got, want):
            return f"output {name} differs"
    return None


def check_optimized(original: onnx.ModelProto, optimized: onnx.ModelProto, inputs: list[TensorSpec]) -> str | None:
    """Why the optimized graph must not replace the original (one line), or None when it is
    proven: every input fed or initialised, and the same outputs on a few made-up inputs."""
    missing = dangling_inputs(optimized, {spec.name for spec in inputs})
    if missing:
        return f"the optimized graph reads {', '.join(missing[:3])}, which nothing feeds or initialises"
    if [o.name for o in optimized.graph.output] != [o.name for o in original.graph.output]:
        return "the optimized graph's outputs differ from the original's"
    try:
        feeds = probe_feeds(inputs, CHECK_SAMPLES)
        reference = ort_host.run_feeds(original.SerializeToString(), feeds)
    except (BuildError, ValueError) as err:
        return f"it could not be compared with the original on made-up inputs ({err})"
    try:
        candidate = ort_host.run_feeds(optimized.SerializeToString(), feeds)
    except BuildError as err:
        return f"onnxruntime cannot run it ({err})"
    for index, (want, got) in enumerate(zip(reference, candidate, strict=True)):
        problem = outputs_differ(want, got)
        if problem is not None:
            return f"{problem} on made-up sample {index}"
    return None


def _fresh_name(taken: set[str], base: str) -> str:
    """A tensor name not yet in the graph for the fp16 twin of ``base`` (a model may already
    hold a tensor called ``base.fp16``); the name is reserved in ``taken``."""
    name, suffix = f"{base}.fp16", 1
    while name in taken:
        name, suffix = f"{base}.fp16.{suffix}", suffix + 1
    taken.add(name)
    return name


def _tensor_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name the top-level graph uses, so new names cannot collide with one."""
    names = {v.name for v in [*graph.input, *graph.output, *graph.value_info]}
    names |= {i.name for i in graph.initializer}
    names |= {name for node in graph.node for name in [*node.input, *node.output]}
    return names


def _is_float(value: onnx.ValueInfoProto) -> bool:
    return value.type.tensor_type.elem_type == TensorProto.FLOAT


def _float_constants_to_fp16(graph: onnx.GraphProto) -> None:
    """Float32 initializers, Constant/attribute tensors and Cast-to-float become float16. An
    initializer that is also a graph input is that input's default and keeps the input's float32
    type (the input's Cast converts whatever value it ends up with)."""
    inputs = {i.name for i in graph.input}
    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT and init.name not in inputs:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float16)))
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.FLOAT16


def _cast_inputs(graph: onnx.GraphProto, taken: set[str]) -> list[onnx.NodeProto]:
    """One Cast to float16 per float32 graph input that nodes read, shared by all its readers.
    An input nothing reads (one passed straight through as an output) needs none."""
    read = {name for node in graph.node for name in node.input}
    casts = []
    for graph_input in graph.input:
        if _is_float(graph_input) and graph_input.name in read:
            internal = _fresh_name(taken, graph_input.name)
            _rename(graph, graph_input.name, internal, "input")
            casts.append(helper.make_node("Cast", [graph_input.name], [internal], to=TensorProto.FLOAT16))
    return casts


def _cast_outputs(graph: onnx.GraphProto, taken: set[str]) -> list[onnx.NodeProto]:
    """One Cast to float32 per float32 graph output name. The fp16 tensor is renamed everywhere
    it appears inside the graph (its producer, the nodes that also read it, an initializer that
    is the output), so internal readers keep reading float16 and the output keeps its name.
    An output that is a graph input is that input itself, already float32: no Cast."""
    inputs = {i.name for i in graph.input}
    initializers = {i.name: i for i in graph.initializer}
    casts, done = [], set()
    for graph_output in graph.output:
        name = graph_output.name
        if not _is_float(graph_output) or name in inputs or name in done:
            continue
        done.add(name)
        internal = _fresh_name(taken, name)
        _rename(graph, name, internal, "output")
        _rename(graph, name, internal, "input")
        if name in initializers:
            initializers[name].name = internal
        casts.append(helper.make_node("Cast", [internal], [name], to=TensorProto.FLOAT))
    return casts


def _to_fp16_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float32 tensor becomes float16; Casts at the graph edges keep io types float32.

    Readers inside the graph always see the float16 tensor, also when it is a graph output
    (a recurrent state, a head's logits feeding its Softmax) or comes from a graph input or an
    initializer: only the graph's edges are float32, so no node mixes float and float16, and
    the Casts at the start and the end keep the node list in topological order."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    taken = _tensor_names(graph)
    _float_constants_to_fp16(graph)
    del graph.value_info[:]
    casts_in = _cast_inputs(graph, taken)
    casts_out = _cast_outputs(graph, taken)
    nodes = [*casts_in, *graph.node, *casts_out]
    del graph.node[:]
    graph.node.extend(nodes)
    return onnx.shape_inference.infer_shapes(out)


def activation_ranges(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> float:
    """Largest absolute value any intermediate tensor takes on ``feeds`` (fp32 run)."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    known = {o.name for o in probe.graph.output}
    for node in probe.graph.node:
        for name in node.output:
            if name and name not in known:
                probe.graph.output.append(helper.make_empty_tensor_value_info(name))
    serialized = probe.SerializeToString()
    # In this process, not the worker: the same workaround keeps a float16 source model's probe alive.
    session = ort.InferenceSession(serialized, providers=["CPUExecutionProvider"], **session_workarounds(serialized))
    largest = 0.0
    for feed in feeds:
        for value in session.run(None, feed):
            if isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.size:
                largest = max(largest, float(np.nanmax(np.abs(value))))
    return largest


@register
class Fp16Pass(Pass):
    """Convert to fp16 keeping fp32 inputs and outputs, after checking nothing overflows."""

    name = "fp16"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.optimize.fp16 and ctx.recipe.quantize.mode == "none"

    def run(self, ctx: BuildContext) -> None:
        from sdk.packager.data import synthetic_samples

        model = ctx.require_model()
        weights = max((float(np.abs(numpy_helper.to_array(i)).max()) for i in model.graph.initializer
                       if i.data_type == TensorProto.FLOAT and i.dims), default=0.0)
        feeds = synthetic_samples(4, ctx.preprocess, ctx.inputs).feeds
        activations = activation_ranges(model, feeds)
        if max(weights, activations) >= FP16_MAX:
            ctx.warn(f"fp16 refused: values up to {max(weights, activations):.3g} overflow fp16 (max {FP16_MAX}); "
                     "keeping fp32")
            ctx.report[self.name] = {"applied": False, "max_weight": weights, "max_activation": activations}
            return
        ctx.model = _to_fp16_graph(model)
        ctx.lossy = "fp16"
        ctx.report[self.name] = {"applied": True, "max_weight": weights, "max_activation": activations}


@register
class OrtFormatPass(Pass):
    """Add the compact ``.ort`` format next to the .onnx for onnxruntime mobile builds."""

    name = "ort_format"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.optimize.ort_format

    def run(self, ctx: BuildContext) -> None:
        import subprocess
        import sys

        prune_opset_imports(ctx.require_model())  # the .ort file keeps the imports and IR it is given
        lower_ir_version(ctx.require_model())
        folder = ctx.new_tempdir("ort-format-")
        source = folder / "model.onnx"
        source.write_bytes(ctx.model_bytes())
        result = subprocess.run([sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(source),
                                 "--optimization_style", "Fixed"], capture_output=True, text=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=300)
        produced = sorted(Path(folder).glob("*.ort"))
        if result.returncode != 0 or not produced:
            raise BuildError(self.name, f"ORT format conversion failed: {result.stderr.strip().splitlines()[-1:]}")
        ctx.files[ORT_MEMBER] = produced[0].read_bytes()
        ctx.ort_member = ORT_MEMBER
        ctx.report[self.name] = {"bytes": produced[0].stat().st_size}
