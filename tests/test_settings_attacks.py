"""Remote settings against a real agent subprocess and a real mosquitto: the attacks on the
signed settings document (each test named after its attack), and settings that reach a running
agent with no restart and survive one."""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import threading
import time
import uuid
from pathlib import Path

import pytest

from edgepack_core.command_auth import sign_command
from edgepack_core.signing import RELEASE, key_id, load_public_key
from sdk.keys import load_operator_key, write_keypair, write_operator_keypair
from tests.agent_process import AgentProcess, Observer
from tests.artifacts import build_artifact

DEVICE = "pi-21"
CMD_TOPIC = f"edgepack/v1/dev/{DEVICE}/cmd"
NOWHERE = "http://127.0.0.9:9"


@pytest.fixture(scope="module")
def operators(tmp_path_factory):
    """Two operator key pairs (the old and the new of a rotation): (signing key, public path)."""
    folder = tmp_path_factory.mktemp("operators")
    pairs = []
    for name in ("old", "new"):
        write_operator_keypair(folder / f"{name}.key", folder / f"{name}.pub")
        pairs.append((load_operator_key(folder / f"{name}.key"), folder / f"{name}.pub"))
    return pairs


@pytest.fixture(scope="module")
def arts(tmp_path_factory, keypair):
    """v1 (installed at start), v2 signed by the release key, v2 signed by a second release key."""
    folder = tmp_path_factory.mktemp("settings-arts")
    write_keypair(folder / "r2.key", folder / "r2.pub")
    second = folder / "second"
    second.mkdir()
    return {
        "v1": build_artifact(folder, keypair[0], version="1.0.0"),
        "v2": build_artifact(folder, keypair[0], version="1.1.0", factor=3.0),
        "r2": build_artifact(second, folder / "r2.key", version="1.2.0", factor=4.0),
        "r2.pub": folder / "r2.pub",
    }


@pytest.fixture()
def observer(mosquitto_broker):
    watch = Observer(mosquitto_broker.port)
    yield watch
    watch.close()


def make_agent(tmp_path, broker, keypair, operators, arts, *, interval: float = 0.5) -> AgentProcess:
    agent = AgentProcess(
        tmp_path,
        device=DEVICE,
        broker_port=broker.port,
        trust=keypair[1],
        artifact=arts["v1"],
        groups=["kitchen"],
        operator_keys=[operators[0][1]],
        updates={"allowed_origins": [NOWHERE], "health_window_s": {"default": 0.5, "min": 0.5, "max": 30}},
    )
    text = agent.config.read_text().replace("telemetry_interval: 0.5", f"telemetry_interval: {interval}")
    agent.config.write_text(text)
    return agent


@pytest.fixture()
def agent(tmp_path, mosquitto_broker, keypair, operators, arts):
    process = make_agent(tmp_path, mosquitto_broker, keypair, operators, arts).start()
    yield process
    process.stop()


def settings_command(generation: int, settings: dict, **fields) -> dict:
    now = time.time()
    return {
        "schema": "edgepack.cmd/1",
        "id": f"settings-{uuid.uuid4().hex[:10]}",
        "type": "apply-settings",
        "issued_at": round(now, 3),
        "expires_at": round(now + 600, 3),
        "target": {"device": DEVICE},
        "generation": generation,
        "settings": settings,
        **fields,
    }


def send(observer: Observer, document: dict, topic: str = CMD_TOPIC) -> str:
    observer.publish(topic, json.dumps(document))
    return document["id"]


def final_event(observer: Observer, job_id: str, timeout: float = 30) -> dict:
    assert observer.wait_for(lambda: any(e.get("final") for e in observer.jobs(DEVICE, job_id)), timeout), (
        observer.jobs(DEVICE, job_id)
    )
    return [e for e in observer.jobs(DEVICE, job_id) if e.get("final")][-1]


