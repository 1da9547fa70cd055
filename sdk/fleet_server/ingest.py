"""The fleet server's MQTT consumer: devices' state, job events and telemetry into the database.

Two connections, because the two kinds of traffic need opposite things:

- **control** (state and job topics, a normal subscription): every server needs every
  device's state and every job event, and none may be lost. It uses a persistent session
  (fixed client id per server, session expiry) and acknowledges each message only after the
  transaction holding it committed (``manual_ack``): a server killed with events in memory gets
  them again from the broker when it reconnects. Writes are idempotent (a job event is unique
  by device, job, state, final and ts; a state heard before the stored one loses), so two
  servers, a redelivery or a retained state seen again change nothing twice.
- **telemetry** (an MQTT 5 shared subscription ``$share/<group>/<root>/dev/+/telemetry``): the
  bulk of the traffic, split by the broker across every server of the share group, each
  message to one of them. A clean session: a crash loses at most what was in memory.

Handlers only parse the topic, take a token from the device's budget (:mod:`.budgets`: the
excess is dropped there, counted by reason and device) and queue (they run on the MQTT network
threads); one writer thread drains the queue in batches of up to :data:`MAX_BATCH` messages per
transaction. The queue is bounded in items and in bytes (:data:`QUEUE_BYTES`): a stalled
database costs at most that much memory, and what does not fit is dropped and counted.

**No message stops the ingest.** :mod:`edgepack_core.protocol.messages` bounds every value before it reaches a
statement; a batch that still fails with a data error (not an operational one: a database
that is down or locked is waited for, the batch kept) is split in halves until the message
that fails is alone, and that message goes to the ``dead_letters`` table (device, topic,
reason, the head of its payload; the newest :data:`MAX_DEAD_LETTERS` kept), is acknowledged and
counted; the rest of the batch is stored. So a poisoned retained state or a redelivered job
event is stored once as a dead letter and never blocks the writer again, across restarts.

The counters (received, stored, dropped by reason and by device, dead letters, lag from
receipt to commit) feed ``/metrics``, ``/api/status`` and the benchmark's loss count.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from sqlalchemy import case, delete, func, or_, select, update
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError

from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.ids import validate_id
from edgepack_core.protocol.messages import (
    Decommissioned,
    DeviceState,
    JobEvent,
    ModelRef,
    SessionMark,
    Telemetry,
    parse_job_event,
    parse_state,
    parse_telemetry,
)
from edgepack_core.protocol.topics import Topics
from sdk.broker import BrokerOptions
from sdk.fleet_server import db as tables
from sdk.fleet_server import settings_db
from sdk.fleet_server.audit import SeenCommand, record_external, seen_command
from sdk.fleet_server.budgets import Buckets, DropLedger, IngestLimits
from sdk.fleet_server.db import Database
from sdk.fleet_server.liveness import HeardState, supersedes
from sdk.fleet_server.retention import kinds_json

log = logging.getLogger("edgepack.fleet_server.ingest")

MAX_BATCH = 2000
BATCH_WINDOW_S = 0.05
QUEUE_BOUND = 200_000
QUEUE_BYTES = 64 * 1024 * 1024
ITEM_OVERHEAD = 600  # bytes one queued message costs beyond its payload (the objects around it)
SESSION_EXPIRY_S = 3600
CONTROL_PUT_TIMEOUT_S = 10.0
MAX_DEAD_LETTERS = 10_000
DEAD_LETTER_HEAD = 1024  # payload bytes kept with a dead letter


@dataclass
class IngestCounters:
    received: Counter[str] = field(default_factory=Counter)
    stored: Counter[str] = field(default_factory=Counter)
    dropped: Counter[str] = field(default_factory=Counter)
    dead_letters: Counter[str] = field(default_factory=Counter)  # by kind
    clamped: Counter[str] = field(default_factory=Counter)  # by field: sums clamped at parse
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
    kind: str  # state | telemetry | job | cmd (audited when the server did not send it)
    device: str
    payload: bytes
    received_at: float
    message: Incoming | None  # control messages, acknowledged after commit
    topic: str = ""

    @property
    def cost(self) -> int:
        return len(self.payload) + ITEM_OVERHEAD


class ByteQueue:
    """A FIFO bounded in items and in bytes (:attr:`_Item.cost`); :meth:`put` waits up to
    ``timeout`` for room and says whether the item went in. Items taken keep their bytes
    counted until :meth:`release` (the writer holds them while it retries a stalled database),
    so what waits in memory, queued or in the writer's hands, stays within ``max_bytes``."""

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: deque[_Item] = deque()
        self._bytes = 0
        self._cond = threading.Condition()

    def put(self, item: _Item, timeout: float = 0.0) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._items) >= self.max_items or (self._bytes and self._bytes + item.cost > self.max_bytes):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._items.append(item)
            self._bytes += item.cost
            self._cond.notify_all()
            return True

    def take(self, limit: int, first_timeout: float, window: float) -> list[_Item]:
        """Up to ``limit`` items: waits ``first_timeout`` for the first, then ``window`` for more."""
        batch: list[_Item] = []
        deadline = time.monotonic() + first_timeout
        with self._cond:
            while len(batch) < limit:
                if self._items:
                    batch.append(self._items.popleft())
                    if len(batch) == 1:
                        deadline = time.monotonic() + window
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            if batch:
                self._cond.notify_all()
        return batch

    def release(self, items: list[_Item]) -> None:
        """``items`` (taken before) are done with: their bytes no longer count."""
        with self._cond:
            self._bytes -= sum(item.cost for item in items)
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def bytes(self) -> int:
        return self._bytes

    def empty(self) -> bool:
        return not self._items


