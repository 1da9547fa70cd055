"""Desired state end to end: a real `edgepack fleet serve`, a real mosquitto and real agents. The
server keeps targets per fleet, group and device and reconciles each device to its effective
target with the signed deploy; every command the mosquitto_broker delivers is counted per device."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from edgepack_core import faults
from edgepack_core.fsutil import sha256_file
from tests.agent_process import AgentProcess
from tests.artifacts import build_artifact
from tests.fleet_server_process import FleetServerProcess, edgepack, wait_for


@pytest.fixture(scope="module")
def versions(tmp_path_factory, keypair) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("arts")
    return {v: build_artifact(folder / v, keypair[0], version=v) for v in ("1.1.0", "2.0.0")}


def _env(server: FleetServerProcess) -> dict[str, str]:
    return {"EDGEPACK_SERVER": server.url, "EDGEPACK_SERVER_TOKEN_FILE": str(server.keys.token_file)}


class Kitchen:
    """Two real agents in group kitchen: cam-01 on 1.1.0, cam-02 on 2.0.0."""

    def __init__(self, folder: Path, mosquitto_broker, server_keys, keypair,
                 versions, server: FleetServerProcess) -> None:
        self.agents = {name: AgentProcess(folder, device=name, broker_port=mosquitto_broker.port, trust=keypair[1],
                                          artifact=versions[version], groups=["kitchen"],
                                          operator_keys=[server_keys.operator_pub],
                                          updates={"allowed_origins": [server.url]})
                       for name, version in (("cam-01", "1.1.0"), ("cam-02", "2.0.0"))}

    def __enter__(self) -> Kitchen:
        for agent in self.agents.values():
            agent.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        for agent in self.agents.values():
            agent.stop()

    def versions(self) -> dict[str, str | None]:
        return {name: agent.version() for name, agent in self.agents.items()}


def _online(server: FleetServerProcess, count: int) -> bool:
    return bool(wait_for(lambda: server.get("/api/devices?group=kitchen&online=true")["total"] == count, 30))


def _on(server: FleetServerProcess, device: str, version: str) -> bool:
    return bool(wait_for(lambda: server.get(f"/api/devices/{device}")["version"] == version, 30))


def test_a_fleet_cannot_be_brought_back_to_one_version_a_group_target_converges_both(
        tmp_path, mosquitto_broker, server_keys, keypair, versions, command_counter):
    """The incident: `rollout create 1.1.0 --group kitchen --force-downgrade` failed its wave because
    cam-01 already ran 1.1.0, and cam-02 (on 2.0.0) was never sent anything. A group target sends
    cam-02 the signed downgrade and counts cam-01 converged, never failed."""
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    try:
        with Kitchen(tmp_path, mosquitto_broker, server_keys, keypair, versions, server) as kitchen:
            assert _online(server, 2) and _on(server, "cam-02", "2.0.0")
            result = edgepack("target", "set", "--group", "kitchen", str(versions["1.1.0"]), "--reason",
                              "incident 42: back to 1.1.0", "--wait", "--timeout", "120", env=_env(server))
            assert result.returncode == 0, result.stdout + result.stderr
            assert "uploaded scale 1.1.0" in result.stderr
            assert "2/2 device(s) on target" in result.stdout
            assert kitchen.versions() == {"cam-01": "1.1.0", "cam-02": "1.1.0"}
            assert dict(command_counter.by_device) == {"cam-02": 1}  # cam-01 on target: nothing sent, none failed
            assert set(command_counter.types.values()) == {"deploy"}
            for device in ("cam-01", "cam-02"):
                doc = server.get(f"/api/devices/{device}/target")
                assert (doc["state"], doc["difference"]) == ("converged", {}), doc
                assert doc["effective"]["models"]["scale"] == {"artifact": sha256_file(versions["1.1.0"]),
                                                               "source": "group:kitchen", "revision": 1}
            shown = edgepack("target", "show", "--group", "kitchen", env=_env(server))
            assert shown.returncode == 0 and shown.stdout.count("converged") == 2, shown.stdout
        entry = next(e for e in server.get("/api/audit")["entries"] if e["action"] == "target.set")
        assert entry["detail"]["reason"] == "incident 42: back to 1.1.0"
        assert entry["target"] == "group:kitchen" and entry["outcome"] == "ok"
    finally:
        server.stop()


@pytest.mark.slow
def test_a_held_device_waits_with_the_reason_and_converges_when_released(
        tmp_path, mosquitto_broker, server_keys, keypair,
                                                                         versions, command_counter):
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    try:
        with Kitchen(tmp_path, mosquitto_broker, server_keys, keypair, versions, server) as kitchen:
            assert _online(server, 2) and _on(server, "cam-02", "2.0.0")
            held = edgepack("target", "hold", "--device", "cam-02", "--reason", "on the bench", env=_env(server))
            assert held.returncode == 0, held.stderr
            result = edgepack("target", "set", "--fleet", str(versions["1.1.0"]), "--wait", "--timeout", "1",
                              env=_env(server))
            assert result.returncode == 1 and "cam-02: held by device" in result.stderr, result.stderr
            doc = server.get("/api/devices/cam-02/target")
            assert doc["state"] == "wait" and doc["reason"] == "held by device"
            assert doc["difference"] == {"scale": "runs 2.0.0, target 1.1.0"}
            assert not command_counter.by_device
            released = edgepack("target", "release", "--device", "cam-02", env=_env(server))
            assert released.returncode == 0, released.stderr
            assert _on(server, "cam-02", "1.1.0") and kitchen.versions()["cam-02"] == "1.1.0"
            assert dict(command_counter.by_device) == {"cam-02": 1}
    finally:
        server.stop()


@pytest.mark.slow
def test_a_server_killed_mid_reconcile_resumes_from_targets_and_sends_the_recorded_command(
        tmp_path, mosquitto_broker, server_keys, keypair, versions, command_counter):
    """SIGKILL after the reconciler recorded cam-02's deploy and before the mosquitto_broker saw it: the
    restarted server resumes from the database alone (the target and the recorded command),
    publishes that same command (no new one), and the device converges."""
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys,
                                extra=("--resend-after", "2s"))
    server.start(env=faults.switch("fleet-recorded-targets"))
    try:
        with Kitchen(tmp_path, mosquitto_broker, server_keys, keypair, versions, server) as kitchen:
            assert _online(server, 2) and _on(server, "cam-02", "2.0.0")
            uploaded = edgepack("target", "set", "--group", "kitchen", str(versions["1.1.0"]), env=_env(server))
            assert uploaded.returncode == 0, uploaded.stderr
            assert server.proc is not None and server.proc.wait(60) == -9  # died at the crash point
            assert not command_counter.by_device
            server.start()
            assert _on(server, "cam-02", "1.1.0")
            assert wait_for(lambda: server.get("/api/devices/cam-02/target")["state"] == "converged", 30)
            assert kitchen.versions() == {"cam-01": "1.1.0", "cam-02": "1.1.0"}
        # one command, the same id and bytes (a mosquitto_broker slow to acknowledge under load may see it twice;
        # the device's replay ledger never runs it twice)
        assert list(command_counter.by_device) == ["cam-02"] and len(command_counter.by_id) == 1
        assert server.get("/api/status")["driver"]["resent"] >= 1
    finally:
        server.stop()


def test_target_requests_are_validated_naming_the_field_and_audited_with_the_reason(
        tmp_path, mosquitto_broker, server_keys,
                                                                                  versions):
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    try:
        status, stored = server.call("POST", "/api/artifacts", data=versions["1.1.0"].read_bytes(),
                                     headers={"Content-Type": "application/octet-stream"})
        assert status == 201, stored
        sha = stored["sha256"]
        path = "/api/targets/groups/kitchen"
        refusals = [
            ({"models": {"scale": "zz"}}, 400, "models.scale"),
            ({"models": {"scale": "0" * 64}}, 422, "models.scale: no artifact"),
            ({"models": {"digits": sha}}, 422, "models.digits: artifact"),
            ({"models": {"a/b": "absent"}}, 400, "models.a/b"),
            ({"modles": {}}, 400, "modles"),
            ({}, 422, "nothing to change"),
            ({"models": {f"m{i}": "absent" for i in range(17)}}, 400, "at most 16"),
            ({"hold": "yes"}, 400, "hold"),
            ({"models": {"scale": sha}, "reason": "x" * 2001}, 400, "reason"),
            ({"models": {"scale": sha}, "waves": [100], "hold": True}, 422, "waves: a staged change sets exactly"),
            ({"models": {"scale": sha}, "soak_s": 5}, 422, "gates without waves"),
            ({"models": {"scale": sha}, "waves": [0]}, 400, "waves"),
        ]
        for body, code, text in refusals:
            status, doc = server.call("PUT", path, body)
            assert status == code and text in doc["error"]["message"], (body, doc)
        status, doc = server.call("PUT", "/api/targets/devices/ghost-1", {"hold": True})
        assert status == 404 and "no device ghost-1" in doc["error"]["message"]
        assert server.call("GET", "/api/devices/ghost-1/target")[0] == 404
        status, doc = server.call("PUT", "/api/targets/devices/ghost-1", {"models": {"scale": sha}, "waves": [100]})
        assert status == 422 and "a device target is not staged" in doc["error"]["message"]
        assert server.call("PUT", path, {"hold": True}, token=False)[0] == 401
        # the limits pass: 16 models, a 2,000-character reason
        status, doc = server.call("PUT", path, {"models": {f"m{i}": "absent" for i in range(16)},
                                                "reason": "r" * 2000})
        assert status == 200 and len(doc["models"]) == 16, doc
        status, doc = server.call("PUT", path, {"models": {"scale": sha}})
        assert status == 422 and "would hold 17 models; at most 16" in doc["error"]["message"], doc
        assert server.call("PUT", path, {"models": {f"m{i}": None for i in range(16)}})[0] == 200
        status, doc = server.call("PUT", path, {"models": {"scale": sha}, "reason": "back to 1.1.0"})
        assert status == 200 and list(doc["models"]) == ["scale"], doc
        assert doc["models"]["scale"]["revision"] == 1 and doc["models"]["scale"]["reason"] == "back to 1.1.0"
        status, doc = server.call("PUT", path, {"models": {"scale": sha}, "reason": "again"})
        assert doc["models"]["scale"]["revision"] == 2  # a new operator decision: a rejected artifact is retried
        everything = server.get("/api/targets")
        assert everything["groups"] == {"kitchen": {"models": {"scale": sha}, "hold": False}}
        entries = [e for e in server.get("/api/audit?limit=1000")["entries"] if e["action"] == "target.set"]
        assert sum(e["outcome"] == "refused" and e["target"] == "kitchen" for e in entries) == len(refusals) + 1
        accepted = [e for e in entries if e["outcome"] == "ok"]
        assert [e["detail"]["reason"] for e in accepted][:2] == ["again", "back to 1.1.0"]
        assert accepted[0]["detail"]["before"] == {"scale": sha} and accepted[0]["target"] == "group:kitchen"
    finally:
        server.stop()


@pytest.mark.slow
def test_a_version_devices_rejected_is_never_sent_again_by_a_group_target_only_by_a_device_target(
        tmp_path, mosquitto_broker, server_keys, keypair, versions, command_counter):
    """A release that fails the devices' smoke test: each device gets it once and reports it
    rejected. With the server's own job records gone (a restore from before the commands), the
    devices' reported rejections still stop it; setting the group again does not resend it; a
    device target set afterwards is the operator's explicit retry."""
    bad = build_artifact(tmp_path / "bad", keypair[0], version="2.1.0", nan=True)
    bad_sha = sha256_file(bad)
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    try:
        with Kitchen(tmp_path, mosquitto_broker, server_keys, keypair, versions, server):
            assert _online(server, 2) and _on(server, "cam-02", "2.0.0")
            result = edgepack("target", "set", "--group", "kitchen", str(bad), env=_env(server))
            assert result.returncode == 0, result.stderr

            def rejected_by_both() -> bool:
                docs = [server.get(f"/api/devices/{d}/target") for d in ("cam-01", "cam-02")]
                return all(bad_sha in doc["reported"]["rejected"] and doc["state"] == "wait" for doc in docs)

            assert wait_for(rejected_by_both, 60)
            assert dict(command_counter.by_device) == {"cam-01": 1, "cam-02": 1}
            server.stop()
            with sqlite3.connect(server.folder / "fleet.db") as connection:
                connection.execute("DELETE FROM target_commands")
                connection.execute("DELETE FROM job_events")
            server.start()
            again = server.call("PUT", "/api/targets/groups/kitchen", {"models": {"scale": bad_sha},
                                                                        "reason": "try again"})
            assert again[0] == 200, again
            doc = server.get("/api/devices/cam-02/target")
            assert doc["state"] == "wait" and "rejected by this device (smoke_test" in doc["reason"], doc
            assert "set a device target to retry" in doc["reason"]
            retry = server.call("PUT", "/api/targets/devices/cam-02", {"models": {"scale": bad_sha}})
            assert retry[0] == 200, retry
            assert wait_for(lambda: command_counter.by_device["cam-02"] == 2, 30)
            assert wait_for(lambda: server.get("/api/devices/cam-02/target")["reason"].startswith(
                f"scale: artifact {bad_sha[:12]} rejected on this device (failed: smoke test"), 30)
            assert server.get("/api/devices/cam-02")["version"] == "2.0.0"
        assert command_counter.by_device["cam-01"] == 1  # never re-targeted
    finally:
        server.stop()