def reports(observer: Observer) -> list[dict]:
    return [
        s["settings"] for s in observer.of(f"dev/{DEVICE}/state") if s.get("status") == "online" and "settings" in s
    ]


def report_with(observer: Observer, generation: int) -> dict:
    assert observer.wait_for(lambda: any(r["generation"] == generation for r in reports(observer)), 20), reports(
        observer
    )
    return [r for r in reports(observer) if r["generation"] == generation][-1]


def pem(path: Path) -> str:
    return path.read_text()


def test_an_unsigned_apply_settings_is_refused(agent, observer, operators):
    event = final_event(observer, send(observer, settings_command(1, {"log_level": "debug"})))
    assert event["state"] == "rejected" and "must be signed by an operator key" in event["reason"]
    stranger = sign_command(settings_command(1, {"log_level": "debug"}), load_operator_key(_stranger(agent)))
    event = final_event(observer, send(observer, stranger))
    assert event["state"] == "rejected" and "not an operator key of this device" in event["reason"]
    assert not (agent.folder / f"{DEVICE}-store" / "settings.json").exists()
    signed = final_event(
        observer, send(observer, sign_command(settings_command(1, {"log_level": "debug"}), operators[0][0]))
    )
    assert signed["state"] == "done" and signed["detail"]["results"] == {"log_level": "applied"}


def _stranger(agent: AgentProcess) -> Path:
    path = agent.folder / "stranger.key"
    write_operator_keypair(path, agent.folder / "stranger.pub")
    return path


def test_a_settings_document_signed_by_a_retired_operator_key_is_refused(agent, observer, operators):
    (old, old_pub), (new, new_pub) = operators
    both = final_event(
        observer,
        send(observer, sign_command(settings_command(1, {"operator_keys": [pem(old_pub), pem(new_pub)]}), old)),
    )
    assert both["state"] == "done", both
    assert set(report_with(observer, 1)["keys"]["operator"]) == {old.key_id, new.key_id}
    retired = final_event(
        observer, send(observer, sign_command(settings_command(2, {"operator_keys": [pem(new_pub)]}), new))
    )
    assert retired["state"] == "done", retired
    assert report_with(observer, 2)["keys"]["operator"] == [new.key_id]
    kept = {"operator_keys": [pem(new_pub)]}  # every document carries the fleet's keys (the server's do)
    by_old = final_event(
        observer, send(observer, sign_command(settings_command(3, {**kept, "log_level": "debug"}), old))
    )
    assert by_old["state"] == "rejected" and f"key id {old.key_id}, which is not an operator key" in by_old["reason"]
    by_new = final_event(
        observer, send(observer, sign_command(settings_command(3, {**kept, "log_level": "debug"}), new))
    )
    assert by_new["state"] == "done"
    # the retirement holds across a restart: the held document wins over agent.yaml's operator_keys
    agent.stop()
    agent.start()
    again = final_event(observer, send(observer, sign_command(settings_command(4, {**kept, "log_level": "info"}), old)))
    assert again["state"] == "rejected" and "not an operator key" in again["reason"]


def test_a_settings_document_that_drops_every_trusted_key_is_refused(agent, observer, operators, keypair):
    old = operators[0][0]
    release_id = key_id(load_public_key(keypair[1]))
    for settings, says in (
        ({"trust": []}, "trust: would leave the device without any key of this kind"),
        ({"operator_keys": [], "log_level": "debug"}, "operator_keys: would leave the device"),
        ({"trust": [pem(operators[1][1])]}, "is an operator key, but a release key is needed"),
        (
            {"store": "/tmp/x", "api.listen": "0.0.0.0:1"},
            "api.listen, store can only be changed in agent.yaml on the device",
        ),
        ({"mqtt.telemetry_intreval": 1}, "unknown keys mqtt.telemetry_intreval"),
    ):
        event = final_event(observer, send(observer, sign_command(settings_command(1, settings), old)))
        assert event["state"] == "rejected" and "settings refused whole" in event["reason"], event
        assert says in event["reason"], event["reason"]
    state = [s for s in observer.of(f"dev/{DEVICE}/state") if s.get("status") == "online"][-1]
    assert state["settings"]["generation"] == 0 and state["settings"]["keys"]["release"] == [release_id]
    assert state["settings"]["keys"]["operator"] == [old.key_id]


