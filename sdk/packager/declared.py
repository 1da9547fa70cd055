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
