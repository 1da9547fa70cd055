"""The fleet server under a simulated fleet: loss, fleet-list latency and ingest lag at 1 Hz.

Each step starts its own mosquitto and a real ``edgepack fleet serve`` on SQLite (a temp dir),
then tools/fleet_sim.py devices in a child process (their own interpreter, so the simulator
and this script's clients do not share a GIL): every device connects, publishes its retained
state, then telemetry at ``--rate`` messages per second, QoS 1. While they run, this script

- asks ``GET /api/devices`` (the fleet list, the API's default page of 1,000) every
  ``--api-interval`` seconds on one keep-alive connection and keeps the wall time from the
  request to the answer's last byte (p50/p95/max over the steady phase, after every device
  is online; each answer is decoded and its length checked, outside the timing);
- measures the **ingest lag** end to end with one extra probe device publishing at 5 Hz: a
  telemetry message with ``inferences.total = k`` is sent at t_k, and the API is polled
  (every 100 ms) until ``GET /api/devices/bench-probe`` reports ``inferences_total >= k``: broker,
  server queue, batch commit and read together (100 ms resolution). The server's own
  receipt-to-commit figure from ``/metrics`` is printed beside it;
- after the simulator stops (every message PUBACKed by the broker), counts the **rows stored**
  in ``telemetry_raw`` for the simulated devices (and distinct (device, seq) pairs), against
  the messages the simulator sent: ``lost = sent - distinct rows``.

The simulator runs in one child process per 1,000 messages a second (one interpreter keeps
that rate on one core), on the same CPUs as the server and the broker and at the same
priority (``--sim-nice`` 0): a conservative setup, since real devices are elsewhere. Whether
it kept its rate is checked: the rate it really sent is printed, and a shortfall of more than
5 % fails the step, naming the simulator rather than the server.

A step *holds* when nothing is lost, the fleet-list p95 is under 200 ms and the ingest lag's
p95 under 2 s. ``--find-max`` then steps the fleet up (``--step`` devices at a time) until a
step does not hold, and says which figure failed and whether the simulator itself kept its
rate (on a small machine the simulator can run out of CPU before the server does).

    .venv/bin/python tools/bench/fleet_server.py --devices 1000 --duration 60 [--find-max]

Needs mosquitto and the server and dev extras. Loopback only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import paho.mqtt.client as mqtt  # noqa: E402

from tests.broker import start_mosquitto  # noqa: E402
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for  # noqa: E402
from tools.fleet_sim import Behaviour, Scheduler, SimDevice, drive, raise_fd_limit  # noqa: E402

TOPIC_ROOT = "edgepack/v1"
PROBE = "bench-probe"
PROBE_HZ = 5.0
SIM_MSGS_PER_PROCESS = 1000  # telemetry messages a second one simulator process is asked for
POLL_S = 0.1  # the probe's API poll: the lag's resolution, and 10 requests a second of load
API_TARGET_P95_S = 0.200
LAG_TARGET_S = 2.0


def percentile(values: list[float], share: float) -> float:
    """Nearest-rank percentile (``share`` in 0..1) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-share * len(ordered) // 1))))
    return ordered[rank - 1]


# --------------------------------------------------------------------------- the simulator child


def sim_child(spec: str) -> int:
    """Run in the child process: connect the devices, say so, drive them, print the count."""
    args = json.loads(spec)
    raise_fd_limit(2 * args["devices"] + 256)
    from edgepack_core.protocol.topics import Topics

    topics = Topics(TOPIC_ROOT)
    scheduler = Scheduler()
    devices = [SimDevice(i, topics, args["host"], args["port"], prefix=args["prefix"],
                         behaviour=Behaviour(groups=("bench",)), scheduler=scheduler)
               for i in range(args["first"], args["first"] + args["devices"])]
    print(json.dumps({"event": "connected"}), flush=True)
    cpu = os.times()
    timing = drive(devices, args["rate"], args["duration"], scheduler=scheduler)
    used = os.times()
    print(json.dumps({"event": "done", "sent": sum(d.seq for d in devices),
                      "acked": sum(d.acked for d in devices), "expected": sum(d.expected_acks for d in devices),
                      "elapsed_s": timing["elapsed_s"],
                      "cpu_s": (used.user - cpu.user) + (used.system - cpu.system)}), flush=True)
    for device in devices:
        device.client.disconnect()
    return 0


