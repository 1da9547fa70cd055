"""Small helpers for writing ONNX graphs by hand with deterministic bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8  # readable by onnxruntime >= 1.10


def initializer(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.ascontiguousarray(array.astype(np.float32)), name)


def save_model(graph: onnx.GraphProto, path: Path, doc: str) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="edgepack-demos",
                              doc_string=doc)
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(model.SerializeToString())
    return path


def float_input(name: str, shape: list[int | str]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)
