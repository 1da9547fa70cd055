"""Telemetry aggregation: a fixed-memory latency histogram and the ``edgepack.telemetry/1`` payload.

Why a log-bucket histogram and not a list of samples: the agent may run thousands of inferences
per interval for months; the histogram's memory is fixed (202 integers) whatever the rate, merging
two is adding arrays, and its percentiles carry a relative error bounded by the bucket width
(:data:`MAX_RELATIVE_ERROR`, under 5 %), which is what a latency percentile needs.

Everything here except :func:`read_system` is pure: time, system readings and queue counters are
passed in, so the aggregation is tested without clocks or /proc. The one lock only makes the
aggregator safe to feed from inference threads while the telemetry thread builds a payload.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from device_agent.memory import read_rss_bytes
from edgepack_core.protocol.messages import ModelRef, QueueCounters, Telemetry
from edgepack_core.protocol.payloads import load_schema

LOW_S = 1e-6  # first bucket edge: 1 µs
HIGH_S = 100.0  # last bucket edge: 100 s
PER_DECADE = 25
BUCKETS = PER_DECADE * round(math.log10(HIGH_S / LOW_S))  # 200 log-spaced buckets
# Reporting a bucket's geometric centre is off by at most half a bucket width (in log terms).
MAX_RELATIVE_ERROR = 10 ** (1 / (2 * PER_DECADE)) - 1  # ~4.7 %
MAX_ERROR_KINDS = 32  # fixed memory: further distinct kinds are counted under "other"


class LatencyHistogram:
    """Counts of durations in log-spaced buckets from 1 µs to 100 s, plus exact count, sum, min, max.

    Index 0 holds durations under 1 µs, index ``BUCKETS + 1`` those of 100 s and more. Estimates
    are clamped to the exact [min, max] seen, so p100 is exact and a single sample is exact.
    """

    __slots__ = ("count", "counts", "maximum", "minimum", "total")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.counts: list[int] = [0] * (BUCKETS + 2)
        self.count = 0
        self.total = 0.0
        self.minimum = math.inf
        self.maximum = 0.0

    @staticmethod
    def bucket_of(seconds: float) -> int:
        if seconds < LOW_S:
            return 0
        if seconds >= HIGH_S:
            return BUCKETS + 1
        return min(BUCKETS, 1 + int(math.log10(seconds / LOW_S) * PER_DECADE))

    @staticmethod
    def centre_of(index: int) -> float:
        """Geometric centre of bucket ``index`` (1..BUCKETS)."""
        return LOW_S * 10 ** ((index - 0.5) / PER_DECADE)

    def record(self, seconds: float) -> None:
        if not seconds >= 0.0 or math.isinf(seconds):  # also rejects NaN
            raise ValueError(f"a duration must be a finite number >= 0, got {seconds!r}")
        self.counts[self.bucket_of(seconds)] += 1
        self.count += 1
        self.total += seconds
        self.minimum = min(self.minimum, seconds)
        self.maximum = max(self.maximum, seconds)

    def percentile(self, p: float) -> float | None:
        """The nearest-rank ``p``-th percentile (0 < p <= 100) in seconds; None when empty."""
        if not 0 < p <= 100:
            raise ValueError(f"percentile {p!r} is not in (0, 100]")
        if self.count == 0:
            return None
        rank = max(1, math.ceil(p / 100 * self.count))
        if rank >= self.count:
            return self.maximum
        seen = 0
        for index, bucket_count in enumerate(self.counts):
            seen += bucket_count
            if seen >= rank:
                if index == 0:
                    estimate = self.minimum
                elif index == BUCKETS + 1:
                    estimate = self.maximum
                else:
                    estimate = self.centre_of(index)
                return min(self.maximum, max(self.minimum, estimate))
        return self.maximum

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count else None

    def merge(self, other: LatencyHistogram) -> None:
        """Add ``other``'s samples to this histogram (e.g. per-thread histograms, or intervals)."""
        for index, value in enumerate(other.counts):
            self.counts[index] += value
        self.count += other.count
        self.total += other.total
        self.minimum = min(self.minimum, other.minimum)
        self.maximum = max(self.maximum, other.maximum)

    def snapshot_and_reset(self) -> LatencyHistogram:
        """Return the samples so far as a new histogram and start this one empty (per interval)."""
        snapshot = LatencyHistogram()
        snapshot.merge(self)
        self.clear()
        return snapshot


@dataclass(frozen=True)
class ModelInfo:
    name: str
    version: str
    sha256: str


@dataclass(frozen=True)
class SystemReading:
    """One reading of the process and board. ``cpu_seconds``/``monotonic`` are kept so the next
    reading can compute ``cpu_percent`` (None on the first one: there is no interval yet)."""

    cpu_seconds: float
    monotonic: float
    cpu_percent: float | None
    memory_rss_bytes: int | None
    temperature_c: float | None


def _read_temperature(thermal: Path) -> float | None:
    """Hottest thermal zone in °C: throttling follows the hottest sensor, not the average."""
    readings: list[float] = []
    for zone in sorted(thermal.glob("thermal_zone*/temp")):
        try:
            readings.append(int(zone.read_text().strip()) / 1000.0)
        except (OSError, ValueError):
            continue
    return max(readings) if readings else None


