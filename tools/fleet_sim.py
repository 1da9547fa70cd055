"""Simulate a fleet: N devices, each with its own MQTT connection, birth/last will and telemetry.

One thread drives every simulated device's paho client through a selector (paho's external
event loop: ``loop_read``/``loop_write``/``loop_misc``), so 1,000 devices cost 1,000 sockets,
not 1,000 threads. Each device publishes a retained "online" state, then telemetry at
``--rate`` messages per second with a sequence number, QoS 1. A checker connection counts what
arrives per device, so the run reports loss exactly; ``edgepack fleet status --json`` is then
run against the same broker to show it sees every device.

    python tools/fleet_sim.py --devices 1000 --rate 1 --duration 30 --start-broker
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from device_agent.mqtt.topics import Topics  # noqa: E402

STATE_SCHEMA = "edgepack.state/1"
TELEMETRY_SCHEMA = "edgepack.telemetry/1"


def _nodelay(_client: Any, _userdata: Any, sock: Any) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(needed, soft), hard), hard))


class SimDevice:
    def __init__(self, index: int, topics: Topics, host: str, port: int) -> None:
        self.device = f"sim-{index:05d}"
        self.topics = topics
        self.seq = 0
        self.acked = 0
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.device, protocol=mqtt.MQTTv5)
        self.client.on_socket_open = _nodelay
        self.client.on_publish = self._on_publish
        self.client.max_queued_messages_set(0)
        self.client.max_inflight_messages_set(100)
        self.client.will_set(topics.state(self.device), self._state("offline"), qos=1, retain=True)
        self.client.connect(host, port, keepalive=60)

    def _on_publish(self, *_args: Any) -> None:
        self.acked += 1

    def _state(self, status: str) -> bytes:
        doc = {"schema": STATE_SCHEMA, "device": self.device, "status": status, "ts": time.time(),
               "groups": ["sim"], "capabilities": {"arch": platform.machine(), "profile": "x86", "simulated": True},
               "model": {"name": "sim-model", "version": "1.0.0"}, "provider": "CPUExecutionProvider"}
        if status == "offline":
            doc["reason"] = "last will"
        return json.dumps(doc).encode()

    def birth(self) -> None:
        self.client.publish(self.topics.state(self.device), self._state("online"), qos=1, retain=True)

    def telemetry(self) -> None:
        self.seq += 1
        latency = random.lognormvariate(1.0, 0.3)
        doc = {"schema": TELEMETRY_SCHEMA, "device": self.device, "seq": self.seq, "ts": time.time(),
               "model": {"name": "sim-model", "version": "1.0.0"}, "provider": "CPUExecutionProvider",
               "inferences": {"interval": 10, "total": 10 * self.seq}, "errors": {},
               "latency_ms": {"p50": round(latency, 3), "p90": round(latency * 1.4, 3), "p99": round(latency * 2, 3)},
               "queue": {"depth": 0, "dropped": 0}}
        self.client.publish(self.topics.telemetry(self.device), json.dumps(doc).encode(), qos=1)


class Checker:
    """Counts telemetry per device on a separate connection (QoS 1)."""

    def __init__(self, topics: Topics, host: str, port: int) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="fleet-sim-checker",
                                  protocol=mqtt.MQTTv5)
        self.client.on_socket_open = _nodelay
        self.client.on_connect = lambda c, *_: (c.subscribe(topics.all_of("telemetry"), qos=1), self.ready.set())
        self.client.on_message = self._on_message
        self.client.connect(host, port, keepalive=60)
        self.client.loop_start()

    def _on_message(self, _c: Any, _u: Any, message: Any) -> None:
        device = message.topic.split("/")[-2]
        with self.lock:
            self.counts[device] = self.counts.get(device, 0) + 1

    def total(self) -> int:
        with self.lock:
            return sum(self.counts.values())


def _pump(devices: list[SimDevice], selector: selectors.BaseSelector, timeout: float) -> None:
    """One round of socket I/O for every simulated device (writes first, then whatever is readable)."""
    for dev in devices:
        if dev.client.want_write():
            dev.client.loop_write()
    for key, _events in selector.select(timeout=timeout):
        key.data.client.loop_read()


def drive(devices: list[SimDevice], rate: float, duration: float) -> dict[str, float]:
    selector = selectors.DefaultSelector()
    for dev in devices:
        selector.register(dev.client.socket(), selectors.EVENT_READ, dev)
    for dev in devices:
        dev.birth()
    started = time.monotonic()
    period = 1.0 / rate
    # Spread devices evenly over one period so the broker sees a steady stream, not bursts.
    next_due = [started + period * i / len(devices) for i in range(len(devices))]
    last_misc = started
    while True:
        now = time.monotonic()
        if now - started >= duration:
            break
        for i, dev in enumerate(devices):
            if now >= next_due[i]:
                dev.telemetry()
                next_due[i] += period
        _pump(devices, selector, 0.002)
        if now - last_misc >= 1.0:
            for dev in devices:
                dev.client.loop_misc()
            last_misc = now
    # Drain: wait for every QoS 1 PUBACK.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(d.acked < d.seq + 1 for d in devices):
        _pump(devices, selector, 0.01)
    elapsed = time.monotonic() - started
    return {"elapsed_s": elapsed}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--rate", type=float, default=1.0, help="telemetry messages per second per device")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--broker", default=None, help="HOST:PORT of a running broker")
    parser.add_argument("--start-broker", action="store_true", help="start a local mosquitto for the run")
    parser.add_argument("--topic-root", default="edgepack/v1")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    if not args.broker and not args.start_broker:
        parser.error("give --broker HOST:PORT or --start-broker")

    raise_fd_limit(2 * args.devices + 256)  # our sockets, and a broker started from here
    broker = None
    if args.start_broker:
        from tests.broker import start_mosquitto

        broker = start_mosquitto()
        host, port = broker.host, broker.port
    else:
        host, _, port_text = args.broker.rpartition(":")
        port = int(port_text)
    topics = Topics(args.topic_root)
    try:
        checker = Checker(topics, host, port)
        checker.ready.wait(5)
        connect_started = time.monotonic()
        devices = [SimDevice(i, topics, host, port) for i in range(args.devices)]
        connect_s = time.monotonic() - connect_started
        cpu_before = os.times()
        timing = drive(devices, args.rate, args.duration)
        cpu = os.times()
        deadline = time.monotonic() + 30
        sent = sum(d.seq for d in devices)
        while checker.total() < sent and time.monotonic() < deadline:
            time.sleep(0.05)
        received = checker.total()
        status = subprocess.run(
            [str(Path(sys.executable).parent / "edgepack"), "fleet", "status", "--broker", f"{host}:{port}",
             "--json", "--wait", "10", "--topic-root", args.topic_root],
            capture_output=True, text=True, timeout=60,
        )
        fleet = json.loads(status.stdout) if status.returncode == 0 else {"devices": [], "error": status.stderr}
        result = {
            "devices": args.devices,
            "rate_per_device": args.rate,
            "duration_s": round(timing["elapsed_s"], 2),
            "connect_s": round(connect_s, 2),
            "sent": sent,
            "received": received,
            "lost": sent - received,
            "throughput_msg_s": round(received / timing["elapsed_s"], 1),
            "sim_cpu_s": round((cpu.user - cpu_before.user) + (cpu.system - cpu_before.system), 2),
            "fleet_status_devices": len(fleet.get("devices", [])),
            "fleet_status_online": fleet.get("online", 0),
        }
        for dev in devices:
            dev.client.disconnect()
        checker.client.loop_stop()
    finally:
        if broker is not None:
            broker.stop()
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    ok = result["lost"] == 0 and result["fleet_status_devices"] == args.devices
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
