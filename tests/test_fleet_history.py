"""Reasons kept and shown, and each device's update history (issue 24 items 6 and 8), against a real
`edgepack fleet serve`, a real mosquitto and simulated devices (tools/fleet_sim.py) that answer
with real job events.

The incidents: the audit kept ``{"from": "running", "to": "paused", "wave": 0}`` without the
operator's reason; the rollout's reason was overwritten at the next step; ``abortd by admin``;
0-based waves in the audit; reasons cut at 80 characters in the CLI; commands sent over MQTT
directly were not audited; no device could tell which updates it went through."""

from __future__ import annotations

import json
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from edgepack_core.protocol.commands import build_command, encode_command
from sdk.fleet_server.history import FAILED, SENT, SUCCEEDED, UNANSWERED, outcome
from tests.artifacts import build_artifact
from tests.broker import free_port, start_mosquitto
from tests.fleet_server_process import ROOT, FleetServerProcess, edgepack, make_keys, wait_for
from tools.fleet_sim import Behaviour, SimFleet

LONG_REASON = (
    "the kitchen cameras miss the 07:00 delivery window when they restart; hold every wave until the "
    "night shift has confirmed the new thresholds on cam-02, cam-05 and cam-09 (ticket OPS-4411), then "
    "resume; this sentence goes on past eighty characters and past two hundred, to the end: END"
)


@pytest.fixture(scope="module")
def arts(tmp_path_factory, keypair) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("arts")
    return {version: build_artifact(folder, keypair[0], version=version) for version in ("1.1.0", "1.2.0")}


@pytest.fixture(scope="module")
def fleet_server(tmp_path_factory, keypair):
    """mosquitto and `edgepack fleet serve` beside it, for the whole module."""
    folder = tmp_path_factory.mktemp("history")
    broker = start_mosquitto(workdir=folder / "mosquitto")
    process = FleetServerProcess(
        folder / "server", broker=broker.address, keys=make_keys(folder / "keys", release=keypair)
    )
    try:
        yield broker, process.start()
    finally:
        process.stop()
        broker.kill()


@pytest.fixture(scope="module")
def broker(fleet_server):
    return fleet_server[0]


@pytest.fixture(scope="module")
def server(fleet_server):
    return fleet_server[1]


def _env(server: FleetServerProcess) -> dict[str, str]:
    return {"EDGEPACK_SERVER": server.url, "EDGEPACK_SERVER_TOKEN_FILE": str(server.keys.token_file)}


def _audit(server: FleetServerProcess, action: str) -> list[dict]:
    """The accepted entries of ``action``, newest first."""
    return [e for e in server.get(f"/api/audit?limit=1000&action={action}")["entries"] if e["outcome"] == "ok"]


def _publish(broker, topic: str, payloads: list[bytes]) -> None:
    """Publish at QoS 1 as an outside client would (not the server), each acknowledged."""
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"outsider-{free_port()}", protocol=mqtt.MQTTv5)
    client.connect(broker.host, broker.port)
    client.loop_start()
    try:
        for payload in payloads:
            client.publish(topic, payload, qos=1).wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


@pytest.fixture(scope="module")
def paused(server, broker, arts):
    """A rollout to group 'slow' (devices that hold each job in a 60 s health window), created
    with a reason, then paused, resumed and aborted from the CLI: the first two with reasons."""
    env = _env(server)
    behaviour = Behaviour(groups=("slow",), health_window_s=60.0)
    with SimFleet(broker.host, broker.port, 4, rate=1, prefix="slow", behaviour=behaviour) as fleet:
        assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?group=slow&online=true")["total"] == 4)
        created = edgepack(
            "rollout",
            "create",
            str(arts["1.1.0"]),
            "--group",
            "slow",
            "--waves",
            "50,100",
            "--reason",
            "release 1.1.0 fixes the night mode",
            env=env,
        )
        assert created.returncode == 0, created.stderr
        rollout_id = created.stdout.split()[1].rstrip(":")
        assert wait_for(lambda: server.get(f"/api/rollouts/{rollout_id}")["counts"]["in_progress"] == 2, 60)
        steps = [
            edgepack("rollout", "pause", rollout_id, "--reason", LONG_REASON, env=env),
            edgepack("rollout", "resume", rollout_id, "--reason", "night shift confirmed", env=env),
            edgepack("rollout", "abort", rollout_id, env=env),
        ]
        assert [step.returncode for step in steps] == [0, 0, 0], [step.stderr for step in steps]
        status = edgepack("rollout", "status", rollout_id, env=env)
    return rollout_id, steps, status


