"""The fleet view: pure aggregation, hostile payloads, and `edgepack fleet status` on a real broker."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import paho.mqtt.client as mqtt

from edgepack_core.protocol.messages import ModelRef
from sdk.fleet import FleetView, format_table
from tests.conftest import run_cli

ROOT = "edgepack/v1"


def _state(device: str, status: str, **extra) -> bytes:
    return json.dumps({"schema": "edgepack.state/1", "device": device, "status": status, "ts": 1.0,
                       **extra}).encode()


def _telemetry(device: str, seq: int, p50: float = 1.5) -> bytes:
    return json.dumps({"schema": "edgepack.telemetry/1", "device": device, "seq": seq,
                       "latency_ms": {"p50": p50, "p99": 3.0}, "errors": {"bad_input": 2},
                       "model": {"name": "digits", "version": "1.0.0"}, "provider": "CPUExecutionProvider"}).encode()


def test_state_and_telemetry_make_one_row_per_device():
    view = FleetView()
    view.apply(f"{ROOT}/dev/pi-1/state", _state("pi-1", "online", groups=["kitchen"],
                                                 capabilities={"profile": "rpi"}), now=100)
    view.apply(f"{ROOT}/dev/pi-1/telemetry", _telemetry("pi-1", 1), now=101)
    view.apply(f"{ROOT}/dev/pi-2/state", _state("pi-2", "offline", reason="last will"), now=102)
    rows = {r.device: r for r in view.rows(now=103)}
    assert rows["pi-1"].status == "online" and rows["pi-1"].profile == "rpi" and rows["pi-1"].groups == ["kitchen"]
    assert rows["pi-1"].model == ModelRef("digits", "1.0.0")
    assert rows["pi-2"].status == "offline" and rows["pi-2"].status_reason == "last will"
    table = format_table(view.rows(now=103), now=103)
    assert "pi-1" in table and "digits 1.0.0" in table and "2 device(s), 1 online" in table


def test_silent_device_is_marked_after_the_silence_window():
    view = FleetView(silence_s=30)
    view.apply(f"{ROOT}/dev/pi-1/state", _state("pi-1", "online"), now=0)
    assert view.rows(now=29)[0].status == "online"
    row = view.rows(now=31)[0]
    assert row.status == "silent" and "31s" in row.status_reason


def test_telemetry_gaps_are_counted_from_sequence_numbers():
    view = FleetView()
    for seq in (1, 2, 5, 6):
        view.apply(f"{ROOT}/dev/d/telemetry", _telemetry("d", seq), now=seq)
    assert view.devices["d"].seq_gaps == 2 and view.devices["d"].telemetry_count == 4


def test_an_agent_restart_starts_a_new_sequence_without_hiding_later_gaps():
    view = FleetView()
    for seq in (1, 2, 3, 4, 5, 6, 1, 2, 4):  # restart after 6; then one message lost (3)
        view.apply(f"{ROOT}/dev/d/telemetry", _telemetry("d", seq), now=seq)
    assert view.devices["d"].restarts == 1 and view.devices["d"].seq_gaps == 1


def test_hostile_payloads_are_dropped_and_counted_never_raised():
    view = FleetView()
    view.apply(f"{ROOT}/dev/d/telemetry", b"\xff\xfe not json", now=1)
    view.apply(f"{ROOT}/dev/d/telemetry", b"[1, 2, 3]", now=1)
    view.apply(f"{ROOT}/dev/d/telemetry", json.dumps({"schema": "other"}).encode(), now=1)
    view.apply(f"{ROOT}/dev/d/state", b"{" + b"x" * (300 * 1024) + b"}", now=1)
    view.apply(f"{ROOT}/dev/d/state", _state("d", "maybe"), now=1)
    view.apply(f"{ROOT}/dev/bad+name/state", _state("x", "online"), now=1)
    view.apply(f"{ROOT}/dev/d/state", _state("other", "online"), now=1)
    view.apply(f"{ROOT}/dev/d/state", _state("d", "online", provider="a\ud800"), now=1)
    view.apply(f"{ROOT}/dev/d/state", _state("d", "online", groups="not-a-list", model=7), now=1)
    assert view.dropped == {"not_json": 1, "bad_schema": 3, "too_large": 1, "bad_topic": 1, "device_mismatch": 1,
                            "bad_text": 1}
    assert list(view.devices) == ["d"] and view.devices["d"].groups == []


def _publisher(port: int) -> mqtt.Client:
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-pub", protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", port)
    client.loop_start()
    return client


def test_fleet_status_reads_retained_states_and_last_will_from_a_real_broker(mosquitto_broker, tmp_path):
    pub = _publisher(mosquitto_broker.port)
    pub.publish(f"{ROOT}/dev/pi-1/state", _state("pi-1", "online"), qos=1, retain=True).wait_for_publish(5)
    pub.publish(f"{ROOT}/dev/pi-1/telemetry", _telemetry("pi-1", 1), qos=1).wait_for_publish(5)
    pub.publish(f"{ROOT}/dev/junk/state", b"not json at all", qos=1, retain=True).wait_for_publish(5)

    # A device process whose connection dies: the broker publishes its retained last will.
    script = tmp_path / "device.py"
    script.write_text(
        "import json, sys, time, paho.mqtt.client as mqtt\n"
        "c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id='pi-2', protocol=mqtt.MQTTv5)\n"
        f"c.will_set('{ROOT}/dev/pi-2/state', json.dumps({{'schema': 'edgepack.state/1', 'device': 'pi-2',"
        " 'status': 'offline', 'ts': time.time(), 'reason': 'last will'}), qos=1, retain=True)\n"
        f"c.connect('127.0.0.1', {mosquitto_broker.port}, keepalive=5)\n"
        f"c.publish('{ROOT}/dev/pi-2/state', json.dumps({{'schema': 'edgepack.state/1', 'device': 'pi-2',"
        " 'status': 'online', 'ts': time.time()}),"
        " qos=1, retain=True).wait_for_publish(5) if c.loop_start() is None else None\n"
        "print('up', flush=True); time.sleep(60)\n"
    )
    device = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert device.stdout.readline().strip() == "up"
        device.kill()
        device.wait(5)
        deadline = time.time() + 10
        rows: dict = {}
        while time.time() < deadline:
            result = run_cli("edgepack", "fleet", "status", "--broker", mosquitto_broker.address, "--json",
                             "--wait", "2")
            assert result.returncode == 0, result.stderr
            rows = {d["device"]: d for d in json.loads(result.stdout)["devices"]}
            if rows.get("pi-2", {}).get("status") == "offline":
                break
        assert rows["pi-1"]["status"] == "online"
        assert rows["pi-2"]["status"] == "offline" and rows["pi-2"]["status_reason"] == "last will"
        assert "junk" not in rows
    finally:
        device.kill()
        pub.disconnect()
        pub.loop_stop()


def test_fleet_status_with_unreachable_broker_is_one_line_exit_1():
    result = run_cli("edgepack", "fleet", "status", "--broker", "127.0.0.1:1")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "cannot reach the broker" in result.stderr


def test_fleet_sim_small_run_loses_nothing_and_status_sees_every_device(mosquitto_broker):
    sim = Path(__file__).resolve().parent.parent / "tools" / "fleet_sim.py"
    result = subprocess.run([sys.executable, str(sim), "--devices", "50", "--rate", "5", "--duration", "2",
                             "--broker", mosquitto_broker.address, "--json"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr + result.stdout
    summary = json.loads(result.stdout)
    assert summary["sent"] >= 50 * 5 and summary["lost"] == 0
    assert summary["fleet_status_devices"] == 50 and summary["fleet_status_online"] == 50


def _probe_until_joined(pub: mqtt.Client, subscribed: list[threading.Event]) -> bool:
    """Publish probes until each consumer got one: then both are in the share group, whatever the timing."""
    deadline = time.monotonic() + 10
    while not all(event.is_set() for event in subscribed) and time.monotonic() < deadline:
        pub.publish(f"{ROOT}/dev/probe/telemetry", _telemetry("probe", 0), qos=1).wait_for_publish(5)
        subscribed[0].wait(0.05)
    return all(event.is_set() for event in subscribed)


def test_shared_subscription_splits_telemetry_between_consumers(mosquitto_broker):
    """Two fleet consumers in one MQTT 5 share group each get part of the telemetry, together all."""
    from sdk.broker import BrokerOptions
    from sdk.fleet import stream_messages

    got: list[list[str]] = [[], []]
    stop = threading.Event()
    subscribed = [threading.Event(), threading.Event()]  # a probe reached this consumer

    def consume(index: int) -> None:
        for topic, payload, _ in stream_messages(BrokerOptions(mosquitto_broker.address), share="exporters"):
            if topic.endswith("/probe/telemetry"):
                subscribed[index].set()
            elif topic.endswith("/telemetry"):
                got[index].append(json.loads(payload)["device"] + f":{json.loads(payload)['seq']}")
            if stop.is_set():
                return

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    pub = _publisher(mosquitto_broker.port)
    assert _probe_until_joined(pub, subscribed), "a consumer never joined the share group"
    sent = [f"d{i % 5}:{i}" for i in range(200)]
    for i in range(200):
        pub.publish(f"{ROOT}/dev/d{i % 5}/telemetry", _telemetry(f"d{i % 5}", i), qos=1).wait_for_publish(5)
    deadline = time.time() + 10
    while len(got[0]) + len(got[1]) < 200 and time.time() < deadline:
        time.sleep(0.05)
    stop.set()
    for thread in threads:
        thread.join(5)
    pub.disconnect()
    pub.loop_stop()
    assert sorted(got[0] + got[1]) == sorted(sent), "every message delivered exactly once across the group"
    assert got[0] and got[1], "the broker should hand messages to both consumers"


def test_fleet_watch_draws_the_live_table_and_stops_after_its_duration(mosquitto_broker):
    pub = _publisher(mosquitto_broker.port)
    pub.publish(f"{ROOT}/dev/pi-3/state", _state("pi-3", "online"), qos=1, retain=True).wait_for_publish(5)
    pub.disconnect()
    pub.loop_stop()
    result = run_cli("edgepack", "fleet", "watch", "--broker", mosquitto_broker.address, "--duration", "1.5",
                     "--interval", "0.2")
    assert result.returncode == 0, result.stderr
    assert "pi-3" in result.stdout and "1 device(s), 1 online" in result.stdout
    assert "watched for" in result.stdout
