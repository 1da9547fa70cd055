"""How long a pipeline's stages take: a fixed-bucket histogram per stage and one for a frame's
whole way through (``end_to_end``), read as frozen snapshots for /healthz, /metrics and
telemetry.

Bounded and cheap whatever a stream's length: a histogram is :data:`BUCKETS_S`' counts, a sum
and nothing per frame, the way Prometheus keeps one (a sample exactly on a bound counts in that
bound's bucket: ``le``). Beside the counts since the start (what /metrics exports, cumulative),
each histogram keeps the counts of the current and the previous :data:`WINDOW_S` window, so the
quantiles /healthz and telemetry show are those of the last one to two minutes: a stage that
turns slow after hours of running shows it at once, not diluted by every frame before.
Quantiles are estimated from the buckets as Prometheus' ``histogram_quantile`` does (linear
within the bucket the rank falls in), so the device's p50 and p95 and a dashboard's over its
/metrics agree. No I/O; the clock is given (``time.monotonic`` unless a test moves it).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass

BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Upper bounds (seconds) of the buckets, 1 ms to 10 s; one more bucket (+Inf) holds the rest."""
WINDOW_S = 60.0
"""The recent quantiles cover the current window and the one before it (60 to 120 s)."""


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


def _snapshot(counts: list[int], total: float) -> HistogramSnapshot:
    running, cumulative = 0, []
    for n in counts:
        running += n
        cumulative.append(running)
    return HistogramSnapshot(tuple(cumulative), total)


class _Window:
    """The counts and sum of the samples recorded in one :data:`WINDOW_S` window."""

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS_S) + 1)
        self.sum = 0.0


class Histogram:
    """A histogram being filled (by a stage's thread) and read (by /metrics' or telemetry's):
    a lock keeps each snapshot's counts and sum from the same moment. ``clock``: monotonic
    seconds, given by a test to move the windows."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._counts = [0] * (len(BUCKETS_S) + 1)
        self._sum = 0.0
        self._current, self._previous = _Window(), _Window()
        self._window_start = clock()

    def record(self, seconds: float) -> None:
        index = bisect_left(BUCKETS_S, seconds)  # the first bound >= seconds: "le"
        now = self._clock()
        with self._lock:
            self._roll(now)
            self._counts[index] += 1
            self._sum += seconds
            self._current.counts[index] += 1
            self._current.sum += seconds

    def _roll(self, now: float) -> None:
        """Start a new window when the current one is over (the lock held); one over for longer
        than a window more leaves nothing recent behind it."""
        elapsed = now - self._window_start
        if elapsed < WINDOW_S:
            return
        self._previous = self._current if elapsed < 2 * WINDOW_S else _Window()
        self._current = _Window()
        self._window_start = now - elapsed % WINDOW_S

    def snapshot(self) -> HistogramSnapshot:
        """Every sample since the start."""
        with self._lock:
            return _snapshot(list(self._counts), self._sum)

    def recent(self) -> HistogramSnapshot:
        """The samples of the current and the previous window (the last 60 to 120 s)."""
        now = self._clock()
        with self._lock:
            self._roll(now)
            counts = [a + b for a, b in zip(self._current.counts, self._previous.counts, strict=True)]
            return _snapshot(counts, self._current.sum + self._previous.sum)


@dataclass(frozen=True)
class StageLatency:
    """One stage's histogram as read once: its name in the pipeline, the model it runs, every
    sample since the start and those of the last minute or two (``recent``)."""

    name: str
    model: str
    histogram: HistogramSnapshot
    recent: HistogramSnapshot = HistogramSnapshot()


@dataclass(frozen=True)
class PipelineLatency:
    """A pipeline's stages in order, and its frames' whole way from the reader to the sinks."""

    stages: tuple[StageLatency, ...]
    end_to_end: HistogramSnapshot
    end_to_end_recent: HistogramSnapshot = HistogramSnapshot()


class LatencyRecorder:
    """A running pipeline's histograms: one per stage (by stage name) and ``end_to_end``."""

    def __init__(self, stages: tuple[tuple[str, str], ...], clock: Callable[[], float] = time.monotonic) -> None:
        """``stages``: (stage name, model) in the pipeline's order."""
        self._stages = stages
        self.by_stage = {name: Histogram(clock) for name, _ in stages}
        self.end_to_end = Histogram(clock)

    def snapshot(self) -> PipelineLatency:
        stages = tuple(StageLatency(name, model, self.by_stage[name].snapshot(), self.by_stage[name].recent())
                       for name, model in self._stages)
        return PipelineLatency(stages, self.end_to_end.snapshot(), self.end_to_end.recent())
