"""Rules that turn a stream's tracked objects into events: zones, lines, counts, confidence bands.

Pure and frame-driven (no clock: a frame's ``ts`` is its time), so a golden clip gives the same
events on every machine. Coordinates are fractions of the frame (0..1). A box's ``anchor`` point
(its center, or the middle of its bottom edge) is what is tested.

- **Zones** (polygon): ``enter`` when an object is first seen inside or moves in, ``leave`` when
  it moves out or its track is lost inside, ``dwell`` once per visit after ``dwell_s``.
- **Lines** (directional): a crossing is counted when the anchor moves from one side to the
  other across the segment itself, by at least :data:`LINE_BAND` on each side: an object that
  jitters on the line, or whose box wobbles, is not counted again and again (the hysteresis the
  double counts users report need). ``in`` is the side clockwise of the line's direction on the
  screen: for a line drawn left to right, ``in`` is downward. Per-label totals ride on each event.
- **Counts**: objects (of ``classes``, optionally inside ``in_zone``) seen in the frame;
  ``count_above`` when the count rises above ``above``, ``count_below`` when it falls below
  ``below``, ``count_normal`` when it is back; once per change, never per frame.
- **Confidence bands**: an object scoring in ``[low, high)``: once per track (with a tracker),
  else the best such detection of a frame.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from device_agent.pipelines.spec import RuleSpec, rule_kind, rule_name
from edgepack_core.protocol.events import EventKind

# Half-width of the band around a line, in frame fractions, that an anchor must leave on the far
# side before a crossing counts (and on the near side before it is "on a side" at all).
LINE_BAND = 0.01

Point = tuple[float, float]


@dataclass(frozen=True)
class Seen:
    """One object of a frame as the rules see it: a box in frame fractions."""

    track: int | None  # None without a tracker
    box: tuple[float, float, float, float]
    score: float
    label: str


@dataclass(frozen=True)
class Frame:
    """What the rules get per frame: its index and time, the objects matched in it, and the
    track ids still alive (a zone's occupant whose id is gone has left)."""

    index: int
    ts: float
    objects: Sequence[Seen]
    live: frozenset[int] | None = None  # None without a tracker


@dataclass(frozen=True)
class RuleEvent:
    """An event before it gets its device, pipeline and sequence number."""

    rule: str
    kind: EventKind
    frame: int
    ts: float
    track: int | None = None
    label: str | None = None
    score: float | None = None
    box: tuple[float, float, float, float] | None = None
    direction: str | None = None
    count: int | None = None
    dwell_s: float | None = None
    counts: tuple[tuple[str, int, int], ...] | None = None  # (label, in, out) of a line


@dataclass(frozen=True)
class ZoneRule:
    name: str
    polygon: tuple[Point, ...]
    classes: frozenset[str]
    anchor: str
    dwell_s: float | None


@dataclass(frozen=True)
class LineRule:
    name: str
    start: Point
    end: Point
    classes: frozenset[str]
    anchor: str
    direction: str


@dataclass(frozen=True)
class CountRule:
    name: str
    classes: frozenset[str]
    in_zone: ZoneRule | None
    above: int | None
    below: int | None


@dataclass(frozen=True)
class ConfidenceRule:
    name: str
    classes: frozenset[str]
    low: float
    high: float


Rule = ZoneRule | LineRule | CountRule | ConfidenceRule


def _points(values: Iterable[Sequence[float]]) -> tuple[Point, ...]:
    return tuple((float(p[0]), float(p[1])) for p in values)


def typed_rules(specs: Sequence[RuleSpec]) -> tuple[Rule, ...]:
    """The typed rules of a checked document (:func:`~.checks.check_document` ran first)."""
    zones = {rule_name(s): ZoneRule(rule_name(s), _points(s.polygon or ()), frozenset(s.classes), s.anchor, s.dwell_s)
             for s in specs if rule_kind(s) == "zone"}
    typed: list[Rule] = []
    for spec in specs:
        kind, name, classes = rule_kind(spec), rule_name(spec), frozenset(spec.classes)
        if kind == "zone":
            typed.append(zones[name])
        elif kind == "line":
            start, end = _points(spec.points or ())
            typed.append(LineRule(name, start, end, classes, spec.anchor, spec.direction))
        elif kind == "count":
            typed.append(CountRule(name, classes, zones.get(spec.in_zone or ""), spec.above, spec.below))
        else:
            typed.append(ConfidenceRule(name, classes, float(spec.low or 0.0), float(spec.high or 1.0)))
    return tuple(typed)


# ---------------------------------------------------------------- geometry (pure)

def anchor_point(box: Sequence[float], anchor: str) -> Point:
    x = (box[0] + box[2]) / 2
    return (x, box[3]) if anchor == "bottom" else (x, (box[1] + box[3]) / 2)


def inside(point: Point, polygon: Sequence[Point]) -> bool:
    """Whether ``point`` is inside ``polygon`` (even-odd ray casting; a point on the right or
    bottom edge is outside, on the left or top edge inside, so adjacent zones never share one)."""
    x, y = point
    result = False
    for (x1, y1), (x2, y2) in zip(polygon, (*polygon[1:], polygon[0]), strict=True):
        if (y1 > y) != (y2 > y) and x < x1 + (y - y1) * (x2 - x1) / (y2 - y1):
            result = not result
    return result


def signed_distance(point: Point, start: Point, end: Point) -> float:
    """Distance of ``point`` from the line through start->end; positive on its ``in`` side."""
    dx, dy = end[0] - start[0], end[1] - start[1]
    length = (dx * dx + dy * dy) ** 0.5
    return (dx * (point[1] - start[1]) - dy * (point[0] - start[0])) / length


def crosses_segment(before: Point, after: Point, start: Point, end: Point) -> bool:
    """Whether the move before->after passes through the segment start-end (between its ends)."""
    d1, d2 = signed_distance(before, start, end), signed_distance(after, start, end)
    if d1 == d2:
        return False
    t = d1 / (d1 - d2)
    crossing = (before[0] + t * (after[0] - before[0]), before[1] + t * (after[1] - before[1]))
    dx, dy = end[0] - start[0], end[1] - start[1]
    along = ((crossing[0] - start[0]) * dx + (crossing[1] - start[1]) * dy) / (dx * dx + dy * dy)
    return 0.0 <= along <= 1.0


def _wanted(classes: frozenset[str], label: str) -> bool:
    return not classes or label in classes


# ---------------------------------------------------------------- per-rule state

@dataclass
class _Visit:
    since: float
    dwelt: bool = False


@dataclass
class _ZoneState:
    rule: ZoneRule
    visits: dict[int, _Visit] = field(default_factory=dict)

    def step(self, frame: Frame) -> list[RuleEvent]:
        events: list[RuleEvent] = []
        for seen in frame.objects:
            if seen.track is None or not _wanted(self.rule.classes, seen.label):
                continue
            now_inside = inside(anchor_point(seen.box, self.rule.anchor), self.rule.polygon)
            visit = self.visits.get(seen.track)
            if now_inside and visit is None:
                self.visits[seen.track] = _Visit(frame.ts)
                events.append(_event(self.rule.name, "enter", frame, seen))
            elif not now_inside and visit is not None:
                del self.visits[seen.track]
                events.append(_event(self.rule.name, "leave", frame, seen, dwell_s=frame.ts - visit.since))
            elif visit is not None and self._dwells(visit, frame.ts):
                visit.dwelt = True
                events.append(_event(self.rule.name, "dwell", frame, seen, dwell_s=frame.ts - visit.since))
        return events + self._lost(frame)

    def _dwells(self, visit: _Visit, ts: float) -> bool:
        return self.rule.dwell_s is not None and not visit.dwelt and ts - visit.since >= self.rule.dwell_s

    def _lost(self, frame: Frame) -> list[RuleEvent]:
        if frame.live is None:
            return []
        gone = [track for track in self.visits if track not in frame.live]
        events = [RuleEvent(self.rule.name, "leave", frame.index, frame.ts, track=track,
                            dwell_s=frame.ts - self.visits[track].since) for track in sorted(gone)]
        for track in gone:
            del self.visits[track]
        return events

    def occupants(self) -> frozenset[int]:
        return frozenset(self.visits)


@dataclass
class _LineState:
    rule: LineRule
    sides: dict[int, tuple[int, Point]] = field(default_factory=dict)  # track -> (side, where it was settled)
    totals: dict[str, list[int]] = field(default_factory=dict)  # label -> [in, out]

    def step(self, frame: Frame) -> list[RuleEvent]:
        events: list[RuleEvent] = []
        for seen in frame.objects:
            if seen.track is None or not _wanted(self.rule.classes, seen.label):
                continue
            event = self._move(seen, frame)
            if event is not None:
                events.append(event)
        if frame.live is not None:
            self.sides = {track: state for track, state in self.sides.items() if track in frame.live}
        return events

    def _move(self, seen: Seen, frame: Frame) -> RuleEvent | None:
        assert seen.track is not None
        point = anchor_point(seen.box, self.rule.anchor)
        distance = signed_distance(point, self.rule.start, self.rule.end)
        if abs(distance) < LINE_BAND:
            return None  # in the band: not yet on either side
        side = 1 if distance > 0 else -1
        before = self.sides.get(seen.track)
        self.sides[seen.track] = (side, point)
        if before is None or before[0] == side or not crosses_segment(before[1], point, self.rule.start,
                                                                        self.rule.end):
            return None
        direction = "in" if side > 0 else "out"
        totals = self.totals.setdefault(seen.label, [0, 0])
        totals[0 if direction == "in" else 1] += 1
        if self.rule.direction not in ("both", direction):
            return None
        counts = tuple((label, t[0], t[1]) for label, t in sorted(self.totals.items()))
        return _event(self.rule.name, "cross", frame, seen, direction=direction, counts=counts)


@dataclass
class _CountState:
    rule: CountRule
    state: str = "normal"

    def step(self, frame: Frame, zone_occupants: frozenset[int] | None) -> list[RuleEvent]:
        count = sum(1 for seen in frame.objects if _wanted(self.rule.classes, seen.label)
                    and (zone_occupants is None or seen.track in zone_occupants))
        if self.rule.above is not None and count > self.rule.above:
            new = "count_above"
        elif self.rule.below is not None and count < self.rule.below:
            new = "count_below"
        else:
            new = "normal"
        if new == self.state:
            return []
        self.state = new
        kind: EventKind = "count_above" if new == "count_above" else "count_below" if new == "count_below" \
            else "count_normal"
        return [RuleEvent(self.rule.name, kind, frame.index, frame.ts, count=count)]


@dataclass
class _ConfidenceState:
    rule: ConfidenceRule
    reported: set[int] = field(default_factory=set)

    def step(self, frame: Frame) -> list[RuleEvent]:
        band = [s for s in frame.objects
                if _wanted(self.rule.classes, s.label) and self.rule.low <= s.score < self.rule.high]
        if frame.live is not None:
            self.reported &= set(frame.live)
            fresh = [s for s in band if s.track is not None and s.track not in self.reported]
            self.reported.update(s.track for s in fresh if s.track is not None)
            return [_event(self.rule.name, "confidence", frame, s) for s in fresh]
        best = max(band, key=lambda s: s.score, default=None)
        return [] if best is None else [_event(self.rule.name, "confidence", frame, best)]


def _event(rule: str, kind: EventKind, frame: Frame, seen: Seen, **extra: object) -> RuleEvent:
    return RuleEvent(rule, kind, frame.index, frame.ts, track=seen.track, label=seen.label, score=seen.score,
                     box=seen.box, **extra)  # type: ignore[arg-type]


class RuleEngine:
    """The rules of one pipeline over its frames, in order; :meth:`step` once per frame."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = tuple(rules)
        self._zones = {r.name: _ZoneState(r) for r in rules if isinstance(r, ZoneRule)}
        self._lines = [_LineState(r) for r in rules if isinstance(r, LineRule)]
        self._counts = [_CountState(r) for r in rules if isinstance(r, CountRule)]
        self._bands = [_ConfidenceState(r) for r in rules if isinstance(r, ConfidenceRule)]

    def step(self, frame: Frame) -> list[RuleEvent]:
        """This frame's events: zones first (counts read their occupants), then lines, counts
        and confidence bands, each in the document's order."""
        events: list[RuleEvent] = []
        for zone in self._zones.values():
            events.extend(zone.step(frame))
        for line in self._lines:
            events.extend(line.step(frame))
        for count in self._counts:
            zone_rule = count.rule.in_zone
            occupants = None if zone_rule is None else self._zones[zone_rule.name].occupants()
            events.extend(count.step(frame, occupants))
        for band in self._bands:
            events.extend(band.step(frame))
        return events

    def line_totals(self) -> dict[str, dict[str, tuple[int, int]]]:
        """Per line, per label: (in, out) since the pipeline started (metrics, telemetry)."""
        return {line.rule.name: {label: (t[0], t[1]) for label, t in line.totals.items()} for line in self._lines}
