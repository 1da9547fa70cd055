"""The preprocessing spec: its JSON Schema and its typed, frozen form, parsed once.

The recipe (on the host) and the verified manifest (on the device) are both parsed by
:func:`parse_preprocess` into a :class:`PreprocessSpec` with every default written out; the
executor (:mod:`edgepack_core.preprocess`), the packager's passes and the agent take that value.
:meth:`PreprocessSpec.to_json` is the manifest's form: explicit, so a later change of a default
cannot change what a device computes for an artifact already built. What each key means, and
the exact order of the steps, is in docs/packager.md ("Image preprocessing").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from edgepack_core.errors import SchemaError
from edgepack_core.schema import validate_by_kind

SPEC_VERSION = 1
DEFAULT_CROP_FRACTION = 0.875

IMAGE_DTYPES = ["float32", "float16", "uint8", "int8"]
AUDIO_DTYPES = ["float32", "float16", "float64", "int16", "int32"]
# An audio frame's layout, named as the recipe writes it (``layout: [B, N, 1]``): B the batch
# axis (dropped with ``batch: false``), N the samples (``context + frame``), 1 a channel axis.
AudioLayout = Literal["BN", "BN1", "B1N"]
AUDIO_LAYOUTS: dict[AudioLayout, list[str | int]] = {"BN": ["B", "N"], "BN1": ["B", "N", 1], "B1N": ["B", 1, "N"]}
TENSOR_DTYPES = ["float32", "float16", "float64", "int8", "uint8", "int16", "uint16", "int32", "int64", "bool"]
_RESIZE_MODES = ["stretch", "keep-aspect", "letterbox", "center-crop", "keep-aspect-height"]
MAX_RESIZE_HEIGHT = 8192  # keep-aspect-height: bounds on the result, so a file cannot ask for a huge tensor
MAX_RESIZE_WIDTH = 65536
_INTERPOLATIONS = ["nearest", "bilinear", "bicubic", "area"]
CHANNELS = {"rgb": 3, "bgr": 3, "gray": 1}

_RESIZE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "Resize to size [H, W], or (keep-aspect-height) to a height with the width following; "
    "mode says how the aspect ratio is kept.",
    "additionalProperties": False,
    "properties": {
        "size": {
            "type": "array",
            "minItems": 2,
            "maxItems": 2,
            "items": {"type": "integer", "minimum": 1},
            "description": "[height, width] of the result",
        },
        "mode": {
            "enum": _RESIZE_MODES,
            "default": "stretch",
            "description": "stretch: ignore aspect; letterbox: fit inside and pad; keep-aspect: cover and "
            "center-crop; center-crop: cover enlarged by 1/crop_fraction and center-crop; keep-aspect-height: "
            "scale to height, the width following (capped at max_width, padded up to a multiple of pad_to)",
        },
        "height": {
            "type": "integer",
            "minimum": 1,
            "maximum": MAX_RESIZE_HEIGHT,
            "description": "keep-aspect-height only: the height of the result",
        },
        "max_width": {
            "type": "integer",
            "minimum": 1,
            "maximum": MAX_RESIZE_WIDTH,
            "description": "keep-aspect-height only: the widest result; a wider image is squeezed to it",
        },
        "pad_to": {
            "type": "integer",
            "minimum": 1,
            "maximum": MAX_RESIZE_WIDTH,
            "default": 1,
            "description": "keep-aspect-height only: the width is padded on the right up to a multiple of it "
            "(a divisor of max_width; pad_to = max_width gives every image that width)",
        },
        "interpolation": {"enum": _INTERPOLATIONS, "default": "bilinear"},
        "pad_value": {
            "type": "integer",
            "minimum": 0,
            "maximum": 255,
            "default": 0,
            "description": "letterbox and keep-aspect-height only: the value of every channel of the padding",
        },
        "pad": {
            "enum": ["center", "top-left"],
            "default": "center",
            "description": "letterbox only: where the image sits in the padded canvas",
        },
        "crop_fraction": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1,
            "default": DEFAULT_CROP_FRACTION,
            "description": "center-crop only: the fraction of the resized image that is kept",
        },
    },
    # pad_value and crop_fraction belong to one mode each; naming them with another mode is
    # a mistake the user should hear about rather than a silently ignored key.
    "oneOf": [
        {
            "additionalProperties": False,
            "required": ["size"],
            "properties": {"size": {}, "interpolation": {}, "mode": {"enum": ["stretch", "keep-aspect"]}},
        },
        {
            "additionalProperties": False,
            "required": ["mode", "size"],
            "properties": {"size": {}, "interpolation": {}, "mode": {"const": "letterbox"}, "pad_value": {}, "pad": {}},
        },
        {
            "additionalProperties": False,
            "required": ["mode", "size"],
            "properties": {"size": {}, "interpolation": {}, "mode": {"const": "center-crop"}, "crop_fraction": {}},
        },
        {
            "additionalProperties": False,
            "required": ["mode"],
            # height and max_width are required once the mode matched (a nested option, checked
            # after the mode's const): another mode's stray key is then reported against the mode.
            "anyOf": [{"required": ["height", "max_width"]}],
            "properties": {
                "height": {},
                "max_width": {},
                "pad_to": {},
                "pad_value": {},
                "interpolation": {},
                "mode": {"const": "keep-aspect-height"},
            },
        },
    ],
}

_PER_CHANNEL = {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "number"}}
_PROPERTIES: dict[str, Any] = {
    "kind": {
        "enum": ["image", "tensor", "audio"],
        "description": "image: decode and transform; audio: WAV to frames; tensor: raw tensors",
    },
    "sample_rate": {
        "type": "integer",
        "minimum": 1000,
        "maximum": 384000,
        "description": "audio: the rate the model expects; files are resampled to it",
    },
    "frame": {"type": "integer", "minimum": 1, "maximum": 1_048_576, "description": "audio: samples per frame"},
    "hop": {
        "type": "integer",
        "minimum": 1,
        "maximum": 1_048_576,
        "description": "audio: samples from one frame's start to the next (default: frame)",
    },
    "context": {
        "type": "integer",
        "minimum": 0,
        "maximum": 1_048_576,
        "description": "audio: samples before each frame prepended to it (zeros before the first)",
    },
    "last_frame": {
        "enum": ["pad", "drop"],
        "default": "pad",
        "description": "audio: the last partial frame padded with zeros, or dropped",
    },
    "resample": {
        "type": "boolean",
        "default": True,
        "description": "audio: resample a file of another rate to sample_rate (false: refuse it)",
    },
    "allow_gaps": {
        "type": "boolean",
        "default": False,
        "description": "audio: hop may exceed frame (the samples between frames are skipped on purpose)",
    },
    "version": {"type": "integer", "const": SPEC_VERSION, "default": SPEC_VERSION},
    "color": {"enum": list(CHANNELS), "default": "rgb"},
    "resize": _RESIZE_SCHEMA,
    "scale": {
        "type": "number",
        "default": 1.0,
        "description": "image: multiplies pixel values after resize; audio: multiplies the samples in "
        "[-1, 1) (32768: int16 scale)",
    },
    "mean": {**_PER_CHANNEL, "description": "per output channel, subtracted after scale"},
    "std": {
        **_PER_CHANNEL,
        "items": {"type": "number", "exclusiveMinimum": 0},
        "description": "per output channel, divides after the mean is subtracted",
    },
    "layout": {
        "enum": ["NCHW", "NHWC", *AUDIO_LAYOUTS.values()],
        "description": "image: NCHW (default) or NHWC; audio: [B, N] (default), [B, N, 1] or [B, 1, N]",
    },
    "dtype": {"enum": TENSOR_DTYPES, "description": f"image: one of {', '.join(IMAGE_DTYPES)}"},
    "batch": {
        "type": "boolean",
        "description": "add a leading batch dimension (default: true for images, "
        "false for tensors, whose shape then includes the batch)",
    },
    "input": {"type": "string", "minLength": 1, "description": "the model input this feeds (default: first)"},
    "shape": {
        "type": "array",
        "items": {"type": ["integer", "string", "null"], "minimum": 0},
        "description": "tensor: the expected shape; strings and nulls are symbolic dims",
    },
    "in_graph": {
        "type": "boolean",
        "default": False,
        "description": "image: the packager lowers scale, mean/std, layout and the cast into the model, "
        "whose input becomes the resized pixels as uint8 NHWC; the agent only decodes and resizes",
    },
}
_KIND_KEYS = {
    "image": [
        "kind",
        "version",
        "color",
        "resize",
        "scale",
        "mean",
        "std",
        "layout",
        "dtype",
        "batch",
        "input",
        "in_graph",
    ],
    "tensor": ["kind", "version", "shape", "dtype", "batch", "input"],
    "audio": [
        "kind",
        "version",
        "sample_rate",
        "frame",
        "hop",
        "context",
        "last_frame",
        "resample",
        "allow_gaps",
        "scale",
        "layout",
        "dtype",
        "batch",
        "input",
    ],
}
_KIND_OVERRIDES: dict[str, dict[str, Any]] = {
    "image": {
        "kind": {"const": "image"},
        "dtype": {"enum": IMAGE_DTYPES},
        "layout": {"enum": ["NCHW", "NHWC"], "default": "NCHW"},
    },
    "tensor": {"kind": {"const": "tensor"}},
    "audio": {
        "kind": {"const": "audio"},
        "dtype": {"enum": AUDIO_DTYPES, "default": "float32"},
        "layout": {"enum": list(AUDIO_LAYOUTS.values()), "default": AUDIO_LAYOUTS["BN"]},
        "scale": {"type": "number", "exclusiveMinimum": 0, "default": 1.0},
    },
}

PREPROCESS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Edgepack preprocessing spec",
    "description": "How a raw input (an encoded image, or a tensor) becomes a model input tensor. "
    "See docs/packager.md for the exact order of the steps.",
    "additionalProperties": False,
    "required": ["kind"],
    "properties": _PROPERTIES,
    # Which keys each kind takes. Tensor first: when both branches fail at equally long key
    # paths, the validator reports the first, and "mean"/"std" on a tensor spec tie with "kind".
    "oneOf": [
        {
            "additionalProperties": False,
            "properties": {**{key: {} for key in _KIND_KEYS[kind]}, **_KIND_OVERRIDES[kind]},
        }
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
        "properties": {
            **{key: _PROPERTIES[key] for key in keys},
            **{key: {**_PROPERTIES[key], **rule} for key, rule in _KIND_OVERRIDES[kind].items()},
        },
    }
    for kind, keys in _KIND_KEYS.items()
}


Dim = int | str | None  # a tensor spec's dim: an integer, or a symbolic one that matches anything
Kind = Literal["image", "tensor", "audio"]
Color = Literal["rgb", "bgr", "gray"]
Layout = Literal["NCHW", "NHWC"]
ResizeMode = Literal["stretch", "keep-aspect", "letterbox", "center-crop", "keep-aspect-height"]
Interpolation = Literal["nearest", "bilinear", "bicubic", "area"]
PadPlace = Literal["center", "top-left"]
LastFrame = Literal["pad", "drop"]


@dataclass(frozen=True)
class Resize:
    """``resize``: the target ``size`` (H, W) and how the aspect ratio is handled. ``pad_value``
    means something for ``letterbox`` and ``keep-aspect-height`` only, ``pad`` for ``letterbox``
    only, ``crop_fraction`` for ``center-crop`` only, ``pad_to`` for ``keep-aspect-height`` only
    (the JSON form writes them for their modes alone, as the schema takes them).

    ``keep-aspect-height`` (text-line recognisers) has no fixed size: ``size`` holds its
    ``height`` and its ``max_width``, the bounds of every result; the width of one image is
    :func:`edgepack_core.geometry.resize_plan`'s."""

    size: tuple[int, int]
    mode: ResizeMode = "stretch"
    interpolation: Interpolation = "bilinear"
    pad_value: int = 0
    pad: PadPlace = "center"
    crop_fraction: float = DEFAULT_CROP_FRACTION
    pad_to: int = 1

    @property
    def variable_width(self) -> bool:
        """True when results of one spec differ in width (keep-aspect-height not padded to max_width)."""
        return self.mode == "keep-aspect-height" and self.pad_to != self.size[1]

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Resize:
        """A validated ``resize`` mapping, defaults filled."""
        if raw.get("mode") == "keep-aspect-height":
            return cls(
                size=(int(raw["height"]), int(raw["max_width"])),
                mode="keep-aspect-height",
                interpolation=raw.get("interpolation", "bilinear"),
                pad_value=raw.get("pad_value", 0),
                pad_to=int(raw.get("pad_to", 1)),
            )
        height, width = (int(v) for v in raw["size"])
        return cls(
            size=(height, width),
            mode=raw.get("mode", "stretch"),
            interpolation=raw.get("interpolation", "bilinear"),
            pad_value=raw.get("pad_value", 0),
            pad=raw.get("pad", "center"),
            crop_fraction=float(raw.get("crop_fraction", DEFAULT_CROP_FRACTION)),
        )

    def to_json(self) -> dict[str, Any]:
        if self.mode == "keep-aspect-height":
            return {
                "mode": self.mode,
                "height": self.size[0],
                "max_width": self.size[1],
                "pad_to": self.pad_to,
                "pad_value": self.pad_value,
                "interpolation": self.interpolation,
            }
        out: dict[str, Any] = {"size": list(self.size), "mode": self.mode, "interpolation": self.interpolation}
        if self.mode == "letterbox":
            out.update(pad_value=self.pad_value, pad=self.pad)
        elif self.mode == "center-crop":
            out["crop_fraction"] = self.crop_fraction
        return out


