"""Pipeline events on the wire: ``{root}/dev/{device}/events``, one event per message, QoS 1.

An event is what a device's pipeline rule saw happen ("track 7, a person, crossed line
'entrance' inward"). The typed :class:`Event` is declared with
:func:`~edgepack_core.typed_options.option`, so its JSON Schema (``events.schema.json``, beside
the other payloads' schemas and copied to the repository's ``schemas/``) is generated from this
declaration (a test keeps the files current). The agent builds events as :class:`Event` and
publishes :meth:`Event.to_payload`; consumers parse with :func:`parse_event`, which bounds the
payload before it is parsed and refuses with a reason, never raising.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from edgepack_core.errors import SchemaError
from edgepack_core.protocol.bounds import decode_document
from edgepack_core.protocol.ids import ID_PATTERN
from edgepack_core.protocol.payloads import EVENTS_SCHEMA_ID, validator
from edgepack_core.typed_options import option, parse, schema_of

MAX_EVENT_BYTES = 16 * 1024
MAX_COUNT_LABELS = 256

EventKind = Literal["enter", "leave", "dwell", "cross", "count_above", "count_below", "count_normal", "confidence",
                    "source_down", "source_up"]


@dataclass(frozen=True)
class LineCount:
    DESCRIPTION = "Crossings of one label since the pipeline started."
    crossed_in: int = option(0, key="in", minimum=0)
    crossed_out: int = option(0, key="out", minimum=0)


@dataclass(frozen=True)
class Event:
    DESCRIPTION = "One pipeline event, published on {root}/dev/{device}/events (QoS 1)."
    schema: str = option(schema={"const": EVENTS_SCHEMA_ID}, description="The payload's schema id.")
    device: str = option(description="The device that saw it.", pattern=ID_PATTERN)
    pipeline: str = option(description="The pipeline's name.", pattern=ID_PATTERN)
    rule: str = option(description="The rule's name ('' for source events).", maxLength=64)
    kind: EventKind = option(description="What happened.")
    seq: int = option(description="Per device and pipeline, +1 per event (gaps: events lost).", minimum=0)
    ts: float = option(description="Device time of the frame, seconds since the epoch.", minimum=0)
    frame: int = option(description="The frame's index in the stream since the source (re)started.", minimum=0)
    track: int | None = option(None, description="The tracked object's id.", minimum=0)
    label: str | None = option(None, description="The object's label.", maxLength=128)
    score: float | None = option(None, description="The detection's score.", minimum=0, maximum=1)
    box: tuple[float, ...] | None = option(None, description="The object's box, fractions of the frame "
                                           "(x1, y1, x2, y2).", minItems=4, maxItems=4)
    direction: Literal["in", "out"] | None = option(None, description="cross: which way.")
    count: int | None = option(None, description="count_*: the objects counted.", minimum=0)
    dwell_s: float | None = option(None, description="dwell and leave: seconds inside.", minimum=0)
    counts: Mapping[str, LineCount] | None = option(None, description="cross: per-label totals of the line.")
    attributes: Mapping[str, str] | None = option(None, description="What the crop stages said of the object "
                                                  "(stage name -> label).")
    detail: str | None = option(None, description="source events: why.", maxLength=512)
    snapshot: str | None = option(None, description="The snapshot file written for it, if any.", maxLength=256)

    def to_json(self) -> dict[str, Any]:
        """The payload document (keys with no value left out)."""
        out: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is None:
                continue
            if field.name == "counts":
                value = {label: {"in": c.crossed_in, "out": c.crossed_out} for label, c in value.items()}
            elif field.name == "attributes":
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[field.name] = value
        return out

    def to_payload(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()


def events_schema() -> dict[str, Any]:
    """The generated JSON Schema of an event payload (the shipped ``events.schema.json``)."""
    schema = schema_of(Event)
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": EVENTS_SCHEMA_ID,
            "title": "Edgepack pipeline event, published on {root}/dev/{device}/events", **schema}


def parse_event(device: str, payload: bytes) -> Event | str:
    """The typed event of ``payload`` from ``device``'s topic, or the reason it is refused
    (the :data:`~edgepack_core.protocol.bounds.Refusal` names and ``too_many_labels``)."""
    if len(payload) > MAX_EVENT_BYTES:
        return "too_large"
    document = decode_document(payload)
    if isinstance(document, str):
        return document
    try:
        validator("events").validate(document)
    except SchemaError:
        return "bad_schema"
    if document["device"] != device:
        return "device_mismatch"
    if len(document.get("counts") or {}) > MAX_COUNT_LABELS:
        return "too_many_labels"
    return parse(Event, document)
