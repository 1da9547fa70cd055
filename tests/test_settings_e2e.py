"""Key rotation and remote settings end to end: a real `edgepack fleet serve`, a real mosquitto and
real agent subprocesses; nothing is edited on the devices and no agent restarts.

A new release key is added from the server and rolled out, an artifact signed by it installs,
the old key is retired and an artifact signed by the old key is refused; a settings change
(telemetry interval, allowed origins) reaches the running agents. Then the operator key is
rotated: the server restarts with the new key first and the old one after it, signs each device's
commands with the first key it holds, and once the old key is retired a command signed by it is
refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from edgepack_core.command_auth import sign_command
from edgepack_core.protocol.commands import build_command
from edgepack_core.signing import key_id, load_public_key
from sdk.keys import load_operator_key, write_keypair, write_operator_keypair
from tests.agent_process import AgentProcess, Observer
from tests.artifacts import build_artifact
from tests.fleet_server_process import FleetServerProcess, edgepack, make_keys, wait_for

pytestmark = pytest.mark.slow

DEVICES = ("rot-a", "rot-b")


def _cli(server: FleetServerProcess, *args: str) -> str:
    done = edgepack(*args, "--server", server.url, "--token-file", str(server.keys.token_file))
    assert done.returncode == 0, done.stderr
    return done.stdout


def _settings(server: FleetServerProcess, device: str) -> dict:
    return server.get(f"/api/devices/{device}/settings")


def _held(server: FleetServerProcess, device: str) -> dict | None:
    """The device's report once it holds the newest generation the server sent."""
    doc = _settings(server, device)
    reported, sent = doc["reported"], doc["sent"]
    if reported is None or sent is None or reported["generation"] < sent["generation"]:
        return None
    return reported


def _rollout(server: FleetServerProcess, artifact, devices) -> dict:
    status, stored = server.call("POST", "/api/artifacts", data=artifact.read_bytes())
    assert status in (200, 201), stored
    status, rollout = server.call(
        "POST", "/api/rollouts", {"artifact": stored["sha256"], "waves": [100], "devices": list(devices)}
    )
    assert status == 201, rollout
    return server.finished(rollout["id"])


