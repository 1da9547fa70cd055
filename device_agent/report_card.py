"""The report card a model earns at activation: measured on this device, after the smoke test.

``runtime.load_model(..., report_card=True)`` (the daemon's every load: first start, install,
update, rollback) measures, for the model it loaded:

- p50/p99 latency over the golden samples: at most :data:`MAX_RUNS` session runs, cycling
  through the samples, and no new run once :data:`BUDGET_S` seconds have gone by or the next
  run would pass them (its cost estimated by the slowest run so far), so a slow model delays
  its activation by at most the budget, or by one run when a single run is longer (its cost
  is known already: the smoke test ran it);
- time to first inference: from the load start to the first golden answer (provider choice,
  session creation and the first run, as a restart pays them);
- peak RSS: the process's high-water mark after the load (``VmHWM`` of /proc/self/status, or
  ``ru_maxrss`` where there is no /proc);
- the share of the session's nodes on an accelerated provider, from onnxruntime's session
  profile of the smoke test (every executed kernel names its provider; onnxruntime 1.16 writes
  the same ``provider`` argument as 1.32). Profiling stops at :func:`node_providers`, before the
  latency runs, so they are not slowed.

The decisions (percentiles, the share, when to stop) are pure functions tested alone.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgepack_core.protocol.report_card import ReportCard
from edgepack_core.targets import CPU

MAX_RUNS = 20
BUDGET_S = 2.0
MAX_PROFILE_BYTES = 64 * 1024 * 1024  # a profile of the smoke test's few runs is far smaller
_KERNEL_SUFFIX = "_kernel_time"


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile (0 < q <= 100) of a non-empty list. Pure."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def node_share(assignment: Mapping[str, str], provider: str) -> tuple[int, int, float]:
    """(nodes, nodes on an accelerated provider, their share) of a node -> provider assignment.
    Pure. A session on the CPU provider has nothing accelerated (share 0); otherwise a node
    counts when its provider is not the CPU's (onnxruntime puts what the accelerator cannot run
    on the CPU provider behind it)."""
    nodes = len(assignment)
    if provider == CPU or nodes == 0:
        return nodes, 0, 0.0
    accelerated = sum(1 for used in assignment.values() if used != CPU)
    return nodes, accelerated, accelerated / nodes


def should_stop(runs: int, elapsed_s: float, slowest_s: float, *, max_runs: int = MAX_RUNS,
                budget_s: float = BUDGET_S) -> bool:
    """Whether the latency runs stop before another one. Pure: at least one run; never more than
    ``max_runs``; none that would end past ``budget_s`` by the slowest run so far."""
    if runs == 0:
        return False
    return runs >= max_runs or elapsed_s + slowest_s > budget_s


def measure_latency(run: Callable[[Mapping[str, np.ndarray]], Any], feeds: Sequence[Mapping[str, np.ndarray]],
                    *, max_runs: int = MAX_RUNS, budget_s: float = BUDGET_S,
                    clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], bool]:
    """Seconds of each run of ``feeds`` in turn, and whether the budget stopped them early."""
    times: list[float] = []
    started = clock()
    while not should_stop(len(times), clock() - started, max(times, default=0.0), max_runs=max_runs,
                          budget_s=budget_s):
        before = clock()
        run(feeds[len(times) % len(feeds)])
        times.append(clock() - before)
    return times, len(times) < max_runs


def parse_profile(events: Any) -> dict[str, str]:
    """Node -> provider from onnxruntime's profile (a JSON list of events): the ``Node`` events
    of kernels (``<node>_kernel_time``), each naming its provider. Pure; {} for anything else."""
    if not isinstance(events, list):
        return {}
    assignment: dict[str, str] = {}
    for event in events:
        if not isinstance(event, dict) or event.get("cat") != "Node":
            continue
        name, args = event.get("name"), event.get("args")
        provider = args.get("provider") if isinstance(args, dict) else None
        if isinstance(name, str) and name.endswith(_KERNEL_SUFFIX) and isinstance(provider, str):
            assignment[name[: -len(_KERNEL_SUFFIX)]] = provider
    return assignment


def node_providers(session: Any) -> dict[str, str]:
    """End the session's profiling (it runs no further) and read which provider ran each node;
    {} when the session was not profiling or the file cannot be read. The file is removed."""
    path = session.end_profiling()
    if not path:
        return {}
    profile = Path(path)
    try:
        with profile.open("rb") as handle:
            data = handle.read(MAX_PROFILE_BYTES + 1)
        return parse_profile(json.loads(data)) if len(data) <= MAX_PROFILE_BYTES else {}
    except (OSError, ValueError):
        return {}
    finally:
        profile.unlink(missing_ok=True)


def peak_rss_bytes(status: Path = Path("/proc/self/status")) -> int | None:
    """The process's peak resident set: ``VmHWM`` where /proc has it, else ``ru_maxrss``
    (KiB on Linux, bytes on macOS)."""
    try:
        for line in status.read_text(encoding="ascii", errors="replace").splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024 if peak > 0 else None


def golden_feeds(root: Path, samples: Sequence[Mapping[str, Any]]) -> list[dict[str, np.ndarray]]:
    """The golden samples' inputs (the smoke test read them already: they are sound)."""
    feeds = []
    for sample in samples:
        with np.load(root / sample["inputs"], allow_pickle=False) as archive:
            feeds.append({name: archive[name] for name in archive.files})
    return feeds


def build_card(provider: str, feeds: Sequence[Mapping[str, np.ndarray]],
               run: Callable[[Mapping[str, np.ndarray]], Any], *, first_inference_s: float | None,
               assignment: Mapping[str, str]) -> ReportCard:
    """Measure the latency runs and put the card together (the first answer and the node
    assignment were taken during the load)."""
    times, budget_hit = measure_latency(run, feeds) if feeds else ([], False)
    nodes, accelerated, share = node_share(assignment, provider)
    ms = [t * 1000 for t in times]
    return ReportCard(
        provider=provider, runs=len(times), p50_ms=round(percentile(ms, 50), 4) if ms else None,
        p99_ms=round(percentile(ms, 99), 4) if ms else None,
        first_inference_ms=None if first_inference_s is None else round(first_inference_s * 1000, 3),
        peak_rss_bytes=peak_rss_bytes(), nodes=nodes if assignment else None,
        accelerated_nodes=accelerated if assignment else None,
        accelerated_share=round(share, 4) if assignment or provider == CPU else None,
        measured_at=round(time.time(), 3), budget_hit=budget_hit)


def profile_prefix(directory: str) -> str:
    """Where onnxruntime writes a profile (``<prefix>_<date>.json``), inside ``directory``."""
    return os.path.join(directory, "report-card")
