"""The one parser of device messages (edgepack_core/protocol/messages.py): every bound at its
boundary, the agent's own messages read back as typed values, and the attacks the host readers
used to let through."""

from __future__ import annotations

import json

import pytest

from device_agent.telemetry.metrics import ModelInfo, SystemReading, TelemetryAggregator
from device_agent.telemetry.reporter import AgentStatus, state_document
from device_agent.updates.jobs import Job, advance
from edgepack_core.protocol import bounds
from edgepack_core.protocol.bounds import BIG, MAX_MESSAGE_BYTES
from edgepack_core.protocol.ids import ID_PATTERN
from edgepack_core.protocol.messages import (
    JOB_STATE,
    MAX_CAPABILITIES_BYTES,
    MAX_ERROR_KINDS,
    MAX_GROUPS,
    MAX_JOB_REASON,
    MAX_JOB_TYPE_CHARS,
    MAX_STATE_REASON,
    MAX_VERSION_CHARS,
    Decommissioned,
    DeviceState,
    JobEvent,
    ModelRef,
    QueueCounters,
    Telemetry,
    parse_job_event,
    parse_state,
    parse_telemetry,
)
from edgepack_core.protocol.payloads import load_schema
from sdk.fleet import FleetView, format_table

ROOT = "edgepack/v1"


def _encode(doc: dict) -> bytes:
    return json.dumps(doc).encode()


def _state(**changes: object) -> bytes:
    return _encode({"schema": "edgepack.state/1", "device": "d", "status": "online", "ts": 5.0, **changes})


def _telemetry(**changes: object) -> bytes:
    return _encode({"schema": "edgepack.telemetry/1", "device": "d", "seq": 1, **changes})


def _job(**changes: object) -> bytes:
    return _encode({"schema": "edgepack.job/1", "device": "d", "ts": 5.0, "job": "c-1", "type": "deploy",
                    "state": "active", "final": True, **changes})


def _padded(payload: bytes, size: int) -> bytes:
    """``payload`` (a JSON object) grown to exactly ``size`` bytes with a padding key."""
    head = payload[:-1] + b', "pad": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


# ------------------------------------------------------------------ the agent's own messages


def test_the_agents_birth_and_last_will_parse_into_typed_states():
    status = AgentStatus(model=ModelInfo("digits", "1.0.0", "ab" * 32), provider="CPUExecutionProvider",
                         profile="x86", available_providers=["CPUExecutionProvider"])
    birth = parse_state("pi-07", _encode(state_document("pi-07", True, status, ["kitchen"], ts=10.0)))
    assert isinstance(birth, DeviceState)
    assert (birth.status, birth.ts, birth.groups, birth.provider, birth.profile) == \
        ("online", 10.0, ("kitchen",), "CPUExecutionProvider", "x86")
    assert birth.model == ModelRef("digits", "1.0.0", "ab" * 32)
    assert birth.capabilities_dict()["providers"] == ["CPUExecutionProvider"]
    will = parse_state("pi-07", _encode(state_document("pi-07", False, AgentStatus(), [], reason="lost", ts=11.0)))
    assert isinstance(will, DeviceState) and (will.status, will.reason, will.model) == ("offline", "lost", None)


def test_the_agents_telemetry_parses_into_typed_figures():
    aggregator = TelemetryAggregator("pi-07", started=0.0)
    for _ in range(4):
        aggregator.record_inference(0.002)
    aggregator.record_error("preprocess")
    doc = aggregator.build(now=2.0, ts=100.0, model=ModelInfo("digits", "1.0.0", "ab" * 32), provider="CPU",
                           system=SystemReading(cpu_percent=12.5, memory_rss_bytes=1000, temperature_c=None,
                                                cpu_seconds=1.0, monotonic=2.0),
                           queue={"queued": 1, "dropped": 0, "produced": 5, "delivered": 4})
    sample = parse_telemetry("pi-07", doc.encode())
    assert isinstance(sample, Telemetry) and sample == doc
    assert (sample.seq, sample.ts, sample.inferences_interval, sample.inferences_total) == (1, 100.0, 4, 4)
    assert sample.errors_total == 1 and sample.error_kinds == (("preprocess", 1),)
    assert sample.latency_p50 is not None and abs(sample.latency_p50 - 2.0) < 0.1
    assert sample.queue == QueueCounters(1, 0, 5, 4) and sample.cpu_percent == 12.5
    assert sample.temperature_c is None and sample.uptime_s == 2.0