@dataclass(frozen=True)
class PreprocessSpec:
    """A complete preprocessing spec (docs/packager.md): the fields of its ``kind`` hold the
    values executed, every default written out; the other kinds' fields keep their defaults.

    Common: ``kind``, ``version``, ``input`` (the model input it feeds; None: the first),
    ``batch``, ``dtype`` (None: a tensor spec that casts nothing). Tensor: ``shape`` (None: not
    checked). Image: ``color``, ``resize`` (None: the image keeps its size), ``scale``,
    ``mean``, ``std`` (one per channel), ``layout``, ``in_graph``. Audio: ``sample_rate``,
    ``frame``, ``hop``, ``context``, ``last_frame``, ``resample``, ``allow_gaps``, ``scale`` and
    ``frame_layout`` (the recipe's ``layout``, named by :data:`AUDIO_LAYOUTS`' keys)."""

    kind: Kind = "tensor"
    version: int = SPEC_VERSION
    input: str | None = None
    batch: bool = False
    dtype: str | None = None
    shape: tuple[Dim, ...] | None = None
    color: Color = "rgb"
    resize: Resize | None = None
    scale: float = 1.0
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    layout: Layout = "NCHW"
    in_graph: bool = False
    sample_rate: int = 0
    frame: int = 0
    hop: int = 0
    context: int = 0
    last_frame: LastFrame = "pad"
    resample: bool = True
    allow_gaps: bool = False
    frame_layout: AudioLayout = "BN"

    @property
    def channels(self) -> int:
        """Channels of an image tensor: 1 for gray, else 3."""
        return CHANNELS[self.color]

    def frame_shape(self) -> tuple[int, ...]:
        """The shape of one audio frame as the model takes it (the layout with B = 1, N =
        ``context + frame``, B dropped with ``batch: false``): what the executor produces and
        the packager checks against the model input. Pure."""
        dims = tuple(self.context + self.frame if d == "N" else 1 for d in AUDIO_LAYOUTS[self.frame_layout])
        return dims if self.batch else dims[1:]

    def to_json(self) -> dict[str, Any]:
        """The manifest's form: the keys of this kind, defaults explicit (the bytes every shipped
        artifact carries; tests/test_pinned_demos.py pins them)."""
        out: dict[str, Any] = {"kind": self.kind, "version": self.version}
        if self.kind == "image":
            out.update(self._image_json())
        elif self.kind == "audio":
            out.update(self._audio_json())
        else:
            out["batch"] = self.batch
            if self.shape is not None:
                out["shape"] = list(self.shape)
            if self.dtype is not None:
                out["dtype"] = self.dtype
        if self.input is not None:
            out["input"] = self.input
        if self.in_graph:
            # Written only when true: a manifest without the key stays readable by older agents.
            out["in_graph"] = True
        return out

    def _audio_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "sample_rate": self.sample_rate,
            "frame": self.frame,
            "hop": self.hop,
            "context": self.context,
        }
        # The keys added after the first audio specs are written only when they differ from
        # what their absence means (the behaviour before they existed): a manifest that uses
        # none of them keeps its bytes and stays readable by older agents.
        if self.last_frame != "pad":
            out["last_frame"] = self.last_frame
        if not self.resample:
            out["resample"] = False
        if self.allow_gaps:
            out["allow_gaps"] = True
        if self.scale != 1.0:
            out["scale"] = self.scale
        if self.frame_layout != "BN":
            out["layout"] = list(AUDIO_LAYOUTS[self.frame_layout])
        out.update(dtype=self.dtype, batch=self.batch)
        return out

    def _image_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"color": self.color}
        if self.resize is not None:
            out["resize"] = self.resize.to_json()
        out.update(
            scale=self.scale,
            mean=list(self.mean),
            std=list(self.std),
            layout=self.layout,
            dtype=self.dtype,
            batch=self.batch,
        )
        return out


