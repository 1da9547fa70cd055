"""The fp16 conversion at the graph's edges (``optimize.fp16`` and the quantization search's fp16
candidate share ``_to_fp16_graph``).

Real exports read their own outputs: a recurrent state output feeds the next node, a detector's
concatenated output is also sliced, a classifier's logits feed the Softmax that is a second output.
The conversion used to rename only the producer of such an output, so its readers kept reading the
float32 Cast result next to float16 weights and onnxruntime refused the model (float vs float16).
An input passed straight through as an output, an output listed twice and an initializer that is
an output each produced a duplicate or mistyped tensor. Each case here converts, loads in a real
onnxruntime session and matches the fp32 model within fp16 tolerance with unchanged output names,
dtypes and shapes.
"""

from __future__ import annotations

import tarfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from sdk.packager.passes.fp16 import _to_fp16_graph
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe

SHAPE = [2, 4]
RTOL, ATOL = 1e-2, 1e-3  # fp16 has an 11-bit significand: ~5e-4 relative per rounding


def _model(nodes: list[onnx.NodeProto], inputs: list[str], outputs: list[str],
           inits: list[onnx.TensorProto] | None = None) -> onnx.ModelProto:
    """A float32 model over [2, 4] tensors, opset 17, IR 8 (what the packager's tests use)."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in outputs],
                              inits or [])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _const(name: str, value: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.full(SHAPE, value, np.float32), name)


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {i.name: rng.uniform(-2, 2, SHAPE).astype(np.float32) for i in model.graph.input}


def _convert_and_compare(model: onnx.ModelProto) -> onnx.ModelProto:
    """Convert, check the result is a valid (topologically sorted, well-typed) model, load it
    and compare every output with fp32: same names, dtypes, shapes, values within fp16 tolerance."""
    converted = _to_fp16_graph(model)
    onnx.checker.check_model(converted, full_check=True)
    want_session, got_session = _session(model), _session(converted)
    assert [(o.name, o.type) for o in got_session.get_outputs()] == [(o.name, o.type) for o in
                                                                     want_session.get_outputs()]
    assert [(i.name, i.type) for i in got_session.get_inputs()] == [(i.name, i.type) for i in
                                                                    want_session.get_inputs()]
    feeds = _feeds(model)
    for want, got in zip(want_session.run(None, feeds), got_session.run(None, feeds), strict=True):
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    return converted


def _readers(model: onnx.ModelProto, name: str) -> list[onnx.NodeProto]:
    return [node for node in model.graph.node if name in node.input]


def _producer(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    (node,) = [node for node in model.graph.node if name in node.output]
    return node


def _recurrent_state() -> onnx.ModelProto:
    """stateN = state * gain + input is an output and also feeds output = stateN * half."""
    return _model([helper.make_node("Mul", ["state", "gain"], ["held"]),
                   helper.make_node("Add", ["held", "input"], ["stateN"]),
                   helper.make_node("Mul", ["stateN", "half"], ["output"])],
                  ["input", "state"], ["output", "stateN"], [_const("gain", 0.9), _const("half", 0.5)])


def _logits_and_softmax() -> onnx.ModelProto:
    """logits = x @ W + b is an output and feeds the Softmax that is the second output."""
    weight = numpy_helper.from_array(np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4), "W")
    return _model([helper.make_node("MatMul", ["x", "W"], ["mm"]),
                   helper.make_node("Add", ["mm", "b"], ["logits"]),
                   helper.make_node("Softmax", ["logits"], ["probs"], axis=-1)],
                  ["x"], ["logits", "probs"], [weight, _const("b", 0.25)])


def _concat_and_slice() -> onnx.ModelProto:
    """A head's concatenated output [2, 8] is an output and is also sliced (and scaled) into a
    second output [2, 4]."""
    starts, ends, axes = (numpy_helper.from_array(np.int64([v]), n) for n, v in
                          (("starts", 2), ("ends", 6), ("axes", 1)))
    graph = helper.make_graph(
        [helper.make_node("Concat", ["a", "b"], ["boxes"], axis=1),
         helper.make_node("Slice", ["boxes", "starts", "ends", "axes"], ["mid"]),
         helper.make_node("Mul", ["mid", "scale"], ["scores"])], "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in ("a", "b")],
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, [2, 8]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, SHAPE)],
        [starts, ends, axes, _const("scale", 3.0)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(("make", "output"), [(_recurrent_state, "stateN"), (_logits_and_softmax, "logits"),
                                              (_concat_and_slice, "boxes")],
                         ids=["recurrent_state", "logits_feed_softmax", "concat_is_sliced"])
def test_an_output_other_nodes_read_stays_float32_while_its_readers_read_float16(make, output):
    """The colleague's report: these failed to load (float vs float16 in the reader)."""
    converted = _convert_and_compare(make())
    cast = _producer(converted, output)
    assert cast.op_type == "Cast" and cast.attribute[0].i == TensorProto.FLOAT
    assert _readers(converted, output) == [], "no node inside the graph reads the float32 output"
    internal = cast.input[0]
    assert _producer(converted, internal).op_type != "Cast" and _readers(converted, internal)[0].op_type != "Cast"


