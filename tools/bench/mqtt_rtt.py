"""QoS 1 request/response round trip over a local mosquitto, with Nagle's algorithm on and off.

Why this exists: a small MQTT publish written while the previous segment is still unacknowledged
waits under Nagle's algorithm until the ACK comes, and the peer delays that ACK (40 ms on Linux).
A request/response exchange then costs tens of milliseconds where the network needs a fraction of
one. MqttTransport and the sample broker config both set TCP_NODELAY; this script shows why,
on this machine, for each combination of client and broker setting.

    python tools/bench/mqtt_rtt.py [--rounds 200]

Needs mosquitto installed and the dev dependencies (it reuses the test helpers' broker starter).
Only loopback traffic: a broker on 127.0.0.1 started and stopped by the script.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from edgepack_core.mqtt_transport import Incoming, MqttTransport
from tests.broker import start_mosquitto, wait_until

REQUEST, RESPONSE = "bench/rtt/request", "bench/rtt/response"


def measure(rounds: int, *, client_nodelay: bool, broker_nodelay: bool, workdir: Path) -> list[float]:
    """Seconds per QoS 1 request -> response round trip, one exchange at a time."""
    broker = start_mosquitto(workdir=workdir, tcp_nodelay=broker_nodelay)
    responder = MqttTransport(broker.settings(client_id="responder", tcp_nodelay=client_nodelay))
    requester = MqttTransport(broker.settings(client_id="requester", tcp_nodelay=client_nodelay))
    answered = threading.Event()

    def answer(message: Incoming) -> None:
        responder.publish(RESPONSE, message.payload, qos=1)

    responder.subscribe(REQUEST, 1, answer)
    requester.subscribe(RESPONSE, 1, lambda message: answered.set())
    samples: list[float] = []
    try:
        for transport, topic in ((responder, REQUEST), (requester, RESPONSE)):
            transport.start()
            if not wait_until(lambda t=transport, f=topic: t.is_subscribed(f), timeout=10):
                raise SystemExit(f"could not connect to the benchmark broker: {transport.last_error}")
        for index in range(rounds + 10):
            answered.clear()
            started = time.perf_counter()
            requester.publish(REQUEST, b"%d" % index, qos=1)
            if not answered.wait(5):
                raise SystemExit("no response within 5 s")
            if index >= 10:  # the first exchanges warm up both connections
                samples.append(time.perf_counter() - started)
    finally:
        requester.close()
        responder.close()
        broker.stop()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200, help="exchanges per configuration (default 200)")
    args = parser.parse_args()
    print(f"QoS 1 request/response round trip, {args.rounds} exchanges each, mosquitto on loopback")
    print(f"{'client TCP_NODELAY':>18} {'broker set_tcp_nodelay':>22} {'median ms':>10} {'p90 ms':>8} {'max ms':>8}")
    with tempfile.TemporaryDirectory(prefix="mqtt-rtt-") as tmp:
        for number, (client, broker) in enumerate([(True, True), (False, False), (True, False), (False, True)]):
            workdir = Path(tmp) / str(number)
            samples = measure(args.rounds, client_nodelay=client, broker_nodelay=broker, workdir=workdir)
            ordered = sorted(samples)
            p90 = ordered[int(0.9 * (len(ordered) - 1))]
            print(f"{'on' if client else 'off':>18} {'on' if broker else 'off':>22} "
                  f"{statistics.median(samples) * 1000:>10.3f} {p90 * 1000:>8.3f} {ordered[-1] * 1000:>8.3f}")


if __name__ == "__main__":
    main()
