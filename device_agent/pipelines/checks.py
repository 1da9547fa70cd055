"""What a pipeline document must satisfy beyond its schema, and against the installed models.

Pure. :func:`check_document` holds the cross-field rules a JSON Schema cannot say (one source
kind, stage and rule names unique and referring backwards, each rule's keys its own kind's);
:func:`check_models` checks the document against the models' real I/O contracts
(:class:`StageContract`, read from their verified manifests by the I/O layer) before anything
starts: every stage's model installed, a video source feeding an image model and an audio source
an audio model, crops and trackers reading detection stages, and every label a rule names one the
model can answer. Each refusal names the key: a :class:`~device_agent.errors.ConfigError` for the
document, a :class:`~device_agent.errors.PipelineRefused` for what the models cannot do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from device_agent.errors import ConfigError, PipelineRefused
from device_agent.pipelines.spec import (
    SOURCE_KINDS,
    PipelineSpec,
    RuleSpec,
    SinkSpec,
    SourceSpec,
    rule_kind,
    rule_name,
)

# The keys each rule kind may set, besides its naming key, classes and anchor.
RULE_KEYS: Mapping[str, frozenset[str]] = {
    "zone": frozenset({"polygon", "dwell_s"}),
    "line": frozenset({"points", "direction"}),
    "count": frozenset({"in_zone", "above", "below"}),
    "confidence": frozenset({"low", "high"}),
}
_RULE_DEFAULTS = RuleSpec()
SINK_KINDS = ("mqtt", "webhook", "file", "snapshots")


@dataclass(frozen=True)
class StageContract:
    """What a pipeline needs to know of an installed model: what its preprocessing eats
    (``image``, ``audio`` or ``tensor``), what its postprocessing gives (``detection``,
    ``softmax``, ``topk``, ``ctc``, ``raw``) and its labels (None when it has none)."""

    input_kind: str
    output_kind: str
    labels: tuple[str, ...] | None = None


def check_document(specs: Sequence[PipelineSpec], *, where: str = "pipelines") -> None:
    names = [spec.name for spec in specs]
    for index, spec in enumerate(specs):
        key = f"{where}[{index}]"
        if names.count(spec.name) > 1:
            raise ConfigError(f"{key}.name", f"two pipelines are named {spec.name!r}")
        _check_source(spec.source, f"{key}.source")
        _check_stages(spec, key)
        _check_rules(spec, key)
        _check_sinks(spec.sinks, f"{key}.sinks")


def _check_source(source: SourceSpec, key: str) -> None:
    given = [kind for kind in SOURCE_KINDS if getattr(source, kind) not in (None, False)]
    if len(given) != 1:
        raise ConfigError(key, f"give exactly one of {', '.join(SOURCE_KINDS)} (got {', '.join(given) or 'none'})")
    if source.reconnect_max_s < source.reconnect_s:
        raise ConfigError(f"{key}.reconnect_max_s", "is below reconnect_s")


def _check_stages(spec: PipelineSpec, key: str) -> None:
    seen: list[str] = []
    for index, stage in enumerate(spec.stages):
        if stage.stage_name in seen:
            raise ConfigError(f"{key}.stages[{index}]", f"two stages are named {stage.stage_name!r}: give one a name")
        if stage.crop is not None and stage.crop.source not in seen:
            raise ConfigError(f"{key}.stages[{index}].crop.from",
                              f"{stage.crop.source!r} is not an earlier stage ({', '.join(seen) or 'none before'})")
        seen.append(stage.stage_name)
    if index_of_crop_first(spec) == 0:
        raise ConfigError(f"{key}.stages[0].crop", "the first stage has no earlier stage to crop from")
    tracker = spec.tracker
    if tracker is not None:
        if tracker.stage is not None and tracker.stage not in seen:
            raise ConfigError(f"{key}.tracker.stage", f"{tracker.stage!r} is not a stage ({', '.join(seen)})")
        if tracker.low > tracker.high:
            raise ConfigError(f"{key}.tracker.low", f"{tracker.low} is above high ({tracker.high})")


def index_of_crop_first(spec: PipelineSpec) -> int | None:
    return 0 if spec.stages and spec.stages[0].crop is not None else None


def _check_rules(spec: PipelineSpec, key: str) -> None:
    names: list[str] = []
    zones = {rule_name(rule) for rule in spec.rules if rule_kind(rule) == "zone"}
    for index, rule in enumerate(spec.rules):
        rule_key = f"{key}.rules[{index}]"
        kind = rule_kind(rule)
        if not kind:
            raise ConfigError(rule_key, "give exactly one of zone, line, count, confidence")
        if rule_name(rule) in names:
            raise ConfigError(rule_key, f"two rules are named {rule_name(rule)!r}")
        names.append(rule_name(rule))
        _check_rule_keys(rule, kind, rule_key)
        _check_rule_values(rule, kind, rule_key, zones)
        if spec.tracker is None and (kind in ("zone", "line") or rule.in_zone is not None):
            raise ConfigError(rule_key, f"a {kind} rule follows objects across frames: add a tracker")


def _check_rule_keys(rule: RuleSpec, kind: str, key: str) -> None:
    for other, keys in RULE_KEYS.items():
        if other == kind:
            continue
        for name in sorted(keys - RULE_KEYS[kind]):
            if getattr(rule, name) != getattr(_RULE_DEFAULTS, name):
                raise ConfigError(f"{key}.{name}", f"is not a key of a {kind} rule")


def _check_rule_values(rule: RuleSpec, kind: str, key: str, zones: set[str]) -> None:
    if kind == "zone":
        _check_points(rule.polygon, f"{key}.polygon", "a zone needs its polygon")
    elif kind == "line":
        _check_points(rule.points, f"{key}.points", "a line needs its two points")
        assert rule.points is not None
        if tuple(rule.points[0]) == tuple(rule.points[1]):
            raise ConfigError(f"{key}.points", "the line's two points are the same")
    elif kind == "count":
        if rule.above is None and rule.below is None:
            raise ConfigError(key, "a count rule needs above or below")
        if rule.in_zone is not None and rule.in_zone not in zones:
            raise ConfigError(f"{key}.in_zone", f"{rule.in_zone!r} is not a zone rule")
    else:
        if rule.low is None or rule.high is None or rule.low >= rule.high:
            raise ConfigError(key, "a confidence rule needs low below high")


def _check_points(points: Sequence[Sequence[float]] | None, key: str, missing: str) -> None:
    if points is None:
        raise ConfigError(key, missing)
    for index, point in enumerate(points):
        if len(point) != 2 or not all(-1.0 <= value <= 2.0 for value in point):
            raise ConfigError(f"{key}[{index}]", "a point is [x, y], fractions of the frame")


def _check_sinks(sinks: Sequence[SinkSpec], key: str) -> None:
    for index, sink in enumerate(sinks):
        given = [kind for kind in SINK_KINDS if getattr(sink, kind) not in (None, False)]
        if len(given) != 1:
            raise ConfigError(f"{key}[{index}]", f"give exactly one of {', '.join(SINK_KINDS)}")


# ---------------------------------------------------------------- against the installed models

def check_models(spec: PipelineSpec, contracts: Mapping[str, StageContract], *, where: str = "pipelines[0]") -> None:
    """Refuse a pipeline the installed models cannot run (``contracts``: by model name)."""
    by_stage: dict[str, StageContract] = {}
    for index, stage in enumerate(spec.stages):
        key = f"{where}.stages[{index}]"
        contract = contracts.get(stage.model)
        if contract is None:
            raise PipelineRefused(f"{key}.model", f"no installed model {stage.model!r} "
                              f"(installed: {', '.join(sorted(contracts)) or 'none'})")
        if stage.crop is None:
            _check_feeds(spec.source, contract, stage.model, key)
        else:
            _check_crop(stage.crop.source, stage.crop.classes, by_stage, contract, stage.model, key)
        by_stage[stage.stage_name] = contract
    detection = _tracked_stage(spec, by_stage, where)
    if detection is not None:
        for index, rule in enumerate(spec.rules):
            _check_labels(rule.classes, detection, f"{where}.rules[{index}].classes")


def _check_feeds(source: SourceSpec, contract: StageContract, model: str, key: str) -> None:
    wanted = "audio" if source.is_audio else "image"
    if source.kind != "push" and contract.input_kind != wanted:
        raise PipelineRefused(f"{key}.model", f"{model} takes {contract.input_kind} input; a {source.kind} source "
                          f"gives {wanted}")


def _check_crop(source: str, classes: Sequence[str], by_stage: Mapping[str, StageContract],
                contract: StageContract, model: str, key: str) -> None:
    origin = by_stage[source]
    if origin.output_kind != "detection":
        raise PipelineRefused(f"{key}.crop.from", f"stage {source!r} gives {origin.output_kind}, not detections")
    if contract.input_kind != "image":
        raise PipelineRefused(f"{key}.model", f"{model} takes {contract.input_kind} input, not image crops")
    _check_labels(classes, origin, f"{key}.crop.classes")


def _tracked_stage(spec: PipelineSpec, by_stage: Mapping[str, StageContract], where: str) -> StageContract | None:
    """The contract of the stage the tracker (and the rules) read: ``tracker.stage``, the first
    detection stage, or without one the first stage (a classifier's label over the whole frame,
    an audio model's over each block)."""
    if spec.tracker is None and not spec.rules:
        return None
    wanted = spec.tracker.stage if spec.tracker is not None else None
    for stage in spec.stages:
        contract = by_stage[stage.stage_name]
        if (wanted is None and contract.output_kind == "detection") or stage.stage_name == wanted:
            if contract.output_kind != "detection" and spec.tracker is not None:
                raise PipelineRefused(f"{where}.tracker.stage", f"stage {stage.stage_name!r} gives "
                                  f"{contract.output_kind}, not detections")
            return contract
    if spec.tracker is not None:
        raise PipelineRefused(f"{where}.tracker", "no stage gives detections to track")
    return by_stage[spec.stages[0].stage_name]  # no detection stage: the rules read the first (runner.py)


def _check_labels(classes: Sequence[str], contract: StageContract, key: str) -> None:
    if contract.labels is None:
        return
    unknown = [label for label in classes if label not in contract.labels]
    if unknown:
        raise PipelineRefused(key, f"{', '.join(map(repr, unknown))} is not a label of the model "
                          f"(it has {len(contract.labels)}: {', '.join(contract.labels[:8])}...)")
