"""What telemetry costs the agent: CPU time of an idle agent over --seconds with MQTT telemetry
at 1 Hz against the same agent without MQTT, both running at once on a real local mosquitto.

    python tools/bench/telemetry_cost.py [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sdk.keys import write_keypair  # noqa: E402
from tests.agent_process import AgentProcess  # noqa: E402
from tests.artifacts import build_artifact  # noqa: E402
from tests.broker import start_mosquitto  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edgepack-telemetry-bench-"))
    write_keypair(folder / "k.key", folder / "k.pub")
    artifact = build_artifact(folder, folder / "k.key")
    broker = start_mosquitto()
    with_mqtt = AgentProcess(folder, device="tele-on", broker_port=broker.port, trust=folder / "k.pub",
                             artifact=artifact)
    config = with_mqtt.config.read_text().replace("telemetry_interval: 0.5", "telemetry_interval: 1")
    with_mqtt.config.write_text(config)
    without = AgentProcess(folder, device="tele-off", broker_port=broker.port, trust=folder / "k.pub",
                           artifact=artifact)
    without.config.write_text("\n".join(line for line in without.config.read_text().splitlines()
                                        if not line.startswith(("mqtt:", "updates:"))) + "\n")
    try:
        with_mqtt.start()
        without.start()
        time.sleep(2.0)  # past start-up
        assert with_mqtt.proc is not None and without.proc is not None
        start = {p.pid: cpu_seconds(p.pid) for p in (with_mqtt.proc, without.proc)}
        time.sleep(args.seconds)
        used = {pid: cpu_seconds(pid) - value for pid, value in start.items()}
    finally:
        with_mqtt.stop()
        without.stop()
        broker.stop()
    on, off = used[with_mqtt.proc.pid], used[without.proc.pid]
    result = {"seconds": args.seconds, "cpu_with_telemetry_s": round(on, 3), "cpu_without_s": round(off, 3),
              "telemetry_percent_of_one_core": round((on - off) / args.seconds * 100, 3),
              "agent_with_telemetry_percent_of_one_core": round(on / args.seconds * 100, 3)}
    print(f"idle agent over {args.seconds:.0f} s: {on:.2f} s CPU with telemetry at 1 Hz, {off:.2f} s without "
          f"-> telemetry costs {(on - off) / args.seconds * 100:.2f}% of one core")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
