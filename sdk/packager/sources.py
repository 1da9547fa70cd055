"""The recipe's data declarations, typed: a data source (``validate.data``, ``golden.data``,
``quantize.calibration``: which layout, where, how much) and what ``inputs.NAME`` declares about
an input (shape, dtype, role, range). The loaders are :mod:`sdk.packager.data`'s; the
shape_inference pass applies the declared shapes."""

from __future__ import annotations

import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from edgepack_core.manifest import DTYPES
from sdk.packager.options import option

SourceKind = Literal["synthetic", "npz", "test_data", "images", "audio"]
FILE_KINDS: tuple[SourceKind, ...] = ("npz", "test_data", "images", "audio")

_PATH = {"type": "string", "minLength": 1}
_LIMIT = {"type": "integer", "minimum": 1, "description": "use at most this many samples"}
SAMPLE_AXIS = {
    "anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}],
    "description": "the axis of the array that runs over samples; null: the whole array is one sample",
}


def _layout(key: str, description: str, **extra: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": [key],
        "properties": {key: {**_PATH, "description": description}, **extra, "limit": _LIMIT},
    }


DATA_SOURCE_SCHEMA: dict[str, Any] = {
    "description": "Sample data: {npz: FILE} (arrays keyed by input name), {test_data: DIR} (ONNX test data "
    "sets), {images: DIR} (run through the preprocessing spec), {audio: DIR} (WAV files cut into frames by "
    "the audio preprocessing spec), or the string 'synthetic' (consent to "
    "made-up inputs). docs/packager.md, 'Data', gives the layouts with examples.",
    "oneOf": [
        {"const": "synthetic"},
        _layout(
            "npz",
            "an .npz: per input, an array of the input's own rank is one sample, one more leading axis "
            "is a stack of samples; optional 'label' array",
            sample_axis={
                "type": "object",
                "additionalProperties": SAMPLE_AXIS,
                "description": "per input name, where the layout is ambiguous",
            },
        ),
        _layout(
            "test_data",
            "a folder of test_data_set_*/input_*.pb (and output_*.pb, expected outputs the build "
            "checks), or one such set",
        ),
        _layout(
            "images",
            "a folder of images, fed through the preprocessing spec",
            labels={**_PATH, "description": "CSV with columns file,label"},
        ),
        _layout(
            "audio",
            "a folder of .wav files, cut into frames by the audio preprocessing spec; each frame is "
            "one sample (state inputs start from init)",
        ),
    ],
}


@dataclass(frozen=True)
class DataSource:
    """One validated data source; ``path`` is absolute (the recipe resolved it), None for
    ``synthetic``. ``sample_axis``: per input name, npz only."""

    kind: SourceKind
    path: str | None = None
    labels: str | None = None
    limit: int | None = None
    sample_axis: Mapping[str, int | None] = field(default_factory=lambda: types.MappingProxyType({}))

    @classmethod
    def from_json(cls, document: str | Mapping[str, Any]) -> DataSource:
        """From a document validated against :data:`DATA_SOURCE_SCHEMA`."""
        if isinstance(document, str):
            return cls("synthetic")
        kind = next(k for k in FILE_KINDS if k in document)
        return cls(
            kind,
            str(document[kind]),
            document.get("labels"),
            document.get("limit"),
            types.MappingProxyType(dict(document.get("sample_axis") or {})),
        )

    @property
    def synthetic(self) -> bool:
        return self.kind == "synthetic"

    def to_json(self) -> str | dict[str, Any]:
        """The document this source was read from (paths absolute)."""
        if self.kind == "synthetic":
            return "synthetic"
        document: dict[str, Any] = {self.kind: self.path}
        if self.labels is not None:
            document["labels"] = self.labels
        if self.sample_axis:
            document["sample_axis"] = dict(self.sample_axis)
        if self.limit is not None:
            document["limit"] = self.limit
        return document


_SHAPE = {
    "type": "array",
    "description": "fixes symbolic dims (a name keeps a dim symbolic)",
    "items": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "minLength": 1}]},
}


@dataclass(frozen=True)
class InputOptions:
    """``inputs.NAME``: read by shape_inference (``shape``) and by the data loaders."""

    DESCRIPTION = "What the model's signature leaves open about one input."

    shape: tuple[int | str, ...] | None = option(None, schema=_SHAPE)
    dtype: str | None = option(None, schema={"enum": DTYPES, "description": "must agree with the model's element type"})
    range: tuple[float, float] | None = option(
        None, description="[low, high] of synthetic values (integers: low <= v < high)", minItems=2, maxItems=2
    )
    role: Literal["tensor", "constant", "image", "audio", "state"] = option(
        "tensor",
        description="constant: the agent feeds `value` on every call; callers do not pass it. "
        "image/audio: the input the preprocessing spec of that kind feeds. state: the agent feeds the "
        "previous call's `output` (per stream), `init` on a stream's first call",
    )
    output: str | None = option(
        None, description="role state: the model output (same dtype and shape) carried into this input", minLength=1
    )
    init: Literal["zeros"] = option(
        "zeros", description="role state: the first value of a stream (zeros; symbolic dims become 1)"
    )
    value: Any = option(
        None, schema={"description": "the value of a constant input: a scalar or a nested list of its shape"}
    )
    allow_non_finite: bool = option(
        False,
        description="the model takes NaN/inf in this input by design (IsNaN, "
        "missing values, -inf attention masks): the agent serves them instead of "
        "answering 400",
    )
    # "auto": not set (an array of the input's rank is one sample, one more axis a stack).
    sample_axis: int | Literal["auto"] | None = option(
        "auto",
        schema={
            **SAMPLE_AXIS,
            "description": "default sample axis of this input's npz arrays (null: an array is one "
            "sample); a data source's sample_axis overrides it",
        },
    )


@dataclass(frozen=True)
class OutputOptions:
    """``outputs.NAME``: what the agent does with this output's answers (the manifest's output spec)."""

    DESCRIPTION = "What the agent may answer in one output."

    allow_non_finite: bool = option(
        False,
        description="NaN/inf in this output are answers by design (-inf log-probabilities, NaN for "
        "'no value'): the agent serves them flagged (non_finite_outputs) instead of answering 500 "
        "non_finite_output",
    )