def test_the_agents_telemetry_wire_bytes_are_those_it_sent_before_the_typed_builder():
    aggregator = TelemetryAggregator("pi-07", started=0.0)
    aggregator.record_inference(0.002)
    aggregator.record_error("runtime")
    sample = aggregator.build(now=4.0, ts=100.12345, model=ModelInfo("m", "1", "ab" * 32), provider="CPU",
                              system=None, queue={"queued": 0, "dropped": 1, "produced": 2, "delivered": 3})
    latency = sample.latency_ms()
    before = {  # the dict TelemetryAggregator.build returned, key for key
        "schema": "edgepack.telemetry/1", "device": "pi-07", "seq": 1, "ts": 100.123,
        "model": {"name": "m", "version": "1", "sha256": "ab" * 32}, "provider": "CPU", "interval_s": 4.0,
        "inferences": {"interval": 1, "total": 1}, "errors": {"runtime": 1}, "errors_interval": {"runtime": 1},
        "latency_ms": {"p50": latency["p50"], "p90": latency["p90"], "p99": latency["p99"], "max": 2.0,
                       "mean": 2.0},
        "throughput_per_s": 0.25, "cpu_percent": None, "memory_rss_bytes": None, "temperature_c": None,
        "uptime_s": 4.0, "queue": {"depth": 0, "dropped": 1, "produced": 2, "delivered": 3},
    }
    assert sample.encode() == json.dumps(before).encode()


def test_the_agents_job_events_parse_and_render_back_to_the_same_document():
    job = advance(Job("c-1", "deploy", command={"version": "1.2.0"}), "downloading", "", 1.0, bytes=10)
    doc = job.event("pi-07", 3.5).to_json()
    event = parse_job_event("pi-07", job.event("pi-07", 3.5).encode())
    assert isinstance(event, JobEvent)
    assert (event.state, event.final, event.version, dict(event.detail)) == ("downloading", False, "1.2.0",
                                                                             {"bytes": 10})
    assert event.to_json() == doc and event == job.event("pi-07", 3.5)


# ------------------------------------------------------------------ bounds, at their boundaries


@pytest.mark.parametrize("parse", [parse_state, parse_telemetry, parse_job_event])
def test_a_message_of_the_limit_passes_and_one_byte_more_is_too_large(parse):
    base = {parse_state: _state(), parse_telemetry: _telemetry(), parse_job_event: _job()}[parse]
    exact = _padded(base, MAX_MESSAGE_BYTES)
    assert len(exact) == MAX_MESSAGE_BYTES and not isinstance(parse("d", exact), str)
    assert parse("d", _padded(base, MAX_MESSAGE_BYTES + 1)) == "too_large"


@pytest.mark.parametrize("parse", [parse_state, parse_telemetry, parse_job_event])
def test_every_parser_refuses_another_devices_message_and_bad_text(parse):
    base = {parse_state: _state, parse_telemetry: _telemetry, parse_job_event: _job}[parse]
    assert parse("e", base()) == "device_mismatch"
    assert parse("d", base(reason="a\ud800")) == "bad_text"
    assert parse("d", base(note="a\x00b")) == "bad_text"
    assert parse("d", base(schema="edgepack.other/1")) == "bad_schema"
    assert parse("d", b'{"a": ' * 10_000) == "not_json"  # nested too deeply: no RecursionError escapes


def test_groups_are_capped_deduplicated_and_only_valid_names():
    names = [f"g{i}" for i in range(MAX_GROUPS + 1)]
    state = parse_state("d", _state(groups=names))
    assert isinstance(state, DeviceState) and state.groups == tuple(names[:MAX_GROUPS])
    state = parse_state("d", _state(groups=["a", "a", "../x", 7, "b"]))
    assert isinstance(state, DeviceState) and state.groups == ("a", "b")


def test_capabilities_of_the_limit_are_kept_and_larger_ones_dropped():
    def caps(size: int) -> DeviceState:
        blob = "x" * (size - len('{"blob":""}'))
        state = parse_state("d", _state(capabilities={"blob": blob}))
        assert isinstance(state, DeviceState)
        return state

    assert caps(MAX_CAPABILITIES_BYTES).capabilities is not None
    assert caps(MAX_CAPABILITIES_BYTES + 1).capabilities is None


def test_reasons_are_cut_at_their_limits():
    state = parse_state("d", _state(status="offline", reason="r" * (MAX_STATE_REASON + 1)))
    assert isinstance(state, DeviceState) and len(state.reason) == MAX_STATE_REASON
    online = parse_state("d", _state(reason="ignored"))
    assert isinstance(online, DeviceState) and online.reason == ""
    event = parse_job_event("d", _job(reason="r" * (MAX_JOB_REASON + 1)))
    assert isinstance(event, JobEvent) and len(event.reason) == MAX_JOB_REASON