def read_system(
    previous: SystemReading | None = None,
    *,
    proc: Path = Path("/proc/self"),
    thermal: Path = Path("/sys/class/thermal"),
) -> SystemReading:
    """Read this process's CPU time and RSS and the board temperature (the only I/O here).

    ``cpu_percent`` is the process's CPU time over the wall time since ``previous``, in percent
    of one core (like ``top``: 150 means one and a half cores busy). RSS comes from
    /proc/self/status (:func:`device_agent.memory.read_rss_bytes`, as /healthz reads it) and
    the temperature from /sys/class/thermal; either is None where absent.
    """
    times = os.times()
    cpu = times.user + times.system
    now = time.monotonic()
    percent = None
    if previous is not None and now > previous.monotonic:
        percent = round(100.0 * (cpu - previous.cpu_seconds) / (now - previous.monotonic), 1)
    return SystemReading(cpu, now, percent, read_rss_bytes(proc / "status"), _read_temperature(thermal))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


class TelemetryAggregator:
    """Accumulates inference timings and errors and builds one telemetry payload per interval.

    Inference threads call :meth:`record_inference` / :meth:`record_error`; the telemetry thread
    calls :meth:`build`, which reports and resets the interval. Cumulative totals never reset,
    so a consumer that missed a message (dropped by the outbox policy) still gets exact counts.
    Each payload carries ``seq``, one more than the previous one, so a consumer counts the
    messages it never received (``edgepack fleet`` reports them as telemetry gaps); pass
    ``first_seq`` to continue a sequence across agent restarts.
    """

    def __init__(self, device_id: str, *, started: float, first_seq: int = 1) -> None:
        self.device_id = device_id
        self.started = started
        self._next_seq = first_seq
        self._lock = threading.Lock()
        self._interval = LatencyHistogram()
        self._interval_start = started
        self._total_inferences = 0
        self._errors_total: dict[str, int] = {}
        self._errors_interval: dict[str, int] = {}

    def record_inference(self, seconds: float) -> None:
        """One successful inference that took ``seconds``."""
        with self._lock:
            self._interval.record(seconds)
            self._total_inferences += 1

    def record_error(self, kind: str) -> None:
        """One failed inference or operation, by kind (e.g. ``preprocess``, ``runtime``)."""
        with self._lock:
            if kind not in self._errors_total and len(self._errors_total) >= MAX_ERROR_KINDS:
                kind = "other"
            self._errors_total[kind] = self._errors_total.get(kind, 0) + 1
            self._errors_interval[kind] = self._errors_interval.get(kind, 0) + 1

    def build(
        self,
        *,
        now: float,
        ts: float,
        model: ModelInfo | None,
        provider: str | None,
        system: SystemReading | None,
        queue: Mapping[str, Any] | None,
    ) -> Telemetry:
        """The ``edgepack.telemetry/1`` sample for the interval ending at ``now`` (monotonic
        seconds, same clock as ``started``); ``ts`` is the wall-clock time to stamp it with. The
        protocol's own type: the host parses the same definition (``Telemetry.encode()``)."""
        with self._lock:
            histogram = self._interval.snapshot_and_reset()
            errors_interval, self._errors_interval = self._errors_interval, {}
            errors_total = dict(self._errors_total)
            total = self._total_inferences
            interval_s = max(0.0, now - self._interval_start)
            self._interval_start = now
            seq, self._next_seq = self._next_seq, self._next_seq + 1
        return Telemetry(
            device=self.device_id, seq=seq, ts=round(ts, 3),
            model=None if model is None else ModelRef(model.name, model.version, model.sha256),
            provider=provider, interval_s=round(interval_s, 3),
            inferences_interval=histogram.count, inferences_total=total,
            error_kinds=tuple(errors_total.items()), error_kinds_interval=tuple(errors_interval.items()),
            errors_total=sum(errors_total.values()), errors_interval=sum(errors_interval.values()),
            latency_p50=_ms(histogram.percentile(50)), latency_p90=_ms(histogram.percentile(90)),
            latency_p99=_ms(histogram.percentile(99)), latency_max=_ms(histogram.maximum if histogram.count else None),
            latency_mean=_ms(histogram.mean),
            throughput_per_s=round(histogram.count / interval_s, 3) if interval_s > 0 else 0.0,
            cpu_percent=None if system is None else system.cpu_percent,
            memory_rss_bytes=None if system is None else system.memory_rss_bytes,
            temperature_c=None if system is None else system.temperature_c,
            uptime_s=round(max(0.0, now - self.started), 3),
            queue=None if queue is None else QueueCounters(int(queue["queued"]), int(queue["dropped"]),
                                                           int(queue["produced"]), int(queue["delivered"])),
        )


# The payload's JSON Schema is part of the shared protocol (schemas/telemetry.schema.json).
TELEMETRY_SCHEMA: dict[str, Any] = load_schema("telemetry")
