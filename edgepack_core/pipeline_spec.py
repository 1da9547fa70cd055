"""Pipeline documents: a source, the models its frames go through, a tracker, rules and sinks.

Shared: the device parses its agent.yaml's and its desired state's pipelines with it, and the
fleet server refuses a pipeline an operator sets by the same rule. Each section is a frozen
dataclass declared with :func:`edgepack_core.typed_options.option`, so
``schemas/pipeline.schema.json`` is generated from the code that reads it (a test keeps the
published file current) and a document is validated (unknown keys refused, naming the key path)
and parsed once, here, into typed values. The flat ``rules`` and ``sinks`` items of the document
(``- zone: door`` ...) become one typed value per kind on the device
(:mod:`device_agent.pipelines.rules`), so no layer below asks a dict which kind it holds.
Coordinates of zones and lines are fractions of the frame's width and height (0..1), so one
pipeline fits every camera resolution.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from edgepack_core.errors import DocumentRuleError, SchemaError
from edgepack_core.pipeline_limits import MAX_PIPELINES as MAX_PIPELINES  # re-exported: the old name
from edgepack_core.pipeline_limits import MAX_STAGES as MAX_STAGES
from edgepack_core.protocol.ids import ID_PATTERN
from edgepack_core.schema import validate
from edgepack_core.typed_options import option, parse, schema_of

SCHEMA_ID = "https://edgepack.dev/schemas/pipeline.schema.json"
MAX_RULES = 64
MAX_POLYGON_POINTS = 64
_NAME = ID_PATTERN

SOURCE_KINDS = ("url", "file", "device", "camera", "audio", "push")


@dataclass(frozen=True)
class SourceSpec:
    DESCRIPTION = ("Where frames or audio come from: exactly one of url, file, device, camera, audio, push; "
                   "with the policy that decides what happens when inference is slower than the source.")
    url: str | None = option(None, description="A camera stream: rtsp:// or rtsps:// (H.264/H.265), http(s):// MJPEG.",
                             pattern="^(rtsps?|https?)://")
    file: str | None = option(None, description="A video file (mp4, mkv, avi), a folder of images, or a WAV file.",
                              minLength=1)
    device: str | None = option(None, description="A V4L2 camera, e.g. /dev/video0.", pattern="^/dev/")
    camera: Literal["picamera2"] | None = option(None, description="A Raspberry Pi camera through picamera2.")
    audio: str | None = option(None, description="An ALSA capture device (hw:1,0) or a WAV file's path.",
                               minLength=1)
    push: bool | None = option(None, description="Frames pushed from Python (Pipeline.push).")
    policy: Literal["latest", "every"] = option(
        "latest", description="latest: a bounded queue that drops the oldest frame (every drop counted); "
        "every: backpressure on the source, nothing dropped.")
    max_fps: float | None = option(None, description="Frames per second taken from the source at most.",
                                   exclusiveMinimum=0)
    queue: int = option(2, description="Frames held between decoding and inference.", minimum=1, maximum=256)
    transport: Literal["tcp", "udp"] = option("tcp", description="RTSP transport.")
    reconnect_s: float = option(0.5, description="First delay before reconnecting a failed source; doubles.",
                                minimum=0.01)
    reconnect_max_s: float = option(4.0, description="Longest delay between reconnects (a camera that comes back "
                                    "is read again within this and an open).", minimum=0.01)
    watchdog_s: float = option(10.0, description="A source that gives no frame for this long is reconnected.",
                               minimum=0.1)
    loop: bool = option(False, description="Files: start again at the end (demos, soak tests).")
    realtime: bool = option(False, description="Files: hand frames over at the file's own frame rate, as a camera "
                            "would (demos, soak tests); otherwise as fast as they decode.")
    sample_rate: int | None = option(None, description="ALSA capture: the rate asked of the device (FFmpeg's "
                                     "48000 by default; the model's preprocessing resamples).",
                                     minimum=1000, maximum=384000)

    @property
    def kind(self) -> str:
        """Which source this is (the one key of :data:`SOURCE_KINDS` that is set)."""
        return next(kind for kind in SOURCE_KINDS if getattr(self, kind) not in (None, False))

    @property
    def is_audio(self) -> bool:
        return self.kind == "audio" or (self.kind == "file" and str(self.file).lower().endswith(".wav"))


@dataclass(frozen=True)
class CropSpec:
    DESCRIPTION = "Crops of an earlier detection stage's boxes, each fed to this stage's model (batched)."
    source: str = option(key="from", description="The detection stage whose boxes are cropped.", pattern=_NAME)
    classes: tuple[str, ...] = option((), description="Only boxes of these labels (all when empty).")
    max: int = option(8, description="Crops per frame at most (best scores first).", minimum=1, maximum=64)
    pad: float = option(0.0, description="Grow each box by this fraction of its size before cropping.",
                        minimum=0, maximum=1)
    min_score: float = option(0.0, description="Only boxes scoring at least this.", minimum=0, maximum=1)


@dataclass(frozen=True)
class StageSpec:
    DESCRIPTION = "One model run on each frame, or on each crop of an earlier stage."
    model: str = option(description="An installed model's name.", pattern=_NAME)
    name: str | None = option(None, description="The stage's name (the model's name by default).", pattern=_NAME)
    crop: CropSpec | None = option(None, description="Run on crops of an earlier stage's detections.")

    @property
    def stage_name(self) -> str:
        return self.name or self.model


@dataclass(frozen=True)
class TrackerSpec:
    DESCRIPTION = ("A ByteTrack-style IoU tracker over the first detection stage: ids that stay with their object "
                   "across frames, so zones and lines count objects, not detections.")
    stage: str | None = option(None, description="The detection stage tracked (the first one by default).",
                               pattern=_NAME)
    high: float = option(0.5, description="Detections scoring at least this start and match tracks first.",
                         minimum=0, maximum=1)
    low: float = option(0.1, description="Detections between low and high only continue existing tracks.",
                        minimum=0, maximum=1)
    iou: float = option(0.3, description="Least IoU between a track's predicted box and a detection to match.",
                        exclusiveMinimum=0, maximum=1)
    max_age: int = option(30, description="Frames a track survives without a match.", minimum=1, maximum=10000)
    min_hits: int = option(3, description="Matches before a track is confirmed (and reported).", minimum=1,
                           maximum=100)


@dataclass(frozen=True)
class RuleSpec:
    DESCRIPTION = ("One rule: exactly one of zone, line, count, confidence names it; the other keys are that "
                   "kind's (docs/agent.md, Pipelines).")
    zone: str | None = option(None, description="A polygon zone: enter, leave and dwell events.", pattern=_NAME)
    line: str | None = option(None, description="A directional line: crossing events, per-class counts.",
                              pattern=_NAME)
    count: str | None = option(None, description="A count threshold on objects (in a zone or the frame).",
                               pattern=_NAME)
    confidence: str | None = option(None, description="A confidence band: detections scoring in [low, high).",
                                    pattern=_NAME)
    classes: tuple[str, ...] = option((), description="Only objects of these labels (all when empty).")
    polygon: tuple[tuple[float, ...], ...] | None = option(
        None, description="zone: the polygon's corners [[x, y], ...] as fractions of the frame.",
        minItems=3, maxItems=MAX_POLYGON_POINTS)
    points: tuple[tuple[float, ...], ...] | None = option(
        None, description="line: its two ends [[x1, y1], [x2, y2]] as fractions of the frame.", minItems=2, maxItems=2)
    direction: Literal["both", "in", "out"] = option(
        "both", description="line: which crossings are events; 'in' crosses from the left of the line "
        "(walking from its first point to its second) to its right.")
    anchor: Literal["center", "bottom"] = option("center", description="The point of a box tested against zones "
                                                 "and lines (bottom: the middle of its bottom edge, feet).")
    dwell_s: float | None = option(None, description="zone: a dwell event once an object has stayed this long.",
                                   exclusiveMinimum=0)
    in_zone: str | None = option(None, description="count: count only objects inside this zone.", pattern=_NAME)
    above: int | None = option(None, description="count: an event when the count rises above this.", minimum=0)
    below: int | None = option(None, description="count: an event when the count falls below this.", minimum=1)
    low: float | None = option(None, description="confidence: the band's lower end (included).", minimum=0,
                               maximum=1)
    high: float | None = option(None, description="confidence: the band's upper end (excluded).", minimum=0,
                                maximum=1)


@dataclass(frozen=True)
class SinkSpec:
    DESCRIPTION = "Where events go: exactly one of mqtt, webhook, file, snapshots."
    mqtt: bool | None = option(None, description="Events on edgepack/v1/dev/{id}/events (QoS 1, through the outbox).")
    webhook: str | None = option(None, description="POST each event as JSON to this URL.", pattern="^https?://")
    file: str | None = option(None, description="Append events as JSON lines to this file (rotated).", minLength=1)
    snapshots: str | None = option(None, description="Write a JPEG of the frame with its boxes per event here.",
                                   minLength=1)
    max_bytes: int = option(10 * 1024 * 1024, description="file: rotate past this size; snapshots: the folder's "
                            "total size at most (oldest deleted).", minimum=4096)
    keep: int = option(5, description="file: rotated files kept; snapshots: files kept at most.", minimum=1,
                       maximum=100000)
    timeout_s: float = option(5.0, description="webhook: one POST's timeout.", exclusiveMinimum=0, maximum=60)


@dataclass(frozen=True)
class PipelineSpec:
    DESCRIPTION = "A stream: a source, the stages its frames go through, a tracker, rules and sinks."
    name: str = option(description="The pipeline's name (events and metrics carry it).", pattern=_NAME)
    source: SourceSpec = option(description="Where frames or audio come from.")
    stages: tuple[StageSpec, ...] = option(description="The models run, in order.", minItems=1, maxItems=MAX_STAGES)
    tracker: TrackerSpec | None = option(None, description="Track the first detection stage's objects.")
    rules: tuple[RuleSpec, ...] = option((), description="Rules that turn results into events.", maxItems=MAX_RULES)
    sinks: tuple[SinkSpec, ...] = option((), description="Where events go.", maxItems=8)


def pipeline_schema() -> dict[str, Any]:
    """The JSON Schema of one pipeline (the published ``schemas/pipeline.schema.json``)."""
    schema = schema_of(PipelineSpec)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID,
            "title": "Edgepack pipeline", **schema}


def pipelines_schema() -> dict[str, Any]:
    """The JSON Schema of a ``pipelines`` list (each item :func:`pipeline_schema`'s, without its
    ``$id``): what the fleet server's OpenAPI document says the remote setting takes."""
    return {"type": "array", "maxItems": MAX_PIPELINES, "items": schema_of(PipelineSpec)}


