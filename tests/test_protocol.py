"""The shared wire protocol (edgepack_core/protocol): one id pattern, one command builder and
parser, JSON Schemas of every payload kept in sync with schemas/, the chunk codec.

Attack tests are named after the attack; each pins the rule at its boundary."""

from __future__ import annotations

import ast
import json
import time
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
    check_command,
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
                command={"version": "1.2.0"}, detail={"requests": 3}).event("pi-07", NOW, duplicate=True)
    validate_payload("job", event.to_json())
    validate_payload("xfer", json.loads(codec.request_payload([0, 5, 9])))
    with pytest.raises(SchemaError, match="status"):
        validate_payload("state", {**online, "status": "maybe"})
    with pytest.raises(SchemaError, match="chunks"):
        validate_payload("xfer", {"schema": SCHEMA_IDS["xfer"], "chunks": list(range(257))})


# ------------------------------------------------------------------ ids


@pytest.mark.parametrize("value", ["a", "X", "aX", "pi-07", "A.b_c-9", "x" * 64])
def test_valid_ids(value):
    assert ids.validate_id(value, "id") == value


@pytest.mark.parametrize("value", ["", "x" * 65, ".", "..", "../state", "-x", "_x", "a/b", "a+b", "a#", "$SYS",
                                   "a b", "a\n", "é", "\U0001f600" * 16, 7, None])
def test_invalid_ids_are_refused_naming_the_field(value):
    with pytest.raises(ids.InvalidNameError) as caught:
        ids.validate_id(value, "device_id")
    assert caught.value.path == "device_id"
    assert not ids.is_valid_id(value)


@pytest.mark.parametrize(("value", "shown", "problem"), [
    (7, "7", "must be a string"),
    (None, "None", "must be a string"),
    ("", "", "must not be empty"),
    ("x" * 65, "x" * 65, "is longer than 64 characters"),
    ("a+b", "a+b", "must not contain '+'"),
    ("a#b", "a#b", "must not contain '#'"),
    ("a/b", "a/b", "must not contain '/'"),
    ("-a", "-a", "may hold only letters, digits, '.', '_' and '-' and must start with a letter or digit"),
])
def test_each_id_rule_has_its_own_message(value, shown, problem):
    with pytest.raises(ids.InvalidNameError) as caught:
        ids.validate_id(value, "group")
    assert (caught.value.path, caught.value.value, caught.value.problem) == ("group", shown, f"{shown!r} {problem}")
    assert str(caught.value) == f"group: {shown!r} {problem}"


def test_a_long_rejected_value_is_shortened_in_the_message():
    exact, long = "y" * 80, "z" * 81
    for value, shown in ((exact, exact), (long, "z" * 77 + "...")):
        with pytest.raises(ids.InvalidNameError) as caught:
            ids.validate_id(value, "id")
        assert caught.value.value == shown


def test_digest_ref_is_a_valid_id_and_stable():
    import hashlib

    ref = ids.digest_ref("../../x")
    assert ref == "rejected-" + hashlib.sha256(b"../../x").hexdigest()[:16]
    assert ids.is_valid_id(ref) and ref == ids.digest_ref("../../x") != ids.digest_ref("../../y")
    assert ids.digest_ref(5) == "rejected-" + hashlib.sha256(b"5").hexdigest()[:16] != ids.digest_ref("6")
    assert ids.is_valid_id(ids.digest_ref("\udcff"))  # a lone surrogate from json.loads does not raise


@pytest.mark.parametrize(("text", "expected"), [("deploy-m-1.0.0+build.7", "deploy-m-1.0.0_build.7"),
                                                 ("-lead", "x-lead"), ("y" * 80, "y" * 64), ("", "x"),
                                                 ("ABC+d", "ABC_d"), ("é1", "x_1"), ("../..", "x.._.."),
                                                 ("a_b", "a_b")])
def test_safe_id_squeezes_text_into_the_pattern(text, expected):
    assert ids.safe_id(text) == expected
    assert ids.is_valid_id(expected)


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
    assert parsed.expires_at == command["expires_at"] == NOW + 3600


