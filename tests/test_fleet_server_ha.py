"""Two `edgepack fleet serve` processes on one PostgreSQL (Debian's package, started by the test on a
free port) and one mosquitto: the shared subscription splits telemetry between them with nothing
lost, whichever holds the lease drives rollouts, and when the leader is killed (-9) mid-rollout the
other takes over within 10 s and finishes it, with no device commanded twice."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgepack_core.signing import TrustStore
from tests.artifacts import build_artifact
from tests.broker import free_port, port_accepts
from tests.fleet_server_process import CommandCounter, FleetServerProcess, edgepack, make_keys, wait_for
from tests.postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)
from tools.fleet_sim import Behaviour, SimFleet

pytestmark = pytest.mark.slow


@pytest.fixture
def broker(mosquitto_broker):
    return mosquitto_broker


@pytest.fixture
def cdn(tmp_path: Path):
    """The artifact store both servers share (as on NFS), served by a plain static HTTP server
    (as a CDN or object store would): what --public-url points devices to."""
    shared = tmp_path / "shared-artifacts"
    shared.mkdir()
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                                "--directory", str(shared)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    assert wait_for(lambda: port_accepts(port), 10)
    yield shared, f"http://127.0.0.1:{port}"
    process.kill()
    process.wait(5)


@pytest.fixture
def pair(tmp_path: Path, broker, keypair, postgres_url, cdn):  # noqa: F811
    keys = make_keys(tmp_path / "keys", release=keypair)
    shared, public_url = cdn
    servers = [FleetServerProcess(tmp_path / name, broker=broker.address, keys=keys, db_url=postgres_url,
                                  server_id=name, artifacts=shared,
                                  extra=("--lease-ttl", "4s", "--resend-after", "3s", "--public-url", public_url))
               for name in ("alpha", "beta")]
    for server in servers:
        server.start()
    yield servers
    for server in servers:
        server.stop()


def _stored(server: FleetServerProcess) -> int:
    return server.get("/api/status")["ingest"]["stored"].get("telemetry", 0)


def test_two_servers_split_telemetry_and_lose_none(pair, broker):
    alpha, beta = pair
    with SimFleet(broker.host, broker.port, 20, rate=5) as fleet:
        assert wait_for(lambda: alpha.get("/api/devices?online=true")["total"] == 20, 30)
        assert wait_for(lambda: fleet.telemetry_sent >= 500, 60)  # about 5 s of 20 devices at 5 a second
        sent = fleet.telemetry_sent
    assert wait_for(lambda: _stored(alpha) + _stored(beta) >= sent, 20)
    split = (_stored(alpha), _stored(beta))
    assert sum(split) == sent, split  # every message stored exactly once, by one of the two
    assert min(split) > 0.2 * sent, split  # and both took a real share
    # one database: both servers answer with the whole fleet
    assert beta.get("/api/devices")["total"] == alpha.get("/api/devices")["total"] == 20


def test_the_other_server_takes_over_a_rollout_within_ten_seconds_of_a_kill_9(pair, broker, keypair, tmp_path):
    alpha, beta = pair
    artifact = build_artifact(tmp_path / "arts", keypair[0], version="1.1.0")
    counter = CommandCounter(broker.port)
    behaviour = Behaviour(operator_trust=TrustStore.from_paths([alpha.keys.operator_pub]), fetch=True,
                          health_window_s=1.5)
    try:
        with SimFleet(broker.host, broker.port, 20, rate=1, behaviour=behaviour) as fleet:
            assert fleet.wait_ready() and wait_for(lambda: alpha.get("/api/devices?online=true")["total"] == 20)
            leader = wait_for(lambda: next((s for s in pair if s.get("/api/status")["leader"]), None), 15)
            follower = beta if leader is alpha else alpha
            env = {"EDGEPACK_SERVER": follower.url, "EDGEPACK_SERVER_TOKEN_FILE": str(alpha.keys.token_file)}
            created = edgepack("rollout", "create", str(artifact), "--group", "sim", "--waves", "5,25,100",
                               env=env)  # made through the follower: the leader drives it all the same
            assert created.returncode == 0, created.stderr
            rollout_id = created.stdout.split()[1].rstrip(":")
            assert wait_for(lambda: leader.get(f"/api/rollouts/{rollout_id}")["wave"] == 1, 60, interval=0.02)
            leader.kill()
            killed = time.monotonic()
            assert wait_for(lambda: follower.get("/api/status")["leader"], 10, interval=0.1)
            took_over = time.monotonic() - killed
            print(f"the follower took the lease {took_over:.1f} s after the kill")
            assert took_over < 10
            final = follower.finished(rollout_id)
            assert final["state"] == "succeeded", final
            assert set(fleet.versions().values()) == {"1.1.0"}
        assert sorted(counter.by_device.values()) == [1] * 20, counter.by_device
        status = follower.get("/api/status")
        assert status["lease"]["holder"] == status["server_id"]
    finally:
        counter.close()