def parse_preprocess(
    spec: PreprocessSpec | Mapping[str, Any] | None, *, document: str = "", path: str = ""
) -> PreprocessSpec:
    """Validate ``spec`` and return it typed, every default filled in.

    ``None`` (a recipe without a preprocess section) means raw tensors; a
    :class:`PreprocessSpec` is returned as it is. ``document`` and ``path`` only prefix error
    messages, e.g. ``path="preprocess"`` inside a recipe. Raises :class:`SchemaError` naming the
    offending key."""
    if isinstance(spec, PreprocessSpec):
        return spec
    raw = validate_by_kind(
        {"kind": "tensor"} if spec is None else spec, _KIND_SCHEMAS, PREPROCESS_SCHEMA, document=document, path=path
    )
    version: int = raw.get("version", SPEC_VERSION)
    if raw["kind"] == "audio":
        return _parse_audio(raw, version, document, path)
    if raw["kind"] == "tensor":
        shape = raw.get("shape")
        return PreprocessSpec(
            kind="tensor",
            version=version,
            input=raw.get("input"),
            batch=raw.get("batch", False),
            dtype=raw.get("dtype"),
            shape=None if shape is None else tuple(shape),
        )
    return _parse_image(raw, version, document, path)


def normalize_preprocess(
    spec: PreprocessSpec | Mapping[str, Any] | None, *, document: str = "", path: str = ""
) -> dict[str, Any]:
    """:func:`parse_preprocess`'s value in its JSON form (what a manifest stores). Idempotent."""
    return parse_preprocess(spec, document=document, path=path).to_json()


