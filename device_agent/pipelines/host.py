"""The agent's pipelines: each checked against the installed models, then started; stopped with
the agent.

A pipeline the installed models cannot run is refused before it starts, with the one line of
:func:`~.checks.check_models` in the log and in :meth:`PipelineSet.status`, and the agent goes
on serving (and running its other pipelines): a bad pipeline never stops the agent, the same way
a failing source never stops its pipeline.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from device_agent.errors import PipelineRefused
from device_agent.pipelines.checks import StageContract, check_models
from device_agent.pipelines.latency import HistogramSnapshot, PipelineLatency
from device_agent.pipelines.runner import PipelineRunner
from device_agent.pipelines.sinks import make_sinks
from device_agent.pipelines.spec import PipelineSpec
from edgepack_core.protocol.events import Event
from edgepack_core.protocol.pipeline_figures import (
    END_TO_END,
    MAX_RULES,
    PipelineFigures,
    SourceFigures,
    StageFigures,
    events_by_rule,
)

log = logging.getLogger(__name__)


class PipelineSet:
    """The running pipelines of one agent, and those refused with why."""

    def __init__(self, specs: Sequence[PipelineSpec], device_id: str, services: Callable[[str], Any],
                 publish: Callable[[Event], None] | None) -> None:
        self.specs, self.device_id, self._services, self._publish = tuple(specs), device_id, services, publish
        self.runners: dict[str, PipelineRunner] = {}
        self.refused: dict[str, str] = {}

    def start(self, contracts: Mapping[str, StageContract]) -> PipelineSet:
        for index, spec in enumerate(self.specs):
            try:
                check_models(spec, contracts, where=f"pipelines[{index}]")
            except PipelineRefused as err:
                self.refused[spec.name] = str(err)
                log.error("pipeline %s not started: %s", spec.name, err)
                continue
            runner = PipelineRunner(spec, self.device_id, self._services, make_sinks(spec.sinks, self._publish))
            runner.start()
            self.runners[spec.name] = runner
            log.info("pipeline %s started (%s source)", spec.name, spec.source.kind)
        return self

    def stop(self) -> None:
        for runner in self.runners.values():
            runner.stop()

    def snapshot(self) -> tuple[PipelineReading, ...]:
        """Every pipeline's state, each runner's counters and source read once: refused ones
        first, then the running in start order. What one answer says is derived from one of
        these, so its parts (/healthz's status, /metrics' figures) never disagree."""
        out = [PipelineReading(name, "refused", reason=reason) for name, reason in self.refused.items()]
        return (*out, *(_reading(name, runner) for name, runner in self.runners.items()))

    def status(self) -> dict[str, Any]:
        """Per pipeline: running with its counters, or refused with the reason (/healthz)."""
        return status_of(self.snapshot())

    def figures(self) -> tuple[PipelineFigures, ...]:
        """Each pipeline's counters, typed (/metrics and telemetry): refused ones with why."""
        return figures_of(self.snapshot())


@dataclass(frozen=True)
class SourceReading:
    """A pipeline's source reader as read once."""

    state: str
    detail: str
    frames: int
    reconnects: int
    failures: int


@dataclass(frozen=True)
class PipelineReading:
    """One pipeline as read once (:meth:`PipelineSet.snapshot`): ``state`` running, finished or
    refused (``reason``: why), its counters, its source (None: frames pushed from Python), its
    events by (rule, kind) and its stages' latency histograms (None: refused)."""

    name: str
    state: str
    reason: str | None = None
    frames: int = 0
    events: int = 0
    dropped: int = 0
    stage_errors: int = 0
    source: SourceReading | None = None
    by_kind: tuple[tuple[tuple[str, str], int], ...] = ()
    latency: PipelineLatency | None = None

    def status(self) -> dict[str, Any]:
        if self.state == "refused":
            return {"state": "refused", "reason": self.reason}
        source = self.source
        return {"state": self.state, "frames": self.frames, "events": self.events, "dropped": self.dropped,
                "stage_errors": self.stage_errors,
                "source": None if source is None else {"state": source.state, "detail": source.detail,
                                                       "reconnects": source.reconnects},
                **self._latency_status()}

    def _latency_status(self) -> dict[str, Any]:
        """Each stage's frames answered, p50 and p95 in ms (and the model it runs), and the
        frames' whole way; nothing for a reading without histograms."""
        if self.latency is None:
            return {}
        latency = self.latency
        return {"stages": [{**_stage_figures(s.name, s.histogram, s.recent).to_json(), "model": s.model}
                           for s in latency.stages],
                "end_to_end": _stage_figures(END_TO_END, latency.end_to_end, latency.end_to_end_recent).unnamed_json()}

    def figures(self) -> PipelineFigures:
        if self.state == "refused":
            return PipelineFigures(self.name, "refused", reason=self.reason)
        source = self.source
        figures = None if source is None else SourceFigures(
            source.state, source.frames, source.reconnects, source.failures,
            (source.detail or None) if source.state == "down" else None)
        latency = self.latency
        return PipelineFigures(self.name, self.state, self.frames, self.dropped, self.stage_errors, figures,
                               events_by_rule(dict(self.by_kind))[:MAX_RULES],
                               stages=() if latency is None else tuple(
                                   _stage_figures(s.name, s.histogram, s.recent) for s in latency.stages),
                               end_to_end=None if latency is None else _stage_figures(
                                   END_TO_END, latency.end_to_end, latency.end_to_end_recent))


def _stage_figures(name: str, histogram: HistogramSnapshot, recent: HistogramSnapshot) -> StageFigures:
    """The frames answered since the start, and the p50 and p95 in ms of the last minute or two
    (None when no frame was answered in it: a stalled stage has no recent latency)."""
    return StageFigures(name, histogram.count, recent.quantile_ms(0.5), recent.quantile_ms(0.95))


def _reading(name: str, runner: PipelineRunner) -> PipelineReading:
    """One runner's state read once, into a frozen value."""
    reader = runner.reader.status if runner.reader is not None else None
    source = None if reader is None else SourceReading(reader.state, reader.detail, reader.frames,
                                                       reader.reconnects, reader.failures)
    counters = runner.counters
    return PipelineReading(name, "finished" if runner.finished.is_set() else "running", None, counters.frames,
                           counters.events, runner.queue.dropped, counters.stage_errors, source,
                           tuple(dict(counters.by_kind).items()), runner.latency.snapshot())


def status_of(snapshot: Sequence[PipelineReading]) -> dict[str, Any]:
    """/healthz's ``pipelines`` of one snapshot. Pure."""
    return {reading.name: reading.status() for reading in snapshot}


def figures_of(snapshot: Sequence[PipelineReading]) -> tuple[PipelineFigures, ...]:
    """/metrics' and telemetry's figures of one snapshot. Pure."""
    return tuple(reading.figures() for reading in snapshot)