def _is_transient(err: BaseException) -> bool:
    """A failure of the database (down, locked, connection lost) rather than of the data: wait
    and retry the same messages. Everything else is the data's: split the batch."""
    if isinstance(err, (OperationalError, InterfaceError)):
        return True
    return isinstance(err, DBAPIError) and bool(err.connection_invalidated)


def ascii_text(value: str, limit: int) -> str:
    """``value`` as printable ASCII (anything else escaped), at most ``limit`` characters."""
    escaped = value.encode("ascii", "backslashreplace").decode("ascii")
    return "".join(c if " " <= c <= "~" else f"\\x{ord(c):02x}" for c in escaped)[:limit]


def _model_values(model: ModelRef | None) -> dict[str, str | None]:
    if model is None:
        return {"model_name": None, "model_version": None, "model_sha256": None}
    return {"model_name": model.name, "model_version": model.version, "model_sha256": model.sha256}


def _device_values(record: DeviceState, heard: float) -> dict[str, Any]:
    mark = record.session
    return {"id": record.device, "status": record.status, "status_reason": record.reason, "first_seen": heard,
            "last_seen": heard, "state_ts": record.ts, "state_heard": heard, "provider": record.provider,
            "state_epoch": None if mark is None else mark.epoch, "state_session": None if mark is None else mark.n,
            "profile": record.profile, "capabilities": record.capabilities, **_model_values(record.model),
            "groups_enrolled_at": heard if record.groups is not None else None}


def _without(devices: set[str], records: list[Any], *, keep_clears: bool = False) -> list[Any]:
    """``records`` less those of ``devices`` (an empty retained state, which clears one, stays)."""
    return [(r, at) for r, at in records if r.device not in devices or (keep_clears and isinstance(r, Decommissioned))]


def _heard(record: DeviceState, heard: float) -> HeardState:
    return HeardState(record.session, record.status, heard)


def _replaces_stored(new: HeardState, row: Any) -> bool:
    """Whether ``new`` supersedes the state stored in ``row`` (a devices row)."""
    if row.state_heard is None:
        return True
    mark = None if row.state_epoch is None or row.state_session is None else SessionMark(row.state_epoch,
                                                                                       row.state_session)
    return supersedes(new, HeardState(mark, row.status, row.state_heard))