def test_a_key_rotation_and_a_settings_change_reach_every_device_from_the_server(tmp_path, mosquitto_broker, keypair):
    keys = make_keys(tmp_path / "keys", release=keypair)
    new_release = (tmp_path / "keys" / "release2.key", tmp_path / "keys" / "release2.pub")
    write_keypair(*new_release)
    arts = tmp_path / "arts"
    v1 = build_artifact(arts / "1", keypair[0], version="1.0.0")
    v2_new_key = build_artifact(arts / "2", new_release[0], version="1.1.0", factor=3.0)
    v3_old_key = build_artifact(arts / "3", keypair[0], version="1.2.0", factor=4.0)
    server = FleetServerProcess(
        tmp_path / "server", broker=mosquitto_broker.address, keys=keys, extra=("--trust", str(new_release[1]))
    ).start()
    for name in DEVICES:
        (tmp_path / name).mkdir()
    agents = [
        AgentProcess(
            tmp_path / name,
            device=name,
            broker_port=mosquitto_broker.port,
            trust=keypair[1],
            artifact=v1,
            operator_keys=[keys.operator_pub],
            updates={"health_window_s": {"default": 0.5, "min": 0.5, "max": 30}},
        )
        for name in DEVICES
    ]
    observer = Observer(mosquitto_broker.port)
    try:
        for agent in agents:
            agent.start()
        pids = [agent.proc.pid for agent in agents]
        assert wait_for(lambda: server.get("/api/devices?online=true")["total"] == len(DEVICES), 30)
        old_id, new_id = key_id(load_public_key(keypair[1])), key_id(load_public_key(new_release[1]))

        # the new release key and a settings change, rolled out from the server
        _cli(server, "fleet", "keys", "add", "--kind", "release", str(keypair[1]))
        _cli(server, "fleet", "keys", "add", "--kind", "release", str(new_release[1]))
        refused = edgepack(
            "fleet",
            "keys",
            "add",
            "--kind",
            "operator",
            str(new_release[1]),
            "--server",
            server.url,
            "--token-file",
            str(server.keys.token_file),
        )
        assert refused.returncode == 1 and "is a release key, but an operator key is needed" in refused.stderr
        _cli(
            server,
            "fleet",
            "settings",
            "set",
            "--fleet",
            "mqtt.telemetry_interval=0.3",
            "updates.allowed_origins=http://127.0.0.1:" + str(server.port) + ",http://127.0.0.2:1",
            "--reason",
            "rotate the release key",
        )
        for device in DEVICES:
            reported = wait_for(lambda d=device: _held(server, d), 60)
            assert reported is not None, _settings(server, device)
            assert sorted(reported["keys"]["release"]) == sorted([old_id, new_id])
            assert reported["results"]["mqtt.telemetry_interval"] == "applied"
            assert reported["results"]["updates.allowed_origins"] == "applied"
        shown = _cli(server, "fleet", "settings", "show", "--device", DEVICES[0])
        assert "mqtt.telemetry_interval" in shown and "applied" in shown and new_id in shown

        done = _rollout(server, v2_new_key, DEVICES)
        assert done["state"] == "succeeded", done
        assert all(agent.version() == "1.1.0" for agent in agents)

        # the old release key retired: an artifact signed by it is refused by every device
        _cli(server, "fleet", "keys", "retire", str(keypair[1]))
        for device in DEVICES:
            assert wait_for(lambda d=device: (_held(server, d) or {}).get("keys", {}).get("release") == [new_id], 60), (
                _settings(server, device)
            )
        failed = _rollout(server, v3_old_key, DEVICES)
        assert failed["state"] == "failed", failed
        assert all(agent.version() == "1.1.0" for agent in agents)
        assert [agent.proc.pid for agent in agents] == pids  # no agent restarted
        listed = _cli(server, "fleet", "keys", "list")
        assert f"{old_id} release   retired" in listed and f"{new_id} release   in use" in listed

        # the operator key: the server restarts with the new key first, the old one for devices not there yet
        new_operator = (tmp_path / "keys" / "operator2.key", tmp_path / "keys" / "operator2.pub")
        write_operator_keypair(*new_operator)
        server.stop()
        server = FleetServerProcess(
            tmp_path / "server",
            broker=mosquitto_broker.address,
            port=server.port,
            keys=dataclasses.replace(keys, operator_key=new_operator[0]),
            extra=("--trust", str(new_release[1]), "--operator-key", str(keys.operator_key)),
        ).start()
        old_op, new_op = load_operator_key(keys.operator_key), load_operator_key(new_operator[0])
        _cli(server, "fleet", "keys", "add", "--kind", "operator", str(keys.operator_pub))
        _cli(server, "fleet", "keys", "add", "--kind", "operator", str(new_operator[1]))
        for device in DEVICES:  # signed by the old key (all they held), they now hold both
            assert wait_for(
                lambda d=device: (
                    sorted((_held(server, d) or {}).get("keys", {}).get("operator", []))
                    == sorted([old_op.key_id, new_op.key_id])
                ),
                60,
            ), _settings(server, device)
        _cli(server, "fleet", "keys", "retire", str(keys.operator_pub))  # signed by the new key now
        for device in DEVICES:
            assert wait_for(
                lambda d=device: (_held(server, d) or {}).get("keys", {}).get("operator") == [new_op.key_id], 60
            ), _settings(server, device)
        stale = sign_command(
            build_command("apply-settings", device=DEVICES[0], generation=10**6, settings={"log_level": "debug"}),
            old_op,
        )
        observer.publish(f"edgepack/v1/dev/{DEVICES[0]}/cmd", json.dumps(stale))
        assert observer.wait_for(
            lambda: any(
                e.get("final") and e["state"] == "rejected" and "not an operator key" in e["reason"]
                for e in observer.jobs(DEVICES[0], stale["id"])
            ),
            30,
        )
        assert [agent.proc.pid for agent in agents] == pids
        audit = server.get("/api/audit?limit=100")
        actions = {entry["action"] for entry in audit["entries"]}
        assert {"keys.add", "keys.retire", "settings.set"} <= actions
    finally:
        observer.close()
        for agent in agents:
            agent.stop()
        server.stop()
