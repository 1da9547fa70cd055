"""Preprocessing declarations checked against the model input they feed (pure decisions).

Why: a ``preprocess.shape`` unlike the input's was signed into the manifest and then ignored by
predict, and float32 pixels in front of a float16 input failed only in onnxruntime's words.
Each function returns the one-line problem, or None when the declaration fits."""

from __future__ import annotations

from collections.abc import Sequence

from edgepack_core.manifest import TensorSpec
from edgepack_core.preprocess_spec import PreprocessSpec


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