_TELEMETRY_FIELDS = ("latency_p50", "latency_p90", "latency_p99", "latency_mean", "throughput_per_s",
                     "inferences_total", "errors_total", "inferences_interval", "errors_interval", "cpu_percent",
                     "memory_rss_bytes", "temperature_c")


class Writer:
    """Turns parsed records into rows. Separate from the MQTT side so tests and tools can feed
    it directly; every method runs inside one write transaction."""

    def __init__(self, database: Database) -> None:
        self.database = database

    @staticmethod
    def decommissioned(connection: Any, devices: list[str]) -> set[str]:
        """Which of ``devices`` were decommissioned: their messages are dropped until an
        operator enrolls them again (``POST /api/devices/{id}/enroll``)."""
        wanted = sorted(set(devices))
        found: set[str] = set()
        table = tables.decommissioned
        for start in range(0, len(wanted), 500):
            found.update(connection.execute(select(table.c.device).where(
                table.c.device.in_(wanted[start:start + 500]))).scalars())
        return found

    def states(self, connection: Any, records: list[tuple[DeviceState | Decommissioned, float]]) -> None:
        """Apply states, each with when the server heard it (``heard``: the receipt for a live
        message; for a retained one, replayed by the broker at every subscribe, no later than the
        device's own ts). States are ordered by ``heard``, never by the device's ts alone (a
        device clock 10 days ahead must not make every later state look older), except between
        states that carry connection marks of one epoch (:func:`.liveness.supersedes`: a will
        heard late still beats the birth it follows); ``last_seen`` only ever moves forward.
        Groups: see :meth:`_groups`."""
        gone = [r.device for r, _ in records if isinstance(r, Decommissioned)]
        latest: dict[str, tuple[DeviceState, float]] = {}
        for record, heard in records:
            if isinstance(record, DeviceState):
                if record.device not in latest or supersedes(_heard(record, heard), _heard(*latest[record.device])):
                    latest[record.device] = (record, heard)
            else:
                latest.pop(record.device, None)
        if gone:
            connection.execute(delete(tables.devices).where(tables.devices.c.id.in_(gone)))
            for table in (tables.device_groups, tables.device_claimed_groups, tables.device_rejected,
                          tables.device_models, tables.settings_reports):
                connection.execute(delete(table).where(table.c.device.in_(gone)))
        if not latest:
            return
        devices = tables.devices
        stored = {row.id: row for row in connection.execute(
            select(devices.c.id, devices.c.status, devices.c.state_heard, devices.c.state_epoch,
                   devices.c.state_session, devices.c.groups_enrolled_at)
            .where(devices.c.id.in_(list(latest))))}
        fresh = [(r, heard) for r, heard in latest.values() if r.device not in stored
                 or _replaces_stored(_heard(r, heard), stored[r.device])]
        if not fresh:
            return
        stmt = self.database.insert(devices)
        keep = ("model_name", "model_version", "model_sha256", "provider", "profile", "capabilities")
        updates = {name: stmt.excluded[name]
                   for name in ("status", "status_reason", "state_ts", "state_heard", "state_epoch", "state_session")}
        updates["last_seen"] = case((stmt.excluded.last_seen > devices.c.last_seen, stmt.excluded.last_seen),
                                    else_=devices.c.last_seen)
        for name in (*keep, "groups_enrolled_at"):  # an offline will without a model does not erase what it ran
            updates[name] = _coalesce(devices.c[name], stmt.excluded[name]) if name == "groups_enrolled_at" \
                else _coalesce(stmt.excluded[name], devices.c[name])
        connection.execute(stmt.on_conflict_do_update(index_elements=["id"], set_=updates),
                           [_device_values(r, heard) for r, heard in fresh])
        unenrolled = {d for d in latest if d not in stored or stored[d].groups_enrolled_at is None}
        self._groups(connection, [r for r, _ in fresh if r.groups is not None], unenrolled)
        self._rejected(connection, [(r, heard) for r, heard in fresh if r.status == "online"])
        self._models(connection, [r for r, _heard in fresh if r.status == "online" and r.models])
        settings_db.save_reports(self.database, connection, [(r, heard) for r, heard in fresh if r.status == "online"])

    def _models(self, connection: Any, records: list[DeviceState]) -> None:
        """Keep ``device_models`` equal to the models each device's newest online state lists
        (states of agents before several models list none and change nothing)."""
        if not records:
            return
        table = tables.device_models
        devices = [record.device for record in records]
        for start in range(0, len(devices), 500):
            connection.execute(delete(table).where(table.c.device.in_(devices[start:start + 500])))
        connection.execute(table.insert(), [{"device": record.device, "name": model.name, "version": model.version,
                                             "model_sha256": model.sha256}
                                            for record in records for model in record.models])

    def _rejected(self, connection: Any, records: list[tuple[DeviceState, float]]) -> None:
        """Keep ``device_rejected`` in step with each device's newest online state (the device's
        own ledger, bounded by the parser): records it no longer lists go, new ones are added
        with when the server first heard them (an existing one keeps its first hearing). One
        read per 500 devices; writes only where something changed (most devices list none)."""
        table = tables.device_rejected
        listed = {record.device: {ref.sha256 for ref in record.rejected} for record, _heard in records}
        devices = sorted(listed)
        stored: set[tuple[str, str]] = set()
        for start in range(0, len(devices), 500):
            part = devices[start:start + 500]
            stored |= {(row.device, row.sha256) for row in connection.execute(
                select(table.c.device, table.c.sha256).where(table.c.device.in_(part)))}
        for device, sha in sorted(pair for pair in stored if pair[1] not in listed[pair[0]]):
            connection.execute(delete(table).where(table.c.device == device, table.c.sha256 == sha))
        rows = [{"device": record.device, "sha256": ref.sha256, "name": ref.name, "version": ref.version,
                 "stage": ref.stage, "reason": ref.reason[:500], "device_ts": ref.ts, "heard_at": heard}
                for record, heard in records for ref in record.rejected if (record.device, ref.sha256) not in stored]
        if rows:
            connection.execute(self.database.insert(table).on_conflict_do_nothing(), rows)

    def _groups(self, connection: Any, claiming: list[DeviceState], unenrolled: set[str]) -> None:
        """A device's claimed groups are recorded, never used: rollouts target the groups the
        server enrolled. The claim of a device's first state with groups is enrolled (trust on
        first use); later claims change only ``device_claimed_groups`` (an operator enrolls
        with ``PUT /api/devices/{id}/groups``)."""
        if not claiming:
            return
        tables_to_set = [(tables.device_claimed_groups, claiming),
                         (tables.device_groups, [r for r in claiming if r.device in unenrolled])]
        for table, records in tables_to_set:
            if not records:
                continue
            connection.execute(delete(table).where(table.c.device.in_([r.device for r in records])))
            rows = [{"device": r.device, "group_name": g} for r in records for g in r.groups or ()]
            if rows:
                connection.execute(self.database.insert(table).on_conflict_do_nothing(), rows)

    def telemetry(self, connection: Any, records: list[tuple[Telemetry, float]]) -> None:
        """Store every sample (raw, at its receipt) and make the newest by the device's ``seq``
        the device's latest figures (see :func:`newer_seq`); ``last_seen`` is the receipt."""
        if not records:
            return
        connection.execute(tables.telemetry_raw.insert(), [
            {"device": r.device, "ts": at, "seq": r.seq, "latency_p50": r.latency_p50, "latency_p99": r.latency_p99,
             "latency_mean": r.latency_mean, "throughput_per_s": r.throughput_per_s,
             "inferences": r.inferences_interval, "errors": r.errors_interval, "cpu_percent": r.cpu_percent,
             "memory_rss_bytes": r.memory_rss_bytes, "error_kinds": kinds_json(dict(r.error_kinds_interval))}
            for r, at in records])
        latest: dict[str, tuple[Telemetry, float]] = {}
        heard: dict[str, float] = {}
        for record, at in records:
            heard[record.device] = max(at, heard.get(record.device, at))
            if record.device not in latest or newer_seq(record.seq, latest[record.device][0].seq):
                latest[record.device] = (record, at)
        devices = tables.devices  # (every integer below 2^62: the protocol's bounds clamp them)
        stmt = self.database.insert(devices)
        rows = []
        for record, at in latest.values():
            row = {"id": record.device, "status": "online", "status_reason": "", "first_seen": at,
                   "last_seen": heard[record.device], "telemetry_at": at, "telemetry_seq": record.seq,
                   **_model_values(record.model), "provider": record.provider}
            row.update({name: getattr(record, name) for name in _TELEMETRY_FIELDS})
            rows.append(row)
        new, old = stmt.excluded, devices.c
        applies = or_(old.telemetry_seq.is_(None), new.telemetry_seq.is_(None), old.telemetry_at.is_(None),
                      new.telemetry_seq > old.telemetry_seq, new.telemetry_seq < old.telemetry_seq - SEQ_RESTART_GAP,
                      old.telemetry_at < new.telemetry_at - SEQ_STALE_S)
        updates: dict[str, Any] = {"last_seen": case((new.last_seen > old.last_seen, new.last_seen),
                                                     else_=old.last_seen)}
        for name in ("telemetry_at", "telemetry_seq", *_TELEMETRY_FIELDS):
            updates[name] = case((applies, new[name]), else_=old[name])
        for name in ("model_name", "model_version", "model_sha256", "provider"):
            updates[name] = case((applies, _coalesce(new[name], old[name])), else_=old[name])
        connection.execute(stmt.on_conflict_do_update(index_elements=["id"], set_=updates), rows)

    def jobs(self, connection: Any, records: list[tuple[JobEvent, float]]) -> int:
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
            # A final event ends the job whatever its ts (a device clock stepped back must not
            # leave the wave to time out); a non-final one loses to a newer ts already applied.
            in_order = rd.c.job_ts.is_(None) | (rd.c.job_ts <= record.ts) if not record.final else rd.c.final.is_(False)
            connection.execute(update(rd).where(
                rd.c.command_id == record.job, rd.c.device == record.device, rd.c.final.is_(False), in_order,
            ).values(state=record.state, final=record.final, reason=record.reason, job_ts=record.ts, updated_at=at))
            connection.execute(update(rd).where(rd.c.undo_command_id == record.job, rd.c.device == record.device)
                               .values(undo_state=record.state, undo_reason=record.reason))
        return repeats


