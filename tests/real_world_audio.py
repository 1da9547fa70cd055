"""Audio models as users bring them, built from code, for tests/test_real_world_audio.py (issue
23, item 6): a speech-quality front end exported from PyTorch takes a channel axis next to the
samples (``[batch, samples, 1]`` or ``[batch, 1, samples]``) and int16-scale floats (the raw
PCM values, not [-1, 1)), so its Conv1d front end's features depend on the scale."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.real_world_declared import build_recipe
from tools.demos.vad import write_wav

RATE = 16000
FRAME = 400  # 25 ms at 16 kHz
CHANNELS = 4


def quality_model(path: Path, layout: str, frame: int = FRAME) -> Path:
    """audio float32 ``[batch, frame, 1]`` (``layout="BN1"``) or ``[batch, 1, frame]``
    (``"B1N"``) -> (Transpose) -> Conv1d 25 taps stride 10 -> Relu -> mean over time ->
    log(1 + x) -> Gemm -> scores [batch, 2]: a quality model's frame scorer, as torch.onnx
    exports it (symbolic batch, named dims)."""
    dims = ["batch", frame, 1] if layout == "BN1" else ["batch", 1, frame]
    x = helper.make_tensor_value_info("audio", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 2])
    rng = np.random.default_rng(11)
    inits = [
        numpy_helper.from_array((rng.standard_normal((CHANNELS, 1, 25)) * 0.05).astype(np.float32), "conv.weight"),
        numpy_helper.from_array(np.zeros(CHANNELS, np.float32), "conv.bias"),
        numpy_helper.from_array(rng.standard_normal((CHANNELS, 2)).astype(np.float32), "head.weight"),
        numpy_helper.from_array(np.array([0.1, -0.1], np.float32), "head.bias"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
    ]
    nodes = (
        [
            helper.make_node(
                "Transpose", ["audio"], ["/front/Transpose_output_0"], perm=[0, 2, 1], name="/front/Transpose"
            )
        ]
        if layout == "BN1"
        else []
    )
    source = nodes[0].output[0] if nodes else "audio"
    nodes += [
        helper.make_node(
            "Conv",
            [source, "conv.weight", "conv.bias"],
            ["/conv/Conv_output_0"],
            strides=[10],
            kernel_shape=[25],
            name="/conv/Conv",
        ),
        helper.make_node("Relu", ["/conv/Conv_output_0"], ["/Relu_output_0"], name="/Relu"),
        helper.make_node(
            "ReduceMean", ["/Relu_output_0"], ["/ReduceMean_output_0"], axes=[2], keepdims=0, name="/ReduceMean"
        ),
        helper.make_node("Add", ["/ReduceMean_output_0", "one"], ["/Add_output_0"], name="/Add"),
        helper.make_node("Log", ["/Add_output_0"], ["/Log_output_0"], name="/Log"),
        helper.make_node("Gemm", ["/Log_output_0", "head.weight", "head.bias"], ["scores"], name="/head/Gemm"),
    ]
    graph = helper.make_graph(nodes, "main_graph", [x], [y], inits)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch", producer_version="2.1.0"
    )
    model.ir_version = 8
    onnx.save(model, path)
    return path


def tone(seconds: float, rate: int, seed: int) -> np.ndarray:
    """A tone with noise in [-0.8, 0.8]: speech-like enough for a front end."""
    t = np.arange(round(seconds * rate)) / rate
    noise = np.random.default_rng(seed).standard_normal(t.size) * 0.1
    return np.clip(0.6 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + noise, -0.8, 0.8)


def clips(folder: Path, *, with_44k: bool = False) -> Path:
    """Validation clips: two 16 kHz PCM16 clips (0.1 s and 0.125 s: 4 and 5 frames of 400), and
    optionally a 44.1 kHz one."""
    folder.mkdir(parents=True, exist_ok=True)
    write_wav(folder / "a-16k.wav", tone(0.1, RATE, 0), RATE)
    write_wav(folder / "b-16k.wav", tone(0.125, RATE, 1), RATE)
    if with_44k:
        write_wav(folder / "c-44k.wav", tone(0.1, 44100, 2), 44100)
    return folder


def build_quality(
    folder: Path, key: Path, layout: str, extra: str = "", *, with_44k: bool = False, declared: str | None = None
) -> Path:
    """The quality model of ``layout`` packaged with the recipe a user writes from the docs:
    ``layout`` as the model takes it (``declared`` overrides it) and ``scale: 32768``."""
    folder.mkdir(parents=True, exist_ok=True)
    quality_model(folder / "quality.onnx", layout)
    clips(folder / "clips", with_44k=with_44k)
    written = declared if declared is not None else {"BN1": "[B, N, 1]", "B1N": "[B, 1, N]"}[layout]
    return build_recipe(
        folder,
        key,
        f"quality-{layout.lower()}",
        "model: {path: quality.onnx}\n"
        "inputs: {audio: {role: audio}}\n"
        f"preprocess: {{kind: audio, sample_rate: {RATE}, frame: {FRAME}, layout: {written}, scale: 32768{extra}}}\n"
        "postprocess: {kind: raw}\nvalidate: {data: {audio: clips}}\n",
    )


def rate_model(path: Path, rate_metadata: str | None = None) -> Path:
    """A Silero-style VAD's signature: audio float32 [1, FRAME] and sr int64 (a scalar the
    caller feeds, 16000 or 8000) -> a score [1, 1]; optionally a ``sample_rate`` metadata
    property, as some exporters write one."""
    x = helper.make_tensor_value_info("audio", TensorProto.FLOAT, [1, FRAME])
    sr = helper.make_tensor_value_info("sr", TensorProto.INT64, [])
    y = helper.make_tensor_value_info("score", TensorProto.FLOAT, [1, 1])
    nodes = [
        helper.make_node("ReduceMean", ["audio"], ["mean"], axes=[1], keepdims=1),
        helper.make_node("Cast", ["sr"], ["sr_float"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["sr_float", "zero"], ["nothing"]),
        helper.make_node("Add", ["mean", "nothing"], ["score"]),
    ]
    graph = helper.make_graph(nodes, "vad", [x, sr], [y], [numpy_helper.from_array(np.array(0, np.float32), "zero")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="pytorch")
    model.ir_version = 8
    if rate_metadata is not None:
        helper.set_model_props(model, {"sample_rate": rate_metadata})
    onnx.save(model, path)
    return path