def parse_pipelines(documents: Any, *, where: str = "pipelines") -> tuple[PipelineSpec, ...]:
    """Validate and parse the ``pipelines`` list of agent.yaml or of a desired state: each item
    against the schema (the offending key path named), then the cross-field rules of
    :func:`check_document` that a schema cannot say; :class:`~edgepack_core.errors.SchemaError`
    naming the key otherwise."""
    validate(documents, {"type": "array", "maxItems": MAX_PIPELINES}, document=where)
    schema = pipeline_schema()
    for index, item in enumerate(documents):
        try:
            validate(item, schema)
        except SchemaError as err:
            raise SchemaError(f"{where}[{index}]" + (f".{err.path}" if err.path else ""), err.problem) from err
    specs = tuple(parse(PipelineSpec, item) for item in documents)
    try:
        check_document(specs, where=where)
    except SchemaError as err:  # well-formed, but its parts do not fit: a rule no schema can say
        raise DocumentRuleError(err.path, err.problem, document=err.document) from err
    return specs


def rule_kind(rule: RuleSpec) -> str:
    """The one of zone/line/count/confidence a rule sets ('' when none or several: refused)."""
    kinds = [kind for kind in ("zone", "line", "count", "confidence") if getattr(rule, kind) is not None]
    return kinds[0] if len(kinds) == 1 else ""


