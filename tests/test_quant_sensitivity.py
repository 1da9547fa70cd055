"""Where int8 hurts, as pure functions on given graphs and arrays: the head, Concats of very
different ranges, keeping a tensor float (producer and every consumer), the rounding a QDQ
graph gives each activation, and tensors ranked by their measured signal-to-quantization-noise
ratio. One real capture at the end: the worker-side profile on a small model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from sdk.packager import quant_sensitivity as sens
from sdk.packager.quant_sensitivity import ErrorTally, QuantParams


def _graph(nodes, outputs=("out",), inits=()) -> onnx.GraphProto:
    return helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                             [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                             initializer=list(inits))


def _detector_graph() -> onnx.GraphProto:
    """x -> Conv -> Relu -> Conv (box) -> Mul (stride) \\
                          -> MatMul (cls) -> Sigmoid     -> Concat -> out"""
    return _graph([
        helper.make_node("Conv", ["x", "w0"], ["f"], name="stem"),
        helper.make_node("Relu", ["f"], ["r"], name="act"),
        helper.make_node("Conv", ["r", "w1"], ["b"], name="box"),
        helper.make_node("Mul", ["b", "stride"], ["pixels"], name="scale"),
        helper.make_node("MatMul", ["r", "w2"], ["c"], name="cls"),
        helper.make_node("Sigmoid", ["c"], ["scores"], name="sig"),
        helper.make_node("Concat", ["pixels", "scores"], ["out"], axis=1, name="join"),
    ])


def test_the_head_is_every_node_after_the_last_heavy_op():
    assert sens.head_nodes(_detector_graph()) == ("scale", "sig", "join")


def test_a_model_ending_in_a_heavy_op_has_no_head():
    graph = _graph([helper.make_node("Relu", ["x"], ["r"], name="act"),
                    helper.make_node("Gemm", ["r", "w"], ["out"], name="fc")])
    assert sens.head_nodes(graph) == ()


def test_the_head_walk_stops_at_graph_inputs_and_reaches_every_output():
    graph = _graph([helper.make_node("Neg", ["x"], ["a"], name="neg"),
                    helper.make_node("MatMul", ["a", "w"], ["m"], name="mm"),
                    helper.make_node("Abs", ["m"], ["out"], name="abs"),
                    helper.make_node("Exp", ["x"], ["out2"], name="exp")], outputs=("out", "out2"))
    assert sens.head_nodes(graph) == ("abs", "exp"), "neg is behind the MatMul; exp reads the input directly"


def test_keeping_a_tensor_float_excludes_its_producer_and_every_consumer():
    graph = _detector_graph()
    assert sens.keep_float_nodes(graph, "r") == ("act", "box", "cls")
    assert sens.keep_float_nodes(graph, "x") == ("stem",), "a graph input has no producer"
    assert sens.keep_float_nodes(graph, "out") == ("join",), "a graph output has no consumer"
    assert sens.keep_float_nodes(graph, "nothing") == ()


def test_the_quantization_span_always_includes_zero():
    assert sens.quantization_span(0.0, 1.0) == 1.0
    assert sens.quantization_span(2.0, 5.0) == 5.0
    assert sens.quantization_span(-3.0, -1.0) == 3.0
    assert sens.quantization_span(-3.0, 640.0) == 643.0


@pytest.mark.parametrize(("high", "wide"), [(10.0, True), (9.99, False), (640.0, True)])
def test_a_concat_of_ranges_ten_times_apart_is_wide(high, wide):
    ranges = {"pixels": (0.0, high), "scores": (0.0, 1.0)}
    found = sens.wide_range_concats(_detector_graph(), ranges)
    assert found == ([("out", pytest.approx(high))] if wide else [])


def test_unmeasured_and_empty_concat_inputs_are_left_out_and_the_widest_come_first():
    graph = _graph([helper.make_node("Concat", ["a", "k"], ["o1"], axis=0, name="c1"),
                    helper.make_node("Concat", ["a", "z", "b"], ["o2"], axis=0, name="c2"),
                    helper.make_node("Concat", ["a", "b", "d"], ["out"], axis=0, name="c3")])
    ranges = {"a": (0.0, 1.0), "z": (0.0, 0.0), "b": (-20.0, 0.0), "d": (0.0, 500.0)}
    assert sens.wide_range_concats(graph, ranges) == [("out", 500.0), ("o2", 20.0)], \
        "c1 joins a constant (k, unmeasured); z is always 0"


def _noisy(rng: np.random.Generator, shape, level: float) -> tuple[np.ndarray, np.ndarray]:
    signal = rng.standard_normal(shape)
    return signal, signal + level * rng.standard_normal(shape)


def test_tensors_are_ranked_by_measured_error_worst_first():
    rng = np.random.default_rng(0)
    shape = (1, 8, 16, 16)
    tallies = sens.tally_arrays({"clean": [_noisy(rng, shape, 0.001)], "rough": [_noisy(rng, shape, 0.1)],
                                 "mid": [_noisy(rng, shape, 0.01)]})
    ranked = sens.rank_tensors(tallies)
    assert [name for name, _ in ranked] == ["rough", "mid", "clean"]
    assert [round(db) for _, db in ranked] == [20, 40, 60], "noise at 1/10, 1/100, 1/1000 of the signal"


def test_an_outlier_channel_ranks_a_tensor_worse_than_its_whole_tensor_sqnr_says():
    rng = np.random.default_rng(1)
    spread = rng.standard_normal((1, 16, 8, 8))
    spread[0, 0] *= 1000.0  # one channel sets the scale
    rounded = QuantParams(np.array(np.ptp(spread) / 255, np.float32), np.array(128, np.uint8), 0, 255)
    outlier = ErrorTally()
    outlier.add(spread, rounded.round_trip(spread))
    evenly = ErrorTally()
    evenly.add(*_noisy(rng, (1, 16, 8, 8), 0.1))  # 20 dB everywhere
    whole = 10 * np.log10(outlier.signal / outlier.noise)
    assert whole > 25 > evenly.sqnr_db, "over the whole tensor the outlier tensor looks better"
    assert outlier.sqnr_db < 5, "15 of 16 channels round to nothing"
    assert [name for name, _ in sens.rank_tensors({"outlier": outlier, "evenly": evenly})] == ["outlier", "evenly"]


def test_samples_accumulate_as_one_concatenated_measurement():
    rng = np.random.default_rng(2)
    pairs = [_noisy(rng, (1, 4, 6), level) for level in (0.01, 0.2, 0.05)]
    split = sens.tally_arrays({"t": pairs})["t"]
    joined = ErrorTally()
    joined.add(np.concatenate([p[0] for p in pairs], 2), np.concatenate([p[1] for p in pairs], 2))
    assert split.sqnr_db == pytest.approx(joined.sqnr_db)
    assert split.samples == 3


def test_exact_and_silent_channels_are_clamped_not_infinite():
    exact = ErrorTally()
    exact.add(np.ones((1, 2, 3)), np.ones((1, 2, 3)))
    assert exact.sqnr_db == sens.SQNR_CEILING_DB
    silent = ErrorTally()
    silent.add(np.zeros((1, 2, 3)), np.full((1, 2, 3), 0.5))
    assert silent.sqnr_db == sens.SQNR_FLOOR_DB
    vector = ErrorTally()
    vector.add(np.array([3.0, 4.0]), np.array([3.0, 4.5]))
    assert vector.sqnr_db == pytest.approx(10 * np.log10(25 / 0.25))


def test_a_changed_channel_count_falls_back_to_the_whole_tensor():
    tally = ErrorTally()
    tally.add(np.ones((1, 4, 2)), np.ones((1, 4, 2)) * 1.1)
    tally.add(np.ones((1, 3, 2)), np.ones((1, 3, 2)) * 1.1)
    assert set(tally.per_axis) == {2}, "axis 1 changed size; the last axis kept its 2"
    with pytest.raises(ValueError, match="shapes differ"):
        tally.add(np.ones((1, 2)), np.ones((1, 3)))


@pytest.mark.parametrize(("zero_dtype", "low", "high"), [(np.uint8, 0, 255), (np.int8, -128, 127)])
def test_a_round_trip_rounds_and_clips_as_quantize_dequantize_linear(zero_dtype, low, high):
    zero = 128 if zero_dtype is np.uint8 else 0
    params = QuantParams(np.array(0.5, np.float32), np.array(zero, zero_dtype), low, high)
    value = np.array([0.0, 0.2, 0.3, -1.1, 1000.0, -1000.0])
    expected = np.array([0.0, 0.0, 0.5, -1.0, (high - zero) * 0.5, (low - zero) * 0.5])
    assert np.allclose(params.round_trip(value), expected)


def test_a_per_channel_scale_applies_along_axis_1():
    params = QuantParams(np.array([0.5, 2.0], np.float32), np.array([0, 0], np.int8), -128, 127)
    value = np.array([[[0.7], [2.9]]])
    assert np.allclose(params.round_trip(value), [[[0.5], [2.0]]])


def test_the_qdq_graph_gives_each_activation_its_scale_and_weights_are_left_out():
    scale = numpy_helper.from_array(np.array(0.1, np.float32), "s")
    zero = numpy_helper.from_array(np.array(3, np.uint8), "z")
    weight = numpy_helper.from_array(np.ones((4, 4), np.int8), "w_q")
    graph = _graph([
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q_in"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_in"),
        helper.make_node("DequantizeLinear", ["w_q", "s"], ["wd"], name="dq_w"),
        helper.make_node("MatMul", ["xd", "wd"], ["out_QuantizeLinear_Input"], name="mm"),
        helper.make_node("QuantizeLinear", ["out_QuantizeLinear_Input", "s", "z"], ["oq"], name="q_out"),
        helper.make_node("DequantizeLinear", ["oq", "s", "z"], ["out"], name="dq_out"),
    ], inits=[scale, zero, weight])
    params = sens.activation_quantization(graph)
    assert set(params) == {"x", "out"}, "the graph output's producer is named by its fp32 name"
    assert (float(params["x"].scale), int(params["x"].zero_point), params["x"].low, params["x"].high) == \
        (pytest.approx(0.1), 3, 0, 255)


def test_with_outputs_adds_intermediate_tensors_once_and_leaves_the_model_alone():
    model = helper.make_model(_detector_graph())
    probe = sens.with_outputs(model, ["r", "r", "out", "c"])
    assert [o.name for o in probe.graph.output] == ["out", "r", "c"]
    assert [o.name for o in model.graph.output] == ["out"]
    assert sens.float_tensors(model.graph) == ["f", "r", "b", "pixels", "c", "scores", "out"]


def test_the_worker_profile_measures_ranges_and_each_activations_own_rounding(tmp_path):
    from sdk.packager.ort_host import call_in_worker

    weight = np.diag([1000.0, 1.0, 1.0, 1.0]).astype(np.float32)  # feature 0: an outlier column
    model = helper.make_model(_graph([helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
                                      helper.make_node("Relu", ["m"], ["out"], name="act")],
                                     inits=[numpy_helper.from_array(weight, "w")]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "fp32.onnx")
    qdq = onnx.ModelProto()
    qdq.CopyFrom(model)  # round "m" to uint8 over [0, 1000]: the small columns vanish
    qdq.graph.initializer.extend([numpy_helper.from_array(np.array(1000 / 255, np.float32), "s"),
                                  numpy_helper.from_array(np.array(0, np.uint8), "z")])
    qdq.graph.node.insert(1, helper.make_node("QuantizeLinear", ["m", "s", "z"], ["mq"]))
    qdq.graph.node.insert(2, helper.make_node("DequantizeLinear", ["mq", "s", "z"], ["md"]))
    qdq.graph.node[3].input[0] = "md"
    onnx.save(qdq, tmp_path / "qdq.onnx")
    feeds = [{"x": np.array([[0.5, 0.4, 0.3, 0.2]], np.float32)}, {"x": np.array([[1.0, 0.9, 0.8, 0.7]], np.float32)}]
    profile = call_in_worker("sdk.packager.passes.quantize:profile_activations", tmp_path / "fp32.onnx",
                             tmp_path / "qdq.onnx", feeds)
    assert profile["ranges"]["m"] == (pytest.approx(0.2), pytest.approx(1000.0))
    assert profile["ranges"]["x"] == (pytest.approx(0.2), pytest.approx(1.0)), "inputs are measured too"
    assert set(profile["errors"]) == {"m"} and profile["errors"]["m"].samples == 2
    tally = profile["errors"]["m"]
    assert 10 * np.log10(tally.signal / tally.noise) > 50, "the whole tensor looks fine"
    assert tally.sqnr_db == pytest.approx((55.1 + 0 + 0 + 0) / 4, abs=0.5), "three of four columns round to 0 dB"
