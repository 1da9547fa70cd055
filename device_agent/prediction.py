"""One prediction's typed values: the request the runtime takes (its input already told apart,
once, by whoever read it: the HTTP layer from the media type and first bytes, ``predict`` from
the file, a library caller by the value it passes) and the result it gives back. How a result
is written as JSON is the HTTP layer's decision (``device_agent/http/answers.py``), not the
runtime's."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from device_agent.runtime import LoadedModel


@dataclass(frozen=True)
class Tensors:
    """Named model-ready tensors (a JSON or ``.npz`` body, a mapping): checked against the
    model's inputs, no preprocessing."""

    feed: Mapping[str, np.ndarray]


@dataclass(frozen=True)
class Array:
    """One unnamed array (an ``.npy`` body): the image when the model takes images and it is a
    ``HxW[xC]`` uint8 array, else the model's only input."""

    value: np.ndarray


@dataclass(frozen=True)
class EncodedImage:
    """An encoded image (PNG, JPEG, ...) for the model's image preprocessing. ``header``: the
    image with its header already read and checked (a ``PIL.Image.Image``, as the HTTP API's
    image gate opens it), which the preprocessing decodes without reading the header again;
    used once."""

    data: bytes
    header: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Audio:
    """A WAV file for an audio model: run frame by frame, its state carried from frame to frame."""

    data: bytes


Input = Tensors | Array | EncodedImage | Audio


@dataclass(frozen=True)
class PredictRequest:
    """What ``InferenceService.predict`` runs: the input, the stream whose state it continues
    (None: from the model's init state) and whether the task result is computed."""

    input: Input
    stream: str | None = None
    postprocess: bool = True


@dataclass(frozen=True)
class PredictResult:
    """One request's outputs, its task result (None when postprocessing was skipped or the
    model's postprocessing is ``raw``), the model that ran it and the session time."""

    outputs: dict[str, np.ndarray]
    result: Any
    model: LoadedModel
    latency_s: float
    # What the image preprocessing did (edgepack_core.geometry.image_geometry); None for tensors.
    geometry: dict[str, Any] | None = None
    # The outputs holding NaN/inf that the recipe allows (``allow_non_finite``): served, flagged.
    non_finite: tuple[str, ...] = ()