def test_a_replayed_older_settings_generation_is_refused(agent, observer, operators):
    old = operators[0][0]
    five = sign_command(settings_command(5, {"mqtt.groups": ["garage"]}), old)
    assert final_event(observer, send(observer, five))["state"] == "done"
    send(observer, five)  # the same command again: answered as it stands, never re-run
    assert observer.wait_for(lambda: any(e.get("duplicate") for e in observer.jobs(DEVICE, five["id"])))
    for generation in (4, 5):  # a fresh id, validly signed, but not newer than what the device holds
        older = sign_command(settings_command(generation, {"mqtt.groups": ["kitchen"]}), old)
        event = final_event(observer, send(observer, older))
        assert event["state"] == "rejected", event
        assert f"generation {generation} is not newer than the one this device holds (5)" in event["reason"]
    assert report_with(observer, 5)["results"] == {"mqtt.groups": "applied"}
    six = final_event(observer, send(observer, sign_command(settings_command(6, {"mqtt.groups": ["kitchen"]}), old)))
    assert six["state"] == "done"


def _serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def _deploy(artifact: Path, origin: str, version: str) -> dict:
    data = artifact.read_bytes()
    command = settings_command(1, {})
    del command["generation"], command["settings"]
    return {
        **command,
        "id": f"deploy-{uuid.uuid4().hex[:8]}",
        "type": "deploy",
        "name": "scale",
        "artifact": {"url": f"{origin}/{artifact.name}"},
        "version": version,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }


def test_a_settings_change_reaches_a_running_agent_with_no_restart(
    tmp_path, mosquitto_broker, observer, keypair, operators, arts
):
    old = operators[0][0]
    agent = make_agent(tmp_path, mosquitto_broker, keypair, operators, arts, interval=3600).start()
    artifact = arts["v2"]
    server, origin = _serve(artifact.parent)
    try:
        refused = final_event(observer, send(observer, sign_command(_deploy(artifact, origin, "1.1.0"), old)))
        assert refused["state"] == "failed" and "origin" in refused["reason"], refused
        assert observer.of(f"dev/{DEVICE}/telemetry") == []  # every 3600 s: none yet
        changed = final_event(
            observer,
            send(
                observer,
                sign_command(
                    settings_command(
                        1,
                        {
                            "mqtt.telemetry_interval": 0.2,
                            "updates.allowed_origins": [origin],
                            "mqtt.groups": ["garage"],
                            "updates.health_window_s": 31,
                        },
                    ),
                    old,
                ),
            ),
        )
        assert changed["state"] == "done" and changed["detail"]["results"]["mqtt.telemetry_interval"] == "applied"
        assert changed["detail"]["results"]["updates.health_window_s"].startswith("refused: 31 s is outside")
        assert observer.wait_for(lambda: len(observer.of(f"dev/{DEVICE}/telemetry")) >= 3, 30)
        deployed = final_event(
            observer, send(observer, sign_command(_deploy(artifact, origin, "1.1.0"), old)), timeout=60
        )
        assert deployed["state"] == "active", deployed
        ping = {**settings_command(1, {}), "type": "ping", "target": {"group": "garage"}}
        del ping["generation"], ping["settings"]
        assert final_event(observer, send(observer, ping, "edgepack/v1/grp/garage/cmd"))["state"] == "done"
        pid = agent.proc.pid
        agent.stop()
        # the held document wins over agent.yaml after a restart: telemetry flows at the remote period
        heard = len(observer.of(f"dev/{DEVICE}/telemetry"))
        agent.start()
        assert agent.proc.pid != pid
        assert observer.wait_for(lambda: len(observer.of(f"dev/{DEVICE}/telemetry")) >= heard + 3, 30)
        assert report_with(observer, 1)["results"]["updates.allowed_origins"] == "applied"
        held = json.loads((agent.folder / f"{DEVICE}-store" / "settings.json").read_text())
        assert held["generation"] == 1 and held["settings"]["mqtt.telemetry_interval"] == 0.2
    finally:
        server.shutdown()
        agent.stop()


