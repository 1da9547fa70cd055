"""Real-world model shapes built from code (issue 23), shaped like what exporters write:
graphs whose declared outputs are not what they return, and classifiers whose softmax is
written out by hand. Each function returns the ONNX model; the tests build them with
``edgepack build`` and compare the served answer with bare onnxruntime on the original."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
FEATURES = 8
CLASSES = 5


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[onnx.ValueInfoProto],
    outputs: list[onnx.ValueInfoProto],
    initializers: list[onnx.TensorProto],
    name: str,
) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="pytorch")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def misdeclared_sequence_head(seed: int = 0, declared: tuple[int | str, ...] = (1, "seqlen")) -> onnx.ModelProto:
    """A CRNN-style head exported with a stale output annotation: ``x [1, seqlen, 8]`` ->
    MatMul -> Transpose to time-major -> a Reshape whose target shape is computed from the
    tensor (so shape inference cannot see through it). It declares ``logits [1, seqlen]`` but
    returns ``[seqlen, 1, 5]``."""
    rng = np.random.default_rng(seed)
    weight = numpy_helper.from_array(rng.standard_normal((FEATURES, CLASSES)).astype(np.float32), "W")
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["scores"], name="head_matmul"),
        helper.make_node("Transpose", ["scores"], ["time_major"], perm=[1, 0, 2], name="to_time_major"),
        helper.make_node("Shape", ["time_major"], ["dynamic_shape"], name="shape_of"),
        helper.make_node("Reshape", ["time_major", "dynamic_shape"], ["logits"], name="reshape_back"),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seqlen", FEATURES])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, list(declared))]
    return _model(nodes, inputs, outputs, [weight], "crnn_head")


def _classifier_logits(classes: int, seed: int) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """A linear layer whose class 0 dominates by far (the model is sure: p ~ 0.9999)."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((FEATURES, classes)).astype(np.float32) * 0.1
    bias = np.zeros(classes, np.float32)
    bias[0] = 20.0
    inits = [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")]
    return [helper.make_node("Gemm", ["x", "W", "B"], ["logits"], name="fc")], inits


def handwritten_softmax_classifier(classes: int = 200, seed: int = 0) -> onnx.ModelProto:
    """A classifier whose softmax an exporter wrote out as Exp / ReduceSum / Div (TF/keras and
    hand-fused exports do), giving ``probs [1, classes]``."""
    nodes, inits = _classifier_logits(classes, seed)
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "class_axis"))
    nodes += [
        helper.make_node("Exp", ["logits"], ["exp"], name="softmax_exp"),
        helper.make_node("ReduceSum", ["exp", "class_axis"], ["total"], keepdims=1, name="softmax_sum"),
        helper.make_node("Div", ["exp", "total"], ["probs"], name="softmax_div"),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, FEATURES])]
    outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, classes])]
    return _model(nodes, inputs, outputs, inits, "handwritten_softmax")


def reciprocal_softmax_classifier(classes: int = 200, seed: int = 0) -> onnx.ModelProto:
    """A softmax no graph pattern names: Exp times the Reciprocal of its sum. Only the
    validation outputs (non-negative, summing to 1 per row) show it is a distribution."""
    nodes, inits = _classifier_logits(classes, seed)
    inits.append(numpy_helper.from_array(np.array([1], np.int64), "class_axis"))
    nodes += [
        helper.make_node("Exp", ["logits"], ["exp"], name="exp"),
        helper.make_node("ReduceSum", ["exp", "class_axis"], ["total"], keepdims=1, name="sum"),
        helper.make_node("Reciprocal", ["total"], ["inverse"], name="inverse"),
        helper.make_node("Mul", ["exp", "inverse"], ["probs"], name="normalise"),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, FEATURES])]
    outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, classes])]
    return _model(nodes, inputs, outputs, inits, "reciprocal_softmax")


def logits_classifier(classes: int = 200, seed: int = 0) -> onnx.ModelProto:
    """A plain classifier ending in logits: ``topk`` must still softmax them."""
    nodes, inits = _classifier_logits(classes, seed)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, FEATURES])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, classes])]
    return _model(nodes, inputs, outputs, inits, "logits")
