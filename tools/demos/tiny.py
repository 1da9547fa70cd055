"""A tiny model for per-call overhead benchmarks: y = Relu(x + b), x float32 [1, 4]."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import helper

from tools.demos.onnx_util import float_input, initializer, save_model


def build_tiny(out: Path) -> Path:
    out = Path(out)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["sum"]), helper.make_node("Relu", ["sum"], ["y"])],
        "tiny", [float_input("x", [1, 4])], [float_input("y", [1, 4])],
        [initializer("bias", np.array([0.5, -0.5, 1.0, -1.0]))],
    )
    model = save_model(graph, out / "model.onnx", "Tiny Add+Relu model for overhead measurements")
    np.save(out / "example.npy", np.array([[1.0, 2.0, -3.0, 0.25]], np.float32))
    return model