def test_a_release_key_added_remotely_verifies_new_artifacts_live(
    tmp_path, mosquitto_broker, observer, keypair, operators, arts
):
    old = operators[0][0]
    artifact = arts["r2"]
    agent = make_agent(tmp_path, mosquitto_broker, keypair, operators, arts).start()
    server, origin = _serve(artifact.parent)
    try:
        allow = final_event(
            observer, send(observer, sign_command(settings_command(1, {"updates.allowed_origins": [origin]}), old))
        )
        assert allow["state"] == "done"
        refused = final_event(
            observer, send(observer, sign_command(_deploy(artifact, origin, "1.2.0"), old)), timeout=60
        )
        assert refused["state"] == "rejected" and "trusted" in refused["reason"], refused
        release_id = key_id(load_public_key(keypair[1]))
        only_new = final_event(
            observer,
            send(
                observer,
                sign_command(
                    settings_command(2, {"updates.allowed_origins": [origin], "trust": [pem(arts["r2.pub"])]}), old
                ),
            ),
        )
        assert only_new["state"] == "done"  # the document is taken, its trust is not: scale 1.0.0 needs the old key
        assert only_new["detail"]["results"]["trust"].startswith("refused: scale 1.0.0 would verify by none")
        assert report_with(observer, 2)["keys"]["release"] == [release_id]
        both = [pem(keypair[1]), pem(arts["r2.pub"])]
        assert RELEASE in both[1].splitlines()[0]
        added = final_event(
            observer,
            send(
                observer, sign_command(settings_command(3, {"updates.allowed_origins": [origin], "trust": both}), old)
            ),
        )
        assert added["state"] == "done"
        assert len(report_with(observer, 3)["keys"]["release"]) == 2
        deployed = final_event(
            observer, send(observer, sign_command(_deploy(artifact, origin, "1.2.0"), old)), timeout=60
        )
        assert deployed["state"] == "active", deployed
    finally:
        server.shutdown()
        agent.stop()


def test_a_models_own_artifact_limit_applies_live_to_that_model(
    tmp_path, mosquitto_broker, observer, keypair, operators, arts
):
    old = operators[0][0]
    agent = make_agent(tmp_path, mosquitto_broker, keypair, operators, arts).start()
    server, origin = _serve(arts["v2"].parent)
    size = arts["v2"].stat().st_size
    try:
        small = {
            "updates.allowed_origins": [origin],
            "models.scale.limits.max_artifact_bytes": size - 1,
            "models.other.limits.max_artifact_bytes": 1,
        }
        assert final_event(observer, send(observer, sign_command(settings_command(1, small), old)))["state"] == "done"
        refused = final_event(
            observer, send(observer, sign_command(_deploy(arts["v2"], origin, "1.1.0"), old)), timeout=60
        )
        assert refused["state"] in ("rejected", "failed") and str(size - 1) in refused["reason"], refused
        exact = {**small, "models.scale.limits.max_artifact_bytes": size}
        assert final_event(observer, send(observer, sign_command(settings_command(2, exact), old)))["state"] == "done"
        deployed = final_event(
            observer, send(observer, sign_command(_deploy(arts["v2"], origin, "1.1.0"), old)), timeout=60
        )
        assert deployed["state"] == "active", deployed
    finally:
        server.shutdown()
        agent.stop()
