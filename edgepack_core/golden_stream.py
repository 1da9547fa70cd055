"""Golden streams: an artifact's short clip and the events its pipeline fragment must give.

Shared by the packager, which runs the clip through the model once and signs the expected
events beside the clip, and the agent, whose activation check runs the same clip through the
candidate model and compares. The contract lives here so both sides bound the same things
(the clip's bytes before any decoding, its frames, the events document) and compare alike: a
multiset of (frame, rule, kind, label, direction), independent of track ids (a tracker may
number objects differently and still see the same crossings).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from edgepack_core.errors import ManifestError

MAX_CLIP_BYTES = 8 * 1024 * 1024
MAX_FRAMES = 300
MAX_EVENTS = 10_000
MAX_EVENTS_BYTES = 2 * 1024 * 1024
EVENTS_MEMBER = "golden_stream/events.json"
CLIP_SUFFIXES = (".mp4", ".mkv", ".avi")
FRAGMENT_KEYS = ("stages", "tracker", "rules")


def clip_member(suffix: str) -> str:
    """The clip's member name in the artifact (its container's suffix kept for the demuxer)."""
    return f"golden_stream/clip{suffix.lower()}"


def clip_size_problem(size: int) -> str | None:
    """Why a clip of ``size`` bytes is refused before it is decoded, or None. Pure."""
    if size > MAX_CLIP_BYTES:
        return f"the golden clip is {size} bytes, over the {MAX_CLIP_BYTES} allowed"
    return None


@dataclass(frozen=True, order=True)
class EventKey:
    """What a golden event must match: no track id, score or box (those may differ by a rounding
    and still be the same event)."""

    frame: int
    rule: str
    kind: str
    label: str | None
    direction: str | None

    def describe(self) -> str:
        parts = [f"frame {self.frame}", f"{self.rule or '-'} {self.kind}"]
        parts += [v for v in (self.label, self.direction) if v]
        return " ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "frame": self.frame,
            "rule": self.rule,
            "kind": self.kind,
            "label": self.label,
            "direction": self.direction,
        }


def key_of(event: Any) -> EventKey:
    """An event (``edgepack_core.protocol.events.Event`` or alike) as its golden key."""
    return EventKey(int(event.frame), str(event.rule), str(event.kind), event.label, event.direction)


@dataclass(frozen=True)
class GoldenStreamField:
    """The manifest's ``golden_stream``: the clip and events members, the clip's frames and the
    pipeline fragment (stages, tracker, rules) both sides run it through."""

    clip: str
    events: str
    frames: int
    pipeline: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"clip": self.clip, "events": self.events, "frames": self.frames, "pipeline": dict(self.pipeline)}


def manifest_schema(member_pattern: str) -> dict[str, Any]:
    """The manifest's optional ``golden_stream`` section (its members use ``member_pattern``)."""
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["clip", "events", "frames", "pipeline"],
        "properties": {
            "clip": {"type": "string", "pattern": member_pattern},
            "events": {"type": "string", "pattern": member_pattern},
            "frames": {"type": "integer", "minimum": 1, "maximum": MAX_FRAMES},
            "pipeline": {
                "type": "object",
                "description": "the pipeline fragment (stages, tracker, rules; "
                "schemas/pipeline.schema.json) the clip runs through",
            },
        },
    }


def golden_stream_of(raw: Mapping[str, Any]) -> GoldenStreamField | None:
    """The typed section of a validated manifest document, or None when it carries none."""
    section = raw.get("golden_stream")
    if section is None:
        return None
    return GoldenStreamField(section["clip"], section["events"], int(section["frames"]), section["pipeline"])


def events_bytes(keys: Iterable[EventKey]) -> bytes:
    """The ``events.json`` member: the expected events in order, one document."""
    return json.dumps({"events": [k.to_json() for k in sorted(keys)]}, sort_keys=True).encode() + b"\n"


def _key(item: Any, index: int) -> EventKey:
    if not isinstance(item, dict) or set(item) != {"frame", "rule", "kind", "label", "direction"}:
        raise ManifestError(f"golden_stream events[{index}]: an object of frame, rule, kind, label, direction")
    frame, rule, kind = item["frame"], item["rule"], item["kind"]
    ok = (
        isinstance(frame, int)
        and not isinstance(frame, bool)
        and 0 <= frame < MAX_FRAMES
        and isinstance(rule, str)
        and isinstance(kind, str)
        and all(v is None or isinstance(v, str) for v in (item["label"], item["direction"]))
    )
    if not ok:
        raise ManifestError(f"golden_stream events[{index}]: a field of the wrong type or out of range")
    return EventKey(frame, rule, kind, item["label"], item["direction"])


def parse_events(data: bytes) -> tuple[EventKey, ...]:
    """The expected events of an ``events.json`` member, bounded before it is parsed."""
    if len(data) > MAX_EVENTS_BYTES:
        raise ManifestError(f"golden_stream events: {len(data)} bytes, over {MAX_EVENTS_BYTES}")
    try:
        document = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ManifestError(f"golden_stream events: not UTF-8 JSON: {err}") from err
    items = document.get("events") if isinstance(document, dict) else None
    if not isinstance(items, list) or len(items) > MAX_EVENTS:
        raise ManifestError(f"golden_stream events: a list of at most {MAX_EVENTS} events under 'events'")
    return tuple(_key(item, index) for index, item in enumerate(items))


@dataclass(frozen=True)
class Comparison:
    """How the events a model gave compare with the expected ones: ``mismatches`` counts the
    events missing plus those not expected; ``first`` describes the first differing one."""

    events: int
    mismatches: int
    first: str | None

    def to_json(self) -> dict[str, int]:
        return {"events": self.events, "mismatches": self.mismatches}


def compare(expected: Iterable[EventKey], got: Iterable[EventKey]) -> Comparison:
    """Compare as multisets (pure); the first differing event in (frame, rule, kind, ...) order."""
    want, have = Counter(expected), Counter(got)
    missing, extra = want - have, have - want
    differing = sorted([(k, "missing") for k in missing] + [(k, "not expected") for k in extra])
    first = None
    if differing:
        key, why = differing[0]
        first = f"{key.describe()}: {'expected, not seen' if why == 'missing' else 'seen, not expected'}"
    return Comparison(sum(want.values()), sum(missing.values()) + sum(extra.values()), first)


def mismatch_reason(model: str, problem: str) -> str:
    """The one line a device's refusal gives (the job's reason), for people: the fleet server
    counts mismatches from the job's typed ``golden_stream`` detail (:func:`counts_in`), never
    from this line."""
    return f"golden stream of {model} failed: {problem}"


def mismatch_problem(comparison: Comparison) -> str:
    return f"{comparison.mismatches} event(s) differ from the {comparison.events} expected; first: {comparison.first}"


MAX_COUNT = MAX_EVENTS * 2
"""The most a count can be: every expected event missing plus as many not expected."""


@dataclass(frozen=True)
class GoldenCounts:
    """A job's ``golden_stream`` detail as the device sent it: events expected, mismatches."""

    events: int
    mismatches: int


def _count(value: Any) -> int | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT
    return value if ok else None


def counts_in(detail: Mapping[str, Any]) -> GoldenCounts | None:
    """The typed counts of a job detail's ``golden_stream`` entry, or None when it has none (no
    clip, a skipped clip, or counts that are not integers within :data:`MAX_COUNT`). Pure."""
    section = detail.get("golden_stream")
    if not isinstance(section, Mapping):
        return None
    events, mismatches = _count(section.get("events")), _count(section.get("mismatches"))
    if events is None or mismatches is None:
        return None
    return GoldenCounts(events, mismatches)
