"""Graphs shaped like real exports, built from code (issue 23's corpus, the graph-pass part):
what torch.onnx and older exporters really write, for the packager's graph passes to meet.

- :func:`if_reading_outer_initializers`: a torch.onnx-style ``If`` whose branches read weights
  of the outer graph (outer-scope references) and end in an ``Identity``;
- :func:`ir4_initializers_as_inputs`: an IR-4 export (``keep_initializers_as_inputs``) of a
  Conv/BatchNormalization/Relu stack with a fixed batch of 10 at 32x32.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(array, dtype=np.float32), name)


def if_reading_outer_initializers(seed: int = 0) -> onnx.ModelProto:
    """x[1, 8] -> Gemm_0 -> If(sum > 0): then Gemm_1(h, W1 of the outer graph), else
    Gemm_2(h, W2 of the outer graph), each branch's result through an Identity (as torch.onnx
    writes a branch output). No BatchNormalization anywhere."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("W0", rng.normal(size=(8, 8))),
        _init("B0", rng.normal(size=8)),
        _init("W1", rng.normal(size=(8, 4))),
        _init("W2", rng.normal(size=(8, 4))),
        _init("B1", rng.normal(size=4)),
    ]

    def branch(name: str, weight: str, node: str) -> onnx.GraphProto:
        return helper.make_graph(
            [
                helper.make_node("Gemm", ["h", weight, "B1"], [f"{name}_g"], name=node),
                helper.make_node("Identity", [f"{name}_g"], [f"{name}_out"], name=f"Identity_{name}"),
            ],
            name,
            [],
            [helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, [1, 4])],
        )

    nodes = [
        helper.make_node("Gemm", ["x", "W0", "B0"], ["h0"], name="Gemm_0"),
        helper.make_node("Identity", ["h0"], ["h"], name="Identity_0"),
        helper.make_node("ReduceSum", ["h"], ["s"], keepdims=0, name="ReduceSum_0"),
        helper.make_node("Constant", [], ["zero"], value=numpy_helper.from_array(np.float32(0.0))),
        helper.make_node("Greater", ["s", "zero"], ["cond"], name="Greater_0"),
        helper.make_node(
            "If",
            ["cond"],
            ["y"],
            name="If_0",
            then_branch=branch("then", "W1", "Gemm_1"),
            else_branch=branch("else", "W2", "Gemm_2"),
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "torch_jit",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="pytorch")
    model.ir_version = 7
    onnx.checker.check_model(model, full_check=True)
    return model


def ir4_initializers_as_inputs(seed: int = 0, batch: int = 10, size: int = 32) -> onnx.ModelProto:
    """An IR-4, opset-9 export of input[10, 3, 32, 32] -> 3 x (Conv, BatchNormalization, Relu)
    -> GlobalAveragePool -> Flatten -> Gemm -> out[10, 10], every initializer also listed as a
    graph input (torch.onnx's ``keep_initializers_as_inputs``), a large conv bias that the
    BatchNorm mean takes back out (as after a trained shift), so where onnxruntime folds
    BatchNorm at load shows beyond float32's default tolerance."""
    rng = np.random.default_rng(seed)
    inits: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    prev, channels = "input", 3
    for i, width in enumerate((16, 32, 32)):
        names = [
            f"conv{i}.weight",
            f"conv{i}.bias",
            f"bn{i}.weight",
            f"bn{i}.bias",
            f"bn{i}.running_mean",
            f"bn{i}.running_var",
        ]
        offset = rng.uniform(2e4, 5e4, size=width)  # a bias BatchNorm's mean takes back out
        inits += [
            _init(names[0], rng.normal(scale=(channels * 9) ** -0.5, size=(width, channels, 3, 3))),
            _init(names[1], offset),
            _init(names[2], rng.uniform(0.5, 2, size=width)),
            _init(names[3], rng.normal(size=width)),
            _init(names[4], offset + rng.normal(scale=0.1, size=width)),
            _init(names[5], rng.uniform(0.5, 2, size=width)),
        ]
        nodes += [
            helper.make_node(
                "Conv",
                [prev, names[0], names[1]],
                [f"c{i}"],
                name=f"Conv_{3 * i}",
                kernel_shape=[3, 3],
                pads=[1, 1, 1, 1],
            ),
            helper.make_node(
                "BatchNormalization",
                [f"c{i}", *names[2:]],
                [f"b{i}"],
                name=f"BatchNormalization_{3 * i + 1}",
                epsilon=1e-5,
            ),
            helper.make_node("Relu", [f"b{i}"], [f"r{i}"], name=f"Relu_{3 * i + 2}"),
        ]
        prev, channels = f"r{i}", width
    inits += [_init("fc.weight", rng.normal(scale=0.3, size=(10, channels))), _init("fc.bias", rng.normal(size=10))]
    nodes += [
        helper.make_node("GlobalAveragePool", [prev], ["pool"], name="GlobalAveragePool_9"),
        helper.make_node("Flatten", ["pool"], ["flat"], name="Flatten_10", axis=1),
        helper.make_node("Gemm", ["flat", "fc.weight", "fc.bias"], ["out"], name="Gemm_11", transB=1),
    ]
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, size, size])]
    inputs += [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in inits]
    graph = helper.make_graph(
        nodes, "torch-jit-export", inputs, [helper.make_tensor_value_info("out", TensorProto.FLOAT, [batch, 10])], inits
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)], producer_name="pytorch")
    model.ir_version = 4
    onnx.checker.check_model(model, full_check=True)
    return model


