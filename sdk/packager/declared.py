"""Preprocessing declarations checked against the model input they feed (pure decisions).

Why: a ``preprocess.shape`` unlike the input's was signed into the manifest and then ignored by
predict, and float32 pixels in front of a float16 input failed only in onnxruntime's words.
Each function returns the one-line problem, or None when the declaration fits."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from edgepack_core.manifest import TensorSpec
from edgepack_core.preprocess_spec import AUDIO_LAYOUTS, AudioLayout, PreprocessSpec


def _dims(dims: Sequence[object]) -> str:
    return "[" + ", ".join("null" if d is None else str(d) for d in dims) + "]"


def shape_problem(spec: PreprocessSpec, model_input: TensorSpec) -> str | None:
    """A tensor spec's ``shape`` against the input (without its batch axis when ``batch``):
    same rank, and every dim fixed on both sides equal; symbolic or null dims fit anything."""
    if spec.kind != "tensor" or spec.shape is None:
        return None
    fits = list(model_input.shape[1:] if spec.batch else model_input.shape)
    declared = list(spec.shape)
    what = f"input {model_input.name} is {_dims(model_input.shape)}"
    where = " without its batch axis" if spec.batch else ""
    if len(declared) != len(fits):
        return f"{_dims(declared)} has rank {len(declared)} but {what}, rank {len(fits)}{where}: declare {_dims(fits)}"
    for axis, (want, got) in enumerate(zip(declared, fits, strict=True)):
        if isinstance(want, int) and isinstance(got, int) and want != got:
            return f"{_dims(declared)} has {want} at dim {axis} but {what}{where}: declare {_dims(fits)}"
    return None


def dtype_problem(spec: PreprocessSpec, model_input: TensorSpec) -> str | None:
    """The dtype preprocessing produces against the input's (a tensor spec without ``dtype``
    casts nothing and is not checked)."""
    if spec.dtype is None or not model_input.dtype or spec.dtype == model_input.dtype:
        return None
    return (
        f"{spec.kind} preprocessing produces {spec.dtype} but input {model_input.name} is "
        f"{model_input.dtype}: declare dtype: {model_input.dtype}"
    )


def _fits(shape: Sequence[object], model_shape: Sequence[object]) -> bool:
    return len(shape) == len(model_shape) and all(
        not isinstance(got, int) or want == got for want, got in zip(shape, model_shape, strict=True)
    )


def _layout_name(layout: AudioLayout) -> str:
    return "[" + ", ".join(str(d) for d in AUDIO_LAYOUTS[layout]) + "]"


def audio_frame_problem(spec: PreprocessSpec, model_input: TensorSpec) -> tuple[str, str] | None:
    """An audio spec's frames (``layout``, ``frame`` + ``context``, ``batch``) against the input
    they feed: ``(key, problem)`` naming the layout that fits when one does, else None."""
    if spec.kind != "audio" or not model_input.shape:
        return None
    frame = spec.frame_shape()
    if _fits(frame, model_input.shape):
        return None
    what = f"input {model_input.name} is {_dims(model_input.shape)}"
    given = f"frames {_dims(frame)} ({_layout_name(spec.frame_layout)}, context + frame = {spec.context + spec.frame})"
    fitting = [
        name for name in AUDIO_LAYOUTS if _fits(replace(spec, frame_layout=name).frame_shape(), model_input.shape)
    ]
    if fitting:
        return "preprocess.layout", f"{given} but {what}: declare layout: {_layout_name(fitting[0])}"
    ranks = [
        name for name in AUDIO_LAYOUTS if len(replace(spec, frame_layout=name).frame_shape()) == len(model_input.shape)
    ]
    if ranks:
        return "preprocess.frame", f"{given} but {what}: no frame + context of {spec.context + spec.frame} fits it"
    return "preprocess.layout", f"{given} but {what}: no audio layout has its rank (batch: {str(spec.batch).lower()})"


def gaps_problem(spec: PreprocessSpec) -> str | None:
    """``hop`` above ``frame`` skips the samples between frames: a typo (hop and frame swapped)
    far more often than a design, so it is refused unless ``allow_gaps`` declares it. Pure."""
    if spec.kind != "audio" or spec.hop <= spec.frame or spec.allow_gaps:
        return None
    return (
        f"{spec.hop} is larger than frame {spec.frame}, so {spec.hop - spec.frame} samples between frames are "
        "never seen: declare allow_gaps: true if the model means that"
    )


def height_resize_problem(spec: PreprocessSpec, model_input: TensorSpec) -> tuple[str, str] | None:
    """A keep-aspect-height resize against the image input it feeds: ``(the recipe key to change,
    the problem)``, or None. A fixed height must be ``height``; a fixed width must be what every
    image gets, i.e. ``pad_to`` = ``max_width`` = that width (a recogniser exported for one width,
    PaddleOCR's 320 say); a symbolic width takes any. Other input dims are io_spec's to check."""
    resize = spec.resize
    if spec.kind != "image" or resize is None or resize.mode != "keep-aspect-height":
        return None
    dims = list(model_input.shape[1:] if spec.batch else model_input.shape)
    if len(dims) != 3:
        return None
    height, width = (dims[1], dims[2]) if spec.layout == "NCHW" else (dims[0], dims[1])
    target_h, max_w = resize.size
    what = f"input {model_input.name} is {_dims(model_input.shape)}"
    if isinstance(height, int) and height != target_h:
        return "preprocess.resize.height", f"is {target_h} but {what}, height {height}: declare height: {height}"
    if not isinstance(width, int) or (not resize.variable_width and max_w == width):
        return None
    fix = f"declare max_width: {width} and pad_to: {width}, or export the model with a dynamic width"
    if max_w != width:
        return "preprocess.resize.max_width", f"is {max_w} but {what}, a fixed width of {width}: {fix}"
    return (
        "preprocess.resize.pad_to",
        f"is {resize.pad_to}, so widths vary up to {max_w}, but {what}, a fixed width of {width}: {fix}",
    )


RATE_NAMES = frozenset({"sr", "sample_rate", "sampling_rate", "samplerate"})


def _rate(value: Any) -> int | None:
    """A whole number of Hz from a constant's value or a metadata string, else None."""
    while isinstance(value, list) and len(value) == 1:
        value = value[0]
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if number.is_integer() and number > 0 else None


def model_rate_problem(spec: PreprocessSpec, constants: Mapping[str, Any], metadata: Mapping[str, str]) -> str | None:
    """``sample_rate`` against the rate the model itself states: a constant input named like a
    rate (``sr``, ``sample_rate``, ...: a Silero-style VAD takes one) or a metadata property of
    that name. Files would be resampled to a wrong ``sample_rate`` without a word, and the model
    would answer on audio at the wrong speed. Pure."""
    if spec.kind != "audio":
        return None
    stated = [(f"constant input {name}", constants[name]) for name in sorted(constants) if name.lower() in RATE_NAMES]
    stated += [(f"metadata property {key}", metadata[key]) for key in sorted(metadata) if key.lower() in RATE_NAMES]
    for where, value in stated:
        rate = _rate(value)
        if rate is not None and rate != spec.sample_rate:
            return (
                f"is {spec.sample_rate} but the model's {where} is {rate}: declare sample_rate: {rate} "
                "(files of other rates are resampled to it)"
            )
    return None
