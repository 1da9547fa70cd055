"""The fleet server's MQTT consumer: devices' state, job events and telemetry into the database.

Two connections, because the two kinds of traffic need opposite things:

- **control** (state and job topics, a normal subscription): every server needs every
  device's state and every job event, and none may be lost. It uses a persistent session
  (fixed client id per server, session expiry) and acknowledges each message only after the
  transaction holding it committed (``manual_ack``): a server killed with events in memory gets
  them again from the broker when it reconnects. Writes are idempotent (a job event is unique
  by device, job, state, final and ts; a state older than the stored one loses), so two
  servers, a redelivery or a retained state seen again change nothing twice.
- **telemetry** (an MQTT 5 shared subscription ``$share/<group>/<root>/dev/+/telemetry``): the
  bulk of the traffic, split by the broker across every server of the share group, each
  message to one of them. A clean session: a crash loses at most what was in memory.

Handlers only parse the topic and queue (they run on the MQTT network threads); one writer
thread drains the queue in batches of up to :data:`MAX_BATCH` messages per transaction. The
counters (received, stored, dropped by reason, lag from receipt to commit) feed ``/metrics``
and the benchmark's loss count.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from sqlalchemy import case, delete, func, select, update

from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.ids import validate_id
from edgepack_core.protocol.topics import Topics
from sdk.broker import BrokerOptions
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database
from sdk.fleet_server.records import (
    Decommissioned,
    JobRecord,
    StateRecord,
    TelemetryRecord,
    parse_job,
    parse_state,
    parse_telemetry,
)

log = logging.getLogger("edgepack.fleet_server.ingest")

MAX_BATCH = 2000
BATCH_WINDOW_S = 0.05
QUEUE_BOUND = 200_000
SESSION_EXPIRY_S = 3600
CONTROL_PUT_TIMEOUT_S = 10.0


@dataclass
class IngestCounters:
    received: Counter[str] = field(default_factory=Counter)
    stored: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    batches: int = 0
    last_lag_s: float = 0.0
    max_lag_s: float = 0.0  # since start
    last_commit_at: float | None = None

    def to_json(self) -> dict[str, Any]:
        # not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs
        return {name: dict(value) if isinstance(value, Counter) else value
                for name, value in ((f.name, getattr(self, f.name)) for f in fields(self))}


@dataclass(frozen=True)
class _Item:
    kind: str  # state | telemetry | job
    device: str
    payload: bytes
    received_at: float
    message: Incoming | None  # control messages, acknowledged after commit


def _device_values(record: StateRecord, heard: float) -> dict[str, Any]:
    return {"id": record.device, "status": record.status, "status_reason": record.reason, "first_seen": heard,
              "last_seen": heard, "state_ts": record.ts, "provider": record.provider, "profile": record.profile,
              "capabilities": record.capabilities, "model_name": record.model_name,
              "model_version": record.model_version, "model_sha256": record.model_sha256}


_TELEMETRY_FIELDS = ("latency_p50", "latency_p90", "latency_p99", "latency_mean", "throughput_per_s",
                     "inferences_total", "errors_total", "inferences_interval", "errors_interval", "cpu_percent",
                     "memory_rss_bytes", "temperature_c")


class Writer:
    """Turns parsed records into rows. Separate from the MQTT side so tests and tools can feed
    it directly; every method runs inside one write transaction."""

    def __init__(self, database: Database) -> None:
        self.database = database

    def states(self, connection: Any, records: list[tuple[StateRecord | Decommissioned, float]]) -> None:
        """Apply states, each with when the device was last heard by it (``heard``: the receipt for
        a live message; for a retained one, replayed by the broker at every subscribe, no later than
        the device's own ts). ``last_seen`` only ever moves forward."""
        gone = [r.device for r, _ in records if isinstance(r, Decommissioned)]
        latest: dict[str, tuple[StateRecord, float]] = {}
        for record, heard in records:
            if isinstance(record, StateRecord):
                if record.device not in latest or record.ts >= latest[record.device][0].ts:
                    latest[record.device] = (record, heard)
            else:
                latest.pop(record.device, None)
        if gone:
            connection.execute(delete(tables.devices).where(tables.devices.c.id.in_(gone)))
            connection.execute(delete(tables.device_groups).where(tables.device_groups.c.device.in_(gone)))
        if not latest:
            return
        stored = dict(connection.execute(select(tables.devices.c.id, tables.devices.c.state_ts)
                                         .where(tables.devices.c.id.in_(list(latest)))).all())
        fresh = [(r, heard) for r, heard in latest.values() if stored.get(r.device) is None or r.ts >= stored[r.device]]
        if not fresh:
            return
        devices = tables.devices
        stmt = self.database.insert(devices)
        keep = ("model_name", "model_version", "model_sha256", "provider", "profile", "capabilities")
        updates = {name: stmt.excluded[name] for name in ("status", "status_reason", "state_ts")}
        updates["last_seen"] = case((stmt.excluded.last_seen > devices.c.last_seen, stmt.excluded.last_seen),
                                    else_=devices.c.last_seen)
        for name in keep:  # an offline will without a model does not erase what the device ran
            updates[name] = _coalesce(stmt.excluded[name], devices.c[name])
        connection.execute(stmt.on_conflict_do_update(index_elements=["id"], set_=updates),
                           [_device_values(r, heard) for r, heard in fresh])
        newer = [r for r, _ in fresh]
        grouped = [r for r in newer if r.groups is not None]
        if grouped:
            connection.execute(delete(tables.device_groups).where(
                tables.device_groups.c.device.in_([r.device for r in grouped])))
            rows = [{"device": r.device, "group_name": g} for r in grouped for g in r.groups or ()]
            if rows:
                connection.execute(self.database.insert(tables.device_groups).on_conflict_do_nothing(), rows)

    def telemetry(self, connection: Any, records: list[tuple[TelemetryRecord, float]]) -> None:
        if not records:
            return
        connection.execute(tables.telemetry_raw.insert(), [
            {"device": r.device, "ts": at, "seq": r.seq, "latency_p50": r.latency_p50, "latency_p99": r.latency_p99,
             "latency_mean": r.latency_mean, "throughput_per_s": r.throughput_per_s,
             "inferences": r.inferences_interval, "errors": r.errors_interval, "cpu_percent": r.cpu_percent,
             "memory_rss_bytes": r.memory_rss_bytes} for r, at in records])
        latest: dict[str, tuple[TelemetryRecord, float]] = {}
        for record, at in records:
            latest[record.device] = (record, at)
        devices = tables.devices
        stmt = self.database.insert(devices)
        rows = []
        for record, at in latest.values():
            row = {"id": record.device, "status": "online", "status_reason": "", "first_seen": at, "last_seen": at,
                   "telemetry_at": at, "telemetry_seq": record.seq, "model_name": record.model_name,
                   "model_version": record.model_version, "model_sha256": record.model_sha256,
                   "provider": record.provider}
            row.update({name: getattr(record, name) for name in _TELEMETRY_FIELDS})
            rows.append(row)
        updates: dict[str, Any] = {name: stmt.excluded[name] for name in ("last_seen", "telemetry_at", "telemetry_seq",
                                                                          *_TELEMETRY_FIELDS)}
        for name in ("model_name", "model_version", "model_sha256", "provider"):
            updates[name] = _coalesce(stmt.excluded[name], devices.c[name])
        connection.execute(stmt.on_conflict_do_update(index_elements=["id"], set_=updates), rows)

    def jobs(self, connection: Any, records: list[tuple[JobRecord, float]]) -> int:
        """Store job events (a repeat is ignored) and fold them into the rollouts they belong
        to. Returns how many were repeats."""
        if not records:
            return 0
        repeats = 0
        for record, at in records:
            new = self.database.insert_new(connection, tables.job_events, {
                "device": record.device, "job": record.job, "type": record.type, "state": record.state,
                "final": record.final, "reason": record.reason, "ts": record.ts, "received_at": at})
            if not new:
                repeats += 1
                continue
            rd = tables.rollout_devices
            connection.execute(update(rd).where(
                rd.c.command_id == record.job, rd.c.device == record.device, rd.c.final.is_(False),
                (rd.c.job_ts.is_(None)) | (rd.c.job_ts <= record.ts),
            ).values(state=record.state, final=record.final, reason=record.reason, job_ts=record.ts, updated_at=at))
            connection.execute(update(rd).where(rd.c.undo_command_id == record.job, rd.c.device == record.device)
                               .values(undo_state=record.state, undo_reason=record.reason))
        return repeats


def _coalesce(new: Any, old: Any) -> Any:
    return func.coalesce(new, old)


class Ingest:
    """The consumer: two MQTT connections, a bounded queue, one writer thread."""

    def __init__(self, database: Database, broker: BrokerOptions, *, server_id: str,
                 share_group: str = "edgepack-fleet", session_expiry_s: int = SESSION_EXPIRY_S) -> None:
        self.database = database
        self.writer = Writer(database)
        self.broker = broker
        self.topics = Topics(broker.topic_root)
        self.server_id = validate_id(server_id, "server id")
        self.share_group = validate_id(share_group, "share group")
        self.session_expiry_s = session_expiry_s
        self.counters = IngestCounters()
        self._queue: queue.Queue[_Item] = queue.Queue(maxsize=QUEUE_BOUND)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._commits: deque[tuple[float, int]] = deque(maxlen=4096)  # (commit time, telemetry stored so far)
        self.control: MqttTransport | None = None
        self.telemetry: MqttTransport | None = None

    # ---------------------------------------------------------------- MQTT side (network threads)

    def _settings(self, client_id: str, *, persistent: bool) -> Any:
        base = self.broker.settings("edgepack-fleet")
        return replace(base, client_id=client_id, session_expiry=self.session_expiry_s if persistent else 0,
                       manual_ack=persistent, max_queued=100_000, max_inflight=100)

    def _on_control(self, message: Incoming) -> None:
        parsed = self.topics.parse(message.topic)
        if parsed is None or parsed.device is None or parsed.kind not in ("state", "job"):
            self.counters.dropped["bad_topic"] += 1
            self._ack(message)
            return
        self.counters.received[parsed.kind] += 1
        try:
            self._queue.put(_Item(parsed.kind, parsed.device, message.payload, time.time(), message),
                            timeout=CONTROL_PUT_TIMEOUT_S)
        except queue.Full:  # not acknowledged: the broker sends it again after a reconnect
            self.counters.dropped["queue_full"] += 1

    def _on_telemetry(self, message: Incoming) -> None:
        parsed = self.topics.parse(message.topic)
        if parsed is None or parsed.device is None or parsed.kind != "telemetry":
            self.counters.dropped["bad_topic"] += 1
            return
        self.counters.received["telemetry"] += 1
        try:
            self._queue.put_nowait(_Item("telemetry", parsed.device, message.payload, time.time(), None))
        except queue.Full:
            self.counters.dropped["queue_full"] += 1

    def _ack(self, message: Incoming) -> None:
        if self.control is not None:
            self.control.ack(message)

    def start(self, connect_timeout: float = 10.0) -> None:
        """Connect both sessions (raising at once if the broker refuses the login) and start the writer."""
        self._thread = threading.Thread(target=self._run, name="fleet-ingest", daemon=True)
        self._thread.start()
        self.control = MqttTransport(self._settings(f"edgepack-fleet-{self.server_id}", persistent=True))
        self.control.subscribe(self.topics.all_of("state"), 1, self._on_control)
        self.control.subscribe(self.topics.all_of("job"), 1, self._on_control)
        self.control.connect_or_raise(connect_timeout)
        telemetry_id = f"edgepack-fleet-{self.server_id[:40]}-t{uuid.uuid4().hex[:6]}"
        self.telemetry = MqttTransport(self._settings(telemetry_id, persistent=False))
        self.telemetry.subscribe(f"$share/{self.share_group}/{self.topics.all_of('telemetry')}", 1,
                                 self._on_telemetry)
        self.telemetry.connect_or_raise(connect_timeout)

    def stop(self) -> None:
        for transport in (self.telemetry, self.control):
            if transport is not None:
                with contextlib.suppress(Exception):
                    transport.close(timeout=1.0)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    # ---------------------------------------------------------------- writer thread

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            batch = self._take_batch()
            if not batch:
                continue
            while True:
                try:
                    self.flush(batch)
                    break
                except Exception:  # the database is unreachable or locked: keep the batch, retry
                    log.exception("storing %d message(s) failed; retrying", len(batch))
                    if self._stop.wait(1.0):
                        return

    def _take_batch(self) -> list[_Item]:
        try:
            first = self._queue.get(timeout=0.2)
        except queue.Empty:
            return []
        batch = [first]
        deadline = time.monotonic() + BATCH_WINDOW_S
        while len(batch) < MAX_BATCH:
            remaining = deadline - time.monotonic()
            try:
                batch.append(self._queue.get(timeout=remaining) if remaining > 0 else self._queue.get_nowait())
            except queue.Empty:
                break
        return batch

    def flush(self, batch: Iterable[_Item]) -> None:
        """Parse, store in one transaction, then acknowledge the control messages in order."""
        items = list(batch)
        states: list[tuple[StateRecord | Decommissioned, float]] = []
        telemetry: list[tuple[TelemetryRecord, float]] = []
        jobs: list[tuple[JobRecord, float]] = []
        dropped: Counter[str] = Counter()
        for item in items:
            record: Any
            if item.kind == "state":
                record = parse_state(item.device, item.payload)
                target: list[Any] = states
                retained = item.message is not None and item.message.retain and isinstance(record, StateRecord)
                value: Any = (record, min(item.received_at, record.ts) if retained else item.received_at)
            elif item.kind == "job":
                record = parse_job(item.device, item.payload)
                target, value = jobs, (record, item.received_at)
            else:
                record = parse_telemetry(item.device, item.payload)
                target, value = telemetry, (record, item.received_at)
            if isinstance(record, str):
                dropped[record] += 1
            else:
                target.append(value)
        with self.database.write() as connection:
            self.writer.states(connection, states)
            self.writer.telemetry(connection, telemetry)
            repeats = self.writer.jobs(connection, jobs)
        committed = time.time()
        for item in items:
            if item.message is not None:
                self._ack(item.message)
        self._count(items, dropped, repeats, len(states), len(telemetry), len(jobs), committed)

    def _count(self, items: list[_Item], dropped: Counter[str], repeats: int, states: int, telemetry: int,
               jobs: int, committed: float) -> None:
        counters = self.counters
        counters.dropped.update(dropped)
        counters.stored["state"] += states
        counters.stored["telemetry"] += telemetry
        counters.stored["job"] += jobs - repeats
        counters.duplicates += repeats
        counters.batches += 1
        lag = committed - min(item.received_at for item in items)
        counters.last_lag_s = lag
        counters.max_lag_s = max(counters.max_lag_s, lag)
        counters.last_commit_at = committed
        self._commits.append((committed, counters.stored["telemetry"]))

    def rate(self, now: float, window_s: float = 10.0) -> float:
        """Telemetry messages stored per second over the last ``window_s`` seconds."""
        recent = [(at, total) for at, total in list(self._commits) if at >= now - window_s]
        if not recent:
            return 0.0
        before = [total for at, total in list(self._commits) if at < now - window_s]
        base = before[-1] if before else 0
        return (recent[-1][1] - base) / window_s