def test_pausing_keeps_the_operators_reason_in_the_audit(server, paused):
    rollout_id, _steps, _status = paused
    [pause] = [e for e in _audit(server, "rollout.pause") if e["target"] == rollout_id]
    assert pause["actor"] == "admin"
    assert pause["detail"] == {"from": "running", "to": "paused", "wave": 1, "wave_count": 2, "reason": LONG_REASON}
    [resume] = [e for e in _audit(server, "rollout.resume") if e["target"] == rollout_id]
    assert resume["detail"]["reason"] == "night shift confirmed"
    [create] = [e for e in _audit(server, "rollout.create") if e["target"] == rollout_id]
    assert create["detail"]["reason"] == "release 1.1.0 fixes the night mode"
    assert create["detail"]["command"]["kind"] == "deploy" and create["detail"]["command"]["target"] == {
        "group": "slow"
    }


def test_a_rollout_keeps_every_transitions_reason(server, paused):
    rollout_id, steps, _status = paused
    doc = server.get(f"/api/rollouts/{rollout_id}")
    moves = [(t["event"], t["from"], t["to"], t["wave"], t["actor"], t["reason"]) for t in doc["transitions"]]
    assert moves[0] == ("create", "", "pending", 1, "admin", "release 1.1.0 fixes the night mode")
    assert moves[1][:4] == ("start", "pending", "running", 1) and moves[1][4].startswith("server:")
    assert moves[1][5] == "started: wave 1 of 2"
    assert moves[2:] == [
        ("pause", "running", "paused", 1, "admin", LONG_REASON),
        ("resume", "paused", "running", 1, "admin", "night shift confirmed"),
        ("abort", "running", "aborted", 1, "admin", "aborted by admin"),
    ]
    assert all(t["at"] > 0 for t in doc["transitions"])
    assert doc["reason"] == "aborted by admin" and "abortd" not in steps[2].stdout
    [abort] = [e for e in _audit(server, "rollout.abort") if e["target"] == rollout_id]
    assert abort["detail"]["reason"] == "aborted by admin"


def test_waves_are_one_based_in_the_audit_and_cli(server, paused):
    rollout_id, steps, status = paused
    doc = server.get(f"/api/rollouts/{rollout_id}")
    assert (doc["wave"], doc["wave_number"]) == (0, 1)  # `wave` stays 0-based for the clients that read it
    assert [(w["index"], w["number"]) for w in doc["waves"]] == [(0, 1), (1, 2)]
    assert {(d["wave"] + 1, d["wave_number"]) for d in doc["devices"]} == {(1, 1), (2, 2)}
    assert all(
        e["detail"]["wave"] == 1
        for action in ("rollout.pause", "rollout.resume", "rollout.abort")
        for e in _audit(server, action)
        if e["target"] == rollout_id
    )
    assert "wave 1/2" in steps[0].stdout
    history = [line for line in status.stdout.splitlines() if line.startswith("  ") and " by admin" in line]
    assert len(history) == 4 and all(" wave 1 " in line for line in history)


def test_the_cli_does_not_cut_reasons(server, paused):
    rollout_id, steps, status = paused
    assert status.returncode == 0, status.stderr
    assert LONG_REASON in steps[0].stdout  # the pause answer shows the reason whole
    [pause_line] = [line for line in status.stdout.splitlines() if " pause " in line]
    assert pause_line.endswith(f"by admin: {LONG_REASON}")
    # a device job's reason longer than 80 characters is printed whole too
    jobs = [d for d in server.get(f"/api/rollouts/{rollout_id}")["devices"] if len(d["reason"]) > 0]
    assert jobs and all(d["reason"] in status.stdout for d in jobs)