def save_with_npz(model: onnx.ModelProto, folder: Path, feeds: dict[str, np.ndarray]) -> tuple[Path, Path]:
    """The model and its validation data (one npz, sample axis 0) in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    np.savez(folder / "val.npz", **feeds)
    return folder / "model.onnx", folder / "val.npz"


VAD_FRAME, VAD_CONTEXT, VAD_HIDDEN = 512, 64, 16


def streaming_vad(seed: int = 0) -> onnx.ModelProto:
    """A Silero-style streaming VAD: ``input [batch, samples]`` (one 512-sample frame after its
    64 samples of context), ``state [2, batch, 16]`` carried from ``stateN``. The front end pads
    the window by reflection (32 each side, as an STFT does) and cuts it into ten 64-sample
    blocks: it runs on a window of exactly 576 samples and on nothing else (one made-up sample
    fails the Pad, another length the Reshape)."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array(np.array([0, 32, 0, 32], np.int64), "pads"),
        numpy_helper.from_array(np.array([0, 10, 64], np.int64), "blocks"),
        _init("W_in", rng.normal(scale=0.5, size=(64, VAD_HIDDEN))),
        _init("W_h", rng.normal(scale=0.3, size=(VAD_HIDDEN, VAD_HIDDEN))),
        _init("V", rng.normal(scale=0.5, size=(VAD_HIDDEN, 1))),
        numpy_helper.from_array(np.array(0, np.int64), "first"),
    ]
    nodes = [
        helper.make_node("Pad", ["input", "pads"], ["padded"], mode="reflect", name="stft_pad"),
        helper.make_node("Reshape", ["padded", "blocks"], ["framed"], name="to_blocks"),
        helper.make_node("ReduceMean", ["framed"], ["energy"], axes=[1], keepdims=0, name="block_mean"),
        helper.make_node("MatMul", ["energy", "W_in"], ["drive"], name="encoder"),
        helper.make_node("MatMul", ["state", "W_h"], ["recurrent"], name="recurrence"),
        helper.make_node("Add", ["recurrent", "drive"], ["pre"], name="mix"),
        helper.make_node("Tanh", ["pre"], ["stateN"], name="squash"),
        helper.make_node("Gather", ["stateN", "first"], ["top"], axis=0, name="layer0"),
        helper.make_node("MatMul", ["top", "V"], ["logit"], name="decoder"),
        helper.make_node("Sigmoid", ["logit"], ["output"], name="probability"),
    ]
    graph = helper.make_graph(
        nodes,
        "silero_like",
        [
            helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", "samples"]),
            helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, "batch", VAD_HIDDEN]),
        ],
        [
            helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 1]),
            helper.make_tensor_value_info("stateN", TensorProto.FLOAT, [2, "batch", VAD_HIDDEN]),
        ],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model
