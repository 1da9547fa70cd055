"""The shared wire protocol (edgepack_core/protocol): one id pattern, one command builder and
parser, JSON Schemas of every payload kept in sync with schemas/, the chunk codec.

Attack tests are named after the attack; each pins the rule at its boundary."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from device_agent.telemetry.reporter import AgentStatus, state_document
from device_agent.updates.jobs import Job
from edgepack_core.errors import SchemaError
from edgepack_core.protocol import codec, ids
from edgepack_core.protocol.commands import (
    MAX_COMMAND_BYTES,
    MAX_LIFETIME_S,
    Command,
    CommandBuildError,
    Rejection,
    build_command,
    encode_command,
    parse_command,
)
from edgepack_core.protocol.payloads import KINDS, SCHEMA_DIR, SCHEMA_IDS, load_schema, validate_payload
from edgepack_core.protocol.topics import Topics

REPO = Path(__file__).resolve().parent.parent
NOW = 1_800_000_000.0
SHA = "ab" * 32


def _deploy(**extra: object) -> dict:
    fields = {"name": "digits", "version": "1.2.0", "size": 20898, "sha256": SHA, "artifact": {"url": "http://h:1/a"}}
    fields.update(extra)
    return build_command("deploy", device="pi-07", now=NOW, **fields)


def _raw(document: dict) -> bytes:
    return json.dumps(document).encode()


# ------------------------------------------------------------------ schemas


def test_every_payload_kind_has_a_schema_file_and_the_published_copy_is_identical():
    shipped = sorted(p.name for p in SCHEMA_DIR.glob("*.schema.json"))
    assert shipped == sorted(f"{kind}.schema.json" for kind in KINDS)
    for name in shipped:
        published = REPO / "schemas" / name
        assert published.exists(), f"schemas/{name} missing: cp edgepack_core/protocol/schemas/{name} schemas/"
        assert published.read_bytes() == (SCHEMA_DIR / name).read_bytes(), (
            f"schemas/{name} differs from edgepack_core/protocol/schemas/{name}: copy the package's file over")


@pytest.mark.parametrize("kind", KINDS)
def test_each_schema_names_its_schema_id(kind):
    schema = load_schema(kind)
    assert schema["$id"] == SCHEMA_IDS[kind]
    assert schema["$schema"].startswith("https://json-schema.org/")


def test_schema_ids_are_spelled_only_in_the_protocol_package():
    """A string literal equal to a schema id anywhere else is a copy that can drift."""
    offenders = []
    for package in ("edgepack_core", "sdk", "device_agent"):
        for path in (REPO / package).rglob("*.py"):
            if path == REPO / "edgepack_core" / "protocol" / "payloads.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and node.value in SCHEMA_IDS.values():
                    offenders.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value}")
    assert offenders == [], "use the constants of edgepack_core.protocol.payloads:\n" + "\n".join(offenders)


def test_the_agents_state_job_and_xfer_payloads_match_their_schemas():
    online = state_document("pi-07", True, AgentStatus(profile="cpu"), ["kitchen"])
    offline = state_document("pi-07", False, AgentStatus(), [], reason="agent stopped")
    validate_payload("state", online)
    validate_payload("state", offline)
    event = Job(id="deploy-1", type="deploy", state="active", reason="ok", final=True,
                command={"version": "1.2.0"}, detail={"requests": 3}).event()
    validate_payload("job", {"schema": SCHEMA_IDS["job"], "device": "pi-07", "ts": NOW, **event})
    validate_payload("xfer", json.loads(codec.request_payload([0, 5, 9])))
    with pytest.raises(SchemaError, match="status"):
        validate_payload("state", {**online, "status": "maybe"})
    with pytest.raises(SchemaError, match="chunks"):
        validate_payload("xfer", {"schema": SCHEMA_IDS["xfer"], "chunks": list(range(257))})


# ------------------------------------------------------------------ ids


@pytest.mark.parametrize("value", ["a", "pi-07", "A.b_c-9", "x" * 64])
def test_valid_ids(value):
    assert ids.validate_id(value, "id") == value


@pytest.mark.parametrize("value", ["", "x" * 65, ".", "..", "../state", "-x", "_x", "a/b", "a+b", "a#", "$SYS",
                                   "a b", "a\n", "é", "\U0001f600" * 16, 7, None])
def test_invalid_ids_are_refused_naming_the_field(value):
    with pytest.raises(ids.InvalidNameError) as caught:
        ids.validate_id(value, "device_id")
    assert caught.value.path == "device_id"
    assert not ids.is_valid_id(value)


def test_digest_ref_is_a_valid_id_and_stable():
    ref = ids.digest_ref("../../x")
    assert ids.is_valid_id(ref) and ref == ids.digest_ref("../../x") != ids.digest_ref("../../y")
    assert "/" not in ref and "." not in ref


@pytest.mark.parametrize(("text", "expected"), [("deploy-m-1.0.0+build.7", "deploy-m-1.0.0_build.7"),
                                                 ("-lead", "x-lead"), ("y" * 80, "y" * 64)])
def test_safe_id_squeezes_text_into_the_pattern(text, expected):
    assert ids.safe_id(text) == expected


def test_topics_use_the_same_pattern():
    topics = Topics()
    assert topics.cmd("x" * 64).endswith("/cmd")
    with pytest.raises(ids.InvalidNameError):
        topics.cmd("x" * 65)
    assert topics.parse(f"edgepack/v1/dev/{'x' * 65}/cmd") is None
    assert topics.parse("edgepack/v1/dev/pi-07/cmd").device == "pi-07"


# ------------------------------------------------------------------ build and parse


def test_a_built_deploy_parses_back_to_the_same_command():
    command = _deploy(health_window_s=30, allow_contract_change=True)
    assert command["target"] == {"device": "pi-07"}
    assert command["expires_at"] - command["issued_at"] == pytest.approx(3600)
    parsed = parse_command(encode_command(command), NOW)
    assert isinstance(parsed, Command)
    assert (parsed.id, parsed.type, parsed.body, parsed.target) == (command["id"], "deploy", command,
                                                                     {"device": "pi-07"})


@pytest.mark.parametrize(("kind", "fields"), [("ping", {}), ("get-state", {}), ("rollback", {}),
                                               ("cancel", {"job": "deploy-1"}),
                                               ("set-telemetry-interval", {"seconds": 5})])
def test_every_command_type_round_trips(kind, fields):
    command = build_command(kind, group="kitchen", now=NOW, **fields)
    parsed = parse_command(encode_command(command), NOW)
    assert isinstance(parsed, Command) and parsed.type == kind and parsed.target == {"group": "kitchen"}


@pytest.mark.parametrize(("call", "path"), [
    (lambda: build_command("ping", now=NOW), "target"),
    (lambda: build_command("ping", device="a", group="b", now=NOW), "target"),
    (lambda: build_command("ping", device="../x", now=NOW), "target.device"),
    (lambda: build_command("ping", device="a", now=NOW, ttl_s=MAX_LIFETIME_S + 1), "expires_at"),
    (lambda: build_command("ping", device="a", now=NOW, ttl_s=0), "expires_at"),
    (lambda: build_command("ping", device="a", now=NOW, colour="red"), "colour"),
    (lambda: build_command("format-disk", device="a", now=NOW), "type"),
    (lambda: build_command("cancel", device="a", now=NOW), "job"),
    (lambda: _deploy(health_window_s=float("nan")), "health_window_s"),
    (lambda: _deploy(name="../../m"), "name"),
    (lambda: _deploy(artifact={"url": "file:///etc/passwd"}), "artifact"),
])
def test_the_host_cannot_build_a_command_the_device_would_reject(call, path):
    with pytest.raises(CommandBuildError) as caught:
        call()
    assert path in caught.value.path or path in str(caught.value)


def test_a_ttl_at_the_lifetime_limit_builds_and_parses():
    command = build_command("ping", device="a", now=NOW, ttl_s=MAX_LIFETIME_S)
    assert isinstance(parse_command(encode_command(command), NOW), Command)


def test_expiry_boundary():
    command = build_command("ping", device="a", now=NOW, ttl_s=10)
    assert isinstance(parse_command(_raw(command), command["expires_at"]), Command)
    late = parse_command(_raw(command), command["expires_at"] + 0.001)
    assert isinstance(late, Rejection) and "expired" in late.reason and late.id == command["id"]


def test_lifetime_boundary_on_the_device():
    command = {**build_command("ping", device="a", now=NOW), "expires_at": NOW + MAX_LIFETIME_S}
    assert isinstance(parse_command(_raw(command), NOW), Command)
    command["expires_at"] = NOW + MAX_LIFETIME_S + 1
    parsed = parse_command(_raw(command), NOW)
    assert isinstance(parsed, Rejection) and "ahead" in parsed.reason


def test_size_boundary():
    command = build_command("ping", device="a", now=NOW)
    text = encode_command(command)
    padded = text[:-1] + b" " * (MAX_COMMAND_BYTES - len(text)) + b"}"
    assert len(padded) == MAX_COMMAND_BYTES and isinstance(parse_command(padded, NOW), Command)
    over = parse_command(padded + b" ", NOW)
    assert isinstance(over, Rejection) and "over the limit" in over.reason and over.id is None


# ------------------------------------------------------------------ attacks


@pytest.mark.parametrize("bad_id", ["../state", "../../x", "jobs/../../state", "a/b", "\U00010348" * 128, "x" * 65,
                                    "id\n", "", 12, None, ["x"]])
def test_rejected_command_id_is_a_path(bad_id):
    """{"id": "../state", "type": "ping"} once made the journal overwrite state.json."""
    parsed = parse_command(_raw({"schema": "edgepack.cmd/1", "id": bad_id, "type": "ping", "expires_at": NOW + 60}),
                           NOW)
    assert isinstance(parsed, Rejection)
    assert parsed.id is None
    assert ids.is_valid_id(parsed.ref) and parsed.ref.startswith("rejected-")
    if isinstance(bad_id, str) and bad_id:
        assert bad_id not in parsed.ref


def test_rejected_command_with_a_valid_id_keeps_it():
    parsed = parse_command(_raw({"schema": "edgepack.cmd/1", "id": "c-1", "type": "format-disk", "expires_at": 9e9}),
                           NOW)
    assert isinstance(parsed, Rejection) and parsed.id == parsed.ref == "c-1"
    assert "unknown command type" in parsed.reason


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_health_window_is_refused(value):
    text = encode_command(_deploy(health_window_s=1))
    text = text.replace(b'"health_window_s":1', f'"health_window_s":{value}'.encode())
    parsed = parse_command(text, NOW)
    assert isinstance(parsed, Rejection) and value in parsed.reason


def test_huge_health_window_is_refused():
    parsed = parse_command(_raw({**_deploy(), "health_window_s": 1e9}), NOW)
    assert isinstance(parsed, Rejection) and "health_window_s" in parsed.reason
    parsed = parse_command(encode_command(_deploy()).replace(b"}", b',"health_window_s":1e999}', 1), NOW)
    assert isinstance(parsed, Rejection)


def test_deeply_nested_command_is_rejected_not_raised():
    payload = b"[" * (MAX_COMMAND_BYTES - 1)
    parsed = parse_command(payload, NOW)
    assert isinstance(parsed, Rejection) and parsed.id is None


def test_command_with_a_newline_smuggled_into_the_url_is_rejected():
    parsed = parse_command(_raw(_deploy(artifact={"url": "http://h/a"}) | {"artifact": {"url": "http://h/a\n"}}), NOW)
    assert isinstance(parsed, Rejection) and "artifact.url" in parsed.reason


def test_rejection_reason_echoes_at_most_a_bounded_amount():
    parsed = parse_command(_raw({**_deploy(), "version": "9" * 20_000}), NOW)
    assert isinstance(parsed, Rejection) and len(parsed.reason) <= 300


# ------------------------------------------------------------------ chunk codec


def test_chunk_round_trip_and_corruption():
    frame = codec.encode_chunk(7, b"payload")
    assert codec.decode_chunk(frame) == (7, b"payload")
    assert codec.decode_chunk(frame[:-1] + b"X") is None
    assert codec.decode_chunk(b"EPX2" + frame[4:]) is None
    assert codec.decode_chunk(frame[: codec.HEADER.size - 1]) is None
    assert codec.decode_chunk(codec.encode_chunk(0, b"")) == (0, b"")


def test_xfer_request_is_capped_deduplicated_and_bounded_by_the_chunk_count():
    many = codec.request_payload(list(range(300)))
    assert codec.parse_request(many, 1000) == list(range(codec.MAX_REQUEST_CHUNKS))
    assert codec.parse_request(codec.request_payload([3, 3, 3, 1]), 10) == [3, 1]
    assert codec.parse_request(codec.request_payload([9, 10, -1, True]), 10) == [9]
    assert codec.parse_request(b'{"schema": "other", "chunks": [1]}', 10) == []
    assert codec.parse_request(b"[" * 5000, 10) == []
    assert codec.parse_request(b" " * (codec.MAX_REQUEST_BYTES + 1), 10) == []


@pytest.mark.parametrize(("size", "chunk", "count"), [(1, 1024, 1), (1024, 1024, 1), (1025, 1024, 2), (0, 1024, 1)])
def test_chunk_count_boundaries(size, chunk, count):
    assert codec.chunk_count(size, chunk) == count


def test_chunk_span_boundaries():
    assert codec.chunk_span(0, 2500, 1024) == (0, 1024)
    assert codec.chunk_span(2, 2500, 1024) == (2048, 452)
    for index in (-1, 3):
        with pytest.raises(ValueError):
            codec.chunk_span(index, 2500, 1024)
