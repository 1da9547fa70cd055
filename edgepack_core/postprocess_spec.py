"""The postprocessing spec: its JSON Schema and its typed, frozen form, parsed once.

The recipe (on the host) and the verified manifest (on the device) are both parsed by
:func:`parse_postprocess` into a :class:`PostprocessSpec` with every default written out; the
executor (:class:`edgepack_core.postprocess.Postprocessor`), the packager's passes and the agent
take that value, and :meth:`PostprocessSpec.to_json` is what a manifest stores. The kinds and
their keys are described in :mod:`edgepack_core.postprocess` and docs/packager.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from edgepack_core.errors import SchemaError
from edgepack_core.schema import validate_by_kind

SPEC_VERSION = 1
DEFAULT_K = 5
DETECTION_FORMATS = ["yolov8", "yolov5", "yolox", "boxes_scores", "yolov5-raw", "yolov8-raw"]
RAW_FORMATS = ("yolov5-raw", "yolov8-raw")  # one output per grid level, decoded here
GRID_FORMATS = ("yolox", *RAW_FORMATS)  # laid over grids: strides, input_size
YOLOX_STRIDES = (8, 16, 32)
# YOLOv5's P3-P5 anchors (models/yolov5s.yaml), per level (w, h) pairs in input pixels.
YOLOV5_ANCHORS = ((10, 13, 16, 30, 33, 23), (30, 61, 62, 45, 59, 119), (116, 90, 156, 198, 373, 326))
DEFAULT_REG_MAX = 16
MAX_REG_MAX = 64
MAX_ANCHORS = 16  # per level
MAX_INPUT_SIDE = 65_536
DETECTION_DEFAULTS: dict[str, Any] = {
    "format": "yolov8",
    "score_threshold": 0.25,
    "iou_threshold": 0.45,
    "max_detections": 100,
}
MAX_DETECTIONS = 10_000

_NAME = {"type": "string", "minLength": 1}
_PROPERTIES: dict[str, Any] = {
    "kind": {"enum": ["raw", "softmax", "topk", "detection", "ctc"]},
    "version": {"type": "integer", "const": SPEC_VERSION, "default": SPEC_VERSION},
    "output": {**_NAME, "description": "the model output to read (default: first)"},
    "k": {"type": "integer", "minimum": 1, "default": DEFAULT_K, "description": "topk: how many classes"},
    "labels": {
        "type": ["string", "null"],
        "minLength": 1,
        "description": "topk, detection: labels file, one per line (recipe: a path; manifest: assets/labels.txt)",
    },
    "apply_softmax": {
        "type": "boolean",
        "description": "topk, ctc: score with softmax probabilities (false: the output's own "
        "values); default false when the graph's output comes from a Softmax, else true",
    },
    "format": {
        "enum": DETECTION_FORMATS,
        "default": DETECTION_DEFAULTS["format"],
        "description": "detection: yolov8 [batch, 4+classes, anchors]; yolov5 [batch, anchors, "
        "5+classes]; yolox: YOLOX's own export (decode_in_inference off): [batch, anchors, 5+classes] "
        "of grid offsets, log sizes and scores, decoded over the strides' grids; boxes_scores: decoded "
        "boxes, scores and classes outputs; yolov5-raw: one output per level, [batch, anchors*(5+classes), "
        "H, W] or [batch, anchors, H, W, 5+classes], before the Detect layer's decode; yolov8-raw: one "
        "output per level, [batch, 4*reg_max+classes, H, W], before the DFL decode",
    },
    "strides": {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 1024},
        "minItems": 1,
        "maxItems": 8,
        "default": list(YOLOX_STRIDES),
        "description": "detection, formats yolox, yolov5-raw, yolov8-raw: the stride of each grid level, in "
        "the order the output holds them (yolox) or of outputs (raw formats) ([8, 16, 32]; P6 models "
        "[8, 16, 32, 64])",
    },
    "anchors": {
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_INPUT_SIDE},
            "minItems": 2,
            "maxItems": 2 * MAX_ANCHORS,
        },
        "minItems": 1,
        "maxItems": 8,
        "default": [list(level) for level in YOLOV5_ANCHORS],
        "description": "detection, format yolov5-raw: per level, the anchor sizes w1, h1, w2, h2, ... in input "
        "pixels, as the model's yaml lists them (default YOLOv5's P3-P5 anchors)",
    },
    "reg_max": {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_REG_MAX,
        "default": DEFAULT_REG_MAX,
        "description": "detection, format yolov8-raw: distribution bins per box side (4 x reg_max box channels "
        "lead each level; 1: plain distances, no DFL)",
    },
    "apply_sigmoid": {
        "type": "boolean",
        "description": "detection, formats yolov5-raw, yolov8-raw: apply the head's sigmoid (false: the graph "
        "already did); default: resolved by the build from the validation data",
    },
    "input_size": {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": MAX_INPUT_SIDE},
        "minItems": 2,
        "maxItems": 2,
        "description": "detection, formats yolox, yolov5-raw, yolov8-raw: [height, width] of the model input "
        "the grids cover (default: the image resize or the input's fixed dims; a yolox manifest always "
        "states it)",
    },
    "score_threshold": {
        "type": "number",
        "minimum": 0,
        "maximum": 1,
        "default": 0.25,
        "description": "detection: keep boxes whose score is above this",
    },
    "iou_threshold": {
        "type": "number",
        "minimum": 0,
        "maximum": 1,
        "default": 0.45,
        "description": "detection: NMS drops a box whose IoU with a better box of its class is above this",
    },
    "max_detections": {
        "type": "integer",
        "minimum": 1,
        "maximum": MAX_DETECTIONS,
        "default": 100,
        "description": "detection: at most this many boxes per image",
    },
    "outputs": {
        "type": ["object", "array"],
        "additionalProperties": False,
        "required": ["boxes", "scores"],
        "description": "detection, format boxes_scores: the model outputs holding boxes [N, 4] "
        "(x1, y1, x2, y2), scores [N] and, optionally, classes [N]; formats yolov5-raw, yolov8-raw: the "
        "list of level outputs, in the order of strides (default: every model output, in order)",
        "properties": {"boxes": _NAME, "scores": _NAME, "classes": _NAME},
        "items": _NAME,
        "minItems": 1,
        "maxItems": 8,
    },
    "blank": {"type": "integer", "minimum": 0, "default": 0, "description": "ctc: the blank class index"},
    "charset": {
        "type": ["string", "null"],
        "minLength": 1,
        "description": "ctc: charset file, one symbol per line, the blank excluded (recipe: a path; "
        "manifest: assets/charset.txt)",
    },
    "append_space": {
        "type": "boolean",
        "default": False,
        "description": "ctc: a space is the last symbol after the charset's lines (PaddleOCR use_space_char)",
    },
    "layout": {
        "enum": ["NTC", "TNC"],
        "default": "NTC",
        "description": "ctc: [batch, steps, classes] or [steps, batch, classes]",
    },
}
_KIND_KEYS: dict[str, list[str]] = {
    "raw": ["kind", "version", "output"],
    "softmax": ["kind", "version", "output"],
    "topk": ["kind", "version", "output", "k", "labels", "apply_softmax"],
    "detection": [
        "kind",
        "version",
        "output",
        "format",
        "score_threshold",
        "iou_threshold",
        "max_detections",
        "labels",
        "outputs",
        "strides",
        "input_size",
        "anchors",
        "reg_max",
        "apply_sigmoid",
    ],
    "ctc": ["kind", "version", "output", "blank", "charset", "append_space", "layout", "apply_softmax"],
}

POSTPROCESS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Edgepack postprocessing spec",
    "description": "How the model's outputs become the 'result' of a prediction.",
    "additionalProperties": False,
    "required": ["kind"],
    "properties": _PROPERTIES,
    # Each kind takes its own keys; k on a softmax spec, blank on a detection spec are mistakes.
    "oneOf": [
        {"additionalProperties": False, "properties": {**{key: {} for key in keys}, "kind": {"const": kind}}}
        for kind, keys in _KIND_KEYS.items()
    ],
}

# One complete schema per kind, so that once the kind is known an error names the key
# itself (``k`` on a softmax spec) instead of whichever oneOf branch failed deepest.
_KIND_SCHEMAS: dict[str, dict[str, Any]] = {
    kind: {
        "type": "object",
        "additionalProperties": False,
        "properties": {**{key: _PROPERTIES[key] for key in keys}, "kind": {"const": kind}},
    }
    for kind, keys in _KIND_KEYS.items()
}


Kind = Literal["raw", "softmax", "topk", "detection", "ctc"]
DetectionFormat = Literal["yolov8", "yolov5", "yolox", "boxes_scores", "yolov5-raw", "yolov8-raw"]
CtcLayout = Literal["NTC", "TNC"]


@dataclass(frozen=True)
class DetectionOutputs:
    """``outputs`` of a ``boxes_scores`` detection spec: the model outputs it reads."""

    boxes: str
    scores: str
    classes: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"boxes": self.boxes, "scores": self.scores, **({"classes": self.classes} if self.classes else {})}


@dataclass(frozen=True)
class PostprocessSpec:
    """A complete postprocessing spec: the fields of its ``kind`` hold the values executed; the
    other kinds' fields keep their defaults. ``output``: the model output read (None: the first).
    ``apply_softmax`` (topk, ctc) is None only where a recipe left it out, until the packager
    resolves it from the graph; an executor reads None as true, as a manifest without the key
    means."""

    kind: Kind = "raw"
    version: int = SPEC_VERSION
    output: str | None = None
    k: int = DEFAULT_K
    apply_softmax: bool | None = None
    labels: str | None = None
    format: DetectionFormat = DETECTION_DEFAULTS["format"]
    score_threshold: float = DETECTION_DEFAULTS["score_threshold"]
    iou_threshold: float = DETECTION_DEFAULTS["iou_threshold"]
    max_detections: int = DETECTION_DEFAULTS["max_detections"]
    outputs: DetectionOutputs | None = None
    strides: tuple[int, ...] = YOLOX_STRIDES
    input_size: tuple[int, int] | None = None
    levels: tuple[str, ...] | None = None  # raw formats: the level outputs (recipe key ``outputs``)
    anchors: tuple[tuple[float, ...], ...] = YOLOV5_ANCHORS
    reg_max: int = DEFAULT_REG_MAX
    apply_sigmoid: bool | None = None
    blank: int = 0
    charset: str | None = None
    append_space: bool = False
    layout: CtcLayout = "NTC"

    @property
    def softmax(self) -> bool:
        """Whether topk/ctc scores are softmax probabilities (the resolved ``apply_softmax``)."""
        return self.apply_softmax is not False

    def _raw_json(self) -> dict[str, Any]:
        """The keys of a raw format: its levels, anchors or bins, the resolved sigmoid."""
        out: dict[str, Any] = {}
        if self.format not in RAW_FORMATS:
            return out
        if self.levels is not None:
            out["outputs"] = list(self.levels)
        if self.format == "yolov5-raw":
            out["anchors"] = [list(level) for level in self.anchors]
        else:
            out["reg_max"] = self.reg_max
        if self.apply_sigmoid is not None:
            out["apply_sigmoid"] = self.apply_sigmoid
        return out

    def to_json(self) -> dict[str, Any]:
        """The manifest's form: the keys of this kind, defaults explicit."""
        out: dict[str, Any] = {"kind": self.kind, "version": self.version}
        if self.kind == "topk":
            out.update(k=self.k, apply_softmax=self.softmax, labels=self.labels)
        elif self.kind == "detection":
            out.update(
                format=self.format,
                score_threshold=self.score_threshold,
                iou_threshold=self.iou_threshold,
                max_detections=self.max_detections,
                labels=self.labels,
            )
            if self.outputs is not None:
                out["outputs"] = self.outputs.to_json()
            if self.format in GRID_FORMATS:
                out["strides"] = list(self.strides)
                if self.input_size is not None:
                    out["input_size"] = list(self.input_size)
            out.update(self._raw_json())
        elif self.kind == "ctc":
            out.update(
                blank=self.blank,
                charset=self.charset,
                append_space=self.append_space,
                layout=self.layout,
                apply_softmax=self.softmax,
            )
        if self.output is not None:
            out["output"] = self.output
        return out


