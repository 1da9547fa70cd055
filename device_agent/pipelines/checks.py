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

from device_agent.errors import PipelineRefused
from edgepack_core.pipeline_spec import PipelineSpec, SourceSpec, check_document

__all__ = ["StageContract", "check_document", "check_models"]

@dataclass(frozen=True)
class StageContract:
    """What a pipeline needs to know of an installed model: what its preprocessing eats
    (``image``, ``audio`` or ``tensor``), what its postprocessing gives (``detection``,
    ``softmax``, ``topk``, ``ctc``, ``raw``) and its labels (None when it has none)."""

    input_kind: str
    output_kind: str
    labels: tuple[str, ...] | None = None



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
