"""How long a pipeline's stages take: a fixed-bucket histogram per stage and one for a frame's
whole way through (``end_to_end``), read as frozen snapshots for /healthz, /metrics and
telemetry.

Bounded and cheap whatever a stream's length: a histogram is :data:`BUCKETS_S`' counts, a sum
and nothing per frame, the way Prometheus keeps one (a sample exactly on a bound counts in that
bound's bucket: ``le``). Quantiles are estimated from the buckets as Prometheus'
``histogram_quantile`` does (linear within the bucket the rank falls in), so the device's p50
and p95 and a dashboard's over its /metrics agree. Pure: no clock, no I/O.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass

BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the buckets, 1 ms to 10 s; one more bucket (+Inf) holds the rest."""


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram as read once: ``cumulative[i]`` samples at most ``BUCKETS_S[i]`` (the last
    entry, +Inf, is every sample) and their ``sum_s``."""

    cumulative: tuple[int, ...] = (0,) * (len(BUCKETS_S) + 1)
    sum_s: float = 0.0

    @property
    def count(self) -> int:
        return self.cumulative[-1]

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0 < q <= 1) in seconds, estimated from the buckets; None when
        empty. A rank in the +Inf bucket reads as the last bound (nothing better is known)."""
        if not 0 < q <= 1:
            raise ValueError(f"quantile {q} is not in (0, 1]")
        if self.count == 0:
            return None
        rank = q * self.count
        index = next(i for i, c in enumerate(self.cumulative) if c >= rank)
        if index == len(BUCKETS_S):
            return BUCKETS_S[-1]
        below = self.cumulative[index - 1] if index else 0
        start = BUCKETS_S[index - 1] if index else 0.0
        return start + (BUCKETS_S[index] - start) * (rank - below) / (self.cumulative[index] - below)

    def quantile_ms(self, q: float) -> float | None:
        """:meth:`quantile` in milliseconds rounded to 0.01 ms (an estimate: no finer is meant)."""
        seconds = self.quantile(q)
        return None if seconds is None else round(seconds * 1000, 2)


class Histogram:
    """A histogram being filled (by a stage's thread) and read (by /metrics' or telemetry's):
    a lock keeps each snapshot's counts and sum from the same moment."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * (len(BUCKETS_S) + 1)
        self._sum = 0.0

    def record(self, seconds: float) -> None:
        index = bisect_left(BUCKETS_S, seconds)  # the first bound >= seconds: "le"
        with self._lock:
            self._counts[index] += 1
            self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        with self._lock:
            counts, total = list(self._counts), self._sum
        running, cumulative = 0, []
        for n in counts:
            running += n
            cumulative.append(running)
        return HistogramSnapshot(tuple(cumulative), total)


@dataclass(frozen=True)
class StageLatency:
    """One stage's histogram as read once: its name in the pipeline and the model it runs."""

    name: str
    model: str
    histogram: HistogramSnapshot


@dataclass(frozen=True)
class PipelineLatency:
    """A pipeline's stages in order, and its frames' whole way from the reader to the sinks."""

    stages: tuple[StageLatency, ...]
    end_to_end: HistogramSnapshot


class LatencyRecorder:
    """A running pipeline's histograms: one per stage (by stage name) and ``end_to_end``."""

    def __init__(self, stages: tuple[tuple[str, str], ...]) -> None:
        """``stages``: (stage name, model) in the pipeline's order."""
        self._stages = stages
        self.by_stage = {name: Histogram() for name, _ in stages}
        self.end_to_end = Histogram()

    def snapshot(self) -> PipelineLatency:
        return PipelineLatency(tuple(StageLatency(name, model, self.by_stage[name].snapshot())
                                     for name, model in self._stages), self.end_to_end.snapshot())