def test_an_input_read_by_many_nodes_gets_one_shared_cast():
    model = _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Sigmoid", ["x"], ["s"]),
                    helper.make_node("Mul", ["x", "w"], ["m"]), helper.make_node("Sum", ["r", "s", "m"], ["y"])],
                   ["x"], ["y"], [_const("w", 1.5)])
    converted = _convert_and_compare(model)
    (cast,) = _readers(converted, "x")
    assert cast.op_type == "Cast" and len(_readers(converted, cast.output[0])) == 3


def test_an_input_passed_through_as_an_output_is_that_input_and_its_readers_read_float16():
    """x is an output as is (no Cast may produce it: it would be defined twice) and still read."""
    model = _model([helper.make_node("Mul", ["x", "w"], ["y"])], ["x"], ["x", "y"], [_const("w", 0.5)])
    converted = _convert_and_compare(model)
    assert not [n for n in converted.graph.node if "x" in n.output]
    assert [n.op_type for n in _readers(converted, "x")] == ["Cast"]


def test_an_input_passed_through_that_no_node_reads_needs_no_cast():
    model = _model([helper.make_node("Relu", ["a"], ["y"])], ["a", "x"], ["y", "x"])
    converted = _convert_and_compare(model)
    assert _readers(converted, "x") == [] and [n.op_type for n in converted.graph.node].count("Cast") == 2


def test_an_output_listed_twice_gets_one_cast():
    model = _model([helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["y"], ["z"])],
                   ["x"], ["y", "z", "y"])
    converted = _convert_and_compare(model)
    assert [o.name for o in converted.graph.output] == ["y", "z", "y"]
    assert _producer(converted, "y").op_type == "Cast"


def test_an_initializer_that_is_an_output_is_cast_and_still_read_as_float16():
    """A constant output (also added to x inside the graph) comes out float32 with its value."""
    model = _model([helper.make_node("Add", ["x", "c"], ["y"])], ["x"], ["y", "c"], [_const("c", 0.75)])
    converted = _convert_and_compare(model)
    cast = _producer(converted, "c")
    assert cast.op_type == "Cast" and cast.input[0] in {i.name for i in converted.graph.initializer}
    assert "c" not in {i.name for i in converted.graph.initializer}


def test_a_constant_node_that_is_an_output_is_cast():
    constant = helper.make_node("Constant", [], ["k"], value=_const("kv", 2.0))
    model = _model([constant, helper.make_node("Mul", ["x", "k"], ["y"])], ["x"], ["k", "y"])
    converted = _convert_and_compare(model)
    assert _producer(converted, "k").op_type == "Cast"


def test_an_initializer_defaulting_an_input_keeps_the_inputs_float32_type():
    """An input with an initializer (an overridable default) is fed float32 or falls back to the
    default; either way the input's Cast converts it, so the default must stay float32."""
    model = _model([helper.make_node("Add", ["x", "bias"], ["y"])], ["x", "bias"], ["y"], [_const("bias", 0.5)])
    converted = _convert_and_compare(model)
    (bias,) = [i for i in converted.graph.initializer if i.name == "bias"]
    assert bias.data_type == TensorProto.FLOAT
    x = np.ones(SHAPE, np.float32)
    np.testing.assert_allclose(_session(converted).run(None, {"x": x})[0], x + 0.5, rtol=RTOL)


def test_the_internal_name_does_not_collide_with_an_existing_tensor():
    """A model may already hold a tensor named like the conversion's float16 twin."""
    model = _model([helper.make_node("Relu", ["x"], ["y.fp16"]), helper.make_node("Neg", ["y.fp16"], ["y"]),
                    helper.make_node("Abs", ["y"], ["x.fp16"])], ["x"], ["y", "x.fp16"])
    _convert_and_compare(model)


def test_an_fp16_build_of_a_model_whose_output_feeds_a_node_succeeds(tmp_path: Path, keypair):
    """Through the packager (``optimize: {fp16: true}``, validated against fp32): it failed to load."""
    onnx.save(_recurrent_state(), tmp_path / "m.onnx")
    (tmp_path / "r.yaml").write_text("name: f\nversion: 1.0.0\nmodel: {path: m.onnx}\noptimize: {fp16: true}\n"
                                     "validate: {data: synthetic, metric: cosine, min_cosine: 0.999}\n")
    result = build(load_recipe(tmp_path / "r.yaml"), key_paths=[str(keypair[0])], output=tmp_path / "a.edgepkg")
    assert result.report["passes"]["fp16"]["applied"] is True
    assert result.manifest.raw["model"]["precision"] == "fp16"
    assert [(o.name, o.dtype) for o in result.manifest.outputs] == [("output", "float32"), ("stateN", "float32")]
    with tarfile.open(tmp_path / "a.edgepkg") as tar:
        shipped = onnx.load_from_string(tar.extractfile("model/model.onnx").read())
    assert any(i.data_type == TensorProto.FLOAT16 for i in shipped.graph.initializer)
    source = _recurrent_state()
    feeds = _feeds(source)
    for want, got in zip(_session(source).run(None, feeds), _session(shipped).run(None, feeds), strict=True):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
