"""Telemetry retention: raw samples for a window, per-minute rollups beyond it, then nothing.

Why: a thousand devices at 1 Hz write 86 million rows a day; kept raw, the database grows
until the disk is full. Raw samples are kept ``raw_s`` (default 1 hour: charts of the last
minutes at full resolution); older samples are folded into one row per device and bucket
(``step_s``, 60 by default: per-minute rollups) and kept ``rollup_s`` (default 30 days); job
events and finished rollouts' history stay with the rollups' window; audit entries are kept
``audit_s`` (default 365 days: ``fleet serve --audit-keep-days``; an entry exactly that old
stays). So under a constant load the row count, and with it the database, stops growing (a test
measures it).

Sums cannot overflow: every stored counter is below 2^62 (edgepack_core.protocol.bounds), and a rollup's integer
sums saturate at :data:`MAX_BIGINT` (its sample counts at :data:`MAX_INT`), the largest values
their columns hold on both backends; float sums of values below 1e15 stay finite.

A device's job events are kept at most ``job_rows_per_device`` (the newest; the ingest's
per-device rate budget bounds how fast they come, this bounds how many stay).

The folding is pure (:func:`bucket_of`, :func:`fold`, :func:`merge_points`): a rollup keeps
sums and counts, never averages of averages, so folding twice (a late sample for a bucket
already rolled up) adds up correctly. p50 over a bucket is the mean of the samples' p50s
(an approximation, said in the API docs); p99 is the largest p99 seen (an upper bound).
The pruning job (:class:`Pruner`) is the I/O: select what aged out, fold, upsert, delete, in
one transaction per batch.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, delete, func, select

from sdk.errors import ServerConfigError
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database

log = logging.getLogger("edgepack.fleet_server.retention")

MAX_POINTS = 5000
"""At most this many points in one telemetry answer (the API refuses a smaller step)."""
PRUNE_BATCH = 20_000
MAX_BIGINT = 2**63 - 1
MAX_INT = 2**31 - 1
JOB_ROWS_PER_DEVICE = 1000
MAX_ERROR_KINDS = 32
"""Error kinds one bucket keeps (a device reports at most 32 a message); more sum as ``other``."""


def saturating(total: int, more: int, limit: int = MAX_BIGINT) -> int:
    """``total + more``, at most ``limit``."""
    return min(total + more, limit)


@dataclass(frozen=True)
class RetentionPolicy:
    raw_s: float = 3600.0
    rollup_s: float = 30 * 86400.0
    step_s: int = 60
    interval_s: float = 60.0  # how often the pruning job runs
    audit_s: float = 365 * 86400.0  # audit entries older than this are deleted

    def __post_init__(self) -> None:
        if not (isinstance(self.step_s, int) and 1 <= self.step_s <= 86400):
            raise ServerConfigError(f"rollup step {self.step_s!r} must be a whole number of seconds in 1..86400")
        for name in ("raw_s", "rollup_s", "interval_s", "audit_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ServerConfigError(f"retention {name} {value!r} must be a positive number of seconds")
        if self.raw_s < self.step_s:
            raise ServerConfigError(f"raw retention ({self.raw_s:g} s) must cover at least one rollup step "
                                    f"({self.step_s} s)")
        if self.rollup_s < self.raw_s:
            raise ServerConfigError(f"rollup retention ({self.rollup_s:g} s) is shorter than the raw window "
                                    f"({self.raw_s:g} s)")


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``30d`` into seconds; :class:`ServerConfigError` otherwise."""
    value = text.strip().lower()
    unit = _UNITS.get(value[-1:])
    number = value[:-1] if unit is not None else value
    try:
        seconds = float(number) * (unit or 1)
    except ValueError as err:
        raise ServerConfigError(f"{text!r} is not a duration (90, 90s, 15m, 1h, 30d)") from err
    if not (math.isfinite(seconds) and seconds > 0):
        raise ServerConfigError(f"{text!r} is not a positive duration")
    return seconds


# --------------------------------------------------------------------------- pure folding


def bucket_of(ts: float, step: int) -> int:
    """Start of the bucket of width ``step`` seconds holding ``ts`` (aligned to the epoch)."""
    return math.floor(ts / step) * step


