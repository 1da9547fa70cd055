"""Image preprocessing lowered into the graph (recipe ``preprocess: {kind: image, ..., in_graph: true}``).

The model then takes the resized pixels as uint8 NHWC and does the rest itself: a
``Transpose`` of the uint8 pixels to planes (NCHW), ``Cast`` to float32, one ``Mul`` and one
``Add`` by the fused per-channel constants of :func:`edgepack_core.preprocess.fused_scale_bias`
(``x * scale/std - mean/std``, shaped ``[C, 1, 1]``), a ``Transpose`` back for an NHWC model and
a ``Cast`` to float16 for a float16 input. Planes first because onnxruntime's Mul/Add
broadcasting a 3-wide last axis ran 855 us each on a 224x224 image against 30 us over planes
(the whole prefix: 124 us of kernel time). The agent only decodes and resizes (the
Preprocessor's ``in_graph`` mode), and a camera pipeline can feed its uint8 frames as they are.

Two passes:

- ``preprocess_graph_plan`` (right after ``io_spec``) checks the lowering is possible and
  takes ``in_graph`` out of the working spec, so everything up to validation (optimization,
  fp16, the quantizer's calibration, validation against the original) sees the float model
  fed by the Python path as before. Quantization therefore calibrates exactly the float part,
  and its first QuantizeLinear stays on the normalized tensor: the lowered arithmetic runs in
  float32 in front of it and is never quantized.
- ``preprocess_graph`` (after ``validate``, before the golden samples) rewrites the validated
  model, then proves the rewrite: the golden data source, through the float spec into the
  validated model and through the uint8 spec into the rewritten one, must give the same
  outputs within the lossless tolerance. Golden samples are then made on the rewritten model
  with uint8 inputs, so the device's smoke test runs the path it serves.

The Python path and the graph use the same float32 constants in the same order (multiply,
then add), so the tensors they compute are the same to the bit on onnxruntime's CPU kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import onnx
from onnx import TensorProto, helper, numpy_helper

from edgepack_core.manifest import TensorSpec
from edgepack_core.preprocess import fused_scale_bias
from edgepack_core.preprocess_spec import PreprocessSpec
from sdk.errors import BuildError, ModelError, RecipeError
from sdk.packager.data import context_options, load_samples
from sdk.packager.fidelity import check_fidelity
from sdk.packager.ort_host import run_feeds
from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.passes.golden import golden_source

CHECK_SAMPLES = 8
MIN_OPSET = 7  # Cast's integer ``to`` and numpy-style broadcasting of Mul/Add


@dataclass(frozen=True)
class PreprocessLowering:
    """``preprocess.in_graph``, planned by preprocess_graph_plan: the spec to lower (with
    ``in_graph``) into ``input``; ``done`` once preprocess_graph rewrote the validated model."""

    spec: PreprocessSpec
    input: str
    done: bool = False


def image_input_name(preprocess: PreprocessSpec, inputs: list[TensorSpec]) -> str:
    return preprocess.input or inputs[0].name


def _subgraphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield attr.g
            elif attr.type == onnx.AttributeProto.GRAPHS:
                yield from attr.graphs


def _rename_uses(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every node input named ``old`` becomes ``new``, in subgraphs too (unless a subgraph
    declares ``old`` itself, which hides the outer one there)."""
    for node in graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
    for sub in _subgraphs(graph):
        own = {i.name for i in sub.input} | {i.name for i in sub.initializer} | {o for n in sub.node for o in n.output}
        if old not in own:
            _rename_uses(sub, old, new)


def _taken_names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {o.name for o in graph.output}
    for node in graph.node:
        names.update(node.input)
        names.update(node.output)
        names.add(node.name)
    return names


def lower_preprocessing(model: onnx.ModelProto, name: str, spec: PreprocessSpec) -> TensorSpec:
    """Rewrite ``model`` in place so that input ``name`` takes uint8 NHWC pixels and the graph
    applies the spec's scale, mean/std, layout and dtype; returns the new input's spec.

    The input keeps its name and position; the tensor the model used to receive is now
    computed by the inserted nodes under a new, unused name."""
    graph = model.graph
    position = next(i for i, value in enumerate(graph.input) if value.name == name)
    original = graph.input[position]
    dims = list(original.type.tensor_type.shape.dim)
    nchw = spec.layout == "NCHW"
    to_nhwc = ([0, 2, 3, 1] if spec.batch else [1, 2, 0]) if nchw else list(range(len(dims)))
    to_planes = [0, 3, 1, 2] if spec.batch else [2, 0, 1]  # NHWC -> NCHW (or HWC -> CHW)
    to_pixels = [0, 2, 3, 1] if spec.batch else [1, 2, 0]  # and back
    taken = _taken_names(graph)

    def fresh(base: str) -> str:
        candidate, n = f"edgepack_pre/{base}", 1
        while candidate in taken:
            candidate, n = f"edgepack_pre/{base}_{n}", n + 1
        taken.add(candidate)
        return candidate

    normalized = fresh(f"{name}_normalized")
    _rename_uses(graph, name, normalized)
    gain, bias = fused_scale_bias(spec)
    gain_name, bias_name = fresh("gain"), fresh("bias")
    # Per-channel constants broadcast over whole planes ([C, 1, 1]): onnxruntime's Mul/Add over a
    # channels-last tensor broadcast a 3-element inner dimension, 11x slower than over planes.
    planes = (-1, 1, 1)
    nodes = [helper.make_node("Constant", [], [gain_name], name=fresh("gain_node"),
                              value=numpy_helper.from_array(gain.reshape(planes), gain_name)),
             helper.make_node("Constant", [], [bias_name], name=fresh("bias_node"),
                              value=numpy_helper.from_array(bias.reshape(planes), bias_name))]
    chain: list[tuple[str, dict[str, Any], list[str]]] = [("Transpose", {"perm": to_planes}, []),
                                                          ("Cast", {"to": TensorProto.FLOAT}, []),
                                                          ("Mul", {}, [gain_name]), ("Add", {}, [bias_name])]
    if not nchw:
        chain.append(("Transpose", {"perm": to_pixels}, []))
    if spec.dtype == "float16":
        chain.append(("Cast", {"to": TensorProto.FLOAT16}, []))
    current = name
    for index, (op, attributes, constants) in enumerate(chain):
        output = normalized if index == len(chain) - 1 else fresh(op.lower())
        nodes.append(helper.make_node(op, [current, *constants], [output], name=fresh(f"{op.lower()}_node"),
                                      **attributes))
        current = output
    for node in reversed(nodes):
        graph.node.insert(0, node)
    new_dims: list[int | str] = []
    replacement = helper.make_tensor_value_info(name, TensorProto.UINT8, None)
    shape = replacement.type.tensor_type.shape
    for axis in to_nhwc:
        dim = shape.dim.add()
        dim.CopyFrom(dims[axis])
        new_dims.append(int(dim.dim_value) if dim.HasField("dim_value") else dim.dim_param or f"{name}_dim{axis}")
    graph.input.remove(original)
    graph.input.insert(position, replacement)
    return TensorSpec(name, "uint8", tuple(new_dims))