def test_a_device_whose_wave_was_never_sent_says_why_in_its_history(server, paused):
    rollout_id, _steps, _status = paused
    doc = server.get(f"/api/rollouts/{rollout_id}")
    left_out = [d["device"] for d in doc["devices"] if d["state"] == "not_sent"]
    assert len(left_out) == 2
    [entry] = [e for e in server.get(f"/api/devices/{left_out[0]}/history")["entries"] if e["rollout"]]
    assert (entry["rollout"]["id"], entry["outcome"], entry["states"]) == (rollout_id, "not_sent", [])
    assert entry["reason"] == "wave 2 was never sent: the rollout aborted"
    assert entry["artifact"]["version"] == "1.1.0"


def test_a_too_long_reason_is_refused_at_the_limit(server, paused):
    rollout_id, _steps, _status = paused
    env = _env(server)
    over = edgepack("rollout", "pause", rollout_id, "--reason", "x" * 501, env=env)
    assert over.returncode == 2 and over.stderr.count("\n") == 1 and "at most 500 characters" in over.stderr
    at_limit = edgepack("rollout", "pause", rollout_id, "--reason", "x" * 500, env=env)
    assert at_limit.returncode == 1 and "409 conflict" in at_limit.stderr  # valid reason; aborted rollout


def _external_deploy(device: str, version: str, sha: str, command_id: str) -> bytes:
    return encode_command(
        build_command(
            "deploy",
            device=device,
            command_id=command_id,
            name="sim-model",
            version=version,
            size=1000,
            sha256=sha,
            artifact={"url": "http://127.0.0.1:9/x.edgepkg"},
        )
    )


def test_a_command_sent_straight_over_mqtt_is_audited(server, broker, arts):
    sha = "ab" * 32
    _publish(broker, f"{ROOT}/dev/cam-77/cmd", [_external_deploy("cam-77", "9.9.9", sha, "by-hand-0001")])
    _publish(
        broker,
        f"{ROOT}/grp/kitchen/cmd",
        [encode_command(build_command("ping", group="kitchen", command_id="by-hand-ping"))],
    )
    _publish(broker, f"{ROOT}/dev/cam-77/cmd", [b"\xff not a command"])
    seen = wait_for(lambda: (lambda e: e if len(e) >= 3 else None)(_audit(server, "command.external")), 30)
    assert seen is not None
    by_id = {e["detail"]["id"]: e for e in seen}
    deploy = by_id["by-hand-0001"]
    assert (deploy["actor"], deploy["target"], deploy["detail"]["topic"]) == (
        "mqtt",
        "cam-77",
        f"{ROOT}/dev/cam-77/cmd",
    )
    assert deploy["detail"]["command"] == {
        "type": "deploy",
        "name": "sim-model",
        "version": "9.9.9",
        "sha256": sha,
        "target": {"device": "cam-77"},
        "expires_at": deploy["detail"]["command"]["expires_at"],
    }
    assert "sig" not in json.dumps(deploy["detail"]) and deploy["detail"]["refused_by_schema"] is None
    assert by_id["by-hand-ping"]["target"] == "group:kitchen"
    assert by_id[None]["detail"]["refused_by_schema"].startswith("command is not JSON")


def test_the_servers_own_commands_are_audited_as_sent_not_external(server, broker, arts):
    with SimFleet(broker.host, broker.port, 2, rate=1, prefix="own", behaviour=Behaviour(groups=("own",))) as fleet:
        assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?group=own&online=true")["total"] == 2)
        created = server.call(
            "POST", "/api/rollouts", {"artifact": _sha(server, arts["1.1.0"]), "group": "own", "waves": [100]}
        )
        assert created[0] == 201, created
        done = server.finished(created[1]["id"], 60)
        assert done["state"] == "succeeded"
    ids = {d["command_id"] for d in done["devices"]}
    sent = {e["detail"]["command"]["id"]: e for e in _audit(server, "command.sent")}
    assert ids <= set(sent) and all(sent[i]["actor"].startswith("server:") for i in ids)
    assert all(sent[i]["detail"]["rollout"] == done["id"] and "sig" not in sent[i]["detail"]["command"] for i in ids)
    # the ingest heard them on dev/+/cmd and knew them as the server's own: not external
    assert wait_for(lambda: server.get("/api/status")["ingest"]["received"].get("cmd", 0) >= 2, 30)
    assert not ids & {e["detail"]["id"] for e in _audit(server, "command.external")}


