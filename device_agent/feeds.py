"""From a typed input to the session's feed (``device_agent/prediction.py``): named tensors
checked against the model's input tables, an image preprocessed with its geometry, a WAV file
cut into frames, several images into the rows of one batch tensor. And the one place where a
library caller's loose value (bytes, an array, a mapping) is told apart, by the same rule the
HTTP layer applies to a body (``device_agent/http/negotiation.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from device_agent.errors import BadRequest
from device_agent.http import bodies
from device_agent.http.negotiation import body_kind, unsupported_media
from device_agent.prediction import Array, Audio, EncodedImage, Input, Tensors
from device_agent.smoke import shape_matches
from edgepack_core.errors import PreprocessError

if TYPE_CHECKING:
    from device_agent.runtime import LoadedModel


class Frames(dict):
    """The frames of one audio body: ``{input: stack}``; the agent runs them one by one."""

    def __init__(self, name: str, frames: np.ndarray) -> None:
        super().__init__({name: frames})
        self.name = name

    def feeds(self) -> list[dict[str, np.ndarray]]:
        return [{self.name: frame} for frame in self[self.name]]


class ImageFeed(dict):
    """The feed of one preprocessed image, with the geometry the detection result maps back through."""

    def __init__(self, name: str, tensor: np.ndarray, geometry: dict[str, Any]) -> None:
        super().__init__({name: tensor})
        self.geometry = geometry


class BatchFeed(dict):
    """The feed of several preprocessed images, one row each, with the geometry of each row."""

    def __init__(self, name: str, tensor: np.ndarray, geometries: list[dict[str, Any]]) -> None:
        super().__init__({name: tensor})
        self.geometries = geometries


def input_of(model: LoadedModel, data: Any, content_type: str | None = None) -> Input:
    """A library caller's value as a typed input, told apart once: a mapping is named tensors,
    an array one array, bytes by ``content_type`` or their first bytes (an ``.npy``/``.npz``
    decoded under the default body limits, a WAV for an audio model, else an image)."""
    if isinstance(data, Mapping):
        return Tensors(data)
    if isinstance(data, np.ndarray):
        return Array(data)
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadRequest("bad_input", f"cannot predict on a {type(data).__name__}")
    data = bytes(data)
    kind = body_kind((content_type or "").split(";")[0].strip().lower(), data[:8],
                     image_model=model.image_input is not None, audio_model=model.audio_input is not None)
    if kind == "numpy":
        decoded = bodies.decode_numpy(data, model.input_specs, image_input=model.image_input)
        return Array(decoded) if isinstance(decoded, np.ndarray) else Tensors(decoded)
    if kind == "audio":
        return Audio(data)
    if kind == "image":
        return EncodedImage(data)
    raise BadRequest("bad_input", "a JSON body is the HTTP API's: pass its inputs as a mapping of arrays")


def input_feed(model: LoadedModel, value: Input) -> Mapping[str, np.ndarray]:
    """The session's feed for one typed input (``ImageFeed`` and ``Frames`` carry more)."""
    if isinstance(value, Tensors):
        check_feed(model, value.feed)
        return value.feed
    if isinstance(value, EncodedImage):
        return _image(model, value.data, value.header)
    if isinstance(value, Audio):
        return _frames(model, value.data)
    return _array_feed(model, value.value)


def _image(model: LoadedModel, data: bytes | np.ndarray, header: Any = None) -> ImageFeed:
    if model.image_input is None:
        raise unsupported_media("image/*", image_model=False, audio_model=model.audio_input is not None)
    try:
        return ImageFeed(model.image_input, *model.preprocessor.image_with_geometry(data, opened=header))
    except PreprocessError as err:
        raise BadRequest("bad_image", str(err)) from err


def _frames(model: LoadedModel, data: bytes) -> Frames:
    name = model.audio_input
    if name is None:
        raise unsupported_media("audio/wav", image_model=model.image_input is not None, audio_model=False)
    try:
        return Frames(name, model.preprocessor.from_audio_bytes(data))
    except PreprocessError as err:
        raise BadRequest("bad_audio", str(err)) from err


def _array_feed(model: LoadedModel, array: np.ndarray) -> Mapping[str, np.ndarray]:
    """One array: the image of an image model when it is ``HxW[xC]`` uint8, else the only input."""
    if model.image_input is not None and array.dtype == np.uint8 and array.ndim in (2, 3):
        return _image(model, array)
    if len(model.input_specs) != 1:
        raise BadRequest("bad_input", f"the model has {len(model.input_specs)} inputs: send named tensors")
    feed = {next(iter(model.input_specs)): array}
    check_feed(model, feed)
    return feed