def test_the_rejections_a_device_reports_follow_its_newest_online_state_and_keep_when_first_heard(tmp_path):
    import json

    from sqlalchemy import select

    from edgepack_core.protocol.messages import parse_state
    from sdk.fleet_server import db as tables
    from sdk.fleet_server.db import open_database
    from sdk.fleet_server.ingest import Writer

    def state(status: str, *shas: str) -> bytes:
        rejected = [{"name": "scale", "version": f"2.{i}.0", "sha256": sha, "stage": "health_window",
                     "reason": "unhealthy", "ts": 5.0} for i, sha in enumerate(shas)]
        return json.dumps({"schema": "edgepack.state/1", "device": "cam-01", "status": status, "ts": 1.0,
                           "rejected": rejected}).encode()

    database = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")
    a, b = "a" * 64, "b" * 64

    def apply(payload: bytes, heard: float) -> dict[str, float]:
        with database.write() as connection:
            Writer(database).states(connection, [(parse_state("cam-01", payload), heard)])
        with database.read() as connection:
            table = tables.device_rejected
            return dict(connection.execute(select(table.c.sha256, table.c.heard_at)).all())

    try:
        assert apply(state("online", a), 10.0) == {a: 10.0}
        assert apply(state("online", a, b), 20.0) == {a: 10.0, b: 20.0}  # a keeps when it was first heard
        assert apply(state("offline"), 30.0) == {a: 10.0, b: 20.0}  # a will lists nothing: nothing forgotten
        assert apply(state("online", b), 40.0) == {b: 20.0}  # the device's ledger dropped a
        assert apply(state("online"), 50.0) == {}
    finally:
        database.dispose()


