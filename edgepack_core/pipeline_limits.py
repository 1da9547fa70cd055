"""The limits of a device's pipelines, apart from the pipeline documents' parser
(:mod:`edgepack_core.pipeline_spec`) so that telemetry's reader
(:mod:`edgepack_core.protocol.pipeline_figures`) bounds what it keeps by the same numbers
without loading the parser: an agent that runs no pipeline never imports it."""

from __future__ import annotations

MAX_PIPELINES = 16
"""Pipelines on one device (agent.yaml or a settings document), and in one telemetry message."""
MAX_STAGES = 8
"""Stages (models) of one pipeline, and stage latencies of one pipeline in telemetry."""
