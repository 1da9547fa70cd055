"""Graph utilities the passes share: opset imports by domain, every node (subgraphs and
functions included), pruning of unused imports, the least IR a graph needs, and the graph's
inputs and outputs as :class:`TensorSpec` values. Pure functions of an ``onnx.ModelProto``."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgepack_core.manifest import DTYPES, TensorSpec
from edgepack_core.ort_compat import DEFAULT_DOMAIN, normalize_domain
from sdk.errors import ModelError


def opset_versions(model: onnx.ModelProto) -> dict[str, int]:
    """Opset imports by domain, the default domain always spelled ``ai.onnx``."""
    return {normalize_domain(entry.domain): int(entry.version) for entry in model.opset_import}


def default_opset(model: onnx.ModelProto) -> int:
    """The ``ai.onnx`` opset, 0 when the model imports none (an ``ai.onnx.ml``-only model)."""
    return opset_versions(model).get(DEFAULT_DOMAIN, 0)


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs a node holds as attributes (If branches, Loop/Scan bodies)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """A graph and every subgraph (If/Loop/Scan bodies) inside it."""
    yield graph
    for node in graph.node:
        for sub in subgraphs(node):
            yield from _graphs(sub)


def all_graphs(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    """The main graph and every subgraph in it, outermost first."""
    return list(_graphs(model.graph))


def names_read(graph: onnx.GraphProto) -> set[str]:
    """Every name a node of ``graph`` or of its subgraphs reads, and every output of them:
    a subgraph reads outer-scope values (weights, activations) by name."""
    read: set[str] = set()
    for sub in _graphs(graph):
        read |= {name for node in sub.node for name in node.input}
        read |= {o.name for o in sub.output}
    return read


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


# Ops whose input at ``slot`` holds indices into an axis of their input 0 (``axis`` attribute,
# default ``default_axis``; None: any leading axis, GatherND/ScatterND), and OneHot, whose
# indices run up to its depth (input 1).
_INDEX_INPUTS: dict[str, tuple[int, int | None]] = {
    "Gather": (1, 0), "GatherElements": (1, 0), "ScatterElements": (1, 0), "Scatter": (1, 0),
    "GatherND": (1, None), "ScatterND": (1, None),
}


def _known_dims(graph: Any, inputs: Sequence[TensorSpec]) -> dict[str, list[int]]:
    """Static shapes of initializers, graph inputs (symbolic dims as synthetic data fills them:
    1) and inferred values of ``graph``."""
    dims: dict[str, list[int]] = {s.name: [d if isinstance(d, int) and d >= 0 else 1 for d in s.shape] for s in inputs}
    for init in graph.graph.initializer:
        dims[init.name] = list(init.dims)
    for info in graph.graph.value_info:
        shape = info.type.tensor_type.shape
        if info.type.HasField("tensor_type") and all(d.HasField("dim_value") for d in shape.dim):
            dims.setdefault(info.name, [int(d.dim_value) for d in shape.dim])
    return dims


def _indexed_size(node: Any, dims: Mapping[str, list[int]], default_axis: int | None) -> int:
    """The size of the axis an index input of ``node`` selects from (1 when unknown)."""
    shape = dims.get(node.input[0])
    if not shape:
        return 1
    if default_axis is None:  # GatherND/ScatterND: an index may address any leading axis
        return max(min(int(d) for d in shape), 1)
    axis = next((a.i for a in node.attribute if a.name == "axis"), default_axis)
    return max(int(shape[axis]), 1) if -len(shape) <= axis < len(shape) else 1


def _one_hot_depth(node: Any, graph: Any) -> int:
    for init in graph.graph.initializer:
        if len(node.input) > 1 and init.name == node.input[1]:
            return max(int(np.asarray(numpy_helper.to_array(init)).reshape(-1)[0]), 1)
    return 1


def index_ranges(graph: Any, inputs: Sequence[TensorSpec]) -> dict[str, tuple[int, int]]:
    """Integer graph inputs used as indices (Gather and its kin, an embedding lookup, OneHot),
    with the range [0, size) of what they index, so made-up indices stay valid. Unknown sizes
    (symbolic) give [0, 1): synthetic data sets symbolic dims to 1."""
    if graph is None:
        return {}
    names = {s.name for s in inputs if s.dtype.startswith(("int", "uint"))}
    dims = _known_dims(graph, inputs)
    ranges: dict[str, tuple[int, int]] = {}
    for node in graph.graph.node:
        if node.op_type == "OneHot" and node.input and node.input[0] in names:
            name, size = node.input[0], _one_hot_depth(node, graph)
        elif node.op_type in _INDEX_INPUTS:
            slot, default_axis = _INDEX_INPUTS[node.op_type]
            if len(node.input) <= slot or node.input[slot] not in names:
                continue
            name, size = node.input[slot], _indexed_size(node, dims, default_axis)
        else:
            continue
        low, high = ranges.get(name, (0, size))
        ranges[name] = (low, min(high, size))
    return ranges


def checker_text(err: Exception) -> str:
    """The lines of an onnx.checker/shape-inference error that say what is wrong, on one line."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return "; ".join(lines[:4]) or type(err).__name__


def rename_uses(graph: onnx.GraphProto, old: str, new: str, field: str) -> None:
    """Point every node's ``field`` ("input" or "output") that names ``old`` at ``new``; readers
    inside subgraphs too (they read outer-scope values by name), unless a subgraph defines
    ``old`` itself."""
    for node in graph.node:
        names = getattr(node, field)
        for i, name in enumerate(names):
            if name == old:
                names[i] = new
        if field == "input":
            for sub in subgraphs(node):
                if old not in _defined(sub):
                    rename_uses(sub, old, new, field)
                    _rename_outputs(sub, old, new)


def _defined(graph: onnx.GraphProto) -> set[str]:
    """Names a graph defines itself (its inputs, initializers and node outputs): they shadow
    the outer scope's."""
    return {i.name for i in graph.input} | {i.name for i in graph.initializer} | \
        {o for node in graph.node for o in node.output}


def _rename_outputs(graph: onnx.GraphProto, old: str, new: str) -> None:
    """A subgraph output that passes an outer-scope value through is renamed with it."""
    for output in graph.output:
        if output.name == old:
            output.name = new
