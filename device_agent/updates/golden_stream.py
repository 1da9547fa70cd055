"""The activation check of a golden stream: the artifact's clip through the candidate model with
the artifact's pipeline fragment; its events must be the signed ones.

Runs on the loaded candidate before it serves (the update service's test stage and
``edgepack-agent install``), after its golden samples reproduced. The events are compared as a
multiset of (frame, rule, kind, label, direction) (:func:`edgepack_core.golden_stream.compare`);
any difference refuses the model with one line naming the first differing event, and the
counts go in the job's detail (``golden_stream: {events, mismatches}``) for the fleet's rollout
health. An agent without PyAV (the ``streams`` extra) cannot decode the clip: it logs a line,
flags ``golden_stream: {skipped: ...}`` and goes on (the golden samples were still checked).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from device_agent.errors import GoldenStreamMismatch, PipelineRefused
from device_agent.runtime import InferenceService, LoadedModel
from edgepack_core.errors import EdgepackError

log = logging.getLogger(__name__)

NO_PYAV = "PyAV is not installed (pip install 'edgepack-agent[streams]'): the golden clip was not decoded"


@dataclass(frozen=True)
class GoldenStreamReport:
    """What the check found: ``detail`` is the job's ``golden_stream`` entry (empty: no clip)."""

    detail: dict[str, Any]

    def job_detail(self) -> dict[str, Any]:
        return {"golden_stream": self.detail} if self.detail else {}


def has_pyav() -> bool:
    try:
        import av  # noqa: F401
    except ImportError:
        return False
    return True


def check_golden_stream(model: LoadedModel) -> GoldenStreamReport:
    """Replay the candidate's golden clip; raises :class:`GoldenStreamMismatch` on a difference
    (or a clip the model cannot run). The pipelines and the comparison are imported only for a
    model that has a clip: most have none, and an idle agent should not hold them."""
    manifest = model.manifest
    section = manifest.golden_stream
    if section is None:
        return GoldenStreamReport({})
    from device_agent.pipelines.golden import replay_clip
    from edgepack_core.golden_stream import MAX_EVENTS_BYTES, compare, mismatch_problem, parse_events

    label = f"{manifest.name} {manifest.version}"
    if not has_pyav():
        log.warning("%s: golden stream skipped: %s", label, NO_PYAV)
        return GoldenStreamReport({"skipped": NO_PYAV})
    events = model.root / section.events
    try:
        if events.stat().st_size > MAX_EVENTS_BYTES:
            raise PipelineRefused("golden_stream.events", f"over {MAX_EVENTS_BYTES} bytes")
        expected = parse_events(events.read_bytes())
        service = InferenceService(model)
        _, got = replay_clip(
            section.pipeline, model.root / section.clip, lambda name: service if name == manifest.name else None
        )
    except (EdgepackError, OSError) as err:
        raise GoldenStreamMismatch(label, str(err), {"events": 0, "mismatches": 1}) from err
    comparison = compare(expected, got)
    if comparison.mismatches:
        raise GoldenStreamMismatch(
            label,
            mismatch_problem(comparison),
            comparison.to_json(),
        )
    log.info("%s: golden stream matched its %d events", label, comparison.events)
    return GoldenStreamReport(comparison.to_json())


def failure_detail(err: Exception) -> dict[str, Any]:
    """The job detail of a refused activation: the golden stream's counts when it refused."""
    return {"golden_stream": dict(err.counts)} if isinstance(err, GoldenStreamMismatch) else {}