def test_a_flood_of_commands_on_one_topic_is_bounded_by_its_budget(server, broker):
    before = len([e for e in _audit(server, "command.external") if e["target"] == "flood-1"])
    payloads = [_external_deploy("flood-1", "1.0.0", "cd" * 32, f"flood-{i:04d}") for i in range(60)]
    _publish(broker, f"{ROOT}/dev/flood-1/cmd", payloads)

    def settled() -> tuple[int, int] | None:
        status = server.get("/api/status")["ingest"]
        dropped = status["dropped_by_device"].get("flood-1", {}).get("cmd_rate", 0)
        audited = len([e for e in _audit(server, "command.external") if e["target"] == "flood-1"]) - before
        return (audited, dropped) if audited + dropped == 60 else None

    counts = wait_for(settled, 30)
    assert counts is not None
    audited, dropped = counts
    assert 20 <= audited < 60 and dropped > 0  # the burst of 20 passes, the rest is limited per topic


def _sha(server: FleetServerProcess, artifact: Path) -> str:
    from edgepack_core.fsutil import sha256_file

    sha = sha256_file(artifact)
    if server.call("GET", f"/api/artifacts/{sha}")[0] == 404:
        status, _doc = server.call(
            "POST", "/api/artifacts", data=artifact.read_bytes(), headers={"Content-Type": "application/octet-stream"}
        )
        assert status in (200, 201)
    return sha


def test_device_history_lists_every_job_with_its_outcome(server, broker, arts):
    behaviour = Behaviour(groups=("hist",), rollback_versions=frozenset({"1.2.0"}))
    env = _env(server)
    with SimFleet(broker.host, broker.port, 1, rate=1, prefix="hist", behaviour=behaviour) as fleet:
        assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?group=hist&online=true")["total"] == 1)
        ok = server.call(
            "POST", "/api/rollouts", {"artifact": _sha(server, arts["1.1.0"]), "group": "hist", "waves": [100]}
        )[1]
        assert server.finished(ok["id"], 60)["state"] == "succeeded"
        bad = server.call(
            "POST", "/api/rollouts", {"artifact": _sha(server, arts["1.2.0"]), "group": "hist", "waves": [100]}
        )[1]
        assert server.finished(bad["id"], 60)["state"] == "failed"
        _publish(
            broker, f"{ROOT}/dev/hist-00000/cmd", [_external_deploy("hist-00000", "1.1.5", "ef" * 32, "by-hand-hist")]
        )
        doc = wait_for(
            lambda: (lambda d: d if len(d["entries"]) == 3 and d["entries"][0]["outcome"] == SUCCEEDED else None)(
                server.get("/api/devices/hist-00000/history")
            ),
            30,
        )
        assert doc is not None
    by_hand, failed, passed = doc["entries"]
    assert (by_hand["job"], by_hand["sent_by_server"], by_hand["rollout"]) == ("by-hand-hist", False, None)
    assert (failed["rollout"]["id"], failed["kind"], failed["outcome"]) == (bad["id"], "deploy", FAILED)
    assert failed["artifact"] == {"sha256": bad["artifact"]["sha256"], "name": "scale", "version": "1.2.0"}
    assert failed["state"] == "rolled_back" and failed["reason"].startswith("unhealthy: simulated failure")
    assert (passed["rollout"]["id"], passed["outcome"], passed["artifact"]["version"]) == (ok["id"], SUCCEEDED, "1.1.0")
    states = [s["state"] for s in passed["states"]]
    assert states[0] == "queued" and states[-1] == "active" and passed["states"][-1]["final"]
    times = [s["received_at"] for s in passed["states"]]
    assert times == sorted(times)
    assert failed["started_at"] > passed["started_at"]
    # one page at a time, newest first, until next_before is null
    first = server.get("/api/devices/hist-00000/history?limit=2")
    assert [e["job"] for e in first["entries"]] == [by_hand["job"], failed["job"]] and first["next_before"]
    rest = server.get(f"/api/devices/hist-00000/history?limit=2&before={first['next_before']!r}")
    assert [e["job"] for e in rest["entries"]] == [passed["job"]] and rest["next_before"] is None
    assert server.call("GET", "/api/devices/hist-00000/history?limit=201")[0] == 400
    assert server.get("/api/devices/hist-00000/history?limit=200")["limit"] == 200
    assert server.call("GET", "/api/devices/nobody-here/history")[0] == 404
    # the device list marks the failed last update; the CLI prints the history with reasons whole
    [listed] = server.get("/api/devices?group=hist")["devices"]
    assert listed["update_status"] == "ok"  # the newest deploy job (the one sent by hand) ended active
    cli = edgepack("device", "history", "hist-00000", env=env)
    assert cli.returncode == 0, cli.stderr
    assert f"rollout {bad['id']}: failed: {failed['reason']}" in cli.stdout and "(not sent by the server)" in cli.stdout
    as_json = edgepack("device", "history", "hist-00000", "--json", "--limit", "1", env=env)
    assert json.loads(as_json.stdout)["entries"][0]["job"] == "by-hand-hist"
    bad_id = edgepack("device", "history", "../rollouts", env=env)
    assert bad_id.returncode == 2 and "Traceback" not in bad_id.stderr


