"""Server-side rollouts end to end: a real `edgepack fleet serve`, a real mosquitto, simulated devices
that answer with real job events (tools/fleet_sim.py) and real agents. Every command the broker
delivers is counted per device, so "no device gets a command twice" is measured, not assumed."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from edgepack_core import faults
from edgepack_core.signing import TrustStore
from tests.artifacts import build_artifact
from tests.fleet_server_process import CommandCounter, FleetServerProcess, edgepack, make_keys, wait_for
from tools.fleet_sim import Behaviour, SimFleet


@pytest.fixture
def broker(mosquitto_broker):
    return mosquitto_broker


@pytest.fixture(scope="module")
def keys(tmp_path_factory, keypair):
    return make_keys(tmp_path_factory.mktemp("keys"), release=keypair)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, keypair) -> Path:
    return build_artifact(tmp_path_factory.mktemp("arts"), keypair[0], version="1.1.0")


@pytest.fixture
def counter(broker):
    counting = CommandCounter(broker.port)
    yield counting
    counting.close()


@pytest.fixture
def server(tmp_path: Path, broker, keys):
    process = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys,
                                 extra=("--resend-after", "3s"))
    process.start()
    yield process
    process.stop()


def _signed_behaviour(keys, **changes) -> Behaviour:
    """Devices that refuse commands not signed by the server's operator key, and fetch for real."""
    return Behaviour(operator_trust=TrustStore.from_paths([keys.operator_pub]), fetch=True, **changes)


def _env(server: FleetServerProcess) -> dict[str, str]:
    return {"EDGEPACK_SERVER": server.url, "EDGEPACK_SERVER_TOKEN_FILE": str(server.keys.token_file)}


def _rollout(server: FleetServerProcess, rollout_id: str) -> dict:
    return server.get(f"/api/rollouts/{rollout_id}")


def _job_events(server: FleetServerProcess) -> dict[str, int]:
    """Job events stored per device, read from the server's SQLite file."""
    with sqlite3.connect(f"file:{server.folder / 'fleet.db'}?mode=ro", uri=True) as connection:
        return dict(connection.execute("SELECT device, count(*) FROM job_events GROUP BY device").fetchall())


def test_three_wave_rollout_to_twenty_devices_completes_from_the_cli(server, broker, keys, artifact, counter):
    with SimFleet(broker.host, broker.port, 20, rate=1, behaviour=_signed_behaviour(keys)) as fleet:
        assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?online=true")["total"] == 20)
        result = edgepack("rollout", "create", str(artifact), "--group", "sim", "--waves", "5,25,100", "--soak", "0.5",
                          "--wait", "--timeout", "120", env=_env(server))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "uploaded scale 1.1.0" in result.stderr
        assert "succeeded" in result.stdout and "wave 3 (100%): passed   15/15 active" in result.stdout
        assert set(fleet.versions().values()) == {"1.1.0"}
        assert wait_for(lambda: server.get("/api/devices?version=1.1.0")["total"] == 20, 10)
    assert sorted(counter.by_device.values()) == [1] * 20  # one command per device, none twice
    assert set(counter.types.values()) == {"deploy"}
    rollouts = server.get("/api/rollouts")["rollouts"]
    assert len(rollouts) == 1 and rollouts[0]["state"] == "succeeded"
    doc = _rollout(server, rollouts[0]["id"])
    assert [(w["devices"], w["state"]) for w in doc["waves"]] == [(1, "passed"), (4, "passed"), (15, "passed")]
    assert all(d["state"] == "active" and d["final"] for d in doc["devices"])
    assert {e["action"] for e in server.get("/api/audit")["entries"]} == {"artifact.upload", "rollout.create",
                                                                          "command.sent"}


