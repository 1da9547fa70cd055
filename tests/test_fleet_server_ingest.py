"""Ingest and retention on real parts: a persistent session redelivers what was not acknowledged,
junk is counted and never stored, and under constant telemetry the database stops growing."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from edgepack_core.mqtt_transport import Incoming, MqttTransport
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for
from tests.test_host_credentials import secured  # noqa: F401  (fixture: the shipped broker config with TLS)
from tools.fleet_sim import SimFleet


@pytest.fixture
def broker(mosquitto_broker):
    return mosquitto_broker


def test_manual_ack_unacknowledged_messages_come_back_to_a_persistent_session(broker):
    """What the fleet server relies on: a message handed to the handler but never acknowledged
    (the process died before its transaction committed) is delivered again on reconnect; an
    acknowledged one is not."""
    settings = broker.settings(client_id="fleet-ack-test", session_expiry=600, manual_ack=True)
    got: list[Incoming] = []

    def session() -> MqttTransport:
        transport = MqttTransport(settings)
        transport.subscribe("edgepack/v1/dev/+/job", 1, got.append)
        transport.connect_or_raise(5)
        assert wait_for(lambda: transport.is_subscribed("edgepack/v1/dev/+/job"), 5)
        return transport

    def payloads_up_to(transport: MqttTransport, marker: bytes) -> list[bytes]:
        """Publish ``marker`` and wait for it: the broker hands a resumed session what it kept
        before anything published later, so what came before the marker is all it had."""
        broker.publish([("edgepack/v1/dev/d1/job", marker)])
        assert wait_for(lambda: marker in [m.payload for m in got], 5)
        for message in got:
            transport.ack(message)  # in arrival order (MQTT 4.6)
        return [m.payload for m in got]

    first = session()
    broker.publish([("edgepack/v1/dev/d1/job", b"one"), ("edgepack/v1/dev/d1/job", b"two")])
    assert wait_for(lambda: len(got) == 2, 5)
    first.ack(got[0])  # "one" committed; "two" was not when the process went away
    first.close(timeout=1)  # the PUBACK goes out before the DISCONNECT: one queue, in order
    got.clear()
    second = session()
    assert payloads_up_to(second, b"marker-2") == [b"two", b"marker-2"]
    second.close(timeout=1)
    got.clear()
    third = session()
    assert payloads_up_to(third, b"marker-3") == [b"marker-3"]  # nothing acknowledged comes back
    third.close(timeout=1)


def test_an_ack_from_an_earlier_connection_is_void(broker):
    settings = broker.settings(client_id="fleet-ack-old", session_expiry=600, manual_ack=True)
    transport = MqttTransport(settings)
    got: list[Incoming] = []
    transport.subscribe("edgepack/v1/dev/+/job", 1, got.append)
    transport.connect_or_raise(5)
    assert wait_for(lambda: transport.is_subscribed("edgepack/v1/dev/+/job"), 5)
    broker.publish([("edgepack/v1/dev/d1/job", b"x")])
    assert wait_for(lambda: len(got) == 1, 5)
    broker.restart()  # the connection (generation) changes; the old packet id means nothing now
    assert wait_for(lambda: transport.connected, 10)
    assert wait_for(lambda: transport.is_subscribed("edgepack/v1/dev/+/job"), 10)
    broker.publish([("edgepack/v1/dev/d1/job", b"y")])
    assert wait_for(lambda: len(got) == 2, 5)
    stale, fresh = got
    assert stale.generation < fresh.generation
    assert transport.ack(stale) is False  # must not acknowledge whatever now holds its packet id
    assert transport.ack(fresh) is True
    transport.close(timeout=1)


@pytest.fixture
def keys(tmp_path: Path, keypair):
    return make_keys(tmp_path / "keys", release=keypair)


def test_junk_is_counted_by_reason_and_never_stored(tmp_path, broker, keys):
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys).start()
    try:
        state = {"schema": "edgepack.state/1", "device": "d1", "status": "online", "ts": 1.0}
        broker.publish([
            ("edgepack/v1/dev/d1/telemetry", b"not json"),
            ("edgepack/v1/dev/d1/telemetry", json.dumps({"schema": "edgepack.telemetry/1", "device": "d2"}).encode()),
            ("edgepack/v1/dev/d1/telemetry", b"[1]"),
            ("edgepack/v1/dev/d1/state", json.dumps({**state, "device": "other"}).encode()),
            ("edgepack/v1/dev/d1/job", json.dumps({"schema": "edgepack.job/1", "job": "../../x"}).encode()),
            ("edgepack/v1/dev/d1/telemetry", b"x" * 70000),
        ])
        dropped = wait_for(lambda: (lambda s: s if sum(s["ingest"]["dropped"].values()) == 6 else None)(
            server.get("/api/status")), 10)
        assert dropped is not None
        assert dropped["ingest"]["dropped"] == {"not_json": 1, "device_mismatch": 2, "bad_schema": 2, "too_large": 1}
        assert dropped["ingest"]["stored"].get("telemetry", 0) == 0
        assert server.get("/api/devices")["total"] == 0
    finally:
        server.stop()


def _sizes(database: Path) -> tuple[int, int, int]:
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=10) as connection:
        raw = connection.execute("SELECT count(*) FROM telemetry_raw").fetchone()[0]
        rolled = connection.execute("SELECT count(*) FROM telemetry_rollup").fetchone()[0]
        pages = connection.execute("PRAGMA page_count").fetchone()[0]
    return raw, rolled, pages


@pytest.mark.slow
def test_under_constant_telemetry_the_database_stops_growing(tmp_path, broker, keys):
    """200 messages a second for 18 s with a 3 s raw window, 1 s rollups kept 6 s and pruning every
    second: the row counts settle at what the windows hold, and so does the database file."""
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys,
                                extra=("--retention-raw", "3s", "--rollup-step", "1", "--retention-rollups", "6s",
                                       "--prune-interval", "1s")).start()
    database = server.folder / "fleet.db"
    samples: list[tuple[float, int, int, int]] = []
    try:
        with SimFleet(broker.host, broker.port, 20, rate=10) as fleet:
            started = time.monotonic()
            while time.monotonic() - started < 18:
                samples.append((time.monotonic() - started, *_sizes(database)))
                time.sleep(0.5)
            sent = fleet.telemetry_sent
        stored = wait_for(lambda: (lambda s: s if s >= sent else None)(
            server.get("/api/status")["ingest"]["stored"].get("telemetry", 0)), 15)
        assert stored == sent  # nothing lost on the way in
    finally:
        server.stop()
    settled = [s for s in samples if s[0] >= 8]
    growing = [s for s in samples if 4 <= s[0] < 11]
    assert max(s[1] for s in settled) <= 200 * 6, settled  # raw: 3 s window, + a bucket, + a pruning interval
    assert max(s[2] for s in settled) <= 20 * 9, settled  # rollups: 6 s of 1 s buckets for 20 devices, + slack
    assert min(s[2] for s in settled) >= 20 * 3  # and rollups are really being kept
    # The file: freed pages are reused, so the last seconds need no more pages than the middle ones.
    assert max(s[3] for s in samples if s[0] >= 13) <= max(s[3] for s in growing) * 1.1 + 8, samples


def test_the_server_logs_in_as_the_shipped_acls_operator_over_tls(tmp_path, secured, keys):  # noqa: F811
    """Against mosquitto with the shipped config, password file and ACL (TLS listener on): the
    operator account may join the telemetry share group, read states and jobs, and its server
    stores what a device (logged in under its own name) publishes."""
    server = FleetServerProcess(tmp_path / "server", broker=secured.tls_args()[1], keys=keys,
                                extra=tuple(secured.tls_args()[2:])).start()
    try:
        device = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="pi-07", protocol=mqtt.MQTTv5)
        device.username_pw_set("pi-07", "pw-07")
        device.connect("127.0.0.1", secured.broker.port)
        device.loop_start()
        state = {"schema": "edgepack.state/1", "device": "pi-07", "status": "online", "ts": time.time(),
                 "groups": ["kitchen"], "model": {"name": "scale", "version": "1.0.0"}}
        telemetry = {"schema": "edgepack.telemetry/1", "device": "pi-07", "seq": 1, "latency_ms": {"p50": 3.0},
                     "inferences": {"interval": 5, "total": 5}}
        device.publish("edgepack/v1/dev/pi-07/state", json.dumps(state), qos=1, retain=True).wait_for_publish(5)
        device.publish("edgepack/v1/dev/pi-07/telemetry", json.dumps(telemetry), qos=1).wait_for_publish(5)
        stored = wait_for(lambda: (lambda d: d if d["total"] == 1 and d["devices"][0]["latency_ms"]["p50"] == 3.0
                                   else None)(server.get("/api/devices")), 15)
        assert stored is not None and stored["devices"][0]["groups"] == ["kitchen"]
        assert server.get("/api/status")["ingest"]["stored"]["telemetry"] == 1
        device.disconnect()
        device.loop_stop()
    finally:
        server.stop()


def test_a_stale_retained_state_does_not_make_a_device_look_online(tmp_path, broker, keys):
    """The broker replays retained states to every new subscriber: a device whose last word was an
    "online" birth an hour ago (and nothing since) is not online just because the server started."""
    hour_ago = time.time() - 3600
    state = {"schema": "edgepack.state/1", "device": "old-1", "status": "online", "ts": hour_ago}
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="old-1", protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    client.publish("edgepack/v1/dev/old-1/state", json.dumps(state), qos=1, retain=True).wait_for_publish(5)
    client.disconnect()
    client.loop_stop()
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys).start()
    try:
        device = wait_for(lambda: (lambda d: d["devices"][0] if d["total"] == 1 else None)(
            server.get("/api/devices")), 10)
        assert device["status"] == "online" and device["online"] is False
        assert abs(device["last_seen"] - hour_ago) < 1
    finally:
        server.stop()