def test_a_device_whose_last_update_failed_is_marked(server, broker, arts):
    slow = Behaviour(groups=("mark",), health_window_s=60.0)
    failing = Behaviour(groups=("markf",), rollback_versions=frozenset({"1.2.0"}))
    with (
        SimFleet(broker.host, broker.port, 1, rate=1, prefix="mark", behaviour=slow) as a,
        SimFleet(broker.host, broker.port, 1, rate=1, prefix="markf", behaviour=failing) as b,
    ):
        assert a.wait_ready() and b.wait_ready()
        assert wait_for(lambda: server.get("/api/devices?group=mark&online=true")["total"] == 1)
        assert wait_for(lambda: server.get("/api/devices?group=markf&online=true")["total"] == 1)
        assert server.get("/api/devices/mark-00000")["update_status"] is None  # no update yet
        for group, version in (("mark", "1.1.0"), ("markf", "1.2.0")):
            assert (
                server.call(
                    "POST", "/api/rollouts", {"artifact": _sha(server, arts[version]), "group": group, "waves": [100]}
                )[0]
                == 201
            )
        assert wait_for(lambda: server.get("/api/devices/mark-00000")["update_status"] == "updating", 30)
        assert wait_for(lambda: server.get("/api/devices/markf-00000")["update_status"] == "failed", 30)
        listed = {d["id"]: d["update_status"] for d in server.get("/api/devices")["devices"]}
        assert (listed["mark-00000"], listed["markf-00000"]) == ("updating", "failed")


def test_a_jobs_outcome_from_its_newest_state():
    assert outcome("deploy", None, False, expires_at=10.0, now=10.0) == SENT
    assert outcome("deploy", None, False, expires_at=10.0, now=10.001) == UNANSWERED
    assert outcome("deploy", "downloading", False, expires_at=None, now=0) == "in_progress"
    assert outcome("deploy", "active", False, expires_at=None, now=0) == "in_progress"  # in its health window
    assert outcome("deploy", "active", True, expires_at=None, now=0) == SUCCEEDED
    assert outcome("deploy", "rolled_back", True, expires_at=None, now=0) == FAILED
    assert outcome("rollback", "rolled_back", True, expires_at=None, now=0) == SUCCEEDED
    assert outcome("deploy", "rejected", True, expires_at=None, now=0) == FAILED
    assert outcome("cancel", "cancelled", True, expires_at=None, now=0) == "cancelled"
    assert outcome("ping", "done", True, expires_at=None, now=0) == SUCCEEDED


def test_the_command_budget_is_per_topic_with_a_burst_of_twenty():
    from sdk.fleet_server.budgets import Buckets, IngestLimits

    buckets = Buckets(IngestLimits().command)
    assert all(buckets.allow("flood", 0.0) for _ in range(20))  # the burst passes
    assert not buckets.allow("flood", 0.0)  # the 21st is dropped
    assert buckets.allow("quiet", 0.0)  # another topic keeps its own budget
    assert buckets.allow("flood", 1.0)  # one a second after