@pytest.mark.slow
def test_kill_9_of_the_server_mid_wave_resumes_where_it_was_without_sending_twice(server, broker, keys, artifact,
                                                                                  counter):
    """The server dies (kill -9) while wave 2 runs; devices keep publishing job events while it is
    down; a restart picks the rollout up from the database, sends each device its command once, and
    stores every event published during the outage (persistent session, acknowledged after commit)."""
    behaviour = _signed_behaviour(keys, health_window_s=2.0)
    with SimFleet(broker.host, broker.port, 20, rate=1, behaviour=behaviour) as fleet:
        assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?online=true")["total"] == 20)
        created = edgepack("rollout", "create", str(artifact), "--group", "sim", "--waves", "5,25,100",
                           env=_env(server))
        assert created.returncode == 0, created.stderr
        rollout_id = created.stdout.split()[1].rstrip(":")

        def devices_working_on_wave_two() -> bool:
            doc = _rollout(server, rollout_id)
            return doc["wave"] == 1 and any(d["wave"] == 1 and d["state"] not in ("not_sent", "sent")
                                            and not d["final"] for d in doc["devices"])

        assert wait_for(devices_working_on_wave_two, 60, interval=0.02)
        server.kill()
        # While the server is down, wave 2's devices finish their jobs (their events queue on the broker):
        # the deploys of waves 1 and 2 (1 + 4 devices) end, health windows closed, before the restart.
        assert wait_for(lambda: sum(v == "1.1.0" for v in fleet.versions().values()) == 5, 20)
        assert wait_for(lambda: fleet.final_deploys() == 5, 20)
        server.start()
        final = server.finished(rollout_id)
        assert final["state"] == "succeeded", final
        assert set(fleet.versions().values()) == {"1.1.0"}
    assert sorted(counter.by_device.values()) == [1] * 20, counter.by_device
    assert sorted(counter.by_id.values()) == [1] * 20
    # queued, downloading, verifying, staging, testing, active, active (final): 7 events per device, all stored
    assert _job_events(server) == {f"sim-{i:05d}": 7 for i in range(20)}
    assert server.get("/api/status")["driver"]["resent"] == 0



def _wait_ticks(server: FleetServerProcess, rounds: int) -> None:
    """Until the driver has gone ``rounds`` more rounds (counted by the server, not timed here)."""
    start = server.get("/api/status")["driver"]["ticks"]
    assert wait_for(lambda: server.get("/api/status")["driver"]["ticks"] >= start + rounds, 60)

@pytest.mark.slow
def test_a_crash_between_recording_and_publishing_a_wave_sends_it_once_after_restart(tmp_path, broker, keys,
                                                                                      artifact, counter):
    """The server dies (SIGKILL at an exact point) after wave 2's commands are recorded and before
    they reach the broker. After the restart it finds them unacknowledged and unanswered, and
    publishes them (the same bytes) once the grace has passed: every device gets one command."""
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys, extra=("--resend-after", "2s"))
    server.start(env=faults.switch("fleet-recorded-wave-2"))
    try:
        with SimFleet(broker.host, broker.port, 20, rate=1, behaviour=_signed_behaviour(keys)) as fleet:
            assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?online=true")["total"] == 20)
            created = edgepack("rollout", "create", str(artifact), "--group", "sim", "--waves", "5,25,100",
                               env=_env(server))
            rollout_id = created.stdout.split()[1].rstrip(":")
            assert server.proc.wait(60) == -9  # died at the crash point
            assert sum(counter.by_device.values()) == 1  # wave 1 only: wave 2 never reached the broker
            server.start()
            final = server.finished(rollout_id)
            assert final["state"] == "succeeded", final
            assert set(fleet.versions().values()) == {"1.1.0"}
        assert sorted(counter.by_device.values()) == [1] * 20, counter.by_device
        assert server.get("/api/status")["driver"]["resent"] == 4
    finally:
        server.stop()


def test_a_failing_wave_stops_the_rollout_and_rolls_back_what_it_updated(server, broker, keys, artifact, counter):
    healthy = _signed_behaviour(keys, groups=("mix",))
    failing = _signed_behaviour(keys, groups=("mix",), rollback_versions=frozenset({"1.1.0"}))
    with SimFleet(broker.host, broker.port, 2, rate=1, prefix="a", behaviour=healthy) as good, \
            SimFleet(broker.host, broker.port, 4, rate=1, prefix="b", behaviour=failing) as bad:
        assert good.wait_ready() and bad.wait_ready()
        assert wait_for(lambda: server.get("/api/devices?group=mix&online=true")["total"] == 6)
        result = edgepack("rollout", "create", str(artifact), "--group", "mix", "--waves", "33,100",
                          "--rollback-on-failure", "--wait", "--timeout", "120", env=_env(server))
        assert result.returncode == 1
        assert "ended failed: not every device is active: wave 2 of 2 failed: b-0000" in result.stderr
        assert result.stderr.count("edgepack: error") == 1 and "Traceback" not in result.stderr
        rollout_id = server.get("/api/rollouts")["rollouts"][0]["id"]
        undone = wait_for(lambda: (lambda d: d if all(x["undo"] is None or x["undo"]["state"] == "done"
                                                      for x in d["devices"]) else None)(_rollout(server, rollout_id)))
        assert undone is not None
        first_wave = [d for d in undone["devices"] if d["wave"] == 0]
        assert [d["device"] for d in first_wave] == ["a-00000", "a-00001"]
        assert all(d["undo"]["kind"] == "rollback" and d["undo"]["state"] == "done" for d in first_wave)
        assert all(d["state"] == "rolled_back" for d in undone["devices"] if d["wave"] == 1)
        assert set(good.versions().values()) == {"1.0.0"} and set(bad.versions().values()) == {"1.0.0"}
    kinds = sorted((counter.types[i], n) for i, n in counter.by_id.items())
    assert kinds == [("deploy", 1)] * 6 + [("rollback", 1)] * 2


