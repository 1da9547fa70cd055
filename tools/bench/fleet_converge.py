"""A target change in 3 waves over a simulated fleet with faults: does it converge, and how fast.

Starts its own mosquitto and a real ``edgepack fleet serve`` (SQLite in a temp dir), then N
tools/fleet_sim.py devices in this process (group ``bench``, model ``scale`` 1.0.0, telemetry
at ``--rate`` Hz, real downloads verified with the release key so each device reports the model
file hash of what it installed). ``--faults`` of them get one fault each (power cut mid-download,
link loss, disk full, a version that fails its health window; tools/fleet_sim.py). Once every
device is online it runs

    edgepack target set --group bench scale-1.1.0.edgepkg --waves 5,25,100 --success-share S

and waits until every device has settled: no job in progress on any device and the server's
view of each device equal to the simulator's. Then it counts, from the server's
``GET /api/targets/groups/bench`` and ``GET /api/devices``:

- healthy devices on target (``converged``), against the rule: at least 99.9 %;
- faulted devices on target or on their last good version (1.0.0): all of them;
- unknown: a device the server sees offline, on another version, or on a version the simulator
  says it does not run: 0;

and prints the time from ``target set`` to convergence, and the server's ingest rate
(``/api/status`` ``ingest.rate_per_s``) and ingest lag (``last_lag_s``, ``max_lag_s`` since the
server started, and the largest ``last_lag_s`` sampled while the change converged).
``--runs`` repeats the whole run (a new broker, server and fleet each time) and prints medians.

    .venv/bin/python tools/bench/fleet_converge.py --devices 1000 --faults 0.05 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from edgepack_core.signing import TrustStore  # noqa: E402
from sdk.keys import write_keypair  # noqa: E402
from tests.artifacts import build_artifact  # noqa: E402
from tests.broker import start_mosquitto  # noqa: E402
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for  # noqa: E402
from tools.fleet_sim import Behaviour, SimFleet, assign_faults, raise_fd_limit  # noqa: E402

GROUP = "bench"
OLD, NEW = "1.0.0", "1.1.0"
HEALTHY_SHARE = 0.999


@dataclass(frozen=True)
class Outcome:
    """One run's figures (what the convergence rule is judged on)."""

    devices: int
    faulted: int
    healthy_on_target: int
    faulted_on_target: int
    faulted_on_last_good: int
    unknown: int
    converge_s: float
    rollout_state: str
    ingest_rate_per_s: float
    ingest_last_lag_s: float
    ingest_max_lag_s: float
    ingest_lag_in_change_s: float = 0.0  # the largest last_lag_s sampled from target set to converged
    rollout_reason: str = ""  # why the staged rollout ended as it did (the server's words)

    @property
    def holds(self) -> bool:
        healthy = self.devices - self.faulted
        # A staged change whose rollout failed did not change the target: the rule is not met,
        # even where the rollout had moved every healthy device before it failed.
        return (self.rollout_state == "succeeded" and self.healthy_on_target >= HEALTHY_SHARE * healthy
                and self.unknown == 0
                and self.faulted_on_target + self.faulted_on_last_good == self.faulted)


def judge(states: dict[str, str], versions: dict[str, str | None], online: dict[str, bool],
          truth: dict[str, str], faulted: set[str]) -> dict[str, int]:
    """Count the outcome from the server's view (``states``: device -> converged/send/wait,
    ``versions``, ``online``) against the simulator's ``truth`` (device -> version it runs). Pure."""
    counts = {"healthy_on_target": 0, "faulted_on_target": 0, "faulted_on_last_good": 0, "unknown": 0}
    for device, version in truth.items():
        seen = versions.get(device)
        if not online.get(device) or seen != version or seen not in (OLD, NEW):
            counts["unknown"] += 1
        elif device not in faulted:
            counts["healthy_on_target"] += states.get(device) == "converged" and seen == NEW
        elif states.get(device) == "converged" and seen == NEW:
            counts["faulted_on_target"] += 1
        else:
            counts["faulted_on_last_good"] += seen == OLD
    return counts


def _server_view(server: FleetServerProcess) -> tuple[dict[str, str], dict[str, str | None], dict[str, bool]]:
    states = {d["device"]: d["state"] for d in server.get(f"/api/targets/groups/{GROUP}")["devices"]}
    versions: dict[str, str | None] = {}
    online: dict[str, bool] = {}
    offset = 0
    while True:
        page = server.get(f"/api/devices?limit=1000&offset={offset}")
        for row in page["devices"]:
            versions[row["id"]] = row.get("version")
            online[row["id"]] = bool(row.get("online"))
        offset += len(page["devices"])
        if not page["devices"] or offset >= page["total"]:
            return states, versions, online


def _settled(fleet: SimFleet, server: FleetServerProcess) -> bool:
    """No device busy or off the broker, and the server sees every device as the simulator does."""
    if any(d.dark or any(not j.final for j in list(d.jobs.values())) for d in fleet.devices):
        return False
    rollouts = server.get("/api/rollouts")["rollouts"]
    if not rollouts or any(r["state"] not in ("succeeded", "failed", "aborted") for r in rollouts):
        return False  # before the staged change ends, a device without a target counts converged
    states, versions, online = _server_view(server)
    reasons = {d["device"]: d["reason"] for d in server.get(f"/api/targets/groups/{GROUP}")["devices"]}
    truth = fleet.versions()
    if any(versions.get(d) != v or not online.get(d) for d, v in truth.items()):
        return False
    faulted = set(fleet.faulted())
    # A healthy device not yet converged is still on its way (the reconciler's next round); a
    # faulted one has settled once converged or once the server will not send it the artifact again.
    return all(states.get(d) == "converged" and truth[d] == NEW for d in truth if d not in faulted) and \
        all(states.get(d) == "converged" or "rejected" in reasons.get(d, "") for d in faulted)