@pytest.mark.parametrize(("kind", "fields"), [("ping", {}), ("get-state", {}),
                                               ("rollback", {"from_version": {"name": "digits", "version": "1.2.0"}}),
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


def test_build_refusals_name_the_field_and_the_rule():
    with pytest.raises(CommandBuildError) as caught:
        build_command("ping", now=NOW)
    assert (caught.value.path, caught.value.problem) == ("target", "a command goes to exactly one device or one group")
    with pytest.raises(CommandBuildError) as caught:
        build_command("ping", device="a", now=NOW, ttl_s=-1)
    assert (caught.value.path, caught.value.problem) == ("expires_at",
                                                         f"lifetime -1 s is outside (0, {MAX_LIFETIME_S}]")
    for artifact in ({}, {"url": "http://h/a", **_XFER}):
        with pytest.raises(CommandBuildError) as caught:
            _deploy(artifact=artifact)
        assert (caught.value.path, caught.value.problem) == ("artifact", "needs exactly one of url or xfer")
    with pytest.raises(CommandBuildError) as caught:
        build_command("t" * 50, device="a", now=NOW)
    assert caught.value.problem.startswith(f"unknown command type {'t' * 40!r} (known: deploy, ")


def test_check_command_refuses_a_document_that_is_not_an_object():
    with pytest.raises(SchemaError) as caught:
        check_command(["ping"], NOW)
    assert caught.value.path == "type" and "None" in caught.value.problem


def test_build_times_are_rounded_to_milliseconds_and_default_to_now():
    command = build_command("ping", device="a", now=NOW + 0.1234567, ttl_s=0.5)
    assert command["issued_at"] == round(NOW + 0.1234567, 3)
    assert command["expires_at"] == round(NOW + 0.6234567, 3)
    before = time.time()
    fresh = build_command("ping", device="a")
    assert round(before, 3) <= fresh["issued_at"] <= time.time() + 0.001


def test_expiry_refusals_name_expires_at():
    late = build_command("ping", device="a", now=NOW, ttl_s=10)
    parsed = parse_command(_raw(late), NOW + 20)
    assert parsed.reason == f"expires_at: command expired at {NOW + 10:.0f} (now {NOW + 20:.0f})"
    early = {**late, "expires_at": NOW + MAX_LIFETIME_S + 5}
    parsed = parse_command(_raw(early), NOW)
    assert parsed.reason == f"expires_at: {NOW + MAX_LIFETIME_S + 5:.0f} is more than {MAX_LIFETIME_S} s ahead " \
                            f"(now {NOW:.0f})"


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


def _with(document: dict, path: str, value: object) -> dict:
    """A deep copy of ``document`` with the value at dotted ``path`` replaced."""
    copy = json.loads(json.dumps(document))
    *parents, last = path.split(".")
    node = copy
    for key in parents:
        node = node[key]
    node[last] = value
    return copy


_XFER = {"xfer": {"id": "t-1", "chunk_size": 4096, "chunks": 3}}


@pytest.mark.parametrize(("path", "base"), [
    ("id", "deploy"), ("target.device", "deploy"), ("name", "deploy"), ("version", "deploy"), ("sha256", "deploy"),
    ("artifact.url", "deploy"), ("artifact.xfer.id", "xfer"), ("target.group", "group"), ("job", "cancel"),
])
def test_control_character_smuggled_into_a_field_is_rejected(path, base):
    """A Python ``$`` matches before a trailing newline: "id\n" would pass a schema pattern."""
    if base == "deploy":
        document = _deploy()
    elif base == "xfer":
        document = _deploy(artifact=_XFER)
    elif base == "group":
        document = build_command("ping", group="kitchen", now=NOW)
    else:
        document = build_command("cancel", device="pi-07", job="deploy-1", now=NOW)
    original = document
    for key in path.split("."):
        original = original[key]
    parsed = parse_command(_raw(_with(document, path, original + "\n")), NOW)
    assert isinstance(parsed, Rejection)
    assert parsed.reason == f"{path}: holds a control character"
    assert parsed.ref == (document["id"] if path != "id" else ids.digest_ref(document["id"] + "\n"))


def test_non_finite_value_deep_in_a_command_is_refused_naming_its_path():
    with pytest.raises(CommandBuildError) as caught:
        _deploy(artifact={"xfer": {"id": "t-1", "chunk_size": 4096, "chunks": float("nan")}})
    assert caught.value.path == "artifact.xfer.chunks" and "not a finite number" in caught.value.problem


def test_rejection_reasons_and_refs_are_exact():
    big = b"{" + b" " * MAX_COMMAND_BYTES + b"}"
    cases = [
        (big, None, f"command of {len(big)} bytes is over the limit of {MAX_COMMAND_BYTES}",
         ids.digest_ref(big[:4096].hex())),
        (b"{nope", None, "command is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
         "(char 1)", ids.digest_ref(b"{nope".hex())),
        (b"[1]", None, "command is not a JSON object", ids.digest_ref(b"[1]".hex())),
        (b"[" * 100_00, None, "command is not JSON: nested too deeply", ids.digest_ref((b"[" * 100_00).hex())),
        (_raw({"id": "c-9", "type": "format-disk"}), "c-9",
         "type: unknown command type 'format-disk' (known: deploy, rollback, cancel, remove, ping, get-state, "
         "set-telemetry-interval, apply-settings, fetch-logs, renew-certificate)", "c-9"),
        (_raw({"id": 5, "type": "ping"}), None, "type", ids.digest_ref(_raw({"id": 5, "type": "ping"}).hex())),
    ]
    for payload, command_id, reason, ref in cases:
        parsed = parse_command(payload, NOW)
        assert isinstance(parsed, Rejection), payload[:40]
        assert (parsed.id, parsed.ref) == (command_id, ref), payload[:40]
        assert parsed.reason == reason or (reason == "type" and parsed.reason.startswith("edgepack.cmd/1: ")), \
            parsed.reason


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
        with pytest.raises(ValueError) as caught:
            codec.chunk_span(index, 2500, 1024)
        assert str(caught.value) == f"chunk {index} is outside a file of 2500 bytes in chunks of 1024"


def test_xfer_request_size_boundary():
    request = codec.request_payload([1, 2])
    exact = request[:-1] + b" " * (codec.MAX_REQUEST_BYTES - len(request)) + b"}"
    assert len(exact) == codec.MAX_REQUEST_BYTES and codec.parse_request(exact, 10) == [1, 2]
    assert codec.parse_request(exact[:-1] + b" }", 10) == []
