"""Pre-quantized models as users download them, built from code (issue 23, item 5).

- ``cast_mul_model``: int8 weights dequantized by Cast + Mul (a common export of weight-only
  quantization); folding the Cast/Mul turns every weight into a float initializer, 4x the bytes.
- ``integer_ops_model``: DynamicQuantizeLinear feeding ConvInteger and MatMulInteger (what
  ``quantize_dynamic`` writes for Conv and MatMul).
- ``qdq_model``: a float Conv + MatMul model through ``onnxruntime.quantization.quantize_static``
  (QuantizeLinear/DequantizeLinear pairs, int8 weights).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
CHANNELS, SIDE, FILTERS, CLASSES = 3, 16, 16, 10


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path


def _int8(rng: np.random.Generator, shape: tuple[int, ...], name: str) -> onnx.TensorProto:
    return numpy_helper.from_array(rng.integers(-127, 128, shape).astype(np.int8), name)


def cast_mul_model(path: Path, width: int = 256, layers: int = 3, seed: int = 5) -> Path:
    """``x [1, width]`` through ``layers`` MatMuls whose int8 weights are dequantized by
    Cast(float) and Mul(scale): about ``layers * width**2`` bytes of int8 weights."""
    rng = np.random.default_rng(seed)
    nodes, inits, current = [], [], "x"
    for layer in range(layers):
        inits += [
            _int8(rng, (width, width), f"w{layer}_q"),
            numpy_helper.from_array(np.float32(1.0 / (127 * width**0.5)), f"w{layer}_scale"),
        ]
        nodes += [
            helper.make_node("Cast", [f"w{layer}_q"], [f"w{layer}_f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"w{layer}_f", f"w{layer}_scale"], [f"w{layer}"]),
            helper.make_node("MatMul", [current, f"w{layer}"], [f"h{layer}"]),
        ]
        current = f"h{layer}"
    nodes.append(helper.make_node("Identity", [current], ["y"]))
    graph = helper.make_graph(
        nodes,
        "cast_mul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])],
        inits,
    )
    return _save(graph, path)


def _conv_integer(rng: np.random.Generator) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """x -> DynamicQuantizeLinear -> ConvInteger (uint8 weights) -> Cast -> Mul(x_scale * w_scale) -> Relu."""
    w = rng.integers(0, 256, (FILTERS, CHANNELS, 3, 3)).astype(np.uint8)
    inits = [
        numpy_helper.from_array(w, "conv_w"),
        numpy_helper.from_array(np.uint8(128), "conv_w_zero"),
        numpy_helper.from_array(np.float32(0.01), "conv_w_scale"),
    ]
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xq_scale", "xq_zero"]),
        helper.make_node("ConvInteger", ["xq", "conv_w", "xq_zero", "conv_w_zero"], ["conv_i"], pads=[1, 1, 1, 1]),
        helper.make_node("Cast", ["conv_i"], ["conv_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["xq_scale", "conv_w_scale"], ["conv_scale"]),
        helper.make_node("Mul", ["conv_f", "conv_scale"], ["conv_out"]),
        helper.make_node("Relu", ["conv_out"], ["feat"]),
    ]
    return nodes, inits


def _matmul_integer(rng: np.random.Generator) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """pooled features -> DynamicQuantizeLinear -> MatMulInteger (uint8 weights) -> Cast -> Mul -> logits."""
    w = rng.integers(0, 256, (FILTERS, CLASSES)).astype(np.uint8)
    inits = [
        numpy_helper.from_array(w, "fc_w"),
        numpy_helper.from_array(np.uint8(128), "fc_w_zero"),
        numpy_helper.from_array(np.float32(0.02), "fc_w_scale"),
        numpy_helper.from_array(np.array([0, -1], np.int64), "flat_shape"),
    ]
    nodes = [
        helper.make_node("GlobalAveragePool", ["feat"], ["pooled"]),
        helper.make_node("Reshape", ["pooled", "flat_shape"], ["flat"]),
        helper.make_node("DynamicQuantizeLinear", ["flat"], ["fq", "fq_scale", "fq_zero"]),
        helper.make_node("MatMulInteger", ["fq", "fc_w", "fq_zero", "fc_w_zero"], ["fc_i"]),
        helper.make_node("Cast", ["fc_i"], ["fc_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["fq_scale", "fc_w_scale"], ["fc_scale"]),
        helper.make_node("Mul", ["fc_f", "fc_scale"], ["logits"]),
    ]
    return nodes, inits


def integer_ops_model(path: Path, seed: int = 7) -> Path:
    """``x [1, 3, 16, 16]`` -> ConvInteger -> pool -> MatMulInteger -> ``logits [1, 10]``,
    activations quantized at run time by DynamicQuantizeLinear."""
    rng = np.random.default_rng(seed)
    conv_nodes, conv_inits = _conv_integer(rng)
    fc_nodes, fc_inits = _matmul_integer(rng)
    graph = helper.make_graph(
        conv_nodes + fc_nodes,
        "integer_ops",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CHANNELS, SIDE, SIDE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, CLASSES])],
        conv_inits + fc_inits,
    )
    return _save(graph, path)


def float_model(path: Path, seed: int = 9, hidden: int = 256) -> Path:
    """The float model ``qdq_model`` quantizes: Conv(16 filters) -> Relu -> pool -> MatMul ->
    Relu -> MatMul -> ``logits [1, 10]``; most bytes in the ``hidden``-wide MatMul weights."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.2, (FILTERS, CHANNELS, 3, 3)).astype(np.float32), "conv_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, FILTERS).astype(np.float32), "conv_b"),
        numpy_helper.from_array(np.array([1, FILTERS * 4], np.int64), "flat_shape"),
        numpy_helper.from_array(rng.normal(0, 0.1, (FILTERS * 4, hidden)).astype(np.float32), "fc1_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, (hidden, hidden)).astype(np.float32), "fc2_w"),
        numpy_helper.from_array(rng.normal(0, 0.1, (hidden, CLASSES)).astype(np.float32), "fc3_w"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "conv_w", "conv_b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["act"]),
        helper.make_node("MaxPool", ["act"], ["pool"], kernel_shape=[8, 8], strides=[8, 8]),
        helper.make_node("Reshape", ["pool", "flat_shape"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc1_w"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["a1"]),
        helper.make_node("MatMul", ["a1", "fc2_w"], ["h2"]),
        helper.make_node("Relu", ["h2"], ["a2"]),
        helper.make_node("MatMul", ["a2", "fc3_w"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "float_cnn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, CHANNELS, SIDE, SIDE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, CLASSES])],
        inits,
    )
    return _save(graph, path)


class _Feeds:
    """onnxruntime.quantization's CalibrationDataReader over fixed random images."""

    def __init__(self, count: int = 8, seed: int = 3) -> None:
        rng = np.random.default_rng(seed)
        self._feeds = iter([{"x": rng.random((1, CHANNELS, SIDE, SIDE), dtype=np.float32)} for _ in range(count)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def qdq_model(folder: Path) -> Path:
    """``float_model`` through ``quantize_static`` (QDQ, int8 weights, per-tensor MinMax)."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    source = float_model(folder / "float.onnx")
    out = folder / "qdq.onnx"
    quantize_static(
        str(source),
        str(out),
        _Feeds(),
        quant_format=QuantFormat.QDQ,
        activation_type=QuantType.QUInt8,
        weight_type=QuantType.QInt8,
    )
    return out


def images(count: int = 6, seed: int = 21) -> np.ndarray:
    """Validation inputs for the image-shaped models: ``count`` x [1, 3, 16, 16] in [0, 1)."""
    return np.random.default_rng(seed).random((count, 1, CHANNELS, SIDE, SIDE), dtype=np.float32)


def qoperator_model(folder: Path) -> Path:
    """``float_model`` through ``quantize_static`` in QOperator form (QLinearConv, QLinearMatMul)."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    source = float_model(folder / "float.onnx")
    out = folder / "qop.onnx"
    quantize_static(str(source), str(out), _Feeds(), quant_format=QuantFormat.QOperator)
    return out


def dynamic_model(folder: Path) -> Path:
    """``float_model`` through ``quantize_dynamic`` on MatMul only (DynamicQuantizeLinear +
    MatMulInteger; the Conv stays float: the report's ``mixed`` split)."""
    from onnxruntime.quantization import quantize_dynamic

    source = float_model(folder / "float.onnx")
    out = folder / "dyn.onnx"
    quantize_dynamic(str(source), str(out), op_types_to_quantize=["MatMul"])
    return out