@pytest.mark.slow
def test_pause_resume_and_abort_from_the_cli(server, broker, keys, artifact, counter):
    # Each wave takes at least the devices' 8 s health window: longer than a CLI call takes to
    # start on a loaded machine, so pause and abort land inside the wave they are meant for.
    behaviour = _signed_behaviour(keys, health_window_s=8.0)
    env = _env(server)
    with SimFleet(broker.host, broker.port, 10, rate=1, behaviour=behaviour) as fleet:
        assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?online=true")["total"] == 10)
        created = edgepack("rollout", "create", str(artifact), "--group", "sim", "--waves", "10,50,100", env=env)
        rollout_id = created.stdout.split()[1].rstrip(":")
        paused = edgepack("rollout", "pause", rollout_id, "--reason", "lunch", env=env)
        assert paused.returncode == 0 and " paused " in paused.stdout and "lunch" in paused.stdout
        _wait_ticks(server, 30)  # 30 rounds of the driver in which a paused rollout must send nothing
        sent_while_paused = sum(counter.by_device.values())
        assert sent_while_paused <= 1 and _rollout(server, rollout_id)["state"] == "paused"
        resumed = edgepack("rollout", "resume", rollout_id, env=env)
        assert resumed.returncode == 0 and " running " in resumed.stdout
        assert wait_for(lambda: _rollout(server, rollout_id)["wave"] == 1, 60)
        aborted = edgepack("rollout", "abort", rollout_id, env=env)
        assert aborted.returncode == 0 and " aborted " in aborted.stdout
        _wait_ticks(server, 15)  # 15 rounds in which an aborted rollout must not send wave 3
        doc = _rollout(server, rollout_id)
        assert doc["state"] == "aborted" and doc["waves"][2]["not_sent"] == 5
        again = edgepack("rollout", "resume", rollout_id, env=env)
        assert again.returncode == 1 and again.stderr.count("\n") == 1
        assert "409 conflict" in again.stderr and "cannot resume a rollout that is aborted" in again.stderr
        status = edgepack("rollout", "status", rollout_id, "--json", env=env)
        assert status.returncode == 0 and '"state": "aborted"' in status.stdout
    assert sum(counter.by_device.values()) == 5  # waves 1 and 2 only
    actions = [(e["action"], e["actor"]) for e in server.get("/api/audit")["entries"]
               if e["outcome"] == "ok" and e["action"].startswith("rollout.")]
    assert actions[:4] == [("rollout.abort", "admin"), ("rollout.resume", "admin"), ("rollout.pause", "admin"),
                           ("rollout.create", "admin")]


