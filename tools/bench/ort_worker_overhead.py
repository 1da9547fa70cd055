"""What the onnxruntime worker process costs a build.

Two measurements:

1. ``edgepack build recipes/mobilenet.yaml --allow-external-paths`` wall time (a fresh CLI process each time, worker
   start-up included) in one or more source trees, interleaved run by run so machine drift
   hits every tree alike: give the tree before the worker and the tree after it
   (``git worktree add``) to see the difference.
   Wall time and CPU time (the CLI process and its worker; less sensitive to a busy machine).
   With ``--in-process N``: N builds after a first one inside one Python process per tree
   (the conformance driver's case, where the worker starts once).
2. In this tree, the worker's own costs: cold start (spawn to first answer), and per-sample
   ``run_feeds`` on the MobileNet-style model (a 1x3x224x224 float32 tensor over the pipe and
   back, in calls of 20 samples as validation makes them) against ``session.run`` on an
   in-process session of the same model, in alternating blocks.

    python tools/bench/ort_worker_overhead.py --tree before=/tmp/before --tree after=. --runs 7

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _ensure_demo(tree: Path) -> None:
    if not (tree / "demo" / "mobilenet" / "model.onnx").exists():
        subprocess.run([sys.executable, "tools/build_demos.py", "--out", "demo", "--only", "mobilenet"], cwd=tree,
                       check=True, capture_output=True)


def _build_once(tree: Path, key: Path, out: Path) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the CLI and its worker) of one build."""
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONWARNINGS": "ignore"}
    code = "import sys; from sdk.cli import main; sys.argv[0] = 'edgepack'; main()"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code, "build", "recipes/mobilenet.yaml", "--key", str(key),
                             "-o", str(out), "-q", "--allow-external-paths"], cwd=tree, env=env,
                            capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        raise SystemExit(f"build failed in {tree}: {result.stderr.strip()}")
    return elapsed, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def build_times(trees: dict[str, Path], runs: int) -> dict[str, list[tuple[float, float]]]:
    from sdk.keys import write_keypair

    times: dict[str, list[tuple[float, float]]] = {label: [] for label in trees}
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "bench.key"
        write_keypair(key, Path(tmp) / "bench.pub")
        for tree in trees.values():
            _ensure_demo(tree)
            _build_once(tree, key, Path(tmp) / "warm.edgepkg")  # page cache and .pyc warm-up
        for _ in range(runs):
            for label, tree in trees.items():
                times[label].append(_build_once(tree, key, Path(tmp) / f"{label}.edgepkg"))
    return times


_IN_PROCESS = """
import json, os, sys, time
from pathlib import Path
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
recipe = load_recipe(Path("recipes/mobilenet.yaml"), allow_external_paths=True)
times = []
for n in range(int(sys.argv[1]) + 1):
    t0, c0 = time.perf_counter(), os.times()
    build(recipe, key_paths=[sys.argv[2]], output=Path(sys.argv[3]))
    c1 = os.times()
    cpu = c1.user + c1.system - c0.user - c0.system + c1.children_user + c1.children_system \
        - c0.children_user - c0.children_system
    times.append((time.perf_counter() - t0, cpu))
print(json.dumps(times[1:]))
"""


def in_process_times(trees: dict[str, Path], builds: int) -> dict[str, list[tuple[float, float]]]:
    """Wall time of builds after the first in one long-lived process (the conformance driver's
    case: the worker, when there is one, is already running). CPU of the worker is counted only
    when it exits, so only wall time is comparable here."""
    from sdk.keys import write_keypair

    times: dict[str, list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        key = Path(tmp) / "bench.key"
        write_keypair(key, Path(tmp) / "bench.pub")
        for label, tree in trees.items():
            _ensure_demo(tree)
            env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONWARNINGS": "ignore"}
            result = subprocess.run([sys.executable, "-c", _IN_PROCESS, str(builds), str(key),
                                     str(Path(tmp) / f"{label}.edgepkg")], cwd=tree, env=env,
                                    capture_output=True, text=True, check=True)
            times[label] = [tuple(t) for t in json.loads(result.stdout)]
    return times


def worker_costs(samples: int) -> dict[str, float]:
    import numpy as np
    import onnxruntime as ort

    from sdk.packager import ort_host

    _ensure_demo(ROOT)
    model = (ROOT / "demo" / "mobilenet" / "model.onnx").read_bytes()
    feed = {"input": np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)}
    starts = []
    for _ in range(5):
        ort_host.shutdown()
        started = time.perf_counter()
        ort_host.worker().call({"op": "ping"}, model="-", doing="ping")
        starts.append(time.perf_counter() - started)
    ort_host.run_feeds(model, [feed])  # session created and cached
    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    block = 20
    worker_times, local_times = [], []
    for _ in range(max(1, samples // block)):  # alternating blocks, so drift hits both alike
        started = time.perf_counter()
        ort_host.run_feeds(model, [feed] * block)
        worker_times.append((time.perf_counter() - started) / block)
        started = time.perf_counter()
        for _ in range(block):
            session.run(names, feed)
        local_times.append((time.perf_counter() - started) / block)
    ort_host.shutdown()
    return {"worker_start_ms": statistics.median(starts) * 1000,
            "run_feeds_ms": statistics.median(worker_times) * 1000,
            "in_process_run_ms": statistics.median(local_times) * 1000}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], metavar="LABEL=DIR",
                        help="a source tree to build in (repeat); default: this tree")
    parser.add_argument("--runs", type=int, default=5, help="builds per tree (default 5; 0: worker costs only)")
    parser.add_argument("--samples", type=int, default=200, help="run_feeds samples for the per-call cost")
    parser.add_argument("--in-process", type=int, default=0, metavar="N",
                        help="also time N builds after a first one in one process, per tree")
    args = parser.parse_args()
    trees = {label: Path(path).resolve() for label, _, path in (t.partition("=") for t in args.tree)} \
        or {"this": ROOT}
    times = build_times(trees, args.runs) if args.runs > 0 else {}
    resident = in_process_times(trees, args.in_process) if args.in_process > 0 else {}
    costs = worker_costs(args.samples)
    print(f"{'tree':<10} {'median wall s':>14} {'min':>8} {'max':>8} {'median CPU s':>13}")
    for label, values in times.items():
        walls = [w for w, _ in values]
        print(f"{label:<10} {statistics.median(walls):>14.3f} {min(walls):>8.3f} {max(walls):>8.3f} "
              f"{statistics.median(c for _, c in values):>13.3f}")
    for label, values in resident.items():
        walls = [w for w, _ in values]
        print(f"{label:<10} in one process, median wall per build {statistics.median(walls):.3f} s "
              f"(min {min(walls):.3f}, max {max(walls):.3f}, {len(walls)} builds)")
    print(f"worker cold start (spawn to first answer): {costs['worker_start_ms']:.1f} ms")
    print(f"MobileNet-style sample: run_feeds via worker {costs['run_feeds_ms']:.3f} ms, "
          f"in-process session.run {costs['in_process_run_ms']:.3f} ms")
    print(json.dumps({"build_wall_s": {k: statistics.median(w for w, _ in v) for k, v in times.items()},
                      "build_cpu_s": {k: statistics.median(c for _, c in v) for k, v in times.items()},
                      "build_runs": times, "in_process_runs": resident, **costs}))


if __name__ == "__main__":
    main()