def parse_postprocess(
    spec: PostprocessSpec | Mapping[str, Any] | None, *, document: str = "", path: str = ""
) -> PostprocessSpec:
    """Validate ``spec`` and return it typed, every default filled in (``apply_softmax`` as the
    spec gives it). ``None`` means ``raw``; a :class:`PostprocessSpec` is returned as it is.
    ``document`` and ``path`` prefix error messages (e.g. ``path="postprocess"`` inside a
    recipe). Raises :class:`SchemaError`."""
    if isinstance(spec, PostprocessSpec):
        return spec
    raw = validate_by_kind(
        {"kind": "raw"} if spec is None else spec, _KIND_SCHEMAS, POSTPROCESS_SCHEMA, document=document, path=path
    )
    kind = raw["kind"]
    common: dict[str, Any] = {"kind": kind, "version": raw.get("version", SPEC_VERSION), "output": raw.get("output")}
    if kind == "topk":
        return PostprocessSpec(
            **common, k=raw.get("k", DEFAULT_K), apply_softmax=raw.get("apply_softmax"), labels=raw.get("labels")
        )
    if kind == "detection":
        return _parse_detection(raw, common, document, path)
    if kind == "ctc":
        return PostprocessSpec(
            **common,
            blank=raw.get("blank", 0),
            charset=raw.get("charset"),
            append_space=raw.get("append_space", False),
            layout=raw.get("layout", "NTC"),
            apply_softmax=raw.get("apply_softmax"),
        )
    return PostprocessSpec(**common)