@register
class PreprocessGraphPlanPass(Pass):
    """Check that ``preprocess.in_graph`` can be honoured, before any long work; set the
    lowering aside so the float passes see the float model and the Python path."""

    name = "preprocess_graph_plan"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.preprocess.in_graph

    def run(self, ctx: BuildContext) -> None:
        recipe = str(ctx.recipe.path)
        model = ctx.require_model()
        name = image_input_name(ctx.preprocess, ctx.inputs)
        spec = next(i for i in ctx.inputs if i.name == name)
        if spec.dtype != ctx.preprocess.dtype:
            raise RecipeError("preprocess.in_graph", f"input {name} is {spec.dtype} but the spec's dtype is "
                              f"{ctx.preprocess.dtype}: the lowered arithmetic must end in the input's dtype",
                              recipe=recipe)
        opset = next((int(o.version) for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        if opset < MIN_OPSET:
            raise RecipeError("preprocess.in_graph", f"needs ai.onnx opset {MIN_OPSET} or later (the model has "
                              f"{opset}); convert it with model.convert_opset", recipe=recipe)
        if name in {o.name for o in model.graph.output}:
            raise RecipeError("preprocess.in_graph", f"input {name} is also a graph output", recipe=recipe)
        key, source = golden_source(ctx)
        if source.kind not in ("images", "synthetic"):
            raise RecipeError("preprocess.in_graph", f"golden samples come from {key} ({source.kind}), "
                              "float tensors the lowered uint8 input cannot take: give golden.data as "
                              "{images: DIR}", recipe=recipe)
        ctx.lowering = PreprocessLowering(ctx.preprocess, name)
        ctx.preprocess = replace(ctx.preprocess, in_graph=False)
        ctx.report[self.name] = {"input": name}


@register
class PreprocessGraphPass(Pass):
    """Lower the image arithmetic into the validated model and prove the two paths agree."""

    name = "preprocess_graph"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.lowering is not None and not ctx.lowering.done

    def run(self, ctx: BuildContext) -> None:
        assert ctx.lowering is not None  # applies() said so
        graph_spec, name = ctx.lowering.spec, ctx.lowering.input
        float_spec, float_inputs = ctx.preprocess, list(ctx.inputs)
        before = ctx.model_bytes()
        model = ctx.require_model()
        lowered = lower_preprocessing(model, name, graph_spec)
        try:
            onnx.checker.check_model(model)
        except onnx.checker.ValidationError as err:  # a bug here, not in the user's model
            raise ModelError(name, f"the lowered preprocessing does not check: {str(err).splitlines()[0]}") from err
        ctx.inputs = [lowered if spec.name == name else spec for spec in float_inputs]
        ctx.preprocess = graph_spec
        ctx.lowering = replace(ctx.lowering, done=True)
        key, source = golden_source(ctx)
        options = context_options(ctx)
        as_floats = load_samples(source, float_spec, float_inputs, key=key, limit=CHECK_SAMPLES, **options)
        as_pixels = load_samples(source, graph_spec, ctx.inputs, key=key, limit=CHECK_SAMPLES, **options)
        fidelity = check_fidelity(run_feeds(before, as_floats.feeds), run_feeds(ctx.model_bytes(), as_pixels.feeds),
                                  sample_names=as_pixels.names)
        added = [node.op_type for node in model.graph.node if node.name.startswith("edgepack_pre/")]
        ctx.report[self.name] = {"input": lowered.to_json(), "nodes": added, "check": fidelity.to_json()}
        ctx.progress(f"preprocess_graph: {name} takes {lowered.dtype} {list(lowered.shape)}; "
                     f"{fidelity.summary()}")
        if not fidelity.ok:
            raise BuildError(self.name, f"the lowered preprocessing changes the model's answers: {fidelity.summary()}")