def rule_name(rule: RuleSpec) -> str:
    return str(getattr(rule, rule_kind(rule)) or "")


# ---------------------------------------------------------------- cross-field rules

# The keys each rule kind may set, besides its naming key, classes and anchor.
RULE_KEYS: Mapping[str, frozenset[str]] = {
    "zone": frozenset({"polygon", "dwell_s"}),
    "line": frozenset({"points", "direction"}),
    "count": frozenset({"in_zone", "above", "below"}),
    "confidence": frozenset({"low", "high"}),
}
_RULE_DEFAULTS = RuleSpec()
SINK_KINDS = ("mqtt", "webhook", "file", "snapshots")


def check_document(specs: Sequence[PipelineSpec], *, where: str = "pipelines") -> None:
    names = [spec.name for spec in specs]
    for index, spec in enumerate(specs):
        key = f"{where}[{index}]"
        if names.count(spec.name) > 1:
            raise SchemaError(f"{key}.name", f"two pipelines are named {spec.name!r}")
        _check_source(spec.source, f"{key}.source")
        _check_stages(spec, key)
        _check_rules(spec, key)
        _check_sinks(spec.sinks, f"{key}.sinks")


def _check_source(source: SourceSpec, key: str) -> None:
    given = [kind for kind in SOURCE_KINDS if getattr(source, kind) not in (None, False)]
    if len(given) != 1:
        raise SchemaError(key, f"give exactly one of {', '.join(SOURCE_KINDS)} (got {', '.join(given) or 'none'})")
    if source.reconnect_max_s < source.reconnect_s:
        raise SchemaError(f"{key}.reconnect_max_s", "is below reconnect_s")