@dataclass
class Bucket:
    """Sums over the samples of one device in one bucket (what a rollup row stores)."""

    device: str
    bucket: int
    step: int
    samples: int = 0
    latency_p50_sum: float = 0.0
    latency_p50_samples: int = 0
    latency_p99_max: float | None = None
    throughput_sum: float = 0.0
    inferences: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)  # the errors by kind, where the device named them

    @classmethod
    def from_row(cls, row: Any) -> Bucket:
        """A rollup row (``error_kinds`` stored as JSON text) as a bucket."""
        values = dict(row)
        return cls(**{**values, "error_kinds": kinds_of(values.get("error_kinds"))})

    def add_kinds(self, kinds: Mapping[str, int]) -> None:
        """Add errors by kind; beyond :data:`MAX_ERROR_KINDS` kinds, under ``other``."""
        for kind, count in kinds.items():
            if kind not in self.error_kinds and len(self.error_kinds) >= MAX_ERROR_KINDS:
                kind = "other"
            self.error_kinds[kind] = saturating(self.error_kinds.get(kind, 0), int(count))

    def add_sample(self, p50: float | None, p99: float | None, throughput: float | None, inferences: int | None,
                   errors: int | None, kinds: str | None = None) -> None:
        self.samples = saturating(self.samples, 1, MAX_INT)
        if p50 is not None:
            self.latency_p50_sum += p50
            self.latency_p50_samples = saturating(self.latency_p50_samples, 1, MAX_INT)
        if p99 is not None:
            self.latency_p99_max = p99 if self.latency_p99_max is None else max(self.latency_p99_max, p99)
        self.throughput_sum += throughput or 0.0
        self.inferences = saturating(self.inferences, inferences or 0)
        self.errors = saturating(self.errors, errors or 0)
        self.add_kinds(kinds_of(kinds))

    def merge(self, other: Bucket) -> None:
        """Add another partial bucket of the same device and time (sums add, the maximum stays)."""
        self.samples = saturating(self.samples, other.samples, MAX_INT)
        self.latency_p50_sum += other.latency_p50_sum
        self.latency_p50_samples = saturating(self.latency_p50_samples, other.latency_p50_samples, MAX_INT)
        if other.latency_p99_max is not None:
            self.latency_p99_max = other.latency_p99_max if self.latency_p99_max is None \
                else max(self.latency_p99_max, other.latency_p99_max)
        self.throughput_sum += other.throughput_sum
        self.inferences = saturating(self.inferences, other.inferences)
        self.errors = saturating(self.errors, other.errors)
        self.add_kinds(other.error_kinds)

    def row(self) -> dict[str, Any]:
        return {"device": self.device, "bucket": self.bucket, "step": self.step, "samples": self.samples,
                "latency_p50_sum": self.latency_p50_sum, "latency_p50_samples": self.latency_p50_samples,
                "latency_p99_max": self.latency_p99_max, "throughput_sum": self.throughput_sum,
                "inferences": self.inferences, "errors": self.errors, "error_kinds": kinds_json(self.error_kinds)}

    def point(self) -> dict[str, Any]:
        """One point of a chart: means over the bucket, the error share of its inferences."""
        return {
            "ts": self.bucket,
            "samples": self.samples,
            "latency_p50_ms": round(self.latency_p50_sum / self.latency_p50_samples, 4)
            if self.latency_p50_samples else None,
            "latency_p99_ms": self.latency_p99_max,
            "throughput_per_s": round(self.throughput_sum / self.samples, 4) if self.samples else None,
            "inferences": self.inferences,
            "errors": self.errors,
            "error_kinds": dict(sorted(self.error_kinds.items())),
            "error_rate": round(self.errors / self.inferences, 6) if self.inferences else None,
        }


def kinds_of(text: str | None) -> dict[str, int]:
    """Stored error kinds (JSON ``{kind: count}``, or None) as a mapping; the server wrote them
    from parsed, bounded telemetry, so anything else is no kinds."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    if not isinstance(value, dict):
        return {}
    return {str(k): int(v) for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def kinds_json(kinds: Mapping[str, int]) -> str | None:
    """Error kinds as stored: compact JSON, sorted, None when there are none."""
    return json.dumps(dict(sorted(kinds.items())), separators=(",", ":")) if kinds else None


def fold(samples: Iterable[Sequence[Any]], step: int) -> list[Bucket]:
    """Fold raw samples ``(device, ts, p50, p99, throughput, inferences, errors[, error_kinds])``
    into buckets of ``step`` seconds, sorted by (device, bucket); ``error_kinds`` as stored
    (JSON text or None)."""
    buckets: dict[tuple[str, int], Bucket] = {}
    for device, ts, p50, p99, throughput, inferences, errors, *kinds in samples:
        start = bucket_of(ts, step)
        bucket = buckets.get((device, start))
        if bucket is None:
            bucket = buckets[(device, start)] = Bucket(device, start, step)
        bucket.add_sample(p50, p99, throughput, inferences, errors, kinds[0] if kinds else None)
    return [buckets[key] for key in sorted(buckets)]


def rebucket(rows: Iterable[Bucket], step: int) -> list[Bucket]:
    """Coarser buckets from finer ones (rollups of 60 s into points of 300 s); ``step`` must
    be a multiple of each row's step. Sorted by (device, bucket)."""
    merged: dict[tuple[str, int], Bucket] = {}
    for row in rows:
        start = bucket_of(row.bucket, step)
        target = merged.get((row.device, start))
        if target is None:
            target = merged[(row.device, start)] = Bucket(row.device, start, step)
        target.merge(row)
    return [merged[key] for key in sorted(merged)]