def normalize_postprocess(
    spec: PostprocessSpec | Mapping[str, Any] | None, *, document: str = "", path: str = ""
) -> dict[str, Any]:
    """:func:`parse_postprocess`'s value in its JSON form (what a manifest stores). Idempotent."""
    return parse_postprocess(spec, document=document, path=path).to_json()


def _parse_detection(raw: Mapping[str, Any], common: dict[str, Any], document: str, path: str) -> PostprocessSpec:
    fmt = raw.get("format", DETECTION_DEFAULTS["format"])
    _check_detection_outputs(raw, fmt, document, path)
    _check_raw_keys(raw, fmt, document, path)
    names = raw.get("outputs")
    outputs = levels = None
    if isinstance(names, Mapping):
        outputs = DetectionOutputs(names["boxes"], names["scores"], names.get("classes"))
    elif names is not None:
        levels = tuple(str(name) for name in names)
    size = raw.get("input_size")
    return PostprocessSpec(
        **common,
        **{key: raw.get(key, value) for key, value in DETECTION_DEFAULTS.items()},
        labels=raw.get("labels"),
        outputs=outputs,
        strides=tuple(raw.get("strides", YOLOX_STRIDES)),
        input_size=None if size is None else (int(size[0]), int(size[1])),
        levels=levels,
        anchors=tuple(tuple(float(v) for v in level) for level in raw.get("anchors", YOLOV5_ANCHORS)),
        reg_max=raw.get("reg_max", DEFAULT_REG_MAX),
        apply_sigmoid=raw.get("apply_sigmoid"),
    )


