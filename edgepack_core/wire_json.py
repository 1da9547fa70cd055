"""JSON on the wire: model outputs as strict JSON that any client's parser accepts.

Python's ``json`` writes a float NaN as a bare ``NaN`` token, which is not JSON: a JavaScript
client's ``JSON.parse`` (and most strict parsers) rejects the whole answer. Every JSON answer
of the agent (HTTP ``/predict``, ``edgepack-agent predict --json``) therefore goes through this
module, which encodes by one convention (docs/agent.md, "Encoding of outputs"):

- a non-finite float is the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (the spelling
  of JavaScript's ``String(x)`` and of ``float()`` in Python, so both parse it back);
- integers stay integers (int64 and uint64 keep every digit), booleans stay booleans;
- ONNX string tensors stay strings (UTF-8; an invalid byte becomes U+FFFD: clients that need
  the exact bytes ask for ``application/x-npz``);
- float16 and bfloat16 values are written as the float they represent.

The output is produced with ``allow_nan=False``, so a bare ``NaN`` can never reach the wire:
anything this module did not convert is an error, not a silent invalid document. Pure: values
in, values or bytes out.
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from edgepack_core.errors import WireEncodingError

NAN, POS_INF, NEG_INF = "NaN", "Infinity", "-Infinity"
_NON_FINITE = {NAN: math.nan, POS_INF: math.inf, NEG_INF: -math.inf}
NPZ_MEDIA_TYPE = "application/x-npz"


def _float(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return NAN if math.isnan(value) else (POS_INF if value > 0 else NEG_INF)


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def _float_array(array: np.ndarray) -> Any:
    if array.dtype.itemsize < 4 or array.dtype.kind != "f":
        array = array.astype(np.float32)  # float16, bfloat16 and other narrow floats: exact widening
    finite = np.isfinite(array)
    if finite.all():
        return array.tolist()
    out = array.astype(object)
    out[np.isnan(array)] = NAN
    out[np.isposinf(array)] = POS_INF
    out[np.isneginf(array)] = NEG_INF
    return out.tolist()


def _text_array(array: np.ndarray) -> Any:
    out = np.empty(array.shape, dtype=object)
    out.reshape(-1)[:] = [_text(v) for v in array.reshape(-1)]
    return out.tolist()


def array_to_wire(array: np.ndarray) -> Any:
    """One tensor as nested lists (a 0-d tensor as a scalar) of its own JSON type."""
    kind = array.dtype.kind
    if kind in "biu":
        return array.tolist()
    if kind == "f":
        return _float_array(array)
    if kind in "USO":
        return _text_array(array)
    if kind == "V" and array.dtype.name in {"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
                                            "float8_e5m2fnuz"}:
        return _float_array(array)
    raise WireEncodingError(f"a {array.dtype.name} tensor has no JSON encoding: ask for {NPZ_MEDIA_TYPE}")


def to_wire(value: Any) -> Any:
    """``value`` (arrays, numpy scalars, floats, containers of them) made JSON-safe by the convention."""
    if isinstance(value, np.ndarray):
        return array_to_wire(value)
    if isinstance(value, np.generic):
        return array_to_wire(np.asarray(value))
    if isinstance(value, float):
        return _float(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, bytes):
        return _text(value)
    if isinstance(value, Mapping):
        return {str(k): to_wire(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    raise WireEncodingError(f"a {type(value).__name__} has no JSON encoding: ask for {NPZ_MEDIA_TYPE}")


def dumps(document: Any) -> bytes:
    """Strict JSON bytes (UTF-8) of ``document``; never a bare NaN or Infinity token."""
    try:
        # Fast path: a document already made of plain, finite values needs no walk.
        text = json.dumps(document, allow_nan=False)
    except (TypeError, ValueError):
        text = json.dumps(to_wire(document), allow_nan=False)
    return text.encode("utf-8")


def from_wire(value: Any) -> Any:
    """The inverse for a client: the convention's strings back to floats, recursively.

    Only for float outputs: a string output that happens to read ``"NaN"`` stays a string when
    the client knows the output's dtype (manifest ``outputs``) and skips this for it."""
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: from_wire(v) for k, v in value.items()}
    return value


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Exact tensors as ``np.savez`` bytes (no pickle: string tensors become unicode arrays)."""
    # The archive np.savez writes, written here: savez(**arrays) would take an output named
    # ``file`` or ``allow_pickle`` as its own argument.
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, value in arrays.items():
            array = np.asarray(value)
            if array.dtype.kind == "O":
                array = np.array(_text_array(array) if array.ndim else _text(array.item()), dtype=str)
            with archive.open(name + ".npy", mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, array, allow_pickle=False)
    return buffer.getvalue()