def _where(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _parse_image(raw: Mapping[str, Any], version: int, document: str, path: str) -> PreprocessSpec:
    color = raw.get("color", "rgb")
    channels = CHANNELS[color]
    per_channel: dict[str, tuple[float, ...]] = {}
    for key, fill in (("mean", 0.0), ("std", 1.0)):
        values = raw.get(key, [fill] * channels)
        if len(values) != channels:
            raise SchemaError(
                _where(path, key),
                f"has {len(values)} value(s) but color {color} has {channels} channel(s)",
                document=document,
            )
        per_channel[key] = tuple(float(v) for v in values)
    dtype = raw.get("dtype", "float32")
    in_graph = bool(raw.get("in_graph", False))
    if in_graph and dtype not in ("float32", "float16"):
        raise SchemaError(
            _where(path, "in_graph"),
            f"lowers the float arithmetic into the model; dtype {dtype} "
            "has none (use in_graph with float32 or float16)",
            document=document,
        )
    resize = Resize.parse(raw["resize"]) if "resize" in raw else None
    if resize is not None and resize.size[1] % resize.pad_to:
        raise SchemaError(
            _where(path, "resize.pad_to"),
            f"{resize.pad_to} does not divide max_width {resize.size[1]}: padding up to a multiple of it "
            f"could pass max_width (use a divisor of {resize.size[1]}, or {resize.size[1]} for one fixed width)",
            document=document,
        )
    return PreprocessSpec(
        kind="image",
        version=version,
        input=raw.get("input"),
        batch=raw.get("batch", True),
        dtype=dtype,
        color=color,
        resize=resize,
        scale=float(raw.get("scale", 1.0)),
        mean=per_channel["mean"],
        std=per_channel["std"],
        layout=raw.get("layout", "NCHW"),
        in_graph=in_graph,
    )


def _parse_audio(raw: Mapping[str, Any], version: int, document: str, path: str) -> PreprocessSpec:
    for key in ("sample_rate", "frame"):
        if key not in raw:
            raise SchemaError(_where(path, key), "an audio spec needs it", document=document)
    layout = raw.get("layout", AUDIO_LAYOUTS["BN"])
    frame_layout = next(name for name, dims in AUDIO_LAYOUTS.items() if dims == layout)
    return PreprocessSpec(
        kind="audio",
        version=version,
        input=raw.get("input"),
        batch=raw.get("batch", True),
        dtype=raw.get("dtype", "float32"),
        sample_rate=raw["sample_rate"],
        frame=raw["frame"],
        hop=raw.get("hop", raw["frame"]),
        context=raw.get("context", 0),
        last_frame=raw.get("last_frame", "pad"),
        resample=raw.get("resample", True),
        allow_gaps=raw.get("allow_gaps", False),
        scale=float(raw.get("scale", 1.0)),
        frame_layout=frame_layout,
    )