def test_a_rollout_to_named_devices_reaches_only_them_and_status_watch_follows_it(server, broker, keys, artifact,
                                                                                 counter):
    """--device names the targets: the other devices of the group get no command and keep their
    version; `rollout status --watch` prints each change and returns once the rollout ends, with
    its final table; `rollout list` shows it, and filters by state."""
    env = _env(server)
    with SimFleet(broker.host, broker.port, 6, rate=1, behaviour=_signed_behaviour(keys)) as fleet:
        assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?online=true")["total"] == 6)
        named = sorted(fleet.versions())[1:4]
        created = edgepack("rollout", "create", str(artifact), *[a for d in named for a in ("--device", d)],
                           "--waves", "50,100", env=env)
        assert created.returncode == 0, created.stderr
        assert created.stdout.endswith(": 3 device(s) in 2 wave(s)\n")
        rollout_id = created.stdout.split()[1].rstrip(":")
        watched = edgepack("rollout", "status", rollout_id, "--watch", "--interval", "0.2", env=env, timeout=120)
        assert watched.returncode == 0, watched.stderr
        lines = watched.stdout.splitlines()
        progress = [line for line in lines if line.startswith(rollout_id)]
        assert len(progress) >= 2 and progress[-1].split()[1] == "succeeded"  # each change, then the end
        header = max(i for i, line in enumerate(lines) if line.split()[:1] == ["DEVICE"])
        assert progress[-1] == lines[header - 3]  # the final table: its line, 2 waves, header, devices, history
        table = lines[header + 1:header + 1 + len(named)]
        assert lines[header + 1 + len(named)] == "  HISTORY" and lines[-1].split()[2] == "succeed"
        assert [row.split()[0] for row in table] == named and all(row.split()[2] == "active" for row in table)
        versions = fleet.versions()
        assert {d: versions[d] for d in named} == dict.fromkeys(named, "1.1.0")
        assert all(version != "1.1.0" for device, version in versions.items() if device not in named)
    assert sorted(counter.by_device) == named and set(counter.by_device.values()) == {1}
    listed = edgepack("rollout", "list", "--json", env=env)
    assert listed.returncode == 0 and [d["id"] for d in json.loads(listed.stdout)] == [rollout_id]
    running = edgepack("rollout", "list", "--state", "running", "--json", env=env)
    assert running.returncode == 0 and json.loads(running.stdout) == []


def test_soak_error_rate_gate_fails_a_wave_whose_devices_report_errors(server, broker, keys, artifact):
    behaviour = _signed_behaviour(keys, error_versions=frozenset({"1.1.0"}))
    with SimFleet(broker.host, broker.port, 4, rate=5, behaviour=behaviour) as fleet:
        assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?online=true")["total"] == 4)
        result = edgepack("rollout", "create", str(artifact), "--group", "sim", "--waves", "25,100", "--soak", "3",
                          "--max-error-rate", "0.2", "--wait", "--timeout", "60", env=_env(server))
        assert result.returncode == 1
        assert "wave 1 of 2 failed its soak: sim-00000 error rate 0.500" in result.stderr
        rollout = server.get("/api/rollouts")["rollouts"][0]
        assert _rollout(server, rollout["id"])["waves"][1]["not_sent"] == 3


def test_a_rollout_whose_artifact_left_the_store_fails_naming_why(server, broker, keys, artifact):
    with SimFleet(broker.host, broker.port, 2, rate=1, behaviour=_signed_behaviour(keys)) as fleet:
        assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?online=true")["total"] == 2)
        status, stored = server.call("POST", "/api/artifacts", data=artifact.read_bytes())
        assert status == 201
        (server.artifacts / f"{stored['sha256']}.edgepkg").unlink()  # e.g. a second server with its own folder
        result = edgepack("rollout", "create", str(artifact), "--group", "sim", "--wait", "--timeout", "30",
                          env=_env(server))
        assert result.returncode == 1
        assert f"artifact {stored['sha256'][:12]} is not in the artifact store of server" in result.stderr
        assert set(fleet.versions().values()) == {"1.0.0"}


@pytest.mark.slow
def test_rollout_to_real_agents_signed_by_the_server_and_fetched_from_it(tmp_path, broker, keys, keypair, artifact):
    """Two real agents with the server's operator key and its origin allowed: the signed command is
    accepted, the artifact fetched over HTTP from the server, verified with the release key."""
    from tests.agent_process import AgentProcess

    v1 = build_artifact(tmp_path / "v1", keypair[0], version="1.0.0")
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys)
    server.start()
    agents = [AgentProcess(tmp_path, device=f"pi-{i}", broker_port=broker.port, trust=keypair[1], artifact=v1,
                           groups=["field"], operator_keys=[keys.operator_pub],
                           updates={"allowed_origins": [server.url]}) for i in range(2)]
    try:
        for agent in agents:
            agent.start()
        assert wait_for(lambda: server.get("/api/devices?group=field&online=true")["total"] == 2, 30)
        result = edgepack("rollout", "create", str(artifact), "--group", "field", "--waves", "50,100",
                          "--health-window", "1", "--wait", "--timeout", "120", env=_env(server))
        assert result.returncode == 0, result.stdout + result.stderr
        assert [agent.version() for agent in agents] == ["1.1.0", "1.1.0"]
        assert agents[0].predict([1.0, 2.0, 3.0, 4.0])[0] == 200
    finally:
        for agent in agents:
            agent.stop()
        server.stop()