def _where(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _check_raw_keys(raw: Mapping[str, Any], fmt: str, document: str, path: str) -> None:
    """Each grid key belongs to the formats that read it; a raw head's tables agree in length:
    one stride per level output, one anchor list per stride, the same count of (w, h) pairs each."""
    owners = {
        "strides": GRID_FORMATS,
        "input_size": GRID_FORMATS,
        "anchors": ("yolov5-raw",),
        "reg_max": ("yolov8-raw",),
        "apply_sigmoid": RAW_FORMATS,
    }
    for key, formats in owners.items():
        if key in raw and fmt not in formats:
            raise SchemaError(
                _where(path, key),
                f"only format {' or '.join(formats)} takes {key} (format {fmt} does not read it)",
                document=document,
            )
    if fmt not in RAW_FORMATS:
        return
    strides = raw.get("strides", YOLOX_STRIDES)
    levels = raw.get("outputs")
    if levels is not None and len(set(levels)) != len(levels):
        raise SchemaError(_where(path, "outputs"), f"names an output twice: {list(levels)}", document=document)
    if levels is not None and len(levels) != len(strides):
        raise SchemaError(
            _where(path, "outputs"),
            f"names {len(levels)} level outputs but strides has "
            f"{len(strides)} levels {list(strides)}: one stride per output",
            document=document,
        )
    if fmt == "yolov5-raw":
        _check_anchors(raw.get("anchors"), strides, document, path)


def _check_anchors(anchors: Any, strides: Any, document: str, path: str) -> None:
    where = _where(path, "anchors")
    if anchors is None:
        if len(strides) != len(YOLOV5_ANCHORS):
            raise SchemaError(
                where,
                f"the default anchors are YOLOv5's {len(YOLOV5_ANCHORS)} levels but strides has "
                f"{len(strides)}: give anchors, one list of w, h pairs per level",
                document=document,
            )
        return
    if len(anchors) != len(strides):
        raise SchemaError(
            where,
            f"has {len(anchors)} levels but strides has {len(strides)} {list(strides)}: one "
            "list of w, h pairs per level",
            document=document,
        )
    for index, level in enumerate(anchors):
        if len(level) % 2:
            raise SchemaError(f"{where}[{index}]", f"has {len(level)} numbers: w, h pairs", document=document)
        if len(level) != len(anchors[0]):
            raise SchemaError(
                f"{where}[{index}]",
                f"has {len(level) // 2} anchors but level 0 has {len(anchors[0]) // 2}: every level has the same count",
                document=document,
            )


def _check_detection_outputs(raw: Mapping[str, Any], fmt: str, document: str, path: str) -> None:
    """boxes_scores reads three named outputs; the raw formats a list of level outputs; the
    other YOLO formats one (``output``)."""

    def where(key: str) -> str:
        return _where(path, key)

    listed = isinstance(raw.get("outputs"), list)
    if fmt in RAW_FORMATS:
        if "output" in raw:
            raise SchemaError(
                where("output"),
                f"format {fmt} reads one output per level: name them in outputs: [...], not output",
                document=document,
            )
        if "outputs" in raw and not listed:
            raise SchemaError(where("outputs"), f"format {fmt} takes a list of level outputs", document=document)
        return
    if listed:
        raise SchemaError(
            where("outputs"), f"only formats {' and '.join(RAW_FORMATS)} take a list of outputs", document=document
        )
    if fmt == "boxes_scores":
        if "outputs" not in raw:
            raise SchemaError(
                where("outputs"),
                "format boxes_scores needs outputs: {boxes: NAME, scores: NAME, classes: NAME}",
                document=document,
            )
        if "output" in raw:
            raise SchemaError(
                where("output"), "format boxes_scores reads outputs.boxes/scores/classes, not output", document=document
            )
    elif "outputs" in raw:
        raise SchemaError(
            where("outputs"),
            f"only format boxes_scores takes outputs (format {fmt} reads one output)",
            document=document,
        )