def _check_stages(spec: PipelineSpec, key: str) -> None:
    seen: list[str] = []
    for index, stage in enumerate(spec.stages):
        if stage.stage_name in seen:
            raise SchemaError(f"{key}.stages[{index}]", f"two stages are named {stage.stage_name!r}: give one a name")
        if stage.crop is not None and stage.crop.source not in seen:
            raise SchemaError(f"{key}.stages[{index}].crop.from",
                              f"{stage.crop.source!r} is not an earlier stage ({', '.join(seen) or 'none before'})")
        seen.append(stage.stage_name)
    tracker = spec.tracker
    if tracker is not None:
        if tracker.stage is not None and tracker.stage not in seen:
            raise SchemaError(f"{key}.tracker.stage", f"{tracker.stage!r} is not a stage ({', '.join(seen)})")
        if tracker.low > tracker.high:
            raise SchemaError(f"{key}.tracker.low", f"{tracker.low} is above high ({tracker.high})")


def _check_rules(spec: PipelineSpec, key: str) -> None:
    names: list[str] = []
    zones = {rule_name(rule) for rule in spec.rules if rule_kind(rule) == "zone"}
    for index, rule in enumerate(spec.rules):
        rule_key = f"{key}.rules[{index}]"
        kind = rule_kind(rule)
        if not kind:
            raise SchemaError(rule_key, "give exactly one of zone, line, count, confidence")
        if rule_name(rule) in names:
            raise SchemaError(rule_key, f"two rules are named {rule_name(rule)!r}")
        names.append(rule_name(rule))
        _check_rule_keys(rule, kind, rule_key)
        _check_rule_values(rule, kind, rule_key, zones)
        if spec.tracker is None and (kind in ("zone", "line") or rule.in_zone is not None):
            raise SchemaError(rule_key, f"a {kind} rule follows objects across frames: add a tracker")


def _check_rule_keys(rule: RuleSpec, kind: str, key: str) -> None:
    for other, keys in RULE_KEYS.items():
        if other == kind:
            continue
        for name in sorted(keys - RULE_KEYS[kind]):
            if getattr(rule, name) != getattr(_RULE_DEFAULTS, name):
                raise SchemaError(f"{key}.{name}", f"is not a key of a {kind} rule")


def _check_rule_values(rule: RuleSpec, kind: str, key: str, zones: set[str]) -> None:
    if kind == "zone":
        _check_points(rule.polygon, f"{key}.polygon", "a zone needs its polygon")
    elif kind == "line":
        _check_points(rule.points, f"{key}.points", "a line needs its two points")
        assert rule.points is not None
        if tuple(rule.points[0]) == tuple(rule.points[1]):
            raise SchemaError(f"{key}.points", "the line's two points are the same")
    elif kind == "count":
        if rule.above is None and rule.below is None:
            raise SchemaError(key, "a count rule needs above or below")
        if rule.in_zone is not None and rule.in_zone not in zones:
            raise SchemaError(f"{key}.in_zone", f"{rule.in_zone!r} is not a zone rule")
    else:
        if rule.low is None or rule.high is None or rule.low >= rule.high:
            raise SchemaError(key, "a confidence rule needs low below high")


def _check_points(points: Sequence[Sequence[float]] | None, key: str, missing: str) -> None:
    if points is None:
        raise SchemaError(key, missing)
    for index, point in enumerate(points):
        if len(point) != 2 or not all(-1.0 <= value <= 2.0 for value in point):
            raise SchemaError(f"{key}[{index}]", "a point is [x, y], fractions of the frame")


def _check_sinks(sinks: Sequence[SinkSpec], key: str) -> None:
    for index, sink in enumerate(sinks):
        given = [kind for kind in SINK_KINDS if getattr(sink, kind) not in (None, False)]
        if len(given) != 1:
            raise SchemaError(f"{key}[{index}]", f"give exactly one of {', '.join(SINK_KINDS)}")
