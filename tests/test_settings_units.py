"""Remote settings, the pure parts: the document's keys and bounds (shared by server and device),
the device's per-key decision and overlay, the server's effective document, generations and
signer choice."""

from __future__ import annotations

import re

import pytest

from device_agent.config import check_config
from device_agent.errors import ConfigError
from device_agent.remote_settings import Held, decide, load_held, overlay, save_held
from edgepack_core.errors import SchemaError
from edgepack_core.protocol.messages import parse_state
from edgepack_core.settings_doc import LOCAL_ONLY, MAX_KEYS, digest, parse_document
from edgepack_core.signing import OPERATOR, RELEASE, generate_private_key, public_key_pem
from sdk.fleet_server.settings import (
    Effective,
    FleetKey,
    Sent,
    SettingsScopes,
    effective,
    parse_assignment,
    signer_for,
)
from sdk.fleet_server.settings import (
    decide as server_decide,
)


def pem(kind: str | None = RELEASE) -> str:
    return public_key_pem(generate_private_key(), kind).decode()


def config(tmp_path, **extra):
    doc = {
        "device_id": "d1",
        "store": str(tmp_path / "store"),
        "trust": ["k.pub"],
        "mqtt": {"host": "broker", "groups": ["a"]},
        "updates": {"health_window_s": {"min": 5, "max": 60}},
    }
    doc.update(extra)
    return check_config(doc, tmp_path / "agent.yaml")


def test_a_document_is_checked_whole_naming_unknown_and_local_only_keys():
    with pytest.raises(SchemaError, match=re.escape("unknown keys mqtt.colour, telemetry")) as caught:
        parse_document(1, {"mqtt.colour": 1, "telemetry": 2, "log_level": "debug"})
    assert "\n" not in str(caught.value)
    with pytest.raises(
        SchemaError, match=re.escape("api.listen, store can only be changed in agent.yaml on the device")
    ):
        parse_document(1, {"store": "/x", "api.listen": "0.0.0.0:1"})
    with pytest.raises(SchemaError, match=re.escape("mqtt.telemetry_interval")):
        parse_document(1, {"mqtt.telemetry_interval": 0.09})
    assert parse_document(1, {"mqtt.telemetry_interval": 0.1}).get("mqtt.telemetry_interval") == 0.1
    with pytest.raises(SchemaError, match=re.escape("mqtt.telemetry_interval")):
        parse_document(1, {"mqtt.telemetry_interval": 86400.5})
    for bad in (0, -1, True, 2**53, "3"):
        with pytest.raises(SchemaError, match="generation"):
            parse_document(bad, {})
    assert parse_document(2**53 - 1, {}).generation == 2**53 - 1
    assert {"store", "device_id", "api.listen", "mqtt.host"} <= LOCAL_ONLY
    limits = {f"models.m{i}.limits.max_total_bytes": 1 for i in range(64)}
    assert len(parse_document(1, limits).values) == 64
    with pytest.raises(SchemaError, match="holds 65 keys, at most 64"):
        parse_document(1, {**limits, "log_level": "info"})


def test_key_lists_are_bounded_non_empty_and_of_their_kind():
    keys = [pem() for _ in range(MAX_KEYS + 1)]
    assert len(parse_document(1, {"trust": keys[:MAX_KEYS]}).release_keys) == MAX_KEYS
    with pytest.raises(SchemaError, match="trust"):
        parse_document(1, {"trust": keys})
    with pytest.raises(SchemaError, match="without any key"):
        parse_document(1, {"operator_keys": []})
    with pytest.raises(SchemaError, match="is an operator key, but a release key is needed"):
        parse_document(1, {"trust": [pem(OPERATOR)]})
    with pytest.raises(SchemaError, match="same key twice"):
        parse_document(1, {"trust": [keys[0], keys[0]]})
    assert len(parse_document(1, {"operator_keys": [pem(None)]}).operator_keys) == 1  # an old unlabelled key