def run_once(args: argparse.Namespace, folder: Path) -> Outcome:
    raise_fd_limit(4 * args.devices + 512)
    release = folder / "release.key", folder / "release.pub"
    write_keypair(*release)
    keys = make_keys(folder / "keys", release=release)
    artifact = build_artifact(folder / "art", release[0], version=NEW)
    broker = start_mosquitto(workdir=folder / "mosquitto")
    server = FleetServerProcess(folder / "server", broker=broker.address, keys=keys,
                                extra=("--silence", "120s", "--max-connections", str(max(1000, args.devices)))
                                ).start(timeout=60)
    env = {**os.environ, "EDGEPACK_SERVER": server.url, "EDGEPACK_SERVER_TOKEN_FILE": str(keys.token_file)}
    behaviour = Behaviour(groups=(GROUP,), model_name="scale", model_version=OLD, fetch=True,
                          release_trust=TrustStore.from_paths([release[1]]),
                          operator_trust=TrustStore.from_paths([keys.operator_pub]),
                          faults=assign_faults(args.devices, args.faults, args.seed), outage_s=args.outage,
                          health_window_s=args.health_window)
    try:
        with SimFleet(broker.host, broker.port, args.devices, rate=args.rate, prefix="bench",
                      behaviour=behaviour) as fleet:
            if not (fleet.wait_ready(120) and wait_for(
                    lambda: server.get(f"/api/devices?group={GROUP}&online=true")["total"] == args.devices, 300)):
                raise RuntimeError("the simulated devices did not all come online")
            started = time.monotonic()
            setter = subprocess.run(
                [str(Path(sys.executable).parent / "edgepack"), "target", "set", "--group", GROUP, str(artifact),
                 "--waves", "5,25,100", "--success-share", str(args.success_share), "--wave-timeout",
                 str(args.wave_timeout), "--json"],
                capture_output=True, text=True, env=env, timeout=120)
            if setter.returncode != 0:
                raise RuntimeError(f"target set failed: {setter.stderr[-500:]}")
            lags: list[float] = []

            def settled() -> bool:
                lags.append(float(server.get("/api/status")["ingest"]["last_lag_s"]))
                return _settled(fleet, server)

            if not wait_for(settled, args.timeout, interval=0.25):
                raise RuntimeError(f"the fleet did not settle in {args.timeout:g} s")
            converge_s = time.monotonic() - started
            counts = judge(*_server_view(server), fleet.versions(), set(fleet.faulted()))
            rollouts = [server.get(f"/api/rollouts/{r['id']}") for r in server.get("/api/rollouts")["rollouts"]]
            ingest = server.get("/api/status")["ingest"]
    finally:
        server.stop()
        broker.stop()
    return Outcome(args.devices, len(behaviour.faults), counts["healthy_on_target"], counts["faulted_on_target"],
                   counts["faulted_on_last_good"], counts["unknown"], round(converge_s, 2),
                   rollouts[0]["state"] if rollouts else "none", float(ingest["rate_per_s"]),
                   float(ingest["last_lag_s"]), float(ingest["max_lag_s"]), max(lags),
                   str(rollouts[0].get("reason") or "") if rollouts else "")


def _median(outcomes: list[Outcome], name: str) -> float:
    return round(statistics.median(getattr(o, name) for o in outcomes), 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--faults", type=float, default=0.05, help="share of the devices given a fault")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--rate", type=float, default=0.2, help="telemetry messages per second per device")
    parser.add_argument("--outage", type=float, default=5.0, help="seconds a power cut or link loss lasts")
    parser.add_argument("--health-window", type=float, default=1.0)
    parser.add_argument("--success-share", type=float, default=0.8, help="share of a wave that must end active")
    parser.add_argument("--wave-timeout", type=float, default=300.0,
                        help="seconds a device has to answer finally (its answer can wait in the ingest lag)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a run may take to settle")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    outcomes = []
    for number in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="fleet-converge-") as folder:
            outcome = run_once(args, Path(folder))
        outcomes.append(outcome)
        print(f"run {number + 1}: {json.dumps({**asdict(outcome), 'holds': outcome.holds})}", flush=True)
    healthy = args.devices - outcomes[0].faulted
    rows: list[tuple[str, Any]] = [
        ("devices / faulted", f"{args.devices} / {outcomes[0].faulted}"),
        ("healthy on target", " / ".join(f"{o.healthy_on_target}/{healthy}" for o in outcomes)),
        ("faulted on target / on last good", " / ".join(f"{o.faulted_on_target}+{o.faulted_on_last_good}"
                                                        for o in outcomes)),
        ("unknown", " / ".join(str(o.unknown) for o in outcomes)),
        ("staged rollout", " / ".join(o.rollout_state for o in outcomes)),
        ("time to converge (median)", f"{_median(outcomes, 'converge_s')} s"),
        ("ingest rate (median)", f"{_median(outcomes, 'ingest_rate_per_s')} msg/s"),
        ("ingest lag last / max (median)", f"{_median(outcomes, 'ingest_last_lag_s')} / "
                                           f"{_median(outcomes, 'ingest_max_lag_s')} s"),
        ("ingest lag during the change, max", f"{_median(outcomes, 'ingest_lag_in_change_s')} s (median)"),
        ("rule holds", all(o.holds for o in outcomes)),
    ]
    for name, value in rows:
        print(f"{name:>34}: {value}")
    print(json.dumps({"devices": args.devices, "runs": [asdict(o) for o in outcomes],
                      "load_avg": os.getloadavg()}))
    return 0 if all(o.holds for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
