"""A device's pipeline counters: the ``pipelines`` section of a telemetry message and the
agent's ``/metrics`` series, one typed value for both.

Per pipeline: its state, the frames its stages answered, the frames its ``latest`` queue
dropped, stage errors; its source's state, frames read, reconnects and failures; events by
rule and kind since the agent started; and each stage's latency (frames answered, p50 and p95
in ms, estimated from the agent's histograms) and the frames' whole way (``end_to_end``).
Counters only grow while the agent runs (they restart with it), so a reader takes differences,
as with Prometheus counters.

Bounded both ways: the agent sends at most :data:`MAX_PIPELINES` pipelines, :data:`MAX_RULES`
rules and :data:`MAX_STAGES` stages per pipeline (the first by name), and
:func:`parse_pipelines_section` keeps no more than that whatever a message holds, reading a
wrong-typed figure as None the way the rest of telemetry does (:mod:`.messages`), never
refusing the message for it. ``stages`` and ``end_to_end`` are optional: an older agent's
pipelines parse without them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, get_args

from edgepack_core.pipeline_limits import MAX_PIPELINES as MAX_PIPELINES  # re-exported: the old name
from edgepack_core.pipeline_limits import MAX_STAGES as MAX_STAGES
from edgepack_core.protocol.bounds import count, first_named, number, text
from edgepack_core.protocol.events import EventKind
from edgepack_core.protocol.ids import is_valid_id

MAX_RULES = 32  # rules per pipeline whose event counts travel in telemetry
PIPELINE_STATES = ("running", "finished", "refused")
SOURCE_STATES = ("starting", "up", "down")
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)
MAX_REASON_CHARS = 300


@dataclass(frozen=True)
class SourceFigures:
    """A pipeline's source reader: ``state`` (starting, up, down), frames read, reopenings
    after a failure or an end, failures (cannot open, read error, watchdog), and why it is down
    (``reason``: sent only then, so an operator sees the cause without the device's logs)."""

    state: str | None = None
    frames: int | None = None
    reconnects: int | None = None
    failures: int | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"state": self.state, "frames": self.frames, "reconnects": self.reconnects,
                               "failures": self.failures}
        if self.reason is not None:
            doc["reason"] = self.reason[:MAX_REASON_CHARS]
        return doc


@dataclass(frozen=True)
class StageFigures:
    """One stage's latency (its work on a frame, not its wait): frames it answered and the p50
    and p95 in milliseconds (None before its first frame). ``end_to_end``'s name is its own."""

    name: str
    count: int | None = None
    p50_ms: float | None = None
    p95_ms: float | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, **self.unnamed_json()}

    def unnamed_json(self) -> dict[str, Any]:
        """The figures without the name (``end_to_end``'s document: its key names it)."""
        return {"count": self.count, "p50_ms": self.p50_ms, "p95_ms": self.p95_ms}


END_TO_END = "end_to_end"


@dataclass(frozen=True)
class PipelineFigures:
    """One pipeline's counters. ``events`` is ``((rule, ((kind, count), ...)), ...)`` sorted by
    rule; ``source`` is None for frames pushed from Python and refused pipelines."""

    name: str
    state: str | None = None
    frames: int | None = None
    dropped: int | None = None
    stage_errors: int | None = None
    source: SourceFigures | None = None
    events: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()
    reason: str | None = None  # refused: why
    stages: tuple[StageFigures, ...] = ()  # per stage in order (absent from older agents)
    end_to_end: StageFigures | None = None  # from the reader's hand-over to the sinks done

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name, "state": self.state, "frames": self.frames, "dropped": self.dropped,
            "stage_errors": self.stage_errors, "source": None if self.source is None else self.source.to_json(),
            "events": {rule: dict(kinds) for rule, kinds in self.events[:MAX_RULES]}}
        if self.reason is not None:
            doc["reason"] = self.reason[:MAX_REASON_CHARS]
        if self.stages:
            doc["stages"] = [stage.to_json() for stage in self.stages[:MAX_STAGES]]
        if self.end_to_end is not None:
            doc["end_to_end"] = self.end_to_end.unnamed_json()
        return doc


def events_by_rule(counts: Mapping[tuple[str, str], int]) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """``{(rule, kind): n}`` as :attr:`PipelineFigures.events`: by rule name, kinds in order."""
    rules: dict[str, dict[str, int]] = {}
    for (rule, kind), n in sorted(counts.items()):
        rules.setdefault(rule, {})[kind] = n
    return tuple((rule, tuple(kinds.items())) for rule, kinds in rules.items())


def _choice(value: Any, allowed: tuple[str, ...]) -> str | None:
    return value if isinstance(value, str) and value in allowed else None


def _source(value: Any) -> SourceFigures | None:
    if not isinstance(value, dict):
        return None
    return SourceFigures(_choice(value.get("state"), SOURCE_STATES), count(value.get("frames")),
                         count(value.get("reconnects")), count(value.get("failures")),
                         text(value.get("reason"), MAX_REASON_CHARS))


def _events(value: Any) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """The first :data:`MAX_RULES` rules with a valid name, each with its known kinds."""
    if not isinstance(value, dict):
        return ()
    out = []
    for rule, kinds in list(value.items())[:MAX_RULES]:
        if not isinstance(kinds, dict) or not is_valid_id(rule):
            continue
        known = tuple((kind, n) for kind, n in ((k, count(v)) for k, v in kinds.items() if k in EVENT_KINDS)
                      if n is not None)
        out.append((rule, known))
    return tuple(out)


def _millis(value: Any) -> float | None:
    figure = number(value)
    return figure if figure is not None and figure >= 0 else None


def _stage(value: Any, name: Any = None) -> StageFigures | None:
    """One stage's figures (``name``: given for ``end_to_end``, else the item's own, an id)."""
    if not isinstance(value, dict):
        return None
    name = value.get("name") if name is None else name
    if not is_valid_id(name):
        return None
    return StageFigures(str(name), count(value.get("count")), _millis(value.get("p50_ms")),
                        _millis(value.get("p95_ms")))


def _pipeline(value: Any) -> PipelineFigures | None:
    if not isinstance(value, dict) or not is_valid_id(value.get("name")):
        return None
    return PipelineFigures(
        name=str(value["name"]), state=_choice(value.get("state"), PIPELINE_STATES), frames=count(value.get("frames")),
        dropped=count(value.get("dropped")), stage_errors=count(value.get("stage_errors")),
        source=_source(value.get("source")), events=_events(value.get("events")),
        reason=text(value.get("reason"), MAX_REASON_CHARS), stages=first_named(value.get("stages"), MAX_STAGES, _stage),
        end_to_end=_stage(value.get("end_to_end"), END_TO_END))


def parse_pipelines_section(value: Any) -> tuple[PipelineFigures, ...]:
    """The valid pipelines among the first :data:`MAX_PIPELINES`, each name once; () for a
    section that is absent (older agents) or not a list."""
    return first_named(value, MAX_PIPELINES, _pipeline)