@pytest.mark.slow
def test_a_staged_target_change_moves_only_the_devices_that_need_it_and_a_failed_one_leaves_the_target(
        tmp_path, mosquitto_broker, server_keys, keypair, versions, command_counter):
    """`target set --group kitchen 1.1.0 --waves 50,100`: a rollout over the devices not on 1.1.0
    (cam-02 alone; cam-01 is converged, never failed), and the target changes when it succeeds.
    A staged change to a release the devices refuse fails its rollout and changes nothing."""
    bad = build_artifact(tmp_path / "bad", keypair[0], version="2.1.0", nan=True)
    good_sha = sha256_file(versions["1.1.0"])
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    try:
        with Kitchen(tmp_path, mosquitto_broker, server_keys, keypair, versions, server) as kitchen:
            assert _online(server, 2) and _on(server, "cam-02", "2.0.0")
            result = edgepack("target", "set", "--group", "kitchen", str(versions["1.1.0"]), "--waves", "50,100",
                              "--reason", "back to 1.1.0 in waves", "--wait", "--timeout", "120", env=_env(server))
            assert result.returncode == 0, result.stdout + result.stderr
            assert "2/2 device(s) on target" in result.stdout
            assert kitchen.versions() == {"cam-01": "1.1.0", "cam-02": "1.1.0"}
            assert dict(command_counter.by_device) == {"cam-02": 1}
            rollout = server.get("/api/rollouts")["rollouts"][0]
            assert rollout["state"] == "succeeded", rollout
            assert [d["device"] for d in server.get(f"/api/rollouts/{rollout['id']}")["devices"]] == ["cam-02"]
            doc = server.get("/api/targets/groups/kitchen")
            assert doc["models"]["scale"]["artifact"] == good_sha and doc["staged"] == []
            actions = [(e["action"], e["detail"].get("rollout")) for e in server.get("/api/audit")["entries"]
                       if e["action"].startswith("target.")]
            assert actions[:2] == [("target.set", rollout["id"]), ("target.stage", rollout["id"])]

            failed = edgepack("target", "set", "--group", "kitchen", str(bad), "--waves", "100", "--wait",
                              "--timeout", "120", env=_env(server))
            assert failed.returncode == 1 and "the target was not changed" in failed.stderr, failed.stderr
            assert server.get("/api/targets/groups/kitchen")["models"]["scale"]["artifact"] == good_sha
            assert wait_for(lambda: all(s["state"] == "converged" for s in
                                        server.get("/api/targets/groups/kitchen")["devices"]), 30)
            assert kitchen.versions() == {"cam-01": "1.1.0", "cam-02": "1.1.0"}
    finally:
        server.stop()


def test_the_models_a_device_lists_are_what_the_reconciler_compares(tmp_path):
    import json
    import time

    from edgepack_core.protocol.messages import parse_state
    from sdk.fleet_server.db import open_database
    from sdk.fleet_server.desired import View, load_plan
    from sdk.fleet_server.ingest import Writer

    def state(*models: tuple[str, str]) -> bytes:
        return json.dumps({"schema": "edgepack.state/1", "device": "cam-01", "status": "online", "ts": 1.0,
                           "model": {"name": models[0][0], "version": models[0][1]},
                           "models": [{"name": n, "version": v} for n, v in models]}).encode()

    database = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")

    def reported(payload: bytes) -> dict[str, str | None]:
        now = time.time()
        with database.write() as connection:
            Writer(database).states(connection, [(parse_state("cam-01", payload), now)])
        with database.read() as connection:
            plan = load_plan(connection, View(now))[0]
        return {name: running.version for name, running in plan.reported.models.items()}

    try:
        assert reported(state(("digits", "1.1.0"), ("kws", "2.0.0"))) == {"digits": "1.1.0", "kws": "2.0.0"}
        assert reported(state(("kws", "2.1.0"))) == {"kws": "2.1.0"}  # the device dropped digits
    finally:
        database.dispose()
