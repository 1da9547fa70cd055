"""The ``fp16`` pass: the graph in fp16 with fp32 inputs and outputs, refused when a weight or an
activation would overflow fp16 (the conversion is also the quantization search's fp16 candidate).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sdk.packager.onnx_graph import all_graphs, rename_uses
from sdk.packager.ort_worker import session_workarounds
from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.self_check import check_feeds

FP16_MAX = 65504.0


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
            rename_uses(graph, graph_input.name, internal, "input")
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
        rename_uses(graph, name, internal, "output")
        rename_uses(graph, name, internal, "input")
        if name in initializers:
            initializers[name].name = internal
        casts.append(helper.make_node("Cast", [internal], [name], to=TensorProto.FLOAT))
    return casts


def _subgraph_to_fp16(graph: onnx.GraphProto) -> None:
    """An If/Loop/Scan body in float16 like the graph around it: its constants, and its float
    inputs and outputs (what the outer graph, already float16, hands it and takes back)."""
    _float_constants_to_fp16(graph)
    del graph.value_info[:]
    for value in [*graph.input, *graph.output]:
        if _is_float(value):
            value.type.tensor_type.elem_type = TensorProto.FLOAT16


def _to_fp16_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float32 tensor becomes float16; Casts at the graph edges keep io types float32.

    Readers inside the graph always see the float16 tensor, also when it is a graph output
    (a recurrent state, a head's logits feeding its Softmax) or comes from a graph input or an
    initializer: only the graph's edges are float32, so no node mixes float and float16, and
    the Casts at the start and the end keep the node list in topological order. If/Loop/Scan
    bodies are float16 throughout too (they read the outer graph's float16 weights by name)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    taken = _tensor_names(graph)
    _float_constants_to_fp16(graph)
    for sub in all_graphs(out)[1:]:
        _subgraph_to_fp16(sub)
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
    guard = "lossy"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.optimize.fp16 and ctx.recipe.quantize.mode == "none"

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        weights = max(
            (
                float(np.abs(numpy_helper.to_array(i)).max())
                for i in model.graph.initializer
                if i.data_type == TensorProto.FLOAT and i.dims
            ),
            default=0.0,
        )
        # The recipe's real data when it gives some: made-up inputs may miss the range real ones reach.
        feeds, checked_on = check_feeds(ctx, 4)
        activations = activation_ranges(model, feeds)
        if max(weights, activations) >= FP16_MAX:
            ctx.warn(
                f"fp16 refused: values up to {max(weights, activations):.3g} overflow fp16 (max {FP16_MAX}); "
                "keeping fp32"
            )
            ctx.report[self.name] = {"applied": False, "max_weight": weights, "max_activation": activations}
            return
        ctx.model = _to_fp16_graph(model)
        ctx.lossy = "fp16"
        ctx.report[self.name] = {"applied": True, "max_weight": weights, "max_activation": activations,
                                 "checked_on": checked_on}
