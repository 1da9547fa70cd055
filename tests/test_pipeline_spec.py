"""Pipeline documents: the schema generated from the typed spec and published, unknown keys and
cross-field mistakes refused naming the key, checks against the installed models' contracts,
and the events payload (schema generated, round trip, refusals)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from device_agent.errors import ConfigError, PipelineRefused
from device_agent.pipelines.checks import StageContract, check_models
from device_agent.pipelines.rules import LineRule, ZoneRule, typed_rules
from device_agent.pipelines.spec import parse_pipelines, pipeline_schema
from edgepack_core.errors import SchemaError
from edgepack_core.protocol.events import Event, LineCount, events_schema, parse_event
from edgepack_core.protocol.payloads import EVENTS_SCHEMA_ID
from edgepack_core.protocol.topics import Topics

REPO = Path(__file__).resolve().parents[1]

DOCUMENT = """
- name: door-cam
  source: {url: "rtsp://10.0.0.5:554/stream1", policy: latest, max_fps: 10}
  stages:
    - model: detector
    - model: classifier
      crop: {from: detector, classes: [person], max: 8}
  tracker: {high: 0.5, low: 0.1}
  rules:
    - zone: door
      polygon: [[0.1, 0.1], [0.5, 0.1], [0.5, 0.9], [0.1, 0.9]]
      dwell_s: 10
    - line: entrance
      points: [[0.6, 0.0], [0.6, 1.0]]
      classes: [person]
    - count: crowd
      in_zone: door
      above: 5
  sinks:
    - mqtt: true
    - file: /var/lib/edgepack/events.jsonl
