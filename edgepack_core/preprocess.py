"""The declarative preprocessing spec and its one executor.

The same :class:`Preprocessor` runs on the workstation (calibration, validation, golden
samples) and on the device (``predict``), so the packager measures exactly the tensors a
device will compute. It needs only numpy, plus Pillow for images (imported lazily, so a
tensor-only device never loads it).

Two kinds of spec:

``kind: image`` — decode an encoded image and turn it into one model input tensor, in this
fixed order:

1. decode with Pillow (first frame of an animation); refuse more than ``max_pixels`` pixels
   before any pixel is decoded, as a guard against decompression bombs, and a JPEG of more
   than 100 scans (:mod:`edgepack_core.jpeg_scans`: each scan costs a pass over the image);
2. apply the EXIF orientation (``ImageOps.exif_transpose``), so photos from phones and
   cameras arrive upright;
3. convert to RGB, or to 8-bit luma for ``color: gray`` (ITU-R 601-2, as Pillow's "L"
   conversion does). Alpha is dropped, not composited;
4. resize to ``resize.size = [H, W]`` with Pillow's filter named by ``interpolation``
   (``nearest``, ``bilinear``, ``bicubic``, ``area`` = Pillow's BOX; Pillow's filters
   antialias when shrinking). ``mode`` says how the aspect ratio is handled; sizes are
   rounded half up and crops/pads are centered with the odd pixel at the bottom/right:

   - ``stretch``: resize to exactly HxW, ignoring the aspect ratio;
   - ``letterbox``: scale by ``min(H/h, W/w)`` so the whole image fits inside HxW, then pad
     to HxW with ``pad_value`` (0..255, every channel) around the image, centered
     (``pad: center``, the default) or at the top-left corner (``pad: top-left``, all the
     padding right and below, as some YOLO exports were trained);
   - ``keep-aspect``: scale by ``max(H/h, W/w)`` so the image covers HxW, then center-crop
     HxW (nothing is padded, the overflow on the long side is cut);
   - ``center-crop``: scale by ``max(H/h, W/w) / crop_fraction`` and center-crop HxW; for a
     square target S this resizes the shorter side to ``round(S / crop_fraction)`` and crops
     S x S, i.e. the classic ImageNet ``Resize(256) + CenterCrop(224)`` with the default
     ``crop_fraction`` 0.875. ``keep-aspect`` is ``center-crop`` with fraction 1.

   Without ``resize`` the image keeps its own size;
5. from here on float32: multiply by ``scale``; ``bgr`` reverses the channel order; then
   ``(x - mean[c]) / std[c]`` per output channel (so for ``bgr`` the mean and std lists are
   given in B, G, R order, as BGR-trained models publish them);
6. transpose to ``layout`` (NCHW or NHWC; gray images have one channel);
7. cast to ``dtype``; ``uint8`` and ``int8`` round half to even and clip to their range;
8. add a leading batch dimension of 1 when ``batch`` is true (the default).

That order defines the numbers; the executor computes them by a shorter road (the *fast
path*), within a bound that tests/test_image_fast_path.py pins against the literal order
above (``Preprocessor(spec, reference=True)``, kept for that test and the benchmarks):

- a JPEG is decoded at a reduced scale (libjpeg's DCT scaling, Pillow's ``draft``: 1/2, 1/4
  or 1/8) when the decoded image stays at least ``REDUCING_GAP`` (1.4) times the resize
  target, so the spec's filter still shrinks what is left by 1.4 or more. The pixel cap is
  still checked on the header's size before anything is decoded, the EXIF orientation still
  applies (the request is made in the stored orientation). One of the two steps whose
  numbers differ beyond rounding (docs/packager.md, "Image preprocessing");
- a raw uint8 array with a bilinear or bicubic resize is reduced first by an integer factor
  (Pillow's ``Image.reduce``: the mean of each block, blocks from the frame's top-left corner)
  by the same rule: the largest factor that leaves at least ``REDUCING_GAP`` times the target
  (:func:`array_reduction`; ``area`` and ``nearest`` are never reduced). The second step whose
  numbers differ beyond rounding, bounded as tightly as the JPEG's;
- only the source region the crop keeps is resampled (Pillow's ``resize(box=...)``: the same
  filter taps as resizing everything and cropping after, to one 8-bit level);
- a raw uint8 array is never copied whole into Pillow: only the window the filter reads is,
  read straight from the array's memory (:func:`pillow_view`: a window or a BGR ``[:, :, ::-1]``
  view costs no numpy copy); its resize runs its first pass in stripes of rows over the cores,
  each stripe's rows going into Pillow on the stripe's thread, to the same bytes as one resize
  (:mod:`edgepack_core.resample`); without resampling (no ``resize``, or a resize that is a pure
  crop) no Pillow at all;
- steps 5-8 are one multiply-add in float32, ``x * (scale / std) + (-mean / std)``, written
  straight into the output tensor in its layout (letterbox padding included): no float64,
  no intermediate images or arrays.

``in_graph: true`` (image kind, float dtypes): the packager has lowered steps 5-7 (scale,
mean/std, layout, cast) into the model (sdk/packager/passes/preprocess_graph.py), so the
executor stops after step 4 (and the channel reversal of ``bgr``): it emits the resized
pixels as uint8 NHWC (``[1, H, W, C]``, or ``[H, W, C]`` with ``batch: false``). The spec's
``scale``, ``mean``, ``std``, ``layout`` and ``dtype`` then say what the graph does.

``kind: audio`` — decode a WAV file and cut it into model-ready frames
(``edgepack_core/audio.py``): mix to mono, resample to ``sample_rate`` (linear
interpolation), then frames of ``frame`` samples every ``hop`` samples, each with ``context``
samples before it prepended; each frame is a float32 ``[1, context + frame]`` tensor
(``[context + frame]`` with ``batch: false``). A file gives a stack of frames, which the
agent runs one after the other, carrying any ``role: state`` inputs between them.

``kind: tensor`` — the input is already a tensor (an ``.npy`` file, a numpy array). The
optional ``shape`` is checked (integers must match, strings and nulls are symbolic dims
that match anything) and the array is cast to the declared ``dtype`` (refusing casts that
would change the kind of number, like float to int). With ``batch: true`` the shape
describes one sample and a leading batch dimension is added after the check; the default
``batch: false`` passes the tensor through as given. No spec at all means raw tensors.

:func:`normalize_preprocess` validates a spec and fills every default, so the manifest
stores an explicit spec and a later change of a default cannot change what a device
computes for an artifact already built.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping
from os import PathLike
from typing import TYPE_CHECKING, Any

import numpy as np

from edgepack_core import audio, jpeg_scans, resample
from edgepack_core.errors import PreprocessError, SchemaError
from edgepack_core.schema import validate_by_kind

if TYPE_CHECKING:
    from PIL import Image

SPEC_VERSION = 1
DEFAULT_MAX_PIXELS = 50_000_000
DEFAULT_CROP_FRACTION = 0.875
# A JPEG is decoded at 1/s (s in 1, 2, 4, 8; libjpeg's DCT scaling) with s at most
# floor(ratio / REDUCING_GAP), ratio being full size over target size: the spec's filter then still
# shrinks by REDUCING_GAP or more. Measured (docs/packager.md, "Image preprocessing"): 1.0, i.e.
# decoding straight to the target, changed the digits demo's answer on 4% of 64x64 JPEGs (1/8 is
# a block mean); 1.4 on 1.1%, 2.0 on 1.1%; 1.4 still decodes a 1280x720 frame at 1/2 for 224x224.
REDUCING_GAP = 1.4
_EXIF_ORIENTATION = 0x0112

IMAGE_DTYPES = ["float32", "float16", "uint8", "int8"]
TENSOR_DTYPES = ["float32", "float16", "float64", "int8", "uint8", "int16", "uint16", "int32", "int64", "bool"]
_RESIZE_MODES = ["stretch", "keep-aspect", "letterbox", "center-crop"]
_INTERPOLATIONS = ["nearest", "bilinear", "bicubic", "area"]
_CHANNELS = {"rgb": 3, "bgr": 3, "gray": 1}

_RESIZE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Resize to size [H, W]; mode says how the aspect ratio is kept.",
    "additionalProperties": False,
    "required": ["size"],
    "properties": {
        "size": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 1},
                 "description": "[height, width] of the result"},
        "mode": {"enum": _RESIZE_MODES, "default": "stretch",
                 "description": "stretch: ignore aspect; letterbox: fit inside and pad; keep-aspect: cover and "
                 "center-crop; center-crop: cover enlarged by 1/crop_fraction and center-crop"},
        "interpolation": {"enum": _INTERPOLATIONS, "default": "bilinear"},
        "pad_value": {"type": "integer", "minimum": 0, "maximum": 255, "default": 0,
                      "description": "letterbox only: the value of every channel of the padding"},
        "pad": {"enum": ["center", "top-left"], "default": "center",
                "description": "letterbox only: where the image sits in the padded canvas"},
        "crop_fraction": {"type": "number", "exclusiveMinimum": 0, "maximum": 1, "default": DEFAULT_CROP_FRACTION,
                          "description": "center-crop only: the fraction of the resized image that is kept"},
    },
    # pad_value and crop_fraction belong to one mode each; naming them with another mode is
    # a mistake the user should hear about rather than a silently ignored key.
    "oneOf": [
        {"additionalProperties": False,
         "properties": {"size": {}, "interpolation": {}, "mode": {"enum": ["stretch", "keep-aspect"]}}},
        {"additionalProperties": False, "required": ["mode"],
         "properties": {"size": {}, "interpolation": {}, "mode": {"const": "letterbox"}, "pad_value": {},
                        "pad": {}}},
        {"additionalProperties": False, "required": ["mode"],
         "properties": {"size": {}, "interpolation": {}, "mode": {"const": "center-crop"}, "crop_fraction": {}}},
    ],
}

_PER_CHANNEL = {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "number"}}
_PROPERTIES: dict[str, Any] = {
    "kind": {"enum": ["image", "tensor", "audio"],
             "description": "image: decode and transform; audio: WAV to frames; tensor: raw tensors"},
    "sample_rate": {"type": "integer", "minimum": 1000, "maximum": 384000,
                    "description": "audio: the rate the model expects; files are resampled to it"},
    "frame": {"type": "integer", "minimum": 1, "maximum": 1_048_576, "description": "audio: samples per frame"},
    "hop": {"type": "integer", "minimum": 1, "maximum": 1_048_576,
            "description": "audio: samples from one frame's start to the next (default: frame)"},
    "context": {"type": "integer", "minimum": 0, "maximum": 1_048_576,
                "description": "audio: samples before each frame prepended to it (zeros before the first)"},
    "version": {"type": "integer", "const": SPEC_VERSION, "default": SPEC_VERSION},
    "color": {"enum": list(_CHANNELS), "default": "rgb"},
    "resize": _RESIZE_SCHEMA,
    "scale": {"type": "number", "default": 1.0, "description": "multiplies pixel values after resize"},
    "mean": {**_PER_CHANNEL, "description": "per output channel, subtracted after scale"},
    "std": {**_PER_CHANNEL, "items": {"type": "number", "exclusiveMinimum": 0},
            "description": "per output channel, divides after the mean is subtracted"},
    "layout": {"enum": ["NCHW", "NHWC"], "default": "NCHW"},
    "dtype": {"enum": TENSOR_DTYPES, "description": f"image: one of {', '.join(IMAGE_DTYPES)}"},
    "batch": {"type": "boolean", "description": "add a leading batch dimension (default: true for images, "
              "false for tensors, whose shape then includes the batch)"},
    "input": {"type": "string", "minLength": 1, "description": "the model input this feeds (default: first)"},
    "shape": {"type": "array", "items": {"type": ["integer", "string", "null"], "minimum": 0},
              "description": "tensor: the expected shape; strings and nulls are symbolic dims"},
    "in_graph": {"type": "boolean", "default": False,
                 "description": "image: the packager lowers scale, mean/std, layout and the cast into the model, "
                 "whose input becomes the resized pixels as uint8 NHWC; the agent only decodes and resizes"},
}
_KIND_KEYS = {
    "image": ["kind", "version", "color", "resize", "scale", "mean", "std", "layout", "dtype", "batch", "input",
              "in_graph"],
    "tensor": ["kind", "version", "shape", "dtype", "batch", "input"],
    "audio": ["kind", "version", "sample_rate", "frame", "hop", "context", "dtype", "batch", "input"],
}
_KIND_OVERRIDES: dict[str, dict[str, Any]] = {
    "image": {"kind": {"const": "image"}, "dtype": {"enum": IMAGE_DTYPES}},
    "tensor": {"kind": {"const": "tensor"}},
    "audio": {"kind": {"const": "audio"}, "dtype": {"enum": ["float32"]}},
}

PREPROCESS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Edgepack preprocessing spec",
    "description": "How a raw input (an encoded image, or a tensor) becomes a model input tensor. "
    "See edgepack_core/preprocess.py for the exact order of the steps.",
    "additionalProperties": False,
    "required": ["kind"],
    "properties": _PROPERTIES,
    # Which keys each kind takes. Tensor first: when both branches fail at equally long key
    # paths, the validator reports the first, and "mean"/"std" on a tensor spec tie with "kind".
    "oneOf": [
        {"additionalProperties": False,
         "properties": {**{key: {} for key in _KIND_KEYS[kind]}, **_KIND_OVERRIDES[kind]}}
        for kind in ("tensor", "image", "audio")
    ],
}

# One complete schema per kind: once the kind is known, validating against its own schema
# names the offending key precisely, where the combined oneOf can only guess which branch
# the author meant.
_KIND_SCHEMAS: dict[str, dict[str, Any]] = {
    kind: {
        "type": "object",
        "additionalProperties": False,
        "properties": {**{key: _PROPERTIES[key] for key in keys},
                       **{key: {**_PROPERTIES[key], **rule} for key, rule in _KIND_OVERRIDES[kind].items()}},
    }
    for kind, keys in _KIND_KEYS.items()
}


def normalize_preprocess(spec: Mapping[str, Any] | None, *, document: str = "", path: str = "") -> dict[str, Any]:
    """Validate ``spec`` and return a new, complete spec with every default written out.

    ``None`` (a recipe without a preprocess section) means raw tensors. ``document`` and
    ``path`` only prefix error messages, e.g. ``path="preprocess"`` inside a recipe. Raises
    :class:`SchemaError` naming the offending key. Idempotent.
    """
    raw = validate_by_kind({"kind": "tensor"} if spec is None else spec, _KIND_SCHEMAS, PREPROCESS_SCHEMA,
                           document=document, path=path)
    out: dict[str, Any] = {"kind": raw["kind"], "version": raw.get("version", SPEC_VERSION)}
    if raw["kind"] == "audio":
        return _normalize_audio(raw, out, document, path)
    if raw["kind"] == "tensor":
        out["batch"] = raw.get("batch", False)
        for key in ("shape", "dtype", "input"):
            if key in raw:
                out[key] = raw[key]
        return out

    color = raw.get("color", "rgb")
    channels = _CHANNELS[color]
    out["color"] = color
    if "resize" in raw:
        out["resize"] = _normalize_resize(raw["resize"])
    out["scale"] = float(raw.get("scale", 1.0))
    for key, fill in (("mean", 0.0), ("std", 1.0)):
        values = raw.get(key, [fill] * channels)
        if len(values) != channels:
            where = f"{path}.{key}" if path else key
            raise SchemaError(where, f"has {len(values)} value(s) but color {color} has {channels} channel(s)",
                              document=document)
        out[key] = [float(v) for v in values]
    out["layout"] = raw.get("layout", "NCHW")
    out["dtype"] = raw.get("dtype", "float32")
    out["batch"] = raw.get("batch", True)
    if "input" in raw:
        out["input"] = raw["input"]
    if raw.get("in_graph"):
        # Written only when true: a manifest without the key stays readable by older agents.
        if out["dtype"] not in ("float32", "float16"):
            where = f"{path}.in_graph" if path else "in_graph"
            raise SchemaError(where, f"lowers the float arithmetic into the model; dtype {out['dtype']} has none "
                              "(use in_graph with float32 or float16)", document=document)
        out["in_graph"] = True
    return out


def _normalize_audio(raw: Mapping[str, Any], out: dict[str, Any], document: str, path: str) -> dict[str, Any]:
    for key in ("sample_rate", "frame"):
        if key not in raw:
            raise SchemaError(f"{path}.{key}" if path else key, "an audio spec needs it", document=document)
    out.update(sample_rate=raw["sample_rate"], frame=raw["frame"], hop=raw.get("hop", raw["frame"]),
               context=raw.get("context", 0), dtype="float32", batch=raw.get("batch", True))
    if "input" in raw:
        out["input"] = raw["input"]
    return out


def _normalize_resize(resize: Mapping[str, Any]) -> dict[str, Any]:
    mode = resize.get("mode", "stretch")
    out: dict[str, Any] = {
        "size": [int(v) for v in resize["size"]],
        "mode": mode,
        "interpolation": resize.get("interpolation", "bilinear"),
    }
    if mode == "letterbox":
        out["pad_value"] = resize.get("pad_value", 0)
        out["pad"] = resize.get("pad", "center")
    elif mode == "center-crop":
        out["crop_fraction"] = float(resize.get("crop_fraction", DEFAULT_CROP_FRACTION))
    return out


# ----------------------------------------------------------------------------- geometry


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def resize_plan(
    height: int, width: int, resize: Mapping[str, Any]
) -> tuple[tuple[int, int], tuple[int, int, int, int] | None, tuple[int, int] | None]:
    """Decide, without touching pixels, how an ``height`` x ``width`` image becomes the target.

    Returns ``(resized (h, w), crop box (left, top, right, bottom) or None, paste offset
    (left, top) into the padded canvas or None)``. Kept pure so the geometry of every mode
    can be checked exactly, apart from the resampling filter.
    """
    target_h, target_w = resize["size"]
    mode = resize["mode"]
    if mode == "stretch":
        return (target_h, target_w), None, None
    if mode == "letterbox":
        factor = min(target_h / height, target_w / width)
        new_h = min(target_h, max(1, _round_half_up(height * factor)))
        new_w = min(target_w, max(1, _round_half_up(width * factor)))
        if resize.get("pad", "center") == "top-left":
            return (new_h, new_w), None, (0, 0)
        return (new_h, new_w), None, ((target_w - new_w) // 2, (target_h - new_h) // 2)
    fraction = resize.get("crop_fraction", 1.0) if mode == "center-crop" else 1.0
    factor = max(target_h / height, target_w / width) / fraction
    new_h = max(target_h, _round_half_up(height * factor))
    new_w = max(target_w, _round_half_up(width * factor))
    left, top = (new_w - target_w) // 2, (new_h - target_h) // 2
    return (new_h, new_w), (left, top, left + target_w, top + target_h), None


def image_geometry(height: int, width: int, resize: Mapping[str, Any] | None) -> dict[str, Any]:
    """Where an ``height`` x ``width`` (upright) image lands in the model input, as the numbers
    that map a model-input pixel back: ``x_original = (x_input - pad_x) / scale_x`` (the same
    for y). ``pad`` is the paste offset of a letterbox, minus the crop offset of a crop mode;
    ``scale`` is per axis because resized sizes are rounded. Pure; the detection
    postprocessing (:func:`edgepack_core.postprocess.to_original`) inverts it."""
    if resize is None:
        return {"original_size": [height, width], "input_size": [height, width],
                "scale_x": 1.0, "scale_y": 1.0, "pad_x": 0.0, "pad_y": 0.0}
    (new_h, new_w), crop, paste = resize_plan(height, width, resize)
    pad_x, pad_y = paste if paste is not None else (-crop[0], -crop[1]) if crop is not None else (0, 0)
    return {"original_size": [height, width], "input_size": list(resize["size"]),
            "scale_x": new_w / width, "scale_y": new_h / height, "pad_x": float(pad_x), "pad_y": float(pad_y)}


def source_region(
    height: int, width: int, resize: Mapping[str, Any]
) -> tuple[tuple[float, float, float, float], tuple[int, int], tuple[int, int] | None]:
    """The part of an ``height`` x ``width`` image the resize keeps, as Pillow's ``resize(box=)``
    takes it: ``(box (left, top, right, bottom) in source pixels, the size (h, w) it is resampled
    to, the paste offset (left, top) of a letterbox or None)``. Resampling the box straight to
    that size reads the same filter taps as :func:`resize_plan`'s resize-then-crop. Pure."""
    (new_h, new_w), crop, paste = resize_plan(height, width, resize)
    if crop is None:
        return (0.0, 0.0, float(width), float(height)), (new_h, new_w), paste
    sx, sy = width / new_w, height / new_h
    left, top, right, bottom = crop
    return (left * sx, top * sy, right * sx, bottom * sy), (bottom - top, right - left), None


