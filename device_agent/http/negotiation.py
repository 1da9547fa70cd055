"""Content negotiation of the inference endpoints (pure, no web framework: the runtime tells a
library caller's bytes apart by the same rule): what a request's body is (its media
type, or for ``application/octet-stream`` its first bytes), what the answer is sent as (the
``Accept`` header, RFC 9110 q-values) and what the ``/predict`` query asks for."""

from __future__ import annotations

from typing import Literal

from device_agent.errors import BadRequest
from device_agent.http import bodies
from edgepack_core import wire_json

JSON_MEDIA_TYPE = "application/json"
# What /predict can answer in, in the server's order of preference for a tie.
ANSWER_TYPES = (JSON_MEDIA_TYPE, wire_json.NPZ_MEDIA_TYPE)
MAX_ACCEPT_CHARS = 1024
NUMPY_TYPES = ("application/x-npy", "application/x-npz")
AUDIO_MEDIA_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave")
# How a body is decoded: JSON inputs, an .npy/.npz, a WAV file, an encoded image.
BodyKind = Literal["json", "numpy", "audio", "image"]


def _quality(parameters: list[str]) -> float:
    for parameter in parameters:
        key, _, value = parameter.partition("=")
        if key.strip().lower() == "q":
            try:
                return min(max(float(value.strip()), 0.0), 1.0)
            except ValueError:
                return 0.0
    return 1.0


def _matches(pattern: str, media_type: str) -> bool:
    if pattern in ("*/*", media_type):
        return True
    return pattern.endswith("/*") and media_type.startswith(pattern[:-1])


def choose_answer_type(accept: str | None) -> str | None:
    """The media type /predict answers in for an ``Accept`` header (pure; RFC 9110 q-values,
    the most specific matching range decides a type's quality). JSON when the header is absent;
    None when the client accepts neither JSON nor npz (the caller answers 406)."""
    if accept is None or not accept.strip():
        return JSON_MEDIA_TYPE
    ranges = []
    for item in accept[:MAX_ACCEPT_CHARS].split(","):
        media, *parameters = item.split(";")
        media = media.strip().lower()
        if media:
            ranges.append((media, _quality(parameters)))
    best, best_quality = None, 0.0
    for media_type in ANSWER_TYPES:
        matching = [(r.count("*"), q) for r, q in ranges if _matches(r, media_type)]
        quality = min(matching)[1] if matching else 0.0  # fewest wildcards = most specific
        if quality > best_quality:
            best, best_quality = media_type, quality
    return best


def outputs_wanted(query: str) -> bool | None:
    """The ``/predict`` query (pure): ``outputs=raw`` adds the raw output tensors to a JSON
    answer, ``outputs=result`` leaves them out, no query keeps the default (raw outputs only
    when the model has no task result). Anything else is a 400, never silently ignored."""
    if not query:
        return None
    choices = {"outputs=raw": True, "outputs=result": False}
    if query not in choices:
        raise BadRequest("bad_query", f"unknown query {query[:100]!r}: /predict takes ?outputs=raw or "
                         "?outputs=result")
    return choices[query]


def body_kind(content_type: str, head: bytes, *, image_model: bool, audio_model: bool) -> BodyKind:
    """How /predict decodes a body (pure): ``json``, ``numpy``, ``audio`` or ``image``, by its
    media type, or for ``application/octet-stream`` (or none) by its first bytes. A type the
    model cannot take is a 415 ``unsupported_media``."""
    if content_type == JSON_MEDIA_TYPE:
        return "json"
    if content_type in NUMPY_TYPES:
        return "numpy"
    if content_type in ("", "application/octet-stream"):
        if head[:6] == bodies.NPY_MAGIC or head[:2] == bodies.ZIP_MAGIC:
            return "numpy"
        if audio_model and head[:4] == b"RIFF":
            return "audio"
        if image_model:
            return "image"
    elif content_type.startswith("image/") and image_model:
        return "image"
    elif content_type in AUDIO_MEDIA_TYPES and audio_model:
        return "audio"
    raise unsupported_media(content_type or "a body without a type", image_model=image_model, audio_model=audio_model)


def unsupported_media(what: str, *, image_model: bool, audio_model: bool) -> BadRequest:
    """The one 415 for an input of a kind the model cannot take, naming what it takes (pure):
    the HTTP API, a library caller's typed input and ``edgepack-agent predict`` word it alike."""
    takes = ["application/json", *NUMPY_TYPES, *(["image/*"] if image_model else []),
             *(["audio/wav"] if audio_model else [])]
    return BadRequest("unsupported_media", f"this model does not take {what}: send {', '.join(takes)}",
                      http_status=415)



def media_type(header: str | None) -> str:
    """A ``Content-Type`` header's media type, without parameters, lower case ("" when absent)."""
    return (header or "").split(";")[0].strip().lower()
