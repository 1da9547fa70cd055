"""Per-device actions through the fleet server (issue 24, item 5): the dashboard could not act,
and commands sent over MQTT directly were not audited. Rollback to the last good model, ping,
re-run the target, hold and release go through `POST /api/devices/{id}/actions/{action}`: the
commands signed with the server's operator key and recorded like the driver's, each audited as
device.<action> with the operator's reason and the command id. Real server, broker and agent."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from edgepack_core import faults
from edgepack_core.fsutil import sha256_file
from tests.agent_process import AgentProcess
from tests.artifacts import build_artifact
from tests.fleet_server_process import CommandCounter, FleetServerProcess, edgepack, wait_for


@pytest.fixture(scope="module")
def versions(tmp_path_factory, keypair) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("arts")
    return {v: build_artifact(folder / v, keypair[0], version=v) for v in ("1.1.0", "2.0.0")}


def _env(server: FleetServerProcess) -> dict[str, str]:
    return {"EDGEPACK_SERVER": server.url, "EDGEPACK_SERVER_TOKEN_FILE": str(server.keys.token_file)}


def _agent(folder: Path, broker, keys, keypair, artifact: Path, server: FleetServerProcess) -> AgentProcess:
    return AgentProcess(
        folder,
        device="cam-01",
        broker_port=broker.port,
        trust=keypair[1],
        artifact=artifact,
        groups=["kitchen"],
        operator_keys=[keys.operator_pub],
        updates={"allowed_origins": [server.url]},
    )


def _audit(server: FleetServerProcess, action: str) -> list[dict]:
    return server.get(f"/api/audit?action={action}")["entries"]


@pytest.fixture
def cam(tmp_path, mosquitto_broker, server_keys, keypair, versions):
    """A server and one real agent (cam-01 on 1.1.0, group kitchen) the server has heard."""
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    agent = _agent(tmp_path, mosquitto_broker, server_keys, keypair, versions["1.1.0"], server).start()
    try:
        assert wait_for(lambda: server.call("GET", "/api/devices/cam-01")[0] == 200, 30)
        yield server, agent
    finally:
        agent.stop()
        server.stop()


def test_the_dashboard_could_not_act_a_rollback_and_a_ping_go_through_the_server_signed_and_audited(cam, versions):
    server, agent = cam
    pinged = edgepack("device", "ping", "cam-01", "--reason", "is it there?", env=_env(server))
    assert pinged.returncode == 0, pinged.stderr
    answer = json.loads(pinged.stdout)
    assert answer["job"]["final"] and answer["job"]["state"] == "done"
    entry = _audit(server, "device.ping")[0]
    assert entry["detail"] == {"reason": "is it there?", "command": answer["command"]}
    assert server.get("/api/devices/cam-01/history")["entries"][0]["job"] == answer["command"]

    # The group's target moves cam-01 to 2.0.0 (the reconciler's signed deploy) ...
    upload = edgepack("target", "set", "--group", "kitchen", str(versions["2.0.0"]), "--wait", env=_env(server))
    assert upload.returncode == 0, upload.stderr
    assert agent.version() == "2.0.0"
    # ... and the operator rolls it back through the server: back on 1.1.0, and held, or the
    # reconciler would send 2.0.0 again at its next round.
    result = edgepack(
        "device", "rollback", "cam-01", "--model", "scale", "--reason", "NaN in the kitchen", env=_env(server)
    )
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert answer["held"] is True and answer["job"]["reason"] == "rolled back to scale 1.1.0", answer
    assert wait_for(lambda: server.get("/api/devices/cam-01")["version"] == "1.1.0", 30)
    assert agent.version() == "1.1.0"
    entry = _audit(server, "device.rollback")[0]
    assert entry["actor"] == "admin" and entry["detail"]["reason"] == "NaN in the kitchen"
    assert entry["detail"]["command"] == answer["command"]
    assert entry["detail"]["from_version"] == {"name": "scale", "version": "2.0.0"}
    target = server.get("/api/devices/cam-01/target")
    assert target["state"] == "wait" and target["reason"] == "held by device"
    sent = [e for e in _audit(server, "command.sent") if e["detail"]["command"]["id"] == answer["command"]]
    assert sent and sent[0]["detail"]["command"]["type"] == "rollback"  # recorded like the driver's


def test_device_actions_mistakes_are_4xx_naming_the_field_and_hold_release_rerun_are_audited(cam, versions):
    server, _agent = cam
    status, doc = server.call("POST", "/api/devices/cam-01/actions/reboot", {})
    assert status == 400 and doc["error"]["message"].startswith("action:"), doc
    status, doc = server.call("POST", "/api/devices/cam-01/actions/ping", {"reason": "r" * 501})
    assert status == 400 and "reason" in doc["error"]["message"], doc
    assert server.call("POST", "/api/devices/cam-01/actions/ping", {"reason": "r" * 500})[0] == 200
    status, doc = server.call("POST", "/api/devices/cam-01/actions/hold", {"model": "scale"})
    assert status == 422 and doc["error"]["message"].startswith("model:"), doc
    status, doc = server.call("POST", "/api/devices/cam-01/actions/rollback", {"model": "other"})
    assert status == 409 and "model: cam-01 serves scale, not other" in doc["error"]["message"], doc
    status, doc = server.call("POST", "/api/devices/never-seen/actions/ping", {})
    assert status == 404 and "never-seen" in doc["error"]["message"]
    status, doc = server.call("POST", "/api/devices/cam-01/actions/rerun", {})
    assert status == 409 and "no target" in doc["error"]["message"]
    assert server.call("POST", "/api/devices/cam-01/actions/ping", {}, token="wrong")[0] == 401
    refused = _audit(server, "device.action")
    assert {e["outcome"] for e in refused} == {"refused"} and len(refused) == 6

    status, doc = server.call("POST", "/api/devices/cam-01/actions/hold", {"reason": "on the bench"})
    assert status == 200 and doc["held_by"] == ["device"]
    assert _audit(server, "device.hold")[0]["detail"] == {"reason": "on the bench", "held_by": ["device"]}
    status, doc = server.call("POST", "/api/devices/cam-01/actions/release", {"reason": "fixed"})
    assert status == 200 and doc["held_by"] == []

    sha = sha256_file(versions["1.1.0"])
    assert edgepack("target", "set", "--device", "cam-01", str(versions["1.1.0"]), env=_env(server)).returncode == 0
    status, doc = server.call("POST", "/api/devices/cam-01/actions/rerun", {"reason": "again"})
    assert status == 200 and doc["models"] == {"scale": sha} and doc["revisions"] == {"scale": 2}, doc
    entry = _audit(server, "device.rerun")[0]
    assert entry["detail"]["reason"] == "again" and entry["detail"]["models"] == {"scale": sha}


def test_a_server_killed_between_recording_and_publishing_a_ping_sends_it_after_the_restart(
    tmp_path, mosquitto_broker, server_keys, keypair, versions
):
    """SIGKILL after the action's command and audit row were committed, before the broker saw the
    command: the restarted server publishes that same recorded command (the driver's resend of
    what the broker never acknowledged), and the device's answer reaches the history."""
    counter = CommandCounter(mosquitto_broker.port)
    server = FleetServerProcess(
        tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys, extra=("--resend-after", "1s")
    )
    server.start(env=faults.switch("fleet-recorded-action"))
    agent = _agent(tmp_path, mosquitto_broker, server_keys, keypair, versions["1.1.0"], server).start()
    try:
        assert wait_for(lambda: server.call("GET", "/api/devices/cam-01")[0] == 200, 30)
        with contextlib.suppress(OSError):  # the server dies answering
            server.call("POST", "/api/devices/cam-01/actions/ping", {"reason": "still there?"})
        assert server.proc is not None and server.proc.wait(60) == -9
        assert not counter.by_device
        server.start()
        command = _audit(server, "device.ping")[0]["detail"]["command"]

        def answered() -> bool:
            entries = server.get("/api/devices/cam-01/history")["entries"]
            return any(e["job"] == command and e["outcome"] == "succeeded" for e in entries)

        assert wait_for(answered, 30)
        assert list(counter.by_id) == [command]
    finally:
        agent.stop()
        server.stop()
        counter.close()