SEQ_RESTART_GAP = 1_000_000
"""A ``seq`` this far below the stored one is a restarted sequence (the agent's outbox replays
at most tens of thousands of older samples), not a late sample."""
SEQ_STALE_S = 300.0
"""Figures not replaced for this long give way to any sample (a sequence restarted lower)."""


def newer_seq(seq: int | None, than: int | None) -> bool:
    """Whether a telemetry sample numbered ``seq`` replaces the latest figures numbered ``than``:
    higher numbers win (a late sample from the device's outbox, or committed late by another
    server of the share group, does not), unknown numbers always do, and a number far below
    is a restarted sequence. Pure."""
    return seq is None or than is None or seq > than or seq < than - SEQ_RESTART_GAP


def _coalesce(new: Any, old: Any) -> Any:
    return func.coalesce(new, old)


class Ingest:
    """The consumer: two MQTT connections, per-device budgets, a bounded queue, one writer thread."""

    def __init__(self, database: Database, broker: BrokerOptions, *, server_id: str,
                 share_group: str = "edgepack-fleet", session_expiry_s: int = SESSION_EXPIRY_S,
                 limits: IngestLimits | None = None, queue_bytes: int = QUEUE_BYTES) -> None:
        self.database = database
        self.writer = Writer(database)
        self.broker = broker
        self.topics = Topics(broker.topic_root)
        self.server_id = validate_id(server_id, "server id")
        self.share_group = validate_id(share_group, "share group")
        self.session_expiry_s = session_expiry_s
        self.limits = limits or IngestLimits()
        self.budgets = {"state": Buckets(self.limits.state), "job": Buckets(self.limits.job),
                        "telemetry": Buckets(self.limits.telemetry), "cmd": Buckets(self.limits.command)}
        self.counters = IngestCounters()
        self.drops = DropLedger()
        self._drop_lock = threading.Lock()
        self._queue = ByteQueue(QUEUE_BOUND, queue_bytes)
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

    def _drop(self, device: str, reason: str) -> None:
        """Count a drop (the network threads and the writer drop concurrently: one lock)."""
        with self._drop_lock:
            self.counters.dropped[reason] += 1
        self.drops.add(device, reason)

    def _admit(self, kind: str, device: str, now: float) -> bool:
        """Whether ``device`` has budget left for one more message of ``kind`` (else dropped)."""
        if self.budgets[kind].allow(device, now):
            return True
        self._drop(device, f"{kind}_rate")
        return False

    def _on_control(self, message: Incoming) -> None:
        parsed = self.topics.parse(message.topic)
        if parsed is None or parsed.device is None or parsed.kind not in ("state", "job"):
            self._drop("(bad topic)", "bad_topic")
            self._ack(message)
            return
        self.counters.received[parsed.kind] += 1
        now = time.time()
        if not self._admit(parsed.kind, parsed.device, now):
            self._ack(message)  # over its budget: dropped for good, not redelivered
            return
        item = _Item(parsed.kind, parsed.device, message.payload, now, message, message.topic)
        if not self._queue.put(item, timeout=CONTROL_PUT_TIMEOUT_S):
            self._drop(parsed.device, "queue_full")  # not acknowledged: the broker sends it again after a reconnect

    def _on_command(self, message: Incoming) -> None:
        """A message on a device's or a group's cmd topic (the server's own commands too: the
        writer tells them apart by id), within the topic's budget, queued to be audited."""
        parsed = self.topics.parse(message.topic)
        target = None if parsed is None else parsed.device if parsed.kind == "cmd" else \
            f"group:{parsed.group}" if parsed.kind == "group_cmd" else None
        if target is None or not message.payload:  # an empty payload clears a retained command: nothing sent
            self._ack(message)
            return
        self.counters.received["cmd"] += 1
        if not self.budgets["cmd"].allow(target, time.time()):
            self._drop(target, "cmd_rate")
            self._ack(message)
            return
        if not self._queue.put(_Item("cmd", target, message.payload, time.time(), message, message.topic),
                               timeout=CONTROL_PUT_TIMEOUT_S):
            self._drop(target, "queue_full")

    def _on_telemetry(self, message: Incoming) -> None:
        parsed = self.topics.parse(message.topic)
        if parsed is None or parsed.device is None or parsed.kind != "telemetry":
            self._drop("(bad topic)", "bad_topic")
            return
        self.counters.received["telemetry"] += 1
        now = time.time()
        if not self._admit("telemetry", parsed.device, now):
            return
        if not self._queue.put(_Item("telemetry", parsed.device, message.payload, now, None, message.topic)):
            self._drop(parsed.device, "queue_full")

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
        self.control.subscribe(self.topics.all_of("cmd"), 1, self._on_command)
        self.control.subscribe(f"{self.topics.root}/grp/+/cmd", 1, self._on_command)
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
        return len(self._queue)

    @property
    def queue_bytes(self) -> int:
        return self._queue.bytes

    # ---------------------------------------------------------------- writer thread

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            batch = self._queue.take(MAX_BATCH, 0.2, BATCH_WINDOW_S)
            if not batch:
                continue
            stored = self.store(batch)
            self._queue.release(batch)
            if not stored:
                return

    def store(self, batch: list[_Item]) -> bool:
        """Store ``batch``, however long the database is away; a message that fails alone with a
        data error becomes a dead letter. False only when stopped while the database was away."""
        pending = [batch]
        while pending:
            part = pending.pop()
            try:
                self.flush(part)
            except Exception as err:  # sorted right below: transient (retried) or the data's (split)
                if _is_transient(err):
                    log.warning("storing %d message(s) failed (%s); retrying", len(part), str(err)[:200])
                    pending.append(part)
                    if self._stop.wait(1.0):
                        return False
                elif len(part) > 1:
                    half = len(part) // 2
                    pending.extend((part[half:], part[:half]))  # the first half is stored first
                else:
                    pending.extend(self._dead_letter(part[0], err))
        return True

    def _dead_letter(self, item: _Item, err: BaseException) -> list[list[_Item]]:
        """Record ``item`` as a dead letter and acknowledge it; if even that fails the database is
        away: the item is handed back to be tried again."""
        reason = ascii_text(f"{type(err).__name__}: {getattr(err, 'orig', None) or err}", 500)
        log.error("a %s message of %s cannot be stored; kept as a dead letter: %s", item.kind, item.device, reason)
        try:
            with self.database.write() as connection:
                connection.execute(tables.dead_letters.insert(), {
                    "received_at": item.received_at, "device": item.device, "kind": item.kind,
                    "topic": ascii_text(item.topic, 300), "reason": reason, "size": len(item.payload),
                    "payload_head": bytes(item.payload[:DEAD_LETTER_HEAD])})
                newest = connection.execute(select(func.max(tables.dead_letters.c.id))).scalar() or 0
                connection.execute(delete(tables.dead_letters).where(
                    tables.dead_letters.c.id <= newest - MAX_DEAD_LETTERS))
        except SQLAlchemyError:
            log.exception("recording a dead letter failed; retrying")
            if self._stop.wait(1.0):
                return []
            return [[item]]
        if item.message is not None:
            self._ack(item.message)
        self.counters.dead_letters[item.kind] += 1
        self.drops.add(item.device, "dead_letter")
        return []

    def flush(self, batch: Iterable[_Item]) -> None:
        """Parse, store in one transaction, then acknowledge the control messages in order."""
        items = list(batch)
        states: list[tuple[DeviceState | Decommissioned, float]] = []
        telemetry: list[tuple[Telemetry, float]] = []
        jobs: list[tuple[JobEvent, float]] = []
        commands: list[tuple[SeenCommand, float]] = []
        dropped: list[tuple[str, str]] = []
        for item in items:
            record: Any
            if item.kind == "cmd":
                commands.append((seen_command(item.topic, item.device, item.payload, item.received_at),
                                 item.received_at))
                continue
            if item.kind == "state":
                record = parse_state(item.device, item.payload)
                target: list[Any] = states
                retained = item.message is not None and item.message.retain and isinstance(record, DeviceState)
                value: Any = (record, min(item.received_at, record.ts) if retained else item.received_at)
            elif item.kind == "job":
                record = parse_job_event(item.device, item.payload)
                target, value = jobs, (record, item.received_at)
            else:
                record = parse_telemetry(item.device, item.payload)
                target, value = telemetry, (record, item.received_at)
            if isinstance(record, str):
                dropped.append((item.device, record))
            else:
                target.append(value)
        with self.database.write() as connection:
            removed = self.writer.decommissioned(connection, [r.device for r, _ in (*states, *telemetry, *jobs)])
            if removed:
                dropped.extend((r.device, "decommissioned") for r, _ in (*states, *telemetry, *jobs)
                               if r.device in removed and not isinstance(r, Decommissioned))
                states, telemetry, jobs = (_without(removed, states, keep_clears=True), _without(removed, telemetry),
                                           _without(removed, jobs))
            self.writer.states(connection, states)
            self.writer.telemetry(connection, telemetry)
            repeats = self.writer.jobs(connection, jobs)
            external = record_external(connection, commands) if commands else 0
        committed = time.time()
        self.counters.stored["command_external"] += external
        for item in items:
            if item.message is not None:
                self._ack(item.message)
        for device, reason in dropped:
            self._drop(device, reason)
        self.counters.clamped.update(name for record, _ in telemetry for name in record.clamped)
        self._count(items, repeats, len(states), len(telemetry), len(jobs), committed)

    def _count(self, items: list[_Item], repeats: int, states: int, telemetry: int, jobs: int,
               committed: float) -> None:
        counters = self.counters
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
