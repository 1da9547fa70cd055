"""Made-up inputs, only where a recipe consents (``synthetic``): deterministic, and following
the spec, so the packager's checks on them mean something (images through the device's own
image code, audio as one stream's consecutive frames, declared ranges and constants honoured,
index inputs kept in range, state inputs fed as a stream's first call is).
"""

from __future__ import annotations

import io
import wave
from collections.abc import Sequence
from typing import Any

import numpy as np

from edgepack_core.manifest import TensorSpec
from edgepack_core.preprocess import Preprocessor
from edgepack_core.preprocess_spec import PreprocessSpec
from sdk.packager.data import (
    _UNDECLARED,
    Declared,
    Feed,
    Samples,
    _fixed_shape,
    _numpy_dtype,
    _target_input,
    carried_outputs,
    constant_feeds,
    state_feeds,
)
from sdk.packager.onnx_graph import index_ranges
from sdk.packager.sources import InputOptions


def _synthetic_value(spec: TensorSpec, decl: InputOptions, index_range: tuple[int, int] | None,
                     rng: np.random.Generator) -> np.ndarray:
    shape = _fixed_shape(spec)
    dtype = _numpy_dtype(spec.dtype)
    low_high = decl.range
    if spec.dtype == "string":
        return np.array([f"s{v}" for v in rng.integers(0, 10, size=shape).ravel()], dtype=str).reshape(shape)
    if spec.dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind == "f":
        if low_high is not None:
            return rng.uniform(low_high[0], low_high[1], size=shape).astype(dtype)
        return rng.standard_normal(shape).astype(dtype)
    low, high = (int(low_high[0]), int(low_high[1])) if low_high is not None else index_range or (0, 10)
    if high <= low:
        return np.full(shape, low, dtype=dtype)
    return rng.integers(low, high, size=shape).astype(dtype)


def _synthetic_audio(count: int, preprocess: PreprocessSpec, rng: np.random.Generator) -> np.ndarray:
    """``count`` consecutive frames of one made-up stream, cut by the device's own audio code:
    each is a frame plus its context, shaped as the spec shapes it (never 1 sample)."""
    length = preprocess.frame + preprocess.hop * max(count - 1, 0)
    t = np.arange(length) / float(preprocess.sample_rate)
    wave_form = 0.3 * np.sin(2 * np.pi * 440.0 * t) + rng.uniform(-0.1, 0.1, length)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:  # PCM16 at the spec's rate: nothing to resample
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(preprocess.sample_rate)
        writer.writeframes((np.clip(wave_form, -1, 1) * 32767).astype("<i2").tobytes())
    frames: np.ndarray = Preprocessor(preprocess).from_audio_bytes(buffer.getvalue())[:count]
    return frames


def _synthetic_image(preprocess: PreprocessSpec, pre: Preprocessor, rng: np.random.Generator) -> np.ndarray:
    """A random image a little larger than the resize's size, through the real preprocessing."""
    height, width = preprocess.resize.size if preprocess.resize is not None else (64, 64)
    image = rng.integers(0, 256, size=(int(height) + 7, int(width) + 5, 3), dtype=np.uint8)
    tensor: np.ndarray = pre.from_array(image)
    return tensor


def _spec_values(count: int, preprocess: PreprocessSpec, rng: np.random.Generator) -> list[np.ndarray] | None:
    """What the preprocessing spec feeds its input in ``count`` made-up samples; None for tensors."""
    if preprocess.kind == "audio":
        return list(_synthetic_audio(count, preprocess, rng))
    if preprocess.kind == "image":
        pre = Preprocessor(preprocess)
        return [_synthetic_image(preprocess, pre, rng) for _ in range(count)]
    return None


def synthetic_samples(
    count: int, preprocess: PreprocessSpec, inputs: Sequence[TensorSpec], seed: int = 0, *,
    declared: Declared | None = None, graph: Any = None, outputs: Sequence[TensorSpec] = (),
) -> Samples:
    """Deterministic made-up inputs (the recipe consented to them) that follow the spec: the
    preprocessed input gets what its preprocessing gives (random images through the real image
    code; for audio, the consecutive frames of one made-up stream, each a frame plus its context);
    the other inputs the recipe's dims, ranges and constants, index inputs kept in range; a
    ``role: state`` input its init zeros, and on audio the output it is carried from, frame to
    frame, as the agent runs a stream (``outputs`` checks the declaration)."""
    declared = declared or {}
    rng = np.random.default_rng(seed)
    target = _target_input(preprocess, inputs) if preprocess.kind in ("image", "audio") and inputs else None
    made = _spec_values(count, preprocess, rng) if target is not None else None
    count = len(made) if made is not None else count
    states = state_feeds(inputs, outputs, declared)
    constants = {**constant_feeds(inputs, declared), **states}
    indices = index_ranges(graph, inputs)
    feeds: list[Feed] = []
    for index in range(count):
        feed: Feed = {}
        for spec in inputs:
            if spec.name in constants:
                feed[spec.name] = constants[spec.name]
            elif spec.name == target and made is not None:
                feed[spec.name] = made[index]
            else:
                decl = declared.get(spec.name, _UNDECLARED)
                feed[spec.name] = _synthetic_value(spec, decl, indices.get(spec.name), rng)
        feeds.append(feed)
    samples = Samples(feeds, names=[f"synthetic sample {n}" for n in range(count)])
    if preprocess.kind == "audio" and target is not None and feeds:  # one stream's frames, in order
        samples.sequences = [(0, len(feeds))]
        samples.carry = carried_outputs(inputs, declared) if states else {}
    return samples