"""

CONTRACTS = {
    "detector": StageContract("image", "detection", ("person", "car")),
    "classifier": StageContract("image", "softmax", ("adult", "child")),
    "kws": StageContract("audio", "softmax", ("yes", "no")),
}


def document(**changes: Any) -> list[dict[str, Any]]:
    doc = yaml.safe_load(DOCUMENT)
    doc[0].update(changes)
    return [{key: value for key, value in doc[0].items() if value is not None}]


def refusal(doc: Any) -> str:
    with pytest.raises((ConfigError, SchemaError)) as info:
        parse_pipelines(doc)
    return str(info.value)


def test_the_example_parses_into_typed_values():
    (spec,) = parse_pipelines(document())
    assert spec.source.kind == "url" and spec.source.max_fps == 10.0
    assert spec.stages[1].crop is not None and spec.stages[1].crop.source == "detector"
    zone, line, count = typed_rules(spec.rules)
    assert isinstance(zone, ZoneRule) and zone.dwell_s == 10
    assert isinstance(line, LineRule) and line.start == (0.6, 0.0) and line.classes == frozenset({"person"})
    assert count.in_zone == zone  # type: ignore[union-attr]
    check_models(spec, CONTRACTS)


def test_the_published_schema_is_the_generated_one():
    published = json.loads((REPO / "schemas" / "pipeline.schema.json").read_text())
    assert published == pipeline_schema(), "run: edgepack-agent pipeline schema > schemas/pipeline.schema.json"


def test_an_unknown_key_is_refused_naming_its_path():
    doc = document()
    doc[0]["stages"][1]["crop"]["form"] = "detector"
    assert "pipelines[0].stages[1].crop" in refusal(doc) and "form" in refusal(doc)


@pytest.mark.parametrize(("change", "key"), [
    ({"source": {"url": "rtsp://x/y", "file": "a.mp4"}}, "pipelines[0].source"),
    ({"source": {"policy": "latest"}}, "pipelines[0].source"),
    ({"source": {"url": "ftp://x/y"}}, "pipelines[0].source.url"),
    ({"stages": [{"model": "classifier", "crop": {"from": "detector"}}, {"model": "detector"}]},
     "pipelines[0].stages[0].crop.from"),
    ({"stages": [{"model": "detector"}, {"model": "detector"}]}, "pipelines[0].stages[1]"),
    ({"tracker": None}, "pipelines[0].rules[0]"),
    ({"rules": [{"zone": "a", "polygon": [[0, 0], [1, 0], [1, 1]], "points": [[0, 0], [1, 1]]}]},
     "pipelines[0].rules[0].points"),
    ({"rules": [{"zone": "a", "line": "b"}]}, "pipelines[0].rules[0]"),
    ({"rules": [{"line": "b", "points": [[0.5, 0], [0.5, 0]]}]}, "pipelines[0].rules[0].points"),
    ({"rules": [{"count": "c"}]}, "pipelines[0].rules[0]"),
    ({"rules": [{"count": "c", "above": 1, "in_zone": "nowhere"}]}, "pipelines[0].rules[0].in_zone"),
    ({"rules": [{"confidence": "u", "low": 0.5, "high": 0.5}]}, "pipelines[0].rules[0]"),
    ({"sinks": [{"mqtt": True, "file": "x"}]}, "pipelines[0].sinks[0]"),
    ({"tracker": {"low": 0.6, "high": 0.5}}, "pipelines[0].tracker.low"),
])
def test_a_mistake_is_refused_naming_the_key(change: dict[str, Any], key: str):
    message = refusal(document(**change))
    assert key in message, message


def test_two_pipelines_with_one_name_are_refused():
    assert "two pipelines" in refusal(document() + document())


def test_a_polygon_of_two_points_is_refused_by_the_schema():
    assert "polygon" in refusal(document(rules=[{"zone": "a", "polygon": [[0, 0], [1, 1]]}]))


@pytest.mark.parametrize(("contracts", "key", "words"), [
    ({**CONTRACTS, "detector": StageContract("audio", "detection")}, "stages[0].model", "takes audio input"),
    ({k: v for k, v in CONTRACTS.items() if k != "classifier"}, "stages[1].model", "no installed model"),
    ({**CONTRACTS, "detector": StageContract("image", "softmax", ("person",))}, "stages[1].crop.from",
     "not detections"),
    ({**CONTRACTS, "detector": StageContract("image", "detection", ("car",))}, "crop.classes", "'person'"),
])
def test_a_pipeline_the_installed_models_cannot_run_is_refused(contracts: dict, key: str, words: str):
    (spec,) = parse_pipelines(document())
    with pytest.raises(PipelineRefused) as info:
        check_models(spec, contracts)
    assert key in str(info.value) and words in str(info.value), str(info.value)


def test_an_audio_source_needs_an_audio_model():
    (spec,) = parse_pipelines(document(source={"audio": "hw:1,0"}, stages=[{"model": "kws"}], tracker=None,
                                       rules=[]))
    check_models(spec, CONTRACTS)
    (wav,) = parse_pipelines(document(source={"file": "clip.wav"}, stages=[{"model": "detector"}], rules=[]))
    with pytest.raises(PipelineRefused, match="gives audio"):
        check_models(wav, CONTRACTS)


# ---------------------------------------------------------------- events on the wire

def event(**changes: Any) -> Event:
    base: dict[str, Any] = dict(schema=EVENTS_SCHEMA_ID, device="pi-07", pipeline="door-cam", rule="entrance",
                                kind="cross", seq=3, ts=1.5e9, frame=120, track=7, label="person", score=0.9,
                                box=(0.1, 0.2, 0.3, 0.4), direction="in",
                                counts={"person": LineCount(4, 1)})
    base.update(changes)
    return Event(**base)


def test_the_events_schema_file_is_generated_and_published():
    generated = events_schema()
    for path in (REPO / "schemas" / "events.schema.json",
                 REPO / "edgepack_core" / "protocol" / "schemas" / "events.schema.json"):
        assert json.loads(path.read_text()) == generated, f"{path} is stale"
    assert Topics().events("pi-07") == "edgepack/v1/dev/pi-07/events"
    assert Topics().parse("edgepack/v1/dev/pi-07/events").kind == "events"  # type: ignore[union-attr]


def test_an_event_round_trips_through_its_payload():
    original = event()
    parsed = parse_event("pi-07", original.to_payload())
    assert parsed == original or (isinstance(parsed, Event) and parsed.to_json() == original.to_json())
    assert json.loads(original.to_payload())["counts"] == {"person": {"in": 4, "out": 1}}


@pytest.mark.parametrize(("payload", "reason"), [
    (b"x" * (16 * 1024 + 1), "too_large"),
    (b"{not json", "not_json"),
    (json.dumps({**event().to_json(), "extra": 1}).encode(), "bad_schema"),
    (json.dumps({**event().to_json(), "kind": "exploded"}).encode(), "bad_schema"),
    (json.dumps({**event().to_json(), "label": "a\u0000b"}).encode(), "bad_text"),
])
def test_a_bad_event_payload_is_refused_with_its_reason(payload: bytes, reason: str):
    assert parse_event("pi-07", payload) == reason


def test_an_event_naming_another_device_is_refused():
    assert parse_event("pi-08", event().to_payload()) == "device_mismatch"
