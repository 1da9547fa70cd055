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
DETECTION_FORMATS = ["yolov8", "yolov5", "yolox", "boxes_scores"]
YOLOX_STRIDES = (8, 16, 32)
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
        "boxes, scores and classes outputs",
    },
    "strides": {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": 1024},
        "minItems": 1,
        "maxItems": 8,
        "default": list(YOLOX_STRIDES),
        "description": "detection, format yolox: the stride of each grid level, in the order the output "
        "holds them (YOLOX: [8, 16, 32]; P6 models [8, 16, 32, 64])",
    },
    "input_size": {
        "type": "array",
        "items": {"type": "integer", "minimum": 1, "maximum": MAX_INPUT_SIDE},
        "minItems": 2,
        "maxItems": 2,
        "description": "detection, format yolox: [height, width] of the model input the grids cover "
        "(default: the image resize or the input's fixed dims; the manifest always states it)",
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
        "type": "object",
        "additionalProperties": False,
        "required": ["boxes", "scores"],
        "description": "detection, format boxes_scores: the model outputs holding boxes [N, 4] "
        "(x1, y1, x2, y2), scores [N] and, optionally, classes [N]",
        "properties": {"boxes": _NAME, "scores": _NAME, "classes": _NAME},
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
DetectionFormat = Literal["yolov8", "yolov5", "yolox", "boxes_scores"]
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
    blank: int = 0
    charset: str | None = None
    append_space: bool = False
    layout: CtcLayout = "NTC"

    @property
    def softmax(self) -> bool:
        """Whether topk/ctc scores are softmax probabilities (the resolved ``apply_softmax``)."""
        return self.apply_softmax is not False

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
            if self.format == "yolox":
                out["strides"] = list(self.strides)
                if self.input_size is not None:
                    out["input_size"] = list(self.input_size)
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
        _check_detection_outputs(raw, raw.get("format", DETECTION_DEFAULTS["format"]), document, path)
        names = raw.get("outputs")
        outputs = None if names is None else DetectionOutputs(names["boxes"], names["scores"], names.get("classes"))
        size = raw.get("input_size")
        return PostprocessSpec(
            **common,
            **{key: raw.get(key, value) for key, value in DETECTION_DEFAULTS.items()},
            labels=raw.get("labels"),
            outputs=outputs,
            strides=tuple(raw.get("strides", YOLOX_STRIDES)),
            input_size=None if size is None else (int(size[0]), int(size[1])),
        )
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


def _check_detection_outputs(raw: Mapping[str, Any], fmt: str, document: str, path: str) -> None:
    """boxes_scores reads three named outputs; the YOLO formats read one (``output``)."""

    def where(key: str) -> str:
        return f"{path}.{key}" if path else key

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
    for key in ("strides", "input_size"):
        if key in raw and fmt != "yolox":
            raise SchemaError(where(key), f"only format yolox takes {key} (format {fmt} is decoded)", document=document)