def reduction_factor(box_size: float, out_size: int) -> int:
    """The largest JPEG reduction the fast path may ask for when ``box_size`` source pixels
    become ``out_size``: ``floor(ratio / REDUCING_GAP)``, at least 1 (libjpeg then takes the
    largest of 1, 2, 4, 8 not above it). Pure."""
    return max(1, int(box_size / out_size / REDUCING_GAP))


def array_reduction(box: tuple[float, float, float, float], out_h: int, out_w: int, interpolation: str) -> int:
    """The integer factor a raw array is reduced by (Pillow's ``Image.reduce``: the mean of each
    factor x factor block, blocks from the frame's top-left corner) before the spec's filter
    resamples ``box`` to ``out_h`` x ``out_w``: a JPEG's reduced-scale rule (the same
    :func:`reduction_factor` on both axes, the smaller kept; any integer where libjpeg has 1, 2,
    4, 8), for the bilinear and bicubic filters. Not for ``area``, itself a block mean that a
    reduction would round twice, nor ``nearest``, whose point samples it would turn into block
    means: both stay exact. Pure."""
    if interpolation not in ("bilinear", "bicubic"):
        return 1
    return min(reduction_factor(box[2] - box[0], out_w), reduction_factor(box[3] - box[1], out_h))


def fused_scale_bias(spec: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    """``(gain, bias)``, float32 per output channel, with ``x * gain + bias`` equal to the spec's
    ``(x * scale - mean) / std`` up to float32 rounding: one multiply-add instead of three
    passes. Computed in float64 and rounded once; the in-graph lowering uses the same constants,
    so Python and the graph compute the same tensor."""
    std = np.asarray(spec["std"], dtype=np.float64)
    gain = float(spec["scale"]) / std
    bias = -np.asarray(spec["mean"], dtype=np.float64) / std
    return gain.astype(np.float32), bias.astype(np.float32)


def pillow_view(pixels: np.ndarray) -> Image.Image:
    """A uint8 HxW (L) or HxWx3 (RGB) array as a Pillow image, read straight from the array's
    memory when each row is a run of whole pixels (a window of a frame, or a BGR frame's
    ``[:, :, ::-1]`` view, read as Pillow's "BGR" raw mode), with one contiguous copy first
    otherwise. Pillow keeps RGB as 4 bytes a pixel, so an image is always one (unpacking) copy;
    this saves the copy before it (a window: 7%; a BGR view: 0.8 ms against 4.5 ms for numpy's
    copy of a 640x640 window, measured)."""
    from PIL import Image

    height, width = pixels.shape[:2]
    channels = 1 if pixels.ndim == 2 else pixels.shape[2]
    row, pixel = pixels.strides[0], pixels.strides[1]
    order = 1 if channels == 1 else pixels.strides[2]
    if pixels.dtype != np.uint8 or pixel != channels * abs(order) or abs(order) != 1 or row < width * channels \
            or height * width == 0:
        pixels = np.ascontiguousarray(pixels)
        return Image.fromarray(pixels, mode="L" if channels == 1 else "RGB")
    first = pixels[:, :, ::-1] if order < 0 else pixels  # the row's first byte is the first pixel's first channel
    span = np.lib.stride_tricks.as_strided(first, shape=((height - 1) * row + width * channels,), strides=(1,))
    mode = "L" if channels == 1 else "RGB"
    return Image.frombytes(mode, (width, height), span, "raw", "BGR" if order < 0 else mode, row, 1)


def _matches(shape: tuple[int, ...], expected: list[Any]) -> bool:
    if len(shape) != len(expected):
        return False
    return all(not isinstance(want, int) or got == want for got, want in zip(shape, expected, strict=True))


def _pillow_filter(name: str) -> Any:
    from PIL import Image

    return {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
            "bicubic": Image.Resampling.BICUBIC, "area": Image.Resampling.BOX}[name]


def _orientation(image: Image.Image) -> int:
    try:
        value = image.getexif().get(_EXIF_ORIENTATION, 1)
    except Exception as err:  # a damaged EXIF block: the reference path refuses it the same way
        raise PreprocessError(f"cannot apply the EXIF orientation ({type(err).__name__}: {err})") from None
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


# ----------------------------------------------------------------------------- executor


class Preprocessor:
    """Turns one raw input into one model input tensor, following a spec (see module docs).

    The spec is normalized on construction, so a manifest written before a default existed
    still runs, and ``self.spec`` is the complete spec actually executed. ``reference=True``
    runs images through the literal steps of the module docs (full decode, resize then crop,
    float32 step by step) instead of the fast path: the yardstick of the parity test.
    """

    def __init__(self, spec: Mapping[str, Any] | None, *, max_pixels: int = DEFAULT_MAX_PIXELS,
                 reference: bool = False) -> None:
        self.spec = normalize_preprocess(spec)
        self.max_pixels = max_pixels
        self.reference = reference
        self.kind: str = self.spec["kind"]
        self.input_name: str | None = self.spec.get("input")
        self.max_audio_bytes = audio.DEFAULT_MAX_BYTES
        if self.kind == "image":
            channels = _CHANNELS[self.spec["color"]]
            self._mean = np.asarray(self.spec["mean"], dtype=np.float32).reshape(1, 1, channels)
            self._std = np.asarray(self.spec["std"], dtype=np.float32).reshape(1, 1, channels)
            self._gain, self._bias = fused_scale_bias(self.spec)
            self.in_graph = bool(self.spec.get("in_graph"))
            # uint8 out and nothing to compute: the pixels are copied, never converted.
            self._copy_only = self.in_graph or (self.spec["dtype"] == "uint8" and bool(np.all(self._gain == 1))
                                                and bool(np.all(self._bias == 0)))

    # ---- entry points

    def from_path(self, path: str | PathLike[str]) -> np.ndarray:
        """An encoded image file (image kind), a WAV file (audio kind: the stack of its frames,
        ``[n_frames, ...one frame's shape]``) or an ``.npy`` file (tensor kind)."""
        if self.kind == "tensor":
            try:
                array = np.load(path, allow_pickle=False)
            except (OSError, ValueError, EOFError) as err:
                raise PreprocessError(f"{path}: not a readable .npy file ({err})") from None
            if not isinstance(array, np.ndarray):
                raise PreprocessError(f"{path}: holds several arrays; a tensor spec takes one .npy array")
            return self.from_array(array)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as err:
            raise PreprocessError(f"{path}: cannot read ({err.strerror or err})") from None
        return self.from_audio_bytes(data) if self.kind == "audio" else self.from_image_bytes(data)

    def from_audio_bytes(self, data: bytes) -> np.ndarray:
        """WAV bytes -> the stack of model-ready frames ``[n_frames, 1, context + frame]``
        (``[n_frames, context + frame]`` with ``batch: false``)."""
        if self.kind != "audio":
            raise PreprocessError(f"this model takes {self.kind} input (preprocess kind: {self.kind}), not audio")
        samples, rate = audio.decode_wav(data, max_bytes=self.max_audio_bytes)
        mono = audio.resample(audio.to_mono(samples), rate, self.spec["sample_rate"])
        frames = audio.cut_frames(mono, self.spec["frame"], self.spec["hop"], self.spec["context"])
        return np.ascontiguousarray(frames[:, None, :] if self.spec["batch"] else frames)

    def batch_from_paths(self, paths: Iterable[str | PathLike[str]]) -> np.ndarray:
        """Several files as one tensor with the samples along the first axis (for calibration).

        With ``batch: false`` the per-sample tensors are stacked, giving the same layout.
        """
        tensors = [self.from_path(p) for p in paths]
        if not tensors:
            raise PreprocessError("no input files given")
        shapes = {t.shape for t in tensors}
        if len(shapes) > 1:
            raise PreprocessError(f"inputs give different shapes {sorted(shapes)}; add a resize to the spec")
        return np.concatenate(tensors, axis=0) if self.spec["batch"] else np.stack(tensors, axis=0)

    def from_image_bytes(self, data: bytes) -> np.ndarray:
        """Decode an encoded image (PNG, JPEG, ...) and preprocess it."""
        return self.image_with_geometry(data)[0]

    def image_with_geometry(self, data: bytes | np.ndarray, *, out: np.ndarray | None = None,
                            opened: Image.Image | None = None) -> tuple[np.ndarray, dict[str, Any]]:
        """Encoded image bytes, or an image array as :meth:`from_array` takes it -> the tensor
        and the geometry applied (:func:`image_geometry` of the upright image), so the
        detection postprocessing can map boxes back to the original's pixels.

        ``out``: a preallocated tensor of :meth:`tensor_shape` and the output dtype (e.g. one
        row of a batch) that the fast path writes into and returns. ``opened``: ``data`` with its
        header already read (and its JPEG scans counted) by the caller, decoded as it is."""
        if isinstance(data, np.ndarray):
            tensor = self.from_array(data, out=out)
            return tensor, image_geometry(data.shape[0], data.shape[1], self.spec.get("resize"))
        if self.reference:
            image = self._upright(self._decode(data, opened))
            return _into(self._pipeline(image), out), image_geometry(image.height, image.width,
                                                                     self.spec.get("resize"))
        image, factor, (height, width) = self._decode_reduced(data, opened)
        return self._fast_image(image, factor, height, width, out), image_geometry(height, width,
                                                                                  self.spec.get("resize"))

    def tensor_shape(self) -> tuple[int, ...] | None:
        """The shape of every image tensor this spec gives, or None when it depends on the
        image (no ``resize``)."""
        if self.kind != "image" or "resize" not in self.spec:
            return None
        return self._shape(*self.spec["resize"]["size"])

    @property
    def out_dtype(self) -> np.dtype:
        """The dtype of the image tensors (uint8 when the arithmetic is in the graph)."""
        return np.dtype("uint8" if self.spec.get("in_graph") else self.spec.get("dtype", "float32"))

    def _open(self, data: bytes, opened: Image.Image | None = None) -> Image.Image:
        """The image with only its header read (``opened``, when the caller read it); the pixel
        cap is checked here, before decoding."""
        self._require_image()
        if opened is not None:
            self._check_pixels(opened.width, opened.height)
            return opened
        from PIL import Image

        jpeg_scans.count_scans(data)  # a progressive JPEG's CPU cost is scans x pixels: bounded first
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as err:
            raise PreprocessError(f"image refused as a decompression bomb: {err}") from None
        except Exception as err:
            # Pillow's format plugins raise a zoo of types (OSError, SyntaxError, struct.error,
            # ValueError, ...) for hostile or damaged bytes; to the caller they all mean one thing.
            raise PreprocessError(f"cannot decode image ({type(err).__name__}: {err})") from None
        self._check_pixels(image.width, image.height)
        return image

    @staticmethod
    def _load(image: Image.Image) -> None:
        try:
            image.load()
        except Exception as err:
            raise PreprocessError(f"cannot decode image ({type(err).__name__}: {err})") from None

    def _decode(self, data: bytes, opened: Image.Image | None = None) -> Image.Image:
        image = self._open(data, opened)
        self._load(image)
        return image

    def _decode_reduced(self, data: bytes, opened: Image.Image | None = None
                        ) -> tuple[Image.Image, int, tuple[int, int]]:
        """Decode, at a reduced scale where the format allows it (JPEG) and the target is small
        enough: ``(upright image in the spec's color, reduction factor, upright (h, w) of the
        full-size image)``."""
        image = self._open(data, opened)
        stored_w, stored_h = image.size
        factor = 1
        if image.format in ("JPEG", "MPO") and self.spec.get("resize") is not None:
            factor = self._draft(image, _orientation(image) >= 5)  # a JPEG's EXIF is in its header
        self._load(image)
        orientation = _orientation(image)
        height, width = (stored_w, stored_h) if orientation >= 5 else (stored_h, stored_w)
        image = self._transpose(image, orientation)
        return self._convert_color(image, keep_gray=True), factor, (height, width)

    def _draft(self, image: Image.Image, transposed: bool) -> int:
        """Ask libjpeg for the largest DCT scale (1/2, 1/4, 1/8) that keeps the decoded image at
        least 1/``reduction_factor`` of full size; returns the scale's denominator."""
        stored_w, stored_h = image.size
        height, width = (stored_w, stored_h) if transposed else (stored_h, stored_w)  # 5..8 swap the axes
        box, (out_h, out_w), _ = source_region(height, width, self.spec["resize"])
        wanted = min(reduction_factor(box[2] - box[0], out_w), reduction_factor(box[3] - box[1], out_h))
        if wanted == 1:
            return 1
        request = (width // wanted, height // wanted)
        drafted = image.draft(None, request[::-1] if transposed else request)  # in the stored orientation
        return 1 if drafted is None else max(1, round(stored_w / drafted[1][2]))

    @staticmethod
    def _transpose(image: Image.Image, orientation: int) -> Image.Image:
        """The EXIF orientation applied (a new image only when there is one to apply)."""
        if orientation == 1:
            return image
        from PIL import Image

        method = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
                  4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270,
                  7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_90}[orientation]
        return image.transpose(method)

    def from_image(self, image: Image.Image) -> np.ndarray:
        """Preprocess an already decoded Pillow image (EXIF orientation is still applied)."""
        if self.reference:
            return self._pipeline(self._upright(image))
        self._require_image()
        self._check_pixels(image.width, image.height)
        self._load(image)
        image = self._convert_color(self._transpose(image, _orientation(image)), keep_gray=True)
        return self._fast_image(image, 1, image.height, image.width, None)

    def _upright(self, image: Image.Image) -> Image.Image:
        self._require_image()
        from PIL import ImageOps

        self._check_pixels(image.width, image.height)
        try:
            image = ImageOps.exif_transpose(image)
        except Exception as err:
            raise PreprocessError(f"cannot apply the EXIF orientation ({type(err).__name__}: {err})") from None
        return self._convert_color(image)

    def from_array(self, array: np.ndarray, *, out: np.ndarray | None = None) -> np.ndarray:
        """Image kind: an HxWx3 uint8 RGB array (or HxW / HxWx1 gray, HxWx4 RGBA), as if decoded.
        A BGR camera frame goes in as ``frame[:, :, ::-1]``: a view, and the fast path copies
        only the window it resamples. Tensor kind: the tensor itself, checked against the
        spec's shape and cast to its dtype."""
        array = np.asarray(array)
        if self.kind == "tensor":
            return self._tensor(array)
        self._require_image()
        if array.dtype != np.uint8:
            raise PreprocessError(f"an image array must be uint8, got {array.dtype}")
        if array.ndim == 3 and array.shape[2] == 1:
            array = array[:, :, 0]
        if not (array.ndim == 2 or (array.ndim == 3 and array.shape[2] in (3, 4))):
            raise PreprocessError(f"an image array must be HxW, HxWx1, HxWx3 or HxWx4, got shape {list(array.shape)}")
        self._check_pixels(array.shape[1], array.shape[0])
        if self.reference:
            from PIL import Image

            mode = "L" if array.ndim == 2 else {3: "RGB", 4: "RGBA"}[array.shape[2]]
            image = Image.fromarray(np.ascontiguousarray(array), mode=mode)
            return _into(self._pipeline(self._convert_color(image)), out)
        if array.ndim == 3 and array.shape[2] == 4:
            array = array[:, :, :3]  # alpha dropped, as Pillow's RGBA -> RGB does
        return self._fast_array(array, out)

    # ---- fast path

    def _fast_image(self, image: Image.Image, factor: int, height: int, width: int,
                    out: np.ndarray | None) -> np.ndarray:
        """An upright image in the spec's color, decoded at 1/``factor`` of ``height`` x ``width``
        -> the tensor: the kept region resampled in one call (a stripe of a Pillow image would
        need a copy of its rows, which costs more than a second thread saves: measured)."""
        resize = self.spec.get("resize")
        if resize is None:
            return self._emit(np.asarray(image), None, out)
        box, (out_h, out_w), paste = source_region(height, width, resize)
        scaled = (box[0] / factor, box[1] / factor, box[2] / factor, box[3] / factor)
        interpolation = self.spec["resize"]["interpolation"]
        if (out_w, out_h) == image.size and scaled == (0.0, 0.0, float(image.width), float(image.height)):
            return self._emit(np.asarray(image), paste, out)
        return self._emit(np.asarray(image.resize((out_w, out_h), resample=_pillow_filter(interpolation), box=scaled)),
                          paste, out)

    def _fast_array(self, array: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """An HxW or HxWx3 uint8 view -> the tensor. Nothing is copied when no resampling is
        needed; otherwise only the window the filter reads goes into Pillow, reduced by
        :func:`array_reduction` when the target is small enough, and the resize's first pass
        runs in stripes over the cores (:mod:`edgepack_core.resample`), each stripe copying
        its own rows of the array into Pillow."""
        height, width = array.shape[:2]
        gray_to_luma = array.ndim == 3 and self.spec["color"] == "gray"
        resize = self.spec.get("resize")
        if resize is None:
            if not gray_to_luma:
                return self._emit(array, None, out)
            return self._emit(np.asarray(self._pillow(array)), None, out)
        box, (out_h, out_w), paste = source_region(height, width, resize)
        whole = [round(v) for v in box]
        if not gray_to_luma and whole == list(box) and (whole[3] - whole[1], whole[2] - whole[0]) == (out_h, out_w):
            # A pure crop: numpy views only, straight into the output.
            return self._emit(array[whole[1]:whole[3], whole[0]:whole[2]], paste, out)
        factor = array_reduction(box, out_h, out_w, resize["interpolation"])
        # The window in reduced pixels (the reduction's blocks start at the frame's top-left
        # corner), with every tap the filter reads around the box.
        reduced = (box[0] / factor, box[1] / factor, box[2] / factor, box[3] / factor)
        interpolation = resize["interpolation"]
        left, right = resample.reach(reduced[0], reduced[2], -(-width // factor), out_w, interpolation)
        top, bottom = resample.reach(reduced[1], reduced[3], -(-height // factor), out_h, interpolation)

        def region(x0: int, y0: int, x1: int, y1: int) -> Image.Image:
            """Pixels [x0, x1) x [y0, y1) of the reduced window, from the array's own rows."""
            image = self._pillow(array[(top + y0) * factor:min(height, (top + y1) * factor),
                                       (left + x0) * factor:min(width, (left + x1) * factor)])
            return image.reduce(factor) if factor > 1 else image

        shifted = (reduced[0] - left, reduced[1] - top, reduced[2] - left, reduced[3] - top)
        return self._emit(resample.resample(region, (right - left, bottom - top), shifted, (out_w, out_h),
                                            interpolation), paste, out)

    def _pillow(self, pixels: np.ndarray) -> Image.Image:
        """A uint8 HxW or HxWx3 array as a Pillow image in the spec's color (gray kept for an rgb
        spec: the output broadcasts it), by :func:`pillow_view`."""
        return self._convert_color(pillow_view(pixels), keep_gray=True)

    def _shape(self, height: int, width: int) -> tuple[int, ...]:
        channels = _CHANNELS[self.spec["color"]]
        layout = "NHWC" if self.in_graph else self.spec["layout"]
        shape = (channels, height, width) if layout == "NCHW" else (height, width, channels)
        return (1, *shape) if self.spec["batch"] else shape

    def _emit(self, pixels: np.ndarray, paste: tuple[int, int] | None, out: np.ndarray | None) -> np.ndarray:
        """Resized uint8 pixels (HxW or HxWxC, in RGB or gray) -> the tensor, in one pass: the
        fused scale-and-bias written straight into the output's layout (or a plain copy when
        the graph does the arithmetic), letterbox padding around it."""
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]  # gray: broadcast to 3 channels for an rgb spec
        if self.spec["color"] == "bgr":
            pixels = pixels[:, :, ::-1]
        height, width = self.spec["resize"]["size"] if paste is not None else pixels.shape[:2]
        shape, dtype = self._shape(height, width), self.out_dtype
        if out is None:
            out = np.empty(shape, dtype=dtype)
        elif out.shape != shape or out.dtype != dtype:
            raise ValueError(f"out must be {dtype} {list(shape)}, got {out.dtype} {list(out.shape)}")
        nchw = not self.in_graph and self.spec["layout"] == "NCHW"
        planes = out[0] if self.spec["batch"] else out  # CHW or HWC
        left, top = paste if paste is not None else (0, 0)
        rows, cols = slice(top, top + pixels.shape[0]), slice(left, left + pixels.shape[1])
        target = planes[:, rows, cols] if nchw else planes[rows, cols]
        source = pixels.transpose(2, 0, 1) if nchw else pixels
        gain, bias = (self._gain[:, None, None], self._bias[:, None, None]) if nchw else (self._gain, self._bias)
        if self._copy_only:
            np.copyto(target, source)
        elif dtype == np.float32:
            np.multiply(source, gain, out=target)
            np.add(target, bias, out=target)
        else:
            target[...] = _cast(source * gain + bias, dtype.name)
        if paste is not None:
            self._pad(planes, nchw, rows, cols)
        return out

    def _pad(self, planes: np.ndarray, nchw: bool, rows: slice, cols: slice) -> None:
        """Fill the letterbox border (the four strips around the pasted image) with the pad
        value as the pixels became: the same fused arithmetic and cast."""
        value = np.float32(self.spec["resize"]["pad_value"])
        fill = np.full(self._gain.shape, value, np.uint8) if self._copy_only else \
            _cast(value * self._gain + self._bias, planes.dtype.name)
        fill = fill[:, None, None] if nchw else fill
        strips = ((slice(0, rows.start), slice(None)), (slice(rows.stop, None), slice(None)),
                  (rows, slice(0, cols.start)), (rows, slice(cols.stop, None)))
        for strip_rows, strip_cols in strips:
            if nchw:
                planes[:, strip_rows, strip_cols] = fill
            else:
                planes[strip_rows, strip_cols] = fill

    # ---- steps

    def _require_image(self) -> None:
        if self.kind != "image":
            raise PreprocessError("this model takes raw tensors (preprocess kind: tensor), not images")

    def _check_pixels(self, width: int, height: int) -> None:
        if width * height > self.max_pixels:
            raise PreprocessError(f"image is {width}x{height} = {width * height} pixels, "
                                  f"over the limit of {self.max_pixels}")

    def _convert_color(self, image: Image.Image, *, keep_gray: bool = False) -> Image.Image:
        """RGB, or L for a gray spec (through RGB from any other mode). ``keep_gray``: an L image
        stays L for an rgb spec (the output broadcasts it to three equal channels, as L -> RGB
        would)."""
        wanted = "L" if self.spec["color"] == "gray" else "RGB"
        if image.mode == wanted or (keep_gray and image.mode == "L"):
            return image
        try:
            if image.mode not in ("RGB", "L"):
                # Palette, CMYK, alpha, 16-bit... all go through RGB first, so gray always means
                # the same luma formula on the same RGB values whatever the file's mode was.
                image = image.convert("RGB")
            return image.convert(wanted) if image.mode != wanted else image
        except ValueError as err:
            raise PreprocessError(f"cannot convert a {image.mode} image to {wanted} ({err})") from None

    # ---- the reference path: the literal steps of the module docs

    def _resize(self, image: Image.Image) -> Image.Image:
        from PIL import Image

        resize = self.spec.get("resize")
        if resize is None:
            return image
        (new_h, new_w), crop, paste = resize_plan(image.height, image.width, resize)
        out = image.resize((new_w, new_h), resample=_pillow_filter(resize["interpolation"]))
        if crop is not None:
            out = out.crop(crop)
        if paste is not None:
            target_h, target_w = resize["size"]
            fill = resize["pad_value"] if out.mode == "L" else (resize["pad_value"],) * 3
            canvas = Image.new(out.mode, (target_w, target_h), fill)
            canvas.paste(out, paste)
            out = canvas
        return out

    def _pipeline(self, image: Image.Image) -> np.ndarray:
        if self.in_graph:
            pixels = np.asarray(self._resize(image))
            pixels = pixels[:, :, None] if pixels.ndim == 2 else pixels
            pixels = pixels[:, :, ::-1] if self.spec["color"] == "bgr" else pixels
            return np.ascontiguousarray(pixels[None] if self.spec["batch"] else pixels)
        pixels = np.asarray(self._resize(image), dtype=np.float32)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if self.spec["scale"] != 1.0:
            pixels = pixels * np.float32(self.spec["scale"])
        if self.spec["color"] == "bgr":
            pixels = pixels[:, :, ::-1]
        pixels = (pixels - self._mean) / self._std
        if self.spec["layout"] == "NCHW":
            pixels = pixels.transpose(2, 0, 1)
        tensor = _cast(pixels, self.spec["dtype"])
        if self.spec["batch"]:
            tensor = tensor[None]
        return np.ascontiguousarray(tensor)

    def _tensor(self, array: np.ndarray) -> np.ndarray:
        shape = self.spec.get("shape")
        if shape is not None and not _matches(array.shape, shape):
            raise PreprocessError(f"tensor shape mismatch: expected {shape}, got {list(array.shape)}")
        dtype = self.spec.get("dtype")
        if dtype is not None and array.dtype != np.dtype(dtype):
            if not np.can_cast(array.dtype, dtype, casting="same_kind"):
                raise PreprocessError(f"tensor dtype {array.dtype} cannot be cast to {dtype} without changing "
                                      "its kind of number")
            array = array.astype(dtype)
        if self.spec["batch"]:
            array = array[None]
        return np.ascontiguousarray(array)


def _into(tensor: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """The reference path honours ``out`` too (copied in, same checks as the fast path)."""
    if out is None:
        return tensor
    if out.shape != tensor.shape or out.dtype != tensor.dtype:
        raise ValueError(f"out must be {tensor.dtype} {list(tensor.shape)}, got {out.dtype} {list(out.shape)}")
    out[...] = tensor
    return out


def _cast(pixels: np.ndarray, dtype: str) -> np.ndarray:
    if dtype in ("uint8", "int8"):
        info = np.iinfo(dtype)
        return np.clip(np.rint(pixels), info.min, info.max).astype(dtype)
    return pixels.astype(dtype, copy=False)