def check_feed(model: LoadedModel, feed: Mapping[str, np.ndarray]) -> None:
    """Named tensors against the model's input tables: names, dtypes, shapes, finiteness, none missing."""
    specs = model.input_specs
    if not isinstance(feed, Mapping):
        raise BadRequest("bad_input", "named tensors must be a mapping of input name to array")
    for name, value in feed.items():
        spec = specs.get(name)
        if spec is None:
            raise BadRequest("unknown_input", f"unknown input {name!r} (inputs: {', '.join(specs)})")
        _check_tensor(model, name, value, spec)
    if len(feed) != len(specs):
        missing = sorted(set(specs) - set(feed))
        raise BadRequest("missing_input", f"missing input(s) {', '.join(missing)}")


def _check_tensor(model: LoadedModel, name: str, value: Any, spec: tuple[np.dtype, tuple[int | str, ...]]) -> None:
    if not isinstance(value, np.ndarray):
        raise BadRequest("bad_input", f"input {name} must be a numpy array")
    # A string input takes numpy's unicode arrays as well as object arrays of str.
    if value.dtype != spec[0] and not (spec[0].kind == "O" and value.dtype.kind == "U"):
        raise BadRequest("dtype", f"input {name} must be {spec[0].name}, got {value.dtype.name}")
    if not shape_matches(value.shape, spec[1]):
        raise BadRequest("shape", f"input {name} must have shape {list(spec[1])}, got {list(value.shape)}")
    if value.dtype.kind == "f" and name not in model.non_finite_inputs and not np.isfinite(value).all():
        # malformed input, not the model's failure: a NaN in must not count as a NaN out
        raise BadRequest("non_finite_input", f"input {name} holds NaN or infinite values")


# ---------------------------------------------------------------------------------------- batches


def batch_refusal(model: LoadedModel) -> str | None:
    """Why a list of images cannot run as one session call on ``model`` (None: it can). Pure.

    A batch needs an image model whose preprocessing gives every image the same shape with a
    leading batch dim of 1, whose image input is its only caller-fed input, with a symbolic
    first dim that every output's first dim repeats (the sign that outputs run along the batch),
    and no state carried from call to call."""
    name = model.image_input
    if name is None:
        return "the model takes no images"
    if model.states:
        return "the model carries state from call to call"
    pre = model.preprocessor
    if pre.tensor_shape() is None or not pre.spec.batch:
        return "its preprocessing gives no fixed-size tensor with a batch dimension"
    if list(model.input_specs) != [name]:
        return "the model takes other inputs besides the image"
    shape = model.input_specs[name][1]
    leading = shape[0] if shape else None
    if leading is None or isinstance(leading, int):
        return f"input {name} has no dynamic batch dimension (shape {list(shape)})"
    for output in model.manifest.outputs:
        if not output.shape or output.shape[0] != leading:
            return f"output {output.name} does not follow the batch dimension {leading!r} (shape {list(output.shape)})"
    return None


def batch_image(index: int, item: Any, content_type: str | None) -> bytes | np.ndarray:
    """Item ``index`` of a batch as an image: encoded bytes or a ``HxW[xC]`` uint8 array."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        item = bytes(item)
        kind = (content_type or "").split(";")[0].strip().lower()
        if kind in ("application/x-npy", "application/x-npz") or item[:6] == bodies.NPY_MAGIC or \
                item[:2] == bodies.ZIP_MAGIC:
            raise BadRequest("bad_input", f"item {index}: a batch takes images, not .npy/.npz bodies")
        return item
    if isinstance(item, np.ndarray) and item.dtype == np.uint8 and item.ndim in (2, 3):
        return item
    what = f"{item.dtype} array of shape {list(item.shape)}" if isinstance(item, np.ndarray) else type(item).__name__
    raise BadRequest("bad_input", f"item {index}: a batch takes images (encoded bytes or HxW[xC] uint8 arrays), "
                     f"got a {what}")


def batch_feed(model: LoadedModel, items: list[Any], content_type: str | None) -> BatchFeed:
    """Each image preprocessed straight into its row of one preallocated batch tensor."""
    pre = model.preprocessor
    shape = pre.tensor_shape()
    assert shape is not None and model.image_input is not None  # batch_refusal said so
    tensor = np.empty((len(items), *shape[1:]), dtype=pre.out_dtype)
    geometries = []
    for index, item in enumerate(items):
        image = batch_image(index, item, content_type)
        try:
            geometries.append(pre.image_with_geometry(image, out=tensor[index:index + 1])[1])
        except PreprocessError as err:
            raise BadRequest("bad_image", f"item {index}: {err}") from err
    return BatchFeed(model.image_input, tensor, geometries)
