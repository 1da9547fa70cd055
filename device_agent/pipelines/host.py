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
from typing import Any

from device_agent.errors import PipelineRefused
from device_agent.pipelines.checks import StageContract, check_models
from device_agent.pipelines.runner import PipelineRunner
from device_agent.pipelines.sinks import make_sinks
from device_agent.pipelines.spec import PipelineSpec
from edgepack_core.protocol.events import Event
from edgepack_core.protocol.pipeline_figures import MAX_RULES, PipelineFigures, SourceFigures, events_by_rule

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

    def status(self) -> dict[str, Any]:
        """Per pipeline: running with its counters, or refused with the reason (/healthz)."""
        out: dict[str, Any] = {name: {"state": "refused", "reason": reason} for name, reason in self.refused.items()}
        for name, runner in self.runners.items():
            source = runner.reader.status if runner.reader is not None else None
            out[name] = {"state": "finished" if runner.finished.is_set() else "running",
                         "frames": runner.counters.frames, "events": runner.counters.events,
                         "dropped": runner.queue.dropped, "stage_errors": runner.counters.stage_errors,
                         "source": None if source is None else {"state": source.state, "detail": source.detail,
                                                                "reconnects": source.reconnects}}
        return out

    def figures(self) -> tuple[PipelineFigures, ...]:
        """Each pipeline's counters, typed (/metrics and telemetry): refused ones with why."""
        out = [PipelineFigures(name, "refused", reason=reason) for name, reason in self.refused.items()]
        for name, runner in self.runners.items():
            reader = runner.reader.status if runner.reader is not None else None
            source = None if reader is None else SourceFigures(
                reader.state, reader.frames, reader.reconnects, reader.failures,
                (reader.detail or None) if reader.state == "down" else None)
            out.append(PipelineFigures(
                name, "finished" if runner.finished.is_set() else "running", runner.counters.frames,
                runner.queue.dropped, runner.counters.stage_errors, source,
                events_by_rule(dict(runner.counters.by_kind))[:MAX_RULES]))
        return tuple(out)
