"""Decommission (issue 24, item 5): `DELETE /api/devices/cam-04` was a 405, and a revoked device
stayed in the fleet (and `fleet status --broker` listed it online) for good. Now the server
removes it, clears its retained state on the broker, drops its later messages (counted) until an
operator enrolls it again, and keeps the operator's reason in the audit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.agent_process import AgentProcess
from tests.artifacts import build_artifact
from tests.fleet_server_process import FleetServerProcess, edgepack, make_keys, wait_for
from tests.test_liveness_e2e import _retained

pytestmark = pytest.mark.slow


def _dropped(server: FleetServerProcess) -> int:
    return server.get("/api/status")["ingest"]["dropped_by_device"].get("cam-04", {}).get("decommissioned", 0)


def test_a_decommissioned_device_leaves_the_fleet_and_the_broker_until_enrolled_again(
        tmp_path: Path, mosquitto_broker, keypair):
    keys = make_keys(tmp_path / "keys", release=keypair)
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=keys).start()
    agent = AgentProcess(tmp_path, device="cam-04", broker_port=mosquitto_broker.port, trust=keypair[1],
                         artifact=build_artifact(tmp_path / "arts", keypair[0]), groups=["g"]).start()
    env = {"EDGEPACK_SERVER": server.url, "EDGEPACK_SERVER_TOKEN_FILE": str(keys.token_file)}
    try:
        assert wait_for(lambda: server.call("GET", "/api/devices/cam-04")[0] == 200, 30)
        result = edgepack("device", "decommission", "cam-04", "--reason", "stolen from the loading dock", env=env)
        assert result.returncode == 0, result.stderr
        assert "cam-04 decommissioned: stolen from the loading dock" in result.stdout
        assert server.call("GET", "/api/devices/cam-04")[0] == 404
        assert _retained(mosquitto_broker.port, "edgepack/v1/dev/cam-04/state") == b""
        # The agent still runs and sends telemetry: dropped and counted, never listed again.
        assert wait_for(lambda: _dropped(server) >= 3, 30)
        assert server.call("GET", "/api/devices/cam-04")[0] == 404
        assert server.get("/api/devices")["total"] == 0
        listed = server.get("/api/decommissioned")["devices"]
        assert [(d["device"], d["reason"], d["actor"]) for d in listed] == [
            ("cam-04", "stolen from the loading dock", "admin")]
        entry = server.get("/api/audit?action=device.decommission")["entries"][0]
        assert entry["target"] == "cam-04" and entry["detail"]["reason"] == "stolen from the loading dock"

        result = edgepack("device", "enroll", "cam-04", "--reason", "found it", env=env)
        assert result.returncode == 0, result.stderr
        assert wait_for(lambda: server.call("GET", "/api/devices/cam-04")[0] == 200, 30)  # its telemetry enrols it
        assert server.get("/api/decommissioned")["devices"] == []
    finally:
        agent.stop()
        server.stop()


def test_decommission_mistakes_are_4xx_naming_what_to_fix(tmp_path: Path, mosquitto_broker, keypair):
    keys = make_keys(tmp_path / "keys", release=keypair)
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=keys).start()
    try:
        status, doc = server.call("DELETE", "/api/devices/never-seen")
        assert (status, doc["error"]["code"]) == (404, "not_found") and "never-seen" in doc["error"]["message"]
        status, doc = server.call("DELETE", "/api/devices/x", {"reason": "r" * 501})
        assert status == 400 and "reason" in doc["error"]["message"]
        status, doc = server.call("POST", "/api/devices/x/enroll", {})
        assert status == 404 and "not decommissioned" in doc["error"]["message"]
        assert server.call("DELETE", "/api/devices/x", token="wrong")[0] == 401
        result = edgepack("device", "decommission", "never-seen", env={"EDGEPACK_SERVER": server.url,
                                                                       "EDGEPACK_SERVER_TOKEN_FILE":
                                                                       str(keys.token_file)})
        assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "never-seen" in result.stderr and "Traceback" not in result.stderr
    finally:
        server.stop()