def check_step(since: float, until: float, step: int) -> None:
    """A chart request is bounded: ``until`` after ``since``, at most :data:`MAX_POINTS` points."""
    if not until > since:
        raise ValueError("until must be after since")
    if step < 1:
        raise ValueError("step must be at least 1 second")
    if (until - since) / step > MAX_POINTS:
        raise ValueError(f"{(until - since) / step:.0f} points asked for; at most {MAX_POINTS} (raise step)")


def effective_step(step: int, since: float, raw_cutoff: float, rollup_step: int) -> int:
    """The step a chart can really have: below the raw window's start only rollups exist, so a
    request reaching back there gets at least the rollup step (rounded up to a multiple)."""
    if since >= raw_cutoff or step % rollup_step == 0:
        return step
    return max(rollup_step, -(-step // rollup_step) * rollup_step)


# --------------------------------------------------------------------------- the pruning job


def _rollup_rows(connection: Any, keys: set[tuple[str, int]]) -> dict[tuple[str, int], Bucket]:
    table = tables.telemetry_rollup
    found: dict[tuple[str, int], Bucket] = {}
    devices = sorted({device for device, _ in keys})
    buckets = sorted({bucket for _, bucket in keys})
    for start in range(0, len(devices), 500):
        query = select(table).where(table.c.device.in_(devices[start:start + 500]),
                                    table.c.bucket.in_(buckets))
        for row in connection.execute(query).mappings():
            found[(row["device"], row["bucket"])] = Bucket.from_row(row)
    return found


@dataclass
class Pruner:
    """Folds aged raw telemetry into rollups and deletes what is past every window. The server
    calls :meth:`run_once` every ``interval_s`` from the rollout driver's loop, on the lease
    holder only, so two servers never fold the same samples."""

    database: Database
    policy: RetentionPolicy
    job_rows_per_device: int = JOB_ROWS_PER_DEVICE
    folded: int = 0
    deleted_rollups: int = 0
    deleted_events: int = 0
    deleted_audit: int = 0
    runs: int = 0

    def run_once(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        # Only whole buckets older than the raw window are folded, so a bucket is folded once
        # (a late sample for it is merged by sums, see Bucket.merge).
        raw_cutoff = bucket_of(now - self.policy.raw_s, self.policy.step_s)
        while self._fold_batch(raw_cutoff):
            pass
        horizon = now - self.policy.rollup_s
        with self.database.write() as connection:
            rollups = connection.execute(delete(tables.telemetry_rollup).where(
                tables.telemetry_rollup.c.bucket < bucket_of(horizon, self.policy.step_s)))
            events = connection.execute(delete(tables.job_events).where(tables.job_events.c.received_at < horizon))
            old_audit = connection.execute(delete(tables.audit_log).where(
                tables.audit_log.c.ts < now - self.policy.audit_s))
        self.deleted_audit += old_audit.rowcount or 0
        self.deleted_rollups += rollups.rowcount or 0
        self.deleted_events += (events.rowcount or 0) + self._cap_job_events()
        self.runs += 1

    def _cap_job_events(self) -> int:
        """Delete each device's job events beyond the newest ``job_rows_per_device``."""
        events, cap, deleted = tables.job_events, self.job_rows_per_device, 0
        with self.database.write() as connection:
            over = connection.execute(select(events.c.device).group_by(events.c.device)
                                      .having(func.count() > cap)).scalars().all()
            for device in over:
                boundary = connection.execute(select(events.c.id).where(events.c.device == device)
                                              .order_by(events.c.id.desc()).offset(cap).limit(1)).scalar()
                if boundary is not None:
                    result = connection.execute(delete(events).where(and_(events.c.device == device,
                                                                          events.c.id <= boundary)))
                    deleted += result.rowcount or 0
        return deleted

    def _fold_batch(self, cutoff: int) -> bool:
        raw = tables.telemetry_raw
        with self.database.write() as connection:
            rows = connection.execute(
                select(raw.c.id, raw.c.device, raw.c.ts, raw.c.latency_p50, raw.c.latency_p99, raw.c.throughput_per_s,
                       raw.c.inferences, raw.c.errors, raw.c.error_kinds).where(raw.c.ts < cutoff).order_by(raw.c.id)
                .limit(PRUNE_BATCH)).all()
            if not rows:
                return False
            buckets = fold((tuple(row[1:]) for row in rows), self.policy.step_s)
            existing = _rollup_rows(connection, {(b.device, b.bucket) for b in buckets})
            fresh = []
            for bucket in buckets:
                old = existing.get((bucket.device, bucket.bucket))
                if old is None:
                    fresh.append(bucket.row())
                else:
                    old.merge(bucket)
                    connection.execute(tables.telemetry_rollup.update().where(
                        tables.telemetry_rollup.c.device == old.device,
                        tables.telemetry_rollup.c.bucket == old.bucket).values(**old.row()))
            if fresh:
                connection.execute(tables.telemetry_rollup.insert(), fresh)
            connection.execute(delete(raw).where(raw.c.id <= rows[-1][0], raw.c.ts < cutoff))
        self.folded += len(rows)
        return len(rows) == PRUNE_BATCH
