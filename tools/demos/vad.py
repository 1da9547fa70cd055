"""A stateful voice-activity-style demo model and WAV data, built from code (no downloads).

The graph has the signature of a streaming VAD: inputs ``input [batch, samples]`` float32,
``state [2, batch, 128]`` float32 and a scalar int64 ``sr``; outputs ``output [batch, 1]`` and
``stateN [2, batch, 128]``. Its update is RNN-like, with fixed random weights (seed 0)::

    e = mean(input ** 2), m = mean(input)              per batch row
    stateN = tanh(state @ W + (e * sr / 16000) * U + m * U2 + b)
    output = sigmoid(stateN[0] @ V + c)

``reference_step`` is the same update in numpy, for tests. ``write_wav`` writes PCM 8/16/24/32,
IEEE float and WAVE_FORMAT_EXTENSIBLE files with numpy and ``struct`` (the demo data and the
tests' fixtures). Run ``python -m tools.demos.vad --out demo/vad`` (tools/build_demos.py does).
"""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from tools.demos.onnx_util import float_input, initializer, save_model

SEED = 0
HIDDEN = 128
SAMPLE_RATE = 16000
FRAME, CONTEXT = 512, 64


def weights(seed: int = SEED) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "W": (rng.standard_normal((HIDDEN, HIDDEN)) * 0.5 / np.sqrt(HIDDEN)).astype(np.float32),
        "U": rng.standard_normal(HIDDEN).astype(np.float32) * 4,
        "U2": rng.standard_normal(HIDDEN).astype(np.float32),
        "b": (rng.standard_normal(HIDDEN) * 0.1).astype(np.float32),
        "V": (rng.standard_normal((HIDDEN, 1)) / np.sqrt(HIDDEN)).astype(np.float32),
        "c": np.array([0.1], np.float32),
    }


def reference_step(frame: np.ndarray, state: np.ndarray, sr: int = SAMPLE_RATE,
                   w: dict[str, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """One call of the model in numpy: (output [batch, 1], stateN [2, batch, 128])."""
    w = w or weights()
    x = frame.astype(np.float64)
    energy = (x * x).mean(axis=1, keepdims=True) * (sr / 16000.0)
    mean = x.mean(axis=1, keepdims=True)
    new_state = np.tanh(state.astype(np.float64) @ w["W"] + energy * w["U"] + mean * w["U2"] + w["b"])
    output = 1 / (1 + np.exp(-(new_state[0] @ w["V"] + w["c"])))
    return output.astype(np.float32), new_state.astype(np.float32)


def build_graph_model(path: Path) -> Path:
    w = weights()
    nodes = [
        helper.make_node("Mul", ["input", "input"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["e0"], axes=[1], keepdims=1),
        helper.make_node("Cast", ["sr"], ["sr_f"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["sr_f", "sr_ref"], ["sr_scale"]),
        helper.make_node("Mul", ["e0", "sr_scale"], ["e"]),
        helper.make_node("ReduceMean", ["input"], ["m"], axes=[1], keepdims=1),
        helper.make_node("MatMul", ["state", "W"], ["sw"]),
        helper.make_node("Mul", ["e", "U"], ["eu"]),
        helper.make_node("Mul", ["m", "U2"], ["mu"]),
        helper.make_node("Add", ["eu", "mu"], ["drive0"]),
        helper.make_node("Add", ["drive0", "b"], ["drive"]),
        helper.make_node("Add", ["sw", "drive"], ["pre"]),
        helper.make_node("Tanh", ["pre"], ["stateN"]),
        helper.make_node("Gather", ["stateN", "zero"], ["h0"], axis=0),
        helper.make_node("MatMul", ["h0", "V"], ["logit0"]),
        helper.make_node("Add", ["logit0", "c"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["output"]),
    ]
    inits = [initializer(k, v) for k, v in w.items()]
    inits += [initializer("sr_ref", np.array(16000.0, np.float32)),
              helper.make_tensor("zero", TensorProto.INT64, [], [0])]
    graph = helper.make_graph(
        nodes, "vad",
        [float_input("input", ["batch", "samples"]), float_input("state", [2, "batch", HIDDEN]),
         helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
        [float_input("output", ["batch", 1]), float_input("stateN", [2, "batch", HIDDEN])],
        inits)
    return save_model(graph, path, "stateful VAD-style demo: input, state [2, batch, 128], sr -> output, stateN")


def write_wav(path: Path, samples: np.ndarray, rate: int, *, encoding: str = "pcm16", extensible: bool = False) -> Path:
    """``samples`` [frames] or [frames, channels] in [-1, 1] as a WAV file. ``encoding``: pcm8,
    pcm16, pcm24, pcm32, float32 or float64."""
    data = np.asarray(samples, dtype=np.float64)
    data = data[:, None] if data.ndim == 1 else data
    channels = data.shape[1]
    bits = int(encoding[-2:] if encoding[-2:].isdigit() else encoding[-1])
    if encoding.startswith("float"):
        raw, tag = data.astype("<f4" if bits == 32 else "<f8").tobytes(), 3
    elif bits == 8:
        raw, tag = np.clip(np.round(data * 128 + 128), 0, 255).astype(np.uint8).tobytes(), 1
    else:
        scale = float(1 << (bits - 1))
        ints = np.clip(np.round(data * scale), -scale, scale - 1).astype(np.int64)
        if bits == 24:
            little = ints.reshape(-1) & 0xFFFFFF
            raw = np.stack([little & 0xFF, (little >> 8) & 0xFF, (little >> 16) & 0xFF], axis=1).astype(np.uint8)
            raw = raw.tobytes()
        else:
            raw = ints.astype("<i2" if bits == 16 else "<i4").tobytes()
        tag = 1
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else tag, channels, rate, rate * block, block, bits)
    if extensible:
        guid = struct.pack("<H", tag) + bytes.fromhex("000000001000800000aa00389b71")
        fmt += struct.pack("<HHI", 22, bits, 0) + guid
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(raw)) + raw
    if len(raw) % 2:
        body += b"\x00"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    return path


def demo_clips(seed: int = SEED) -> dict[str, tuple[np.ndarray, int, str]]:
    """Deterministic clips: silence, then tone bursts and noise (name -> samples, rate, encoding)."""
    rng = np.random.default_rng(seed)
    t16 = np.arange(int(SAMPLE_RATE * 0.5)) / SAMPLE_RATE
    burst = np.where((t16 > 0.15) & (t16 < 0.35), 0.6 * np.sin(2 * np.pi * 300 * t16), 0.0)
    t44 = np.arange(int(44100 * 0.3)) / 44100
    stereo = np.stack([0.4 * np.sin(2 * np.pi * 440 * t44), 0.2 * rng.standard_normal(t44.size).clip(-1, 1)], 1)
    t8 = np.arange(int(8000 * 0.4)) / 8000
    return {
        "burst-16k-pcm16.wav": (burst, SAMPLE_RATE, "pcm16"),
        "tone-44k-stereo-pcm24.wav": (stereo, 44100, "pcm24"),
        "chirp-8k-float32.wav": (0.5 * np.sin(2 * np.pi * (200 + 400 * t8) * t8), 8000, "float32"),
    }


def build_vad(out: Path) -> Path:
    """The model at ``out/model.onnx`` and clips under ``out/audio/``."""
    out = Path(out)
    for name, (samples, rate, encoding) in demo_clips().items():
        write_wav(out / "audio" / name, samples, rate, encoding=encoding)
    return build_graph_model(out / "model.onnx")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("demo/vad"))
    print(build_vad(parser.parse_args().out))
