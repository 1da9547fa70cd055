"""The pipeline document, on the device: :mod:`edgepack_core.pipeline_spec` (shared, so the fleet
server checks a pipeline it sends by the same rule); this module keeps the agent's import path."""

from __future__ import annotations

from edgepack_core.pipeline_spec import (
    MAX_PIPELINES,
    MAX_POLYGON_POINTS,
    MAX_RULES,
    MAX_STAGES,
    SOURCE_KINDS,
    CropSpec,
    PipelineSpec,
    RuleSpec,
    SinkSpec,
    SourceSpec,
    StageSpec,
    TrackerSpec,
    parse_pipelines,
    pipeline_schema,
    rule_kind,
    rule_name,
)

__all__ = [
    "MAX_PIPELINES", "MAX_POLYGON_POINTS", "MAX_RULES", "MAX_STAGES", "SOURCE_KINDS", "CropSpec", "PipelineSpec",
    "RuleSpec", "SinkSpec", "SourceSpec", "StageSpec", "TrackerSpec", "parse_pipelines", "pipeline_schema",
    "rule_kind", "rule_name",
]