class Simulators:
    """The simulated fleet split over ``processes`` children (one interpreter drives about
    1,000 devices at 1 Hz on one core; more need more processes)."""

    def __init__(self, devices: int, processes: int, *, rate: float, duration: float, host: str, port: int,
                 nice: int) -> None:
        share = -(-devices // processes)
        self.children: list[subprocess.Popen] = []
        for first in range(0, devices, share):
            spec = json.dumps({"first": first, "devices": min(share, devices - first), "rate": rate,
                               "duration": duration, "host": host, "port": port, "prefix": "sim"})
            self.children.append(subprocess.Popen(
                [sys.executable, __file__, "--sim-child", spec], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                preexec_fn=(lambda: os.nice(nice)) if nice else None))

    def _line(self, child: subprocess.Popen) -> dict[str, Any]:
        assert child.stdout is not None
        return json.loads(child.stdout.readline() or "{}")

    def wait_connected(self) -> None:
        if any(self._line(child).get("event") != "connected" for child in self.children):
            raise SystemExit("a simulator did not connect")

    def wait_done(self) -> dict[str, float]:
        """Every child's count, summed (elapsed: the longest)."""
        done = [self._line(child) for child in self.children]
        if any(d.get("event") != "done" for d in done):
            raise SystemExit("a simulator did not finish")
        for child in self.children:
            child.wait(60)
        return {"sent": sum(d["sent"] for d in done), "acked": sum(d["acked"] for d in done),
                "expected": sum(d["expected"] for d in done), "cpu_s": sum(d["cpu_s"] for d in done),
                "elapsed_s": max(d["elapsed_s"] for d in done)}

    def kill(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()
                child.wait(10)


# --------------------------------------------------------------------------- measuring clients


class Probe:
    """One device publishing at PROBE_HZ; the API is polled until each message shows."""

    def __init__(self, broker_host: str, broker_port: int, server: FleetServerProcess) -> None:
        self.server = server
        self.sent_at: dict[int, float] = {}
        self.lags: list[float] = []
        self.stop = threading.Event()
        self.measuring = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=PROBE, protocol=mqtt.MQTTv5)
        self.client.connect(broker_host, broker_port)
        self.client.loop_start()
        self.threads = [threading.Thread(target=self._publish, daemon=True),
                        threading.Thread(target=self._poll, daemon=True)]

    def start(self) -> Probe:
        for thread in self.threads:
            thread.start()
        return self

    def _publish(self) -> None:
        state = {"schema": "edgepack.state/1", "device": PROBE, "status": "online", "ts": time.time(),
                 "groups": ["probe"], "model": {"name": "probe", "version": "1", "sha256": "0" * 64}}
        self.client.publish(f"{TOPIC_ROOT}/dev/{PROBE}/state", json.dumps(state), qos=1, retain=True)
        seq = 0
        next_at = time.monotonic()
        while not self.stop.is_set():
            seq += 1
            doc = {"schema": "edgepack.telemetry/1", "device": PROBE, "seq": seq, "ts": time.time(),
                   "interval_s": 1 / PROBE_HZ, "inferences": {"interval": 1, "total": seq}}
            self.sent_at[seq] = time.monotonic()
            self.client.publish(f"{TOPIC_ROOT}/dev/{PROBE}/telemetry", json.dumps(doc), qos=1)
            next_at += 1 / PROBE_HZ
            self.stop.wait(max(0.0, next_at - time.monotonic()))

    def _poll(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
        headers = {"Authorization": f"Bearer {self.server.keys.token}"}
        seen = 0
        while not self.stop.is_set():
            try:
                connection.request("GET", f"/api/devices/{PROBE}", headers=headers)
                answer = connection.getresponse()
                body = answer.read()
            except (OSError, http.client.HTTPException):
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
                continue
            now = time.monotonic()
            if answer.status == 200:
                total = json.loads(body).get("inferences_total") or 0
                if self.measuring.is_set():
                    self.lags.extend(now - self.sent_at[k] for k in range(seen + 1, total + 1) if k in self.sent_at)
                seen = max(seen, total)
            self.stop.wait(POLL_S)
        connection.close()

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(10)
        self.client.loop_stop()
        self.client.disconnect()


class ListPoller:
    """GET /api/devices on one keep-alive connection, every ``interval`` seconds."""

    def __init__(self, server: FleetServerProcess, interval: float) -> None:
        self.server = server
        self.interval = interval
        self.samples: list[float] = []
        self.sizes: list[int] = []
        self.errors = 0
        self.stop = threading.Event()
        self.measuring = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
        headers = {"Authorization": f"Bearer {self.server.keys.token}"}
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                connection.request("GET", "/api/devices", headers=headers)
                answer = connection.getresponse()
                body = answer.read()
                took = time.perf_counter() - started  # to the last byte, as HTTP load tools count it
                doc = json.loads(body)
                ok = answer.status == 200
            except (OSError, http.client.HTTPException, ValueError):
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", self.server.port, timeout=30)
                ok, doc, took = False, {}, time.perf_counter() - started
            if self.measuring.is_set():
                if ok:
                    self.samples.append(took)
                    self.sizes.append(len(doc["devices"]))
                else:
                    self.errors += 1
            self.stop.wait(max(0.0, self.interval - took))
        connection.close()


# --------------------------------------------------------------------------- one step


@dataclass
class StepResult:
    devices: int
    rate: float
    duration_s: float
    tree: str = "working tree"
    sent: int = 0
    acked: int = 0
    publishes: int = 0  # births and telemetry: what the broker had to acknowledge
    stored_rows: int = 0
    stored_distinct: int = 0
    lost: int = 0
    sim_send_rate: float = 0.0
    sim_cpu_s: float = 0.0
    api_p50_ms: float = 0.0
    api_p95_ms: float = 0.0
    api_max_ms: float = 0.0
    api_samples: int = 0
    api_errors: int = 0
    lag_p50_s: float = 0.0
    lag_p95_s: float = 0.0
    lag_max_s: float = 0.0
    lag_samples: int = 0
    server_commit_lag_max_s: float = 0.0
    drain_s: float = 0.0
    online_after_s: float = 0.0
    server_cpu_s: float = 0.0
    server_cpu_us_per_msg: float = 0.0  # everything the server did while measured, per telemetry message
    broker_cpu_s: float = 0.0
    load_average: tuple[float, float, float] = (0.0, 0.0, 0.0)
    failed: list[str] = field(default_factory=list)

    def holds(self) -> bool:
        return not self.failed


def _count_rows(db_path: Path, prefix: str) -> tuple[int, int]:
    connection = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=30)
    try:
        return connection.execute(
            "SELECT count(*), count(DISTINCT device || ':' || seq) FROM telemetry_raw WHERE device LIKE ?",
            (f"{prefix}-%",)).fetchone()
    finally:
        connection.close()


def _cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a running process (/proc/PID/stat, clock ticks)."""
    fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


def _metric(server: FleetServerProcess, name: str) -> float:
    _status, text = server.call("GET", "/metrics")
    for line in (text.decode() if isinstance(text, bytes) else str(text)).splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def _py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """py-spy sampling the server into a collapsed-stack file: only the thread holding the GIL
    (``--gil``), so the samples say where the interpreter's time goes, not who waits for it."""
    spy = Path(sys.executable).parent / "py-spy"
    return subprocess.Popen([str(spy), "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "50",
                             "--threads", "--gil", "--format", "raw", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _check_tree(folder: Path) -> None:
    """The server's interpreter really imports ``sdk`` from ``folder`` (the editable install of
    this checkout must not win)."""
    found = subprocess.run([sys.executable, "-c", "import sdk.fleet_server.ingest as m; print(m.__file__)"],
                           capture_output=True, text=True, cwd=tempfile.gettempdir(), check=True,
                           env={**os.environ, "PYTHONPATH": str(folder)}).stdout.strip()
    if not Path(found).is_relative_to(folder):
        raise SystemExit(f"--tree {folder}: the server would import {found}")


def run_step(devices: int, rate: float, duration: float, api_interval: float, workdir: Path,
             profile: Path | None = None, sim_nice: int = 0, tree: tuple[str, Path] | None = None,
             broker_extra: str = "") -> StepResult:
    """One measured run; ``tree`` = (name, folder): the server imports its code from that
    folder (PYTHONPATH) instead of this checkout, for side-by-side comparisons."""
    result = StepResult(devices, rate, duration, tree=tree[0] if tree else "working tree")
    if tree:
        _check_tree(tree[1])
    prefix = "sim"
    raise_fd_limit(3 * devices + 512)
    broker = start_mosquitto(broker_extra, workdir=workdir / "mosquitto")
    # the defaults of `edgepack fleet serve` (the test helper's quicker tick and silence are overridden)
    server = FleetServerProcess(workdir / "server", broker=broker.address, keys=make_keys(workdir / "keys"),
                                extra=("--tick", "0.5s", "--silence", "60s"))
    sim: Simulators | None = None
    probe: Probe | None = None
    poller: ListPoller | None = None
    try:
        server.start(60, env={"PYTHONPATH": str(tree[1])} if tree else None)
        sim = Simulators(devices, max(1, -(-int(devices * rate) // SIM_MSGS_PER_PROCESS)), rate=rate,
                         duration=duration, host=broker.host, port=broker.port, nice=sim_nice)
        sim.wait_connected()
        started = time.monotonic()
        probe = Probe(broker.host, broker.port, server).start()
        poller = ListPoller(server, api_interval)
        poller.thread.start()
        online = wait_for(lambda: server.get("/api/devices?limit=1&group=bench&online=true")["total"] >= devices,
                          timeout=min(60.0, duration / 2), interval=0.2)
        result.online_after_s = round(time.monotonic() - started, 2)
        if not online:
            result.failed.append(f"only {server.get('/api/devices?limit=1&online=true')['total']} devices online "
                                 f"after {result.online_after_s} s")
        cpu_server, cpu_broker = _cpu_seconds(server.proc.pid), _cpu_seconds(broker.process.pid)
        measured_from = time.monotonic()
        spy = _py_spy(server.proc.pid, max(5.0, duration - result.online_after_s - 5), profile) if profile else None
        probe.measuring.set()
        poller.measuring.set()
        done = sim.wait_done()
        probe.measuring.clear()
        poller.measuring.clear()
        measured_s = time.monotonic() - measured_from
        result.server_cpu_s = round(_cpu_seconds(server.proc.pid) - cpu_server, 1)
        result.server_cpu_us_per_msg = round(1e6 * result.server_cpu_s / max(1.0, devices * rate * measured_s), 1)
        result.broker_cpu_s = round(_cpu_seconds(broker.process.pid) - cpu_broker, 1)
        result.load_average = tuple(round(x, 2) for x in os.getloadavg())  # type: ignore[assignment]
        if spy is not None:
            spy.wait(120)
        result.sent, result.acked, result.publishes = done["sent"], done["acked"], done["expected"]
        result.sim_send_rate = round(done["sent"] / done["elapsed_s"], 1)
        result.sim_cpu_s = round(done["cpu_s"], 1)
        drain_from = time.monotonic()
        db = workdir / "server" / "fleet.db"
        wait_for(lambda: _count_rows(db, prefix)[1] >= result.sent, timeout=60, interval=0.25)
        result.drain_s = round(time.monotonic() - drain_from, 2)
        result.stored_rows, result.stored_distinct = _count_rows(db, prefix)
        result.lost = result.sent - result.stored_distinct
        result.server_commit_lag_max_s = _metric(server, "edgepack_fleet_ingest_lag_max_seconds")
        api = poller.samples
        if api:
            result.api_p50_ms = round(1000 * statistics.median(api), 1)
            result.api_p95_ms = round(1000 * percentile(api, 0.95), 1)
            result.api_max_ms = round(1000 * max(api), 1)
        result.api_samples, result.api_errors = len(api), poller.errors
        lags = probe.lags
        if lags:
            result.lag_p50_s = round(statistics.median(lags), 3)
            result.lag_p95_s = round(percentile(lags, 0.95), 3)
            result.lag_max_s = round(max(lags), 3)
        result.lag_samples = len(lags)
        _judge(result, measured_s)
    finally:
        for closer in (probe.close if probe else None, poller.stop.set if poller else None):
            if closer:
                closer()
        if sim is not None:
            sim.kill()
        server.stop()
        broker.kill()
    return result


def _judge(result: StepResult, measured_s: float) -> None:
    if result.acked < result.publishes:
        result.failed.append(f"the broker acknowledged {result.acked} of {result.publishes} publishes")
    if result.lost:
        result.failed.append(f"{result.lost} of {result.sent} telemetry messages not stored")
    if not result.api_samples or result.api_p95_ms >= 1000 * API_TARGET_P95_S:
        result.failed.append(f"fleet list p95 {result.api_p95_ms} ms (target < {1000 * API_TARGET_P95_S:.0f} ms)")
    if not result.lag_samples or result.lag_p95_s >= LAG_TARGET_S:
        result.failed.append(f"ingest lag p95 {result.lag_p95_s} s (target < {LAG_TARGET_S} s)")
    expected_rate = result.devices * result.rate
    if result.sim_send_rate < 0.95 * expected_rate:
        result.failed.append(f"the simulator sent {result.sim_send_rate} msg/s of {expected_rate:.0f} "
                             f"(it ran out of CPU: sim {result.sim_cpu_s} CPU s in {measured_s:.0f} s)")


def report(result: StepResult) -> str:
    verdict = "holds" if result.holds() else "DOES NOT HOLD: " + "; ".join(result.failed)
    return "\n".join([
        f"{result.devices} devices at {result.rate:g} Hz for {result.duration_s:g} s ({result.tree}): {verdict}",
        f"  telemetry sent {result.sent} (broker acked {result.acked} of {result.publishes} publishes), "
        f"rows stored {result.stored_rows}, "
        f"distinct (device, seq) {result.stored_distinct}, lost {result.lost}; stored all {result.drain_s} s "
        f"after the simulator stopped",
        f"  simulator: {result.sim_send_rate} msg/s sent, {result.sim_cpu_s} CPU s; every device online "
        f"{result.online_after_s} s after connecting",
        f"  GET /api/devices (fleet list, {result.devices} devices): p50 {result.api_p50_ms} ms, "
        f"p95 {result.api_p95_ms} ms, max {result.api_max_ms} ms over {result.api_samples} requests "
        f"({result.api_errors} errors)",
        f"  ingest lag (publish -> visible in the API): p50 {result.lag_p50_s} s, p95 {result.lag_p95_s} s, "
        f"max {result.lag_max_s} s over {result.lag_samples} probe messages; server receipt -> commit max "
        f"{result.server_commit_lag_max_s:.3f} s",
        f"  CPU while measured: server {result.server_cpu_s} s ({result.server_cpu_us_per_msg} us per telemetry "
        f"message, API requests included), mosquitto {result.broker_cpu_s} s; "
        f"load average {result.load_average[0]} (1 min) on {os.cpu_count()} CPUs",
    ])


def _tree(text: str) -> tuple[str, Path]:
    name, sep, folder = text.partition("=")
    path = Path(folder).resolve()
    if not sep or not name or not (path / "sdk" / "fleet_server").is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=FOLDER, FOLDER holding sdk/ and edgepack_core/")
    return name, path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=1.0, help="telemetry messages per second per device")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds the simulator publishes per step")
    parser.add_argument("--api-interval", type=float, default=1.0,
                        help="seconds between two fleet-list requests (a dashboard open on the fleet page asks "
                             "every 5 s)")
    parser.add_argument("--find-max", action="store_true", help="then step the fleet up until a step fails")
    parser.add_argument("--step", type=int, default=1000, help="devices added per step of --find-max")
    parser.add_argument("--max-devices", type=int, default=10000)
    parser.add_argument("--step-duration", type=float, default=30.0, help="seconds per --find-max step")
    parser.add_argument("--sim-nice", type=int, default=0,
                        help="niceness of the simulator processes (default 0: they compete with the server for "
                             "this machine's CPUs on equal terms, the conservative choice)")
    parser.add_argument("--tree", type=_tree, action="append", default=[],
                        help="NAME=FOLDER: also run the server from a copy of the code in FOLDER (its sdk/ and "
                             "edgepack_core/), alternating with this checkout, and compare medians (repeatable)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the first step per tree (with --tree)")
    parser.add_argument("--broker-inflight", type=int,
                        help="max_inflight_messages of the broker (default: mosquitto's 20, as in "
                             "deploy/mosquitto/mosquitto.conf)")
    parser.add_argument("--json", type=Path, help="also write every step's figures to this file")
    parser.add_argument("--py-spy", type=Path, help="profile the server of the first step with py-spy into this "
                                                     "file (collapsed stacks; needs py-spy in the venv)")
    return parser


def _broker_extra(args: argparse.Namespace) -> str:
    return "" if args.broker_inflight is None else f"max_inflight_messages {args.broker_inflight}\n"


def _compare(results: list[StepResult]) -> str:
    """Medians per tree, for runs that alternated between trees on one machine."""
    lines = ["medians per tree (alternating runs):"]
    for name in dict.fromkeys(r.tree for r in results):
        mine = [r for r in results if r.tree == name]
        median = {key: statistics.median(getattr(r, key) for r in mine)
                  for key in ("api_p95_ms", "lag_p50_s", "lag_p95_s", "lag_max_s", "server_cpu_us_per_msg")}
        lines.append(f"  {name}: {len(mine)} runs, lost {sum(r.lost for r in mine)}, fleet list p95 "
                     f"{median['api_p95_ms']:.1f} ms, ingest lag p50 {median['lag_p50_s']:.3f} s / p95 "
                     f"{median['lag_p95_s']:.3f} s / max {median['lag_max_s']:.3f} s, server "
                     f"{median['server_cpu_us_per_msg']:.0f} us CPU per message")
    return "\n".join(lines)


def _find_max(args: argparse.Namespace, folder: Path, first: StepResult, results: list[StepResult]) -> int:
    """Step the fleet up from ``first`` until a step does not hold; the largest that held."""
    size, last = args.devices, first
    largest = size if first.holds() else 0
    while last.holds() and size + args.step <= args.max_devices:
        size += args.step
        last = run_step(size, args.rate, args.step_duration, args.api_interval, folder / f"s{size}",
                        sim_nice=args.sim_nice, broker_extra=_broker_extra(args))
        results.append(last)
        print(report(last), flush=True)
        if last.holds():
            largest = size
    return largest


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--sim-child":
        return sim_child(sys.argv[2])
    parser = _parser()
    args = parser.parse_args()
    if args.devices < 1 or args.rate <= 0 or args.duration < 10 or args.repeat < 1:
        parser.error("--devices >= 1, --rate > 0, --duration >= 10, --repeat >= 1")
    results: list[StepResult] = []
    trees: list[tuple[str, Path] | None] = [None, *args.tree]
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as name:
        folder = Path(name)
        for run in range(args.repeat if args.tree else 1):
            for tree in trees:
                result = run_step(args.devices, args.rate, args.duration, args.api_interval,
                                  folder / f"main-{run}-{tree[0] if tree else 'checkout'}",
                                  profile=args.py_spy if not results else None, sim_nice=args.sim_nice, tree=tree,
                                  broker_extra=_broker_extra(args))
                results.append(result)
                print(report(result), flush=True)
        if args.tree:
            print(_compare(results), flush=True)
        first = results[0]
        if args.find_max:
            largest = _find_max(args, folder, first, results)
            print(f"largest fleet held at {args.rate:g} Hz with 0 loss and both targets met: "
                  f"{largest} devices (steps of {args.step})", flush=True)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return 0 if first.holds() else 1


if __name__ == "__main__":
    sys.exit(main())
