"""Power loss is offline (issue 24): a real agent killed with -9 under a real mosquitto and fleet
server is shown offline, with the last will's reason, within keepalive x 1.5 of its death, also
when the server that takes over (a failover: another server id, a fresh MQTT session) hears the
will only as the broker's retained message, whose ts is the connection time, before the birth."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from tests.agent_process import AgentProcess
from tests.artifacts import build_artifact
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for

pytestmark = pytest.mark.slow
KEEPALIVE_S = 5  # tests/agent_process.py's agent.yaml


def _device(server: FleetServerProcess, device: str) -> dict:
    status, doc = server.call("GET", f"/api/devices/{device}")
    return doc if status == 200 else {}  # 404 until its first state is stored


def _retained(port: int, topic: str) -> bytes:
    """The retained payload on ``topic`` now (b"" when none arrives within 2 s)."""
    got: list[bytes] = []
    arrived = threading.Event()

    def on_message(_c, _u, message) -> None:
        got.append(message.payload)
        arrived.set()

    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"peek-{time.monotonic_ns()}",
                         protocol=mqtt.MQTTv5)
    client.on_message = on_message
    client.connect("127.0.0.1", port)
    client.subscribe(topic, qos=1)
    client.loop_start()
    try:
        arrived.wait(2)
    finally:
        client.disconnect()
        client.loop_stop()
    return got[0] if got else b""


def _kill_9(agent: AgentProcess) -> None:
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(10)


@pytest.mark.parametrize("failover", [False, True], ids=["server-listening", "failover-hears-it-retained"])
def test_power_loss_is_offline_with_the_wills_reason(tmp_path: Path, mosquitto_broker, keypair, failover):
    keys = make_keys(tmp_path / "keys", release=keypair)
    artifact = build_artifact(tmp_path / "arts", keypair[0], version="1.0.0")
    database = f"sqlite:///{tmp_path / 'fleet.db'}"
    server = FleetServerProcess(tmp_path / "a", broker=mosquitto_broker.address, keys=keys, db_url=database,
                                server_id="a").start()
    agent = AgentProcess(tmp_path, device="cam-01", broker_port=mosquitto_broker.port, trust=keypair[1],
                         artifact=artifact, groups=["g"]).start()
    try:
        assert wait_for(lambda: _device(server, "cam-01").get("online") is True, 30)
        if failover:
            server.kill()
        _kill_9(agent)
        if failover:  # the will is on the broker, retained, before the other server starts
            topic = "edgepack/v1/dev/cam-01/state"
            assert wait_for(lambda: b"last will" in _retained(mosquitto_broker.port, topic), KEEPALIVE_S * 1.5 + 10)
            server = FleetServerProcess(tmp_path / "b", broker=mosquitto_broker.address, keys=keys, db_url=database,
                                        server_id="b", extra=("--per-server-urls",)).start()
        offline = wait_for(lambda: (lambda d: d if d.get("status") == "offline" else None)(_device(server, "cam-01")),
                           KEEPALIVE_S * 1.5 + 10)
        assert offline, _device(server, "cam-01")
        assert offline["online"] is False and offline["status_reason"] == "connection lost (last will)"
    finally:
        agent.stop()
        server.stop()
