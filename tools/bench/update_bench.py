"""Remote-update benchmark on loopback, with a real mosquitto and the agent as a subprocess.

- command round trip: a ping on ``dev/{d}/cmd`` answered on ``dev/{d}/job`` (one connection,
  Nagle off on both sides), median and p90 over --pings;
- deploy to active: `deploy()` of a 10 MB artifact, both delivery ways (built-in HTTP server
  and chunked MQTT), health window 0, median of --deploys;
- inference latency during a swap: client-side p99 of HTTP predict requests while a deploy
  hot-swaps the model, against the p99 of an equally long steady window.

    python tools/bench/update_bench.py [--pings 300] [--deploys 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from edgepack_core.mqtt_settings import MqttSettings  # noqa: E402
from edgepack_core.mqtt_transport import Incoming, MqttTransport  # noqa: E402
from edgepack_core.protocol.messages import parse_job_event  # noqa: E402
from edgepack_core.protocol.topics import Topics  # noqa: E402
from sdk.broker import BrokerOptions  # noqa: E402
from sdk.deploy import DeployOptions, deploy  # noqa: E402
from sdk.keys import write_keypair  # noqa: E402
from tests.agent_process import AgentProcess  # noqa: E402
from tests.artifacts import build_artifact, resign_with_changes  # noqa: E402
from tests.broker import start_mosquitto  # noqa: E402


def ping_round_trips(port: int, device: str, count: int) -> list[float]:
    topics = Topics()
    transport = MqttTransport(MqttSettings(host="127.0.0.1", port=port, client_id=f"bench-{uuid.uuid4().hex[:6]}"))
    transport.start()
    transport.wait_connected(10)
    answered = threading.Event()
    waiting: dict[str, str] = {}

    def on_job(message: Incoming) -> None:
        event = parse_job_event(device, message.payload)
        if not isinstance(event, str) and event.job == waiting.get("id"):
            answered.set()

    transport.subscribe(topics.job(device), 1, on_job)
    while not transport.is_subscribed(topics.job(device)):
        time.sleep(0.01)
    times = []
    for i in range(count + 20):
        command_id = f"ping-{i}-{uuid.uuid4().hex[:6]}"
        waiting["id"] = command_id
        answered.clear()
        payload = json.dumps({"schema": "edgepack.cmd/1", "id": command_id, "type": "ping",
                              "expires_at": time.time() + 60}).encode()
        started = time.perf_counter()
        transport.publish(topics.cmd(device), payload, qos=1)
        if not answered.wait(5):
            raise RuntimeError("ping not answered")
        if i >= 20:  # warm-up
            times.append(time.perf_counter() - started)
    transport.close()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pings", type=int, default=300)
    parser.add_argument("--deploys", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edgepack-update-bench-"))
    write_keypair(folder / "k.key", folder / "k.pub")
    v1 = build_artifact(folder, folder / "k.key", version="1.0.0", factor=2.0)
    base = build_artifact(folder, folder / "k.key", version="1.1.0", factor=3.0)
    blob = np.random.default_rng(0).bytes(10 * 1024 * 1024)
    broker = start_mosquitto()
    agent = AgentProcess(folder, device="bench-01", broker_port=broker.port, trust=folder / "k.pub", artifact=v1,
                         health_window_s=0).start()
    results: dict = {}
    try:
        time.sleep(0.5)
        rtts = ping_round_trips(broker.port, "bench-01", args.pings)
        results["ping_ms"] = {"median": round(statistics.median(rtts) * 1000, 3),
                              "p90": round(float(np.percentile(rtts, 90)) * 1000, 3), "count": len(rtts)}
        ping = results["ping_ms"]
        print(f"ping round trip over MQTT: median {ping['median']} ms, p90 {ping['p90']} ms")

        version = [1, 2, 0]
        for transfer in ("http", "mqtt"):
            times = []
            for _ in range(args.deploys):
                version[1] += 1
                artifact = resign_with_changes(base, folder / f"big-{version[1]}.edgepkg", folder / "k.key",
                                               replace={"assets/blob.bin": blob},
                                               manifest_changes={"version": f"1.{version[1]}.0"})
                started = time.perf_counter()
                result = deploy(DeployOptions(artifact, BrokerOptions(broker.address), devices=("bench-01",),
                                              transfer=transfer, timeout=120, health_window_s=0))
                elapsed = time.perf_counter() - started
                if not result.succeeded:
                    raise RuntimeError(f"deploy failed: {result.jobs}")
                times.append(elapsed)
            size = artifact.stat().st_size
            results[f"deploy_{transfer}_s"] = {"median": round(statistics.median(times), 3), "runs": times,
                                               "bytes": size}
            print(f"deploy -> active, {size / 2**20:.1f} MiB over {transfer}: median {statistics.median(times):.2f} s")

        def load(seconds: float) -> list[float]:
            latencies = []
            end = time.time() + seconds
            while time.time() < end:
                t0 = time.perf_counter()
                status, _ = agent.predict([1.0, 2.0, 3.0, 4.0])
                latencies.append(time.perf_counter() - t0)
                assert status == 200
            return latencies

        steady = load(2.0)
        during: list[float] = []
        version[1] += 1
        small = resign_with_changes(base, folder / "swap.edgepkg", folder / "k.key",
                                    manifest_changes={"version": f"1.{version[1]}.0"})
        thread = threading.Thread(target=lambda: during.extend(load(2.0)))
        thread.start()
        time.sleep(0.3)
        deploy(DeployOptions(small, BrokerOptions(broker.address), devices=("bench-01",), timeout=60,
                             health_window_s=0))
        thread.join()
        p99_steady, p99_swap = float(np.percentile(steady, 99)), float(np.percentile(during, 99))
        results["swap_p99_ms"] = {"steady": round(p99_steady * 1000, 3), "during_swap": round(p99_swap * 1000, 3),
                                  "ratio": round(p99_swap / p99_steady, 3)}
        print(f"HTTP predict p99: steady {p99_steady * 1000:.2f} ms, during a swap {p99_swap * 1000:.2f} ms "
              f"({p99_swap / p99_steady:.2f}x)")
    finally:
        agent.stop()
        broker.stop()
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
