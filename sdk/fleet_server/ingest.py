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

from sqlalchemy import delete, func, select
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError

from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.ids import validate_id
from edgepack_core.protocol.messages import (
    Decommissioned,
    DeviceState,
    JobEvent,
    Telemetry,
    parse_job_event,
    parse_state,
    parse_telemetry,
)
from edgepack_core.protocol.topics import Topics
from sdk.broker import BrokerOptions
from sdk.fleet_server import db as tables
from sdk.fleet_server.audit import SeenCommand, record_external, seen_command
from sdk.fleet_server.budgets import Buckets, DropLedger, IngestLimits
from sdk.fleet_server.db import Database
from sdk.fleet_server.ingest_writer import (  # noqa: F401  (Writer, ascii_text, newer_seq: imported from here by others)
    SEQ_RESTART_GAP,
    SEQ_STALE_S,
    Writer,
    _without,
    ascii_text,
    newer_seq,
)

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
