"""Offline devices in a rollout (issue 24, item 4): a group rollout created while a device was
down included it, and its wave then waited up to 30 minutes with nothing saying so. Waves now
count offline devices apart with the deadline they wait until, and a rollout over a device list
can leave out the devices offline at creation."""

from __future__ import annotations

import re
from pathlib import Path

from sdk.fleet_server.wave_waits import wave_waits
from tests.agent_process import AgentProcess
from tests.artifacts import build_artifact
from tests.fleet_server_process import FleetServerProcess, edgepack, make_keys, wait_for

MEMBERS = [("a", 0, True), ("b", 0, False), ("c", 0, False), ("d", 1, False)]


def test_a_wave_counts_its_unanswered_offline_devices_and_only_the_running_wave_has_a_deadline():
    waits = wave_waits(
        2, MEMBERS, {"a", "b", "d"}, state="running", current_wave=0, wave_started_at=100.0, wave_timeout_s=1800.0
    )
    assert waits == [{"offline": 1, "deadline": 1900.0}, {"offline": 1, "deadline": None}]  # a answered finally
    for state in ("paused", "pending", "failed", "succeeded"):
        assert [
            w["deadline"]
            for w in wave_waits(
                2, MEMBERS, set(), state=state, current_wave=0, wave_started_at=100.0, wave_timeout_s=1.0
            )
        ] == [None, None]
    assert wave_waits(
        1, [("x", 5, False)], {"x"}, state="running", current_wave=0, wave_started_at=None, wave_timeout_s=1.0
    ) == [{"offline": 0, "deadline": None}]


def test_a_rollout_over_devices_can_exclude_the_offline_ones_and_shows_what_its_wave_waits_for(
    tmp_path: Path, mosquitto_broker, keypair
):
    keys = make_keys(tmp_path / "keys", release=keypair)
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=keys).start()
    artifact = build_artifact(tmp_path / "arts", keypair[0], version="2.0.0")
    agents = {
        name: AgentProcess(
            tmp_path,
            device=name,
            broker_port=mosquitto_broker.port,
            trust=keypair[1],
            artifact=build_artifact(tmp_path / f"a-{name}", keypair[0], version="1.0.0"),
            operator_keys=[keys.operator_pub],
            updates={"allowed_origins": [server.url]},
        )
        for name in ("cam-01", "cam-02")
    }
    try:
        for agent in agents.values():
            agent.start()
        assert wait_for(lambda: server.get("/api/devices?online=true")["total"] == 2, 30)
        agents["cam-02"].stop()  # a clean stop: offline with its reason
        assert wait_for(lambda: server.get("/api/devices?online=true")["total"] == 1, 30)
        status, stored = server.call("POST", "/api/artifacts", data=artifact.read_bytes())
        assert status == 201, stored
        body = {"artifact": stored["sha256"], "waves": [100], "devices": ["cam-01", "cam-02"], "wave_timeout_s": 600}
        status, doc = server.call("POST", "/api/rollouts", {**body, "exclude_offline": True})
        assert status == 201 and doc["target"] == {"devices": ["cam-01"]}, doc
        status, doc = server.call("POST", "/api/rollouts", {**body, "devices": ["cam-02"], "exclude_offline": True})
        assert status == 422 and doc["error"]["message"].startswith("exclude_offline:"), doc
        status, doc = server.call("POST", "/api/rollouts", {**body, "exclude_offline": "yes"})
        assert status == 400 and "exclude_offline" in doc["error"]["message"], doc

        status, doc = server.call("POST", "/api/rollouts", {**body, "devices": ["cam-02"]})
        assert status == 201, doc
        running = wait_for(lambda: (d := server.get(f"/api/rollouts/{doc['id']}"))["waves"][0]["deadline"] and d)
        assert running["waves"][0]["offline"] == 1 and running["offline"] == 1
        assert running["waves"][0]["deadline"] == running["wave_deadline"] == running["wave_started_at"] + 600
        shown = edgepack("rollout", "status", doc["id"], env={"EDGEPACK_SERVER": server.url,
                                                              "EDGEPACK_SERVER_TOKEN_FILE": str(keys.token_file)})
        assert shown.returncode == 0, shown.stderr
        assert re.search(r"wave 1 \(100%\): running .*, 1 offline, times out at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC",
                         shown.stdout), shown.stdout
    finally:
        for agent in agents.values():
            agent.stop()
        server.stop()