def test_a_rollout_with_an_out_of_range_health_window_fails_alone_and_the_rollouts_after_it_run(
        server, broker, keys, artifact, counter):
    """A rollout stored with a health window no device accepts (100,000 s: an older server's API took
    it; the command schema's maximum is 86,400) fails alone, naming the bound, without a command
    sent; a rollout created after it (so driven after it in every round) runs to the end."""
    from sdk.fleet_server.db import open_database
    from sdk.fleet_server.queries import RolloutRequest, create_rollout
    from sdk.fleet_server.rollouts import Gates

    first = SimFleet(broker.host, broker.port, 2, rate=1, prefix="a",
                     behaviour=_signed_behaviour(keys, groups=("first",)))
    second = SimFleet(broker.host, broker.port, 2, rate=1, prefix="b",
                      behaviour=_signed_behaviour(keys, groups=("second",)))
    with first, second:
        assert wait_for(lambda: server.get("/api/devices?online=true")["total"] == 4)
        status, stored = server.call("POST", "/api/artifacts", data=artifact.read_bytes())
        assert status == 201, stored
        database = open_database(server.db_url, migrate_schema=False)
        try:
            bad = create_rollout(database, RolloutRequest(
                artifact=stored["sha256"], waves=[100.0], group="first", devices=None, gates=Gates(),
                health_window_s=100000.0, force_downgrade=False, allow_contract_change=False),
                actor="older-server", remote="", silence_s=20.0)
        finally:
            database.dispose()
        status, good = server.call("POST", "/api/rollouts", {"artifact": stored["sha256"], "waves": [100],
                                                             "group": "second"})
        assert status == 201, good
        failed = server.finished(bad, 60)
        assert failed["state"] == "failed" and "health_window_s" in failed["reason"], failed
        assert "86400" in failed["reason"], failed["reason"]
        assert server.finished(good["id"], 60)["state"] == "succeeded"
    assert counter.by_device.get("a-00000", 0) == 0 and counter.by_device.get("a-00001", 0) == 0
    assert counter.by_device["b-00000"] == 1 and counter.by_device["b-00001"] == 1
    assert server.get("/api/status")["driver"]["rollout_errors"] >= 1


def test_a_restore_of_a_copy_taken_mid_wave_resumes_the_rollout_instead_of_hanging(tmp_path, broker, keys,
                                                                                   artifact):
    """The incident: a database copy taken while wave 1's devices were in their health window,
    restored after they had finished, held the rollout at `running wave 1/2` until the wave's
    30-minute timeout (the job events after the copy were gone and devices do not send them
    again). The server asks a silent job again (the same command: the device answers with the job
    as it stands and never runs it twice), so the restored rollout completes."""
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys,
                                extra=("--requery-after", "1s"))
    server.start()
    try:
        with SimFleet(broker.host, broker.port, 4, rate=1, behaviour=_signed_behaviour(keys, health_window_s=2.0)) \
                as fleet:
            assert fleet.wait_ready() and wait_for(lambda: server.get("/api/devices?online=true")["total"] == 4)
            created = edgepack("rollout", "create", str(artifact), "--group", "sim", "--waves", "50,100",
                               env=_env(server))
            assert created.returncode == 0, created.stderr
            rollout_id = created.stdout.split()[1].rstrip(":")

            def in_health_window() -> bool:
                wave = [d for d in _rollout(server, rollout_id)["devices"] if d["wave"] == 0]
                return all(d["state"] == "active" and not d["final"] for d in wave)

            assert wait_for(in_health_window, 60, interval=0.02)
            copy = tmp_path / "mid-wave.db"
            backed_up = edgepack("fleet", "backup", "--db", server.db_url, str(copy))
            assert backed_up.returncode == 0, backed_up.stderr
            assert wait_for(lambda: fleet.final_deploys() >= 2, 30)  # wave 1 ended on the devices
            assert wait_for(lambda: _rollout(server, rollout_id)["wave"] == 1, 30)
            server.stop()
            for suffix in ("", "-wal", "-shm"):
                (server.folder / f"fleet.db{suffix}").unlink(missing_ok=True)
            copy.rename(server.folder / "fleet.db")
            server.start()
            assert _rollout(server, rollout_id)["wave"] == 0  # the copy's view: wave 1 still in its health window
            final = server.finished(rollout_id, timeout=60)
            assert final["state"] == "succeeded", final
            assert set(fleet.versions().values()) == {"1.1.0"}
            assert server.get("/api/status")["driver"]["requeried"] >= 2
    finally:
        server.stop()