def test_the_device_decides_each_key_against_its_own_bounds(tmp_path):
    agent = config(tmp_path)
    document = parse_document(3, {"updates.health_window_s": 61, "mqtt.telemetry_interval": 2, "log_level": "debug"})
    results = decide(document, agent)
    assert results["mqtt.telemetry_interval"] == "applied" and results["log_level"] == "applied"
    assert results["updates.health_window_s"].startswith("refused: 61 s is outside this device's range [5, 60]")
    assert decide(parse_document(3, {"updates.health_window_s": 60}), agent)["updates.health_window_s"] == "applied"
    held = Held(document, tuple(sorted(results.items())))
    effective_config = overlay(agent, held.applied())
    assert effective_config.mqtt.telemetry_interval == 2.0 and effective_config.log_level == "debug"
    assert effective_config.updates.health_window_s == agent.updates.health_window_s  # the refused key
    moved = overlay(agent, {"mqtt.groups": ["b", "c"], "updates.allowed_origins": ["http://h:1"]})
    assert moved.mqtt.groups == ("b", "c") and moved.updates.allowed_origins == ("http://h:1",)
    assert moved.mqtt.host == "broker" and moved.store == agent.store


def test_held_settings_survive_a_restart_and_a_damaged_file_is_named(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    assert load_held(store).generation == 0
    document = parse_document(4, {"mqtt.telemetry_interval": 3, "trust": [pem()]})
    save_held(store, Held(document, (("mqtt.telemetry_interval", "applied"), ("trust", "applied"))))
    assert (store / "settings.json").stat().st_mode & 0o777 == 0o600
    again = load_held(store)
    assert again.generation == 4 and again.applied()["mqtt.telemetry_interval"] == 3
    assert len(again.document.release_keys) == 1
    (store / "settings.json").write_text("{not json")
    with pytest.raises(ConfigError, match=re.escape("settings.json")):
        load_held(store)


def test_the_state_report_is_parsed_bounded():
    state = {
        "schema": "edgepack.state/1",
        "device": "d1",
        "status": "online",
        "ts": 1.0,
        "settings": {
            "generation": 5,
            "results": {"log_level": "applied", "x" * 65: "applied", "trust": "refused: " + "r" * 1000},
            "keys": {"release": ["0123456789abcdef"], "operator": []},
        },
    }
    import json

    parsed = parse_state("d1", json.dumps(state).encode())
    report = parsed.settings
    assert report.generation == 5 and report.release_keys == ("0123456789abcdef",)
    assert dict(report.results)["log_level"] == "applied" and len(dict(report.results)["trust"]) == 300
    assert "x" * 65 not in dict(report.results)
    state["settings"]["keys"]["operator"] = ["not-a-key-id"]
    assert parse_state("d1", json.dumps(state).encode()).settings is None


def _key(kind: str, kid: str, retired: float | None = None) -> FleetKey:
    return FleetKey(kid, kind, f"pem-{kid}", 0.0, retired)


def test_the_most_specific_scope_wins_and_disagreeing_groups_leave_it_to_the_fleet():
    scopes = SettingsScopes(
        fleet={"log_level": "info", "mqtt.telemetry_interval": 10},
        groups={"a": {"mqtt.telemetry_interval": 5, "log_level": "debug"}, "b": {"mqtt.telemetry_interval": 7}},
        devices={"d1": {"log_level": "error"}},
    )
    doc = effective(scopes, [], "d1", ["a", "b"])
    assert doc.settings == {"log_level": "error", "mqtt.telemetry_interval": 10}
    assert doc.conflicts == {"mqtt.telemetry_interval": ("a", "b")} and doc.sources["log_level"] == "device"
    only_a = effective(scopes, [], "d2", ["a"])
    assert only_a.settings["mqtt.telemetry_interval"] == 5 and only_a.sources["mqtt.telemetry_interval"] == "group a"
    keys = [_key(RELEASE, "bb"), _key(RELEASE, "aa"), _key(RELEASE, "cc", retired=5.0)]
    with_keys = effective(SettingsScopes(), keys, "d3", [])
    assert with_keys.settings == {"trust": ["pem-aa", "pem-bb"]}  # no operator key added: agent.yaml's stay


def test_a_generation_only_rises_and_is_sent_when_the_document_changes():
    doc = Effective({"log_level": "debug"}, {})
    assert server_decide(Effective({}, {}), None, None, online=True, now=0, retry_s=60).kind == "converged"
    first = server_decide(doc, None, None, online=True, now=0, retry_s=60)
    assert (first.kind, first.generation) == ("send", 1)
    assert server_decide(doc, None, None, online=False, now=0, retry_s=60).kind == "wait"
    sent = Sent(1, doc.digest, "c1", 0.0)
    assert server_decide(doc, sent, 1, online=True, now=1, retry_s=60).kind == "converged"
    waiting = server_decide(doc, sent, 0, online=True, now=59.9, retry_s=60)
    assert waiting.kind == "wait" and "generation 1 sent" in waiting.reason
    again = server_decide(doc, sent, 0, online=True, now=60, retry_s=60)
    assert (again.kind, again.generation) == ("send", 2)
    changed = server_decide(Effective({"log_level": "info"}, {}), sent, 7, online=True, now=1, retry_s=60)
    assert (changed.kind, changed.generation) == ("send", 8)  # above what the device holds (a restored server)
    assert digest({"a": 1, "b": [1]}) == digest({"b": [1], "a": 1})


def test_the_server_signs_with_the_first_key_the_device_holds():
    old, new = generate_private_key(), generate_private_key()
    assert signer_for([new, old], []) is new
    assert signer_for([new, old], [old.key_id]) is old
    assert signer_for([new, old], [old.key_id, new.key_id]) is new
    assert signer_for([new, old], ["0000000000000000"]) is new


def test_cli_assignments_are_typed_by_the_key():
    assert parse_assignment("mqtt.telemetry_interval=2.5") == ("mqtt.telemetry_interval", 2.5)
    assert parse_assignment("updates.allowed_origins=http://a:1, http://b:2") == (
        "updates.allowed_origins",
        ["http://a:1", "http://b:2"],
    )
    assert parse_assignment("mqtt.groups=") == ("mqtt.groups", [])
    assert parse_assignment("log_level=debug") == ("log_level", "debug")
    with pytest.raises(ValueError, match="takes a number"):
        parse_assignment("updates.health_min_requests=many")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_assignment("log_level")


def test_a_models_own_limits_are_keys_of_their_own(tmp_path):
    from device_agent.remote_settings import limits_for

    document = parse_document(1, {"models.scale.limits.max_member_bytes": 10, "limits.max_member_bytes": 20})
    assert parse_assignment("models.scale.limits.max_total_bytes=5") == ("models.scale.limits.max_total_bytes", 5)
    with pytest.raises(SchemaError, match=re.escape("unknown keys models.scale.limits.colour")):
        parse_document(1, {"models.scale.limits.colour": 1})
    with pytest.raises(SchemaError, match=re.escape("models.scale.limits.max_total_bytes")):
        parse_document(1, {"models.scale.limits.max_total_bytes": 0})
    agent = overlay(config(tmp_path), dict(document.values))
    assert limits_for(agent, dict(document.values), "scale").max_member_bytes == 10
    assert limits_for(agent, dict(document.values), "other").max_member_bytes == 20
    assert limits_for(agent, dict(document.values), None).max_member_bytes == 20


def test_a_refused_key_keeps_what_the_device_held(tmp_path):
    agent = config(tmp_path)
    first = parse_document(1, {"updates.health_window_s": 30, "log_level": "debug"})
    held = Held().after(first, decide(first, agent))
    assert held.applied() == {"updates.health_window_s": 30, "log_level": "debug"}
    second = parse_document(2, {"updates.health_window_s": 61})
    later = held.after(second, decide(second, agent))
    assert dict(later.results)["updates.health_window_s"].startswith("refused")
    assert later.applied() == {"updates.health_window_s": 30}  # kept, not agent.yaml's; log_level left out: dropped
    store = tmp_path / "store"
    store.mkdir()
    save_held(store, later)
    assert load_held(store).applied() == {"updates.health_window_s": 30}
    keys = parse_document(3, {"trust": [pem()]})
    assert decide(keys, agent, ("scale 1.0.0",))["trust"].startswith("refused: scale 1.0.0 would verify by none")
    assert decide(keys, agent)["trust"] == "applied"


def test_every_remote_setting_and_every_local_only_key_is_documented():
    from pathlib import Path

    from edgepack_core.settings_doc import SETTING_KEYS

    text = (Path(__file__).resolve().parents[1] / "docs" / "agent.md").read_text()
    section = text[text.index("### Remote settings") :]
    named = (*SETTING_KEYS, *(key for key in LOCAL_ONLY if "." in key and not key.startswith("api.")))
    missing = [key for key in named if key not in section]
    assert not missing, f"docs/agent.md's Remote settings does not name: {', '.join(missing)}"


def test_the_last_will_names_the_groups_a_settings_change_left(tmp_path):
    import json

    from device_agent.telemetry.reporter import settings_from_config

    agent = config(tmp_path)
    groups = list(agent.mqtt.groups)
    settings = settings_from_config(agent.mqtt, agent.device_id, None, groups)
    assert json.loads(settings.will.payload())["groups"] == ["a"]
    groups[:] = ["b", "c"]  # what settings_apply does to the reporter's list
    assert json.loads(settings.will.payload())["groups"] == ["b", "c"]


def test_a_settings_documents_pipelines_are_parsed_once_and_those_values_are_the_ones_applied(tmp_path, monkeypatch):
    """The document's ``pipelines`` are parsed with the document (the boundary); the held
    settings and the config the agent runs carry those very values, kept as parsed when a later
    document's pipelines are refused; a restart reads the held file (a new boundary) once."""
    import edgepack_core.pipeline_spec as pipeline_spec
    import edgepack_core.settings_doc as settings_doc

    parsed = []

    def counting(*args, **kwargs):
        parsed.append(args)
        return pipeline_spec.parse_pipelines(*args, **kwargs)

    monkeypatch.setattr(settings_doc, "parse_pipelines", counting)
    cam = {"name": "cam", "source": {"file": "/clip.mp4"}, "stages": [{"model": "scale"}]}
    agent = config(tmp_path)
    first = parse_document(1, {"pipelines": [cam], "log_level": "debug"})
    held = Held().after(first, {"pipelines": "applied", "log_level": "applied"})
    running = overlay(agent, held.applied(), held.pipelines)
    assert len(parsed) == 1 and first.pipelines is not None and running.pipelines is first.pipelines
    assert running.pipelines[0].name == "cam" and running.log_level == "debug"
    refused = parse_document(2, {"pipelines": [{**cam, "name": "other"}]})
    later = held.after(refused, {"pipelines": "refused: the models installed cannot run it"})
    assert len(parsed) == 2 and later.pipelines is first.pipelines  # kept as parsed, not parsed again
    assert overlay(agent, later.applied(), later.pipelines).pipelines is first.pipelines
    dropped = held.after(parse_document(3, {"log_level": "info"}), {"log_level": "applied"})
    assert dropped.pipelines is None and overlay(agent, dropped.applied(), dropped.pipelines).pipelines == ()
    store = tmp_path / "store"
    store.mkdir()
    save_held(store, later)
    again = load_held(store)
    assert len(parsed) == 4 and again.pipelines == first.pipelines  # the file: its document and its kept value


def test_a_settings_documents_keys_are_parsed_once_and_those_keys_are_the_ones_held(tmp_path, monkeypatch):
    """``trust`` and ``operator_keys`` are parsed with their document (each PEM once); the keys
    the daemon trusts are those very values, kept as parsed when a later document's ``trust``
    is refused, dropped when a document leaves the key out; a restart parses the file once."""
    import edgepack_core.settings_doc as settings_doc
    from device_agent.remote_settings import held_keys

    parsed = []

    def counting(data, where):
        parsed.append(where)
        return real(data, where)

    real = settings_doc.public_key_from_pem
    monkeypatch.setattr(settings_doc, "public_key_from_pem", counting)
    agent = config(tmp_path)
    first = parse_document(1, {"trust": [pem(), pem()], "operator_keys": [pem(OPERATOR)]})
    assert parsed == ["trust[0]", "trust[1]", "operator_keys[0]"]
    held = Held().after(first, decide(first, agent))
    assert held_keys(held, "trust") is first.release_keys and len(first.release_keys) == 2
    assert held_keys(held, "operator_keys") is first.operator_keys
    refused = parse_document(2, {"trust": [pem()], "operator_keys": [pem(OPERATOR)]})
    later = held.after(refused, {**decide(refused, agent), "trust": "refused: would verify none"})
    assert len(parsed) == 5
    assert held_keys(later, "trust") is first.release_keys  # kept as parsed, not agent.yaml's
    assert held_keys(later, "operator_keys") is refused.operator_keys
    dropped = later.after(parse_document(3, {"log_level": "info"}), {"log_level": "applied"})
    assert held_keys(dropped, "trust") == () and held_keys(dropped, "operator_keys") == ()
    store = tmp_path / "store"
    store.mkdir()
    save_held(store, later)
    del parsed[:]
    again = load_held(store)
    assert sorted(parsed) == ["operator_keys[0]", "trust[0]", "trust[0]", "trust[1]"]  # its document, its kept trust
    assert [k.public_bytes_raw() for k in held_keys(again, "trust")] == \
        [k.public_bytes_raw() for k in first.release_keys]
    assert held_keys(again, "operator_keys")[0].public_bytes_raw() == refused.operator_keys[0].public_bytes_raw()