def test_error_kinds_are_capped_and_counters_bounded():
    errors = {f"k{i}": 1 for i in range(MAX_ERROR_KINDS + 1)}
    sample = parse_telemetry("d", _telemetry(errors=errors))
    assert isinstance(sample, Telemetry)
    assert len(sample.error_kinds) == MAX_ERROR_KINDS and sample.errors_total == MAX_ERROR_KINDS + 1
    edge = parse_telemetry("d", _telemetry(seq=BIG - 1, memory_rss_bytes=BIG))
    assert isinstance(edge, Telemetry) and (edge.seq, edge.memory_rss_bytes) == (BIG - 1, None)


def test_a_string_count_of_the_limit_passes_and_one_more_is_bad_text():
    def job(strings: int) -> bytes:  # the event's own keys and values, then a list of one-letter strings
        base = {"schema": "edgepack.job/1", "device": "d", "ts": 5.0, "job": "c-1", "state": "active",
                "final": True, "detail": {"x": []}}
        counted = sum(1 for _ in _strings(base))
        base["detail"]["x"] = ["s"] * (strings - counted)
        return _encode(base)

    assert isinstance(parse_job_event("d", job(bounds.MAX_STRINGS)), JobEvent)
    assert parse_job_event("d", job(bounds.MAX_STRINGS + 1)) == "bad_text"


def _strings(doc: object):
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield key
            yield from _strings(value)
    elif isinstance(doc, list):
        for item in doc:
            yield from _strings(item)
    elif isinstance(doc, str):
        yield doc


def test_the_parsers_bounds_are_the_json_schemas_bounds():
    """One definition: where the parser and the shipped JSON Schema bound the same field, they
    agree (the parser cuts some texts shorter, for storage: those are not schema bounds)."""
    state, job = load_schema("state")["properties"], load_schema("job")["properties"]
    assert state["groups"]["maxItems"] == MAX_GROUPS
    assert job["state"]["pattern"] == f"^{JOB_STATE.pattern}$"
    assert job["type"]["maxLength"] == MAX_JOB_TYPE_CHARS and job["version"]["maxLength"] == MAX_VERSION_CHARS
    assert job["job"]["pattern"] == state["device"]["pattern"] == ID_PATTERN


def test_an_empty_state_decommissions():
    assert parse_state("d", b"") == Decommissioned("d")


# ------------------------------------------------------------------ attacks on the host readers


def test_a_lone_surrogate_in_a_state_cannot_stop_fleet_status_printing_its_table():
    """The fleet view used to keep any string a device sent; a lone surrogate in its provider
    made ``edgepack fleet status`` fail to write its table as UTF-8."""
    view = FleetView()
    view.apply(f"{ROOT}/dev/d/state", _state(provider="CPU\ud800"), now=1)
    view.apply(f"{ROOT}/dev/e/state", _encode({"schema": "edgepack.state/1", "device": "e", "status": "online",
                                               "ts": 1.0, "provider": "CPU"}), now=1)
    table = format_table(view.rows(now=2), now=2)
    assert table.encode("utf-8") and view.dropped == {"bad_text": 1} and list(view.devices) == ["e"]


def test_a_telemetry_message_with_thousands_of_error_kinds_is_kept_bounded_by_the_fleet_view():
    """The fleet view used to keep each device's whole last telemetry document (any keys, up
    to 256 KiB a device) and print it back; now it keeps typed, bounded figures."""
    view = FleetView()
    view.apply(f"{ROOT}/dev/d/telemetry", _telemetry(errors={f"k{i}": 1 for i in range(3000)},
                                                     junk={"deep": ["x"] * 100}), now=1)
    row = view.rows(now=1)[0].to_json()
    assert len(row["errors"]) == MAX_ERROR_KINDS and "junk" not in json.dumps(row)


def test_a_figure_too_large_for_a_float_reads_as_none_and_does_not_stop_the_parse():
    """JSON has no bound on an integer's size: a device's ``"cpu_percent": 1000…0`` (400 digits)
    overflowed ``float()`` inside the one figure reader, raising out of the telemetry parser.
    The figure reads as None like any other out-of-bounds one; the limit itself stays."""
    from edgepack_core.protocol.payloads import TELEMETRY_SCHEMA_ID

    huge = 10**400
    assert bounds.number(huge) is None and bounds.number(-huge) is None
    assert bounds.number(bounds.MAX_FIGURE - 1) == bounds.MAX_FIGURE - 1 and bounds.number(bounds.MAX_FIGURE) is None
    payload = json.dumps({"schema": TELEMETRY_SCHEMA_ID, "device": "d1", "seq": 1, "ts": 1.0,
                          "cpu_percent": huge, "uptime_s": 5}).encode()
    sample = parse_telemetry("d1", payload)
    assert not isinstance(sample, str) and sample.cpu_percent is None and sample.uptime_s == 5.0
