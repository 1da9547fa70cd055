"""``tools/bench/agent_rss.py --session-options``: onnxruntime's CPU memory arena and memory
pattern on the installed model, each turned off against the agent's own session options
(``device_agent/providers.py: session_options``), side by side: RSS after the session and after
the runs, the runs' median latency, and whether every answer is identical (a digest of all).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIB_PER_MIB = 1024
# The child of --session-options: the agent's session options plus one change, on the installed
# model; RSS (kB) after the session and after the runs, the runs' median latency (us), a digest
# of every answer (identical answers: identical digests).
SESSION = r"""
import hashlib, json, re, statistics, sys, time
import numpy as np, onnxruntime
from device_agent.providers import session_options
def rss():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1))
model, change, runs = json.loads(sys.stdin.read())
options = session_options(0)
for key, value in change.items():
    setattr(options, key, value)
before = rss()
session = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
made = rss()
feed = {i.name: np.random.default_rng(0).random([d if isinstance(d, int) else 1 for d in i.shape],
                                                dtype=np.float32) for i in session.get_inputs()}
digest, times = hashlib.sha256(), []
for _ in range(runs):
    start = time.perf_counter()
    outputs = session.run(None, feed)
    times.append(time.perf_counter() - start)
    for out in outputs:
        digest.update(np.ascontiguousarray(out).tobytes())
print(json.dumps([made - before, rss() - before, statistics.median(times) * 1e6, digest.hexdigest()]))
"""
SESSION_CHANGES = {
    "the agent's options": {},
    "enable_cpu_mem_arena=False": {"enable_cpu_mem_arena": False},
    "enable_mem_pattern=False": {"enable_mem_pattern": False},
    "both off": {"enable_cpu_mem_arena": False, "enable_mem_pattern": False},
}


def session_options_side_by_side(model: Path, rounds: int, runs: int = 2000) -> dict[str, dict[str, object]]:
    """Each session option change against the agent's options: RSS and latency, alternating."""
    results: dict[str, list[list[object]]] = {name: [] for name in SESSION_CHANGES}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for _ in range(rounds):
        for name, change in SESSION_CHANGES.items():
            done = subprocess.run(
                [sys.executable, "-c", SESSION],
                input=json.dumps([str(model), change, runs]),
                env=env,
                capture_output=True,
                text=True,
                check=True,
                timeout=300,
            )
            results[name].append(json.loads(done.stdout))
    digests = {run[3] for runs_of in results.values() for run in runs_of}
    return {
        name: {
            "session_mib": round(statistics.median(r[0] for r in rs) / KIB_PER_MIB, 2),
            "after_runs_mib": round(statistics.median(r[1] for r in rs) / KIB_PER_MIB, 2),
            "latency_us": round(statistics.median(r[2] for r in rs), 1),
            "answers_identical": len(digests) == 1,
        }
        for name, rs in results.items()
    }
