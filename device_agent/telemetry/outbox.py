"""Store-and-forward for everything a device publishes: a bounded SQLite outbox and its forwarder.

Why SQLite in WAL mode: one file, atomic transactions (a message and the counters that account
for it change together, so a kill -9 can never leave the accounting off by one), readers that do
not block the writer, and it ships with Python on every board.

Why ``synchronous=NORMAL`` by default: in WAL mode NORMAL never corrupts the database and loses
nothing when the *process* dies (kill -9, OOM killer, crash): committed transactions are in the
WAL in the OS page cache. Only a power cut can lose the last transactions since the last WAL
sync. FULL fsyncs the WAL on every commit, which on an SD card costs milliseconds per message
and wears the card; the messages at risk are the newest few telemetry samples, and job progress
is rebuilt from the job state the agent persists separately. ``synchronous="FULL"`` is
available for deployments that prefer the fsync.

Drop policy when full (``max_messages`` / ``max_bytes``):

1. the oldest ``telemetry`` row goes first, then the oldest pipeline ``events`` row, then the
   oldest ``state`` row; job events are never dropped to make room for those kinds;
2. job events may therefore exceed the soft bound, up to their own hard cap
   (``job_max_messages`` / ``job_max_bytes``, by default twice the soft bound); beyond that
   the oldest job event is dropped.

So the file holds at most max(soft, hard) messages, job results survive an outage far longer
than telemetry, and every drop is counted per kind. Accounting invariant, kept in the same
transactions as the rows: ``produced == delivered + dropped + queued``.

SQLite's page cache is bounded to :data:`CACHE_KIB` (its default is about 2 MiB a connection):
the outbox reads the head of a queue and appends at its tail, and the default cache, filled
during an outage's backlog, stayed resident for the agent's life (issue 25 item 10: 9,000
messages of 1.5 kB put and drained left 1.9 MiB more RSS with the default, 0.3 with this, in
the same time).

Delivery is at least once: a message is removed only after the broker acknowledged it, so a
crash between the broker's PUBACK and the local delete sends it again on restart.
"""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from device_agent.errors import MessageTooLargeError, OutboxError
from device_agent.telemetry import DEFAULT_MAX_BYTES, DEFAULT_MAX_MESSAGES
from edgepack_core.errors import EdgepackError, InvalidPublishError, UsageError

if TYPE_CHECKING:  # agent.yaml's defaults come from here: the config must not load paho-mqtt
    from edgepack_core.mqtt_transport import MqttTransport

log = logging.getLogger(__name__)

Kind = Literal["telemetry", "job", "state", "events"]
KINDS: tuple[Kind, ...] = ("telemetry", "job", "state", "events")
CACHE_KIB = 256
"""SQLite page cache of the outbox's connection (``PRAGMA cache_size``; module docstring)."""
# Non-job kinds in the order they are sacrificed when the soft bound is reached.
_DROP_ORDER: tuple[Kind, ...] = ("telemetry", "events", "state")


_SCHEMA = """
CREATE TABLE IF NOT EXISTS messages (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    topic    TEXT    NOT NULL,
    payload  BLOB    NOT NULL,
    qos      INTEGER NOT NULL,
    retain   INTEGER NOT NULL,
    kind     TEXT    NOT NULL,
    created  REAL    NOT NULL
);
CREATE INDEX IF NOT EXISTS messages_kind ON messages (kind, seq);
CREATE TABLE IF NOT EXISTS counters (
    name  TEXT PRIMARY KEY,
    value INTEGER NOT NULL
);
"""
_COUNTERS = ("produced", "delivered", "dropped", "refused", *(f"dropped.{k}" for k in KINDS))


@dataclass(frozen=True)
class Message:
    """One queued message, as :meth:`Outbox.peek` returns it."""

    seq: int
    topic: str
    payload: bytes
    qos: int
    retain: bool
    kind: Kind
    created: float


class Outbox:
    """A bounded, persistent FIFO of outgoing MQTT messages; safe to share between threads."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_messages: int = DEFAULT_MAX_MESSAGES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        job_max_messages: int | None = None,
        job_max_bytes: int | None = None,
        synchronous: Literal["NORMAL", "FULL"] = "NORMAL",
    ) -> None:
        self.path = Path(path)
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.job_max_messages = 2 * max_messages if job_max_messages is None else job_max_messages
        self.job_max_bytes = 2 * max_bytes if job_max_bytes is None else job_max_bytes
        if min(max_messages, max_bytes) < 1:
            raise UsageError("outbox max_messages and max_bytes must be positive")
        if self.job_max_messages < max_messages or self.job_max_bytes < max_bytes:
            raise UsageError("outbox job_max_messages/job_max_bytes must be at least max_messages/max_bytes")
        if synchronous not in ("NORMAL", "FULL"):
            raise UsageError(f"outbox synchronous={synchronous!r} is not NORMAL or FULL")
        self._lock = threading.Lock()
        self._watchers: list[Callable[[], None]] = []
        self.recovered_from: Path | None = None
        self.degraded: str | None = None
        try:
            self._db = self._connect(str(self.path), synchronous)
        except OutboxError as err:
            self._db = self._recover(err, synchronous)

    def _connect(self, target: str, synchronous: str) -> sqlite3.Connection:
        """Open ``target``, check it (``PRAGMA quick_check``), create the schema, load totals."""
        try:
            db = sqlite3.connect(target, check_same_thread=False, isolation_level=None, timeout=10.0)
        except sqlite3.Error as err:
            raise OutboxError(target, str(err)) from err
        self._db = db
        try:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if str(mode).lower() != "wal" and target != ":memory:":
                raise OutboxError(target, f"cannot switch to WAL mode (got {mode})")
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise OutboxError(target, f"integrity check failed: {check}")
            db.execute(f"PRAGMA synchronous={synchronous}")
            db.execute(f"PRAGMA cache_size=-{CACHE_KIB}")
            db.executescript(_SCHEMA)
            db.executemany("INSERT OR IGNORE INTO counters (name, value) VALUES (?, 0)", [(n,) for n in _COUNTERS])
            self._load_totals()
        except (sqlite3.Error, OutboxError) as err:
            db.close()
            if isinstance(err, OutboxError):
                raise
            raise OutboxError(target, str(err)) from err
        return db

    def _recover(self, err: OutboxError, synchronous: str) -> sqlite3.Connection:
        """The file cannot be used. Move it (and its WAL/SHM) aside for a post-mortem and start a
        fresh one; if the medium refuses that too (read-only), keep an in-memory outbox so the
        device still reports, and say so in ``degraded``."""
        log.error("outbox %s is unusable (%s); moving it aside", self.path, err.problem)
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
        try:
            if self.path.exists():
                os.replace(self.path, aside)
                self.recovered_from = aside
            for suffix in ("-wal", "-shm"):
                extra = self.path.with_name(self.path.name + suffix)
                if extra.exists():
                    os.replace(extra, aside.with_name(aside.name + suffix))
            return self._connect(str(self.path), synchronous)
        except (OSError, OutboxError) as again:
            problem = getattr(again, "problem", None) or getattr(again, "strerror", None) or str(again)
            self.degraded = f"outbox {self.path} unusable ({err.problem}; {problem}): messages kept in memory only"
            log.error("%s", self.degraded)
            return self._connect(":memory:", synchronous)

    # ------------------------------------------------------------------ plumbing

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db, on_rollback=self._load_totals)

    def _load_totals(self) -> None:
        """(Re)compute the per-kind message count and byte size kept in memory, so the bound
        checks of put() cost O(1) instead of a table scan. The outbox file has one writer
        process (the agent); its totals are rebuilt from the file at open and after a rollback."""
        self._count = dict.fromkeys(KINDS, 0)
        self._bytes = dict.fromkeys(KINDS, 0)
        rows = self._db.execute("SELECT kind, COUNT(*), COALESCE(SUM(LENGTH(payload)), 0) FROM messages GROUP BY kind")
        for kind, count, size in rows:
            self._count[kind] = int(count)
            self._bytes[kind] = int(size)

    def _bump(self, name: str, by: int = 1) -> None:
        self._db.execute("UPDATE counters SET value = value + ? WHERE name = ?", (by, name))

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every :meth:`put` (a forwarder wakes up on it)."""
        with self._lock:
            self._watchers.append(callback)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # ------------------------------------------------------------------ API

    def put(self, topic: str, payload: bytes, qos: int = 1, kind: Kind = "telemetry", *, retain: bool = False) -> int:
        """Append a message and enforce the bounds; return its sequence number.

        The new message itself may be the one dropped (the queue is full of job events and
        it is telemetry); it is then counted as produced and dropped like any other.
        """
        if kind not in KINDS:
            raise UsageError(f"outbox kind {kind!r} is not one of {', '.join(KINDS)}")
        if not topic or "+" in topic or "#" in topic:
            # Caught here, not when forwarding, so one bad row cannot reach the head of the queue.
            raise UsageError(f"outbox topic {topic!r} must be a non-empty topic name without wildcards")
        if qos not in (0, 1, 2):
            raise UsageError(f"outbox qos {qos!r} is not 0, 1 or 2")
        limit = self.job_max_bytes if kind == "job" else self.max_bytes
        if len(payload) > limit:
            raise MessageTooLargeError(len(payload), limit)
        with self._lock:
            try:
                with self._transaction():
                    cursor = self._db.execute(
                        "INSERT INTO messages (topic, payload, qos, retain, kind, created) VALUES (?, ?, ?, ?, ?, ?)",
                        (topic, bytes(payload), qos, int(retain), kind, time.time()),
                    )
                    seq = int(cursor.lastrowid or 0)
                    self._count[kind] += 1
                    self._bytes[kind] += len(payload)
                    self._bump("produced")
                    self._enforce_bounds()
            except sqlite3.Error as err:
                raise OutboxError(str(self.path), str(err)) from err
            watchers = list(self._watchers)
        for callback in watchers:
            callback()
        return seq

    def _drop_oldest(self, kind: Kind) -> bool:
        row = self._db.execute(
            "SELECT seq, LENGTH(payload) FROM messages WHERE kind = ? ORDER BY seq LIMIT 1", (kind,)
        ).fetchone()
        if row is None:
            return False
        self._db.execute("DELETE FROM messages WHERE seq = ?", (row[0],))
        self._count[kind] -= 1
        self._bytes[kind] -= int(row[1])
        self._bump("dropped")
        self._bump(f"dropped.{kind}")
        return True

    def _over_soft_bound(self) -> bool:
        return sum(self._count.values()) > self.max_messages or sum(self._bytes.values()) > self.max_bytes

    def _enforce_bounds(self) -> None:
        """The drop policy of the module docstring; runs inside put()'s transaction."""
        while self._over_soft_bound():
            if not any(self._drop_oldest(kind) for kind in _DROP_ORDER):
                break  # only job events left: they may grow up to their hard cap
        while self._count["job"] > self.job_max_messages or self._bytes["job"] > self.job_max_bytes:
            self._drop_oldest("job")

    def peek(self, limit: int = 100, *, after: int = 0) -> list[Message]:
        """Up to ``limit`` queued messages with ``seq > after``, oldest first; nothing is removed."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, topic, payload, qos, retain, kind, created FROM messages"
                " WHERE seq > ? ORDER BY seq LIMIT ?",
                (after, limit),
            ).fetchall()
        return [Message(r[0], r[1], bytes(r[2]), r[3], bool(r[4]), r[5], r[6]) for r in rows]

    def ack(self, seq: int) -> bool:
        """The broker acknowledged ``seq``: remove it and count it delivered. False if it was no
        longer queued (dropped by policy while in flight; it stays counted as dropped)."""
        return self._remove(seq, "delivered")

    def refuse(self, seq: int) -> bool:
        """The broker answered ``seq`` with a failure (e.g. not authorised): remove it, count it
        dropped and refused. Retrying a refused message would block the queue forever."""
        return self._remove(seq, "refused")

    def _remove(self, seq: int, outcome: Literal["delivered", "refused"]) -> bool:
        with self._lock:
            try:
                with self._transaction():
                    row = self._db.execute(
                        "SELECT kind, LENGTH(payload) FROM messages WHERE seq = ?", (seq,)
                    ).fetchone()
                    if row is None:
                        return False
                    self._db.execute("DELETE FROM messages WHERE seq = ?", (seq,))
                    self._count[row[0]] -= 1
                    self._bytes[row[0]] -= int(row[1])
                    self._bump(outcome)
                    if outcome == "refused":
                        self._bump("dropped")
                        self._bump(f"dropped.{row[0]}")
            except sqlite3.Error as err:
                raise OutboxError(str(self.path), str(err)) from err
        return True

    def __len__(self) -> int:
        with self._lock:
            return sum(self._count.values())

    def counters(self) -> dict[str, object]:
        """``{produced, delivered, dropped, refused, queued, queued_bytes, dropped_by_kind}``,
        read in one snapshot so the invariant holds between the numbers returned."""
        with self._lock:
            values = dict(self._db.execute("SELECT name, value FROM counters").fetchall())
            queued, queued_bytes = sum(self._count.values()), sum(self._bytes.values())
        return {
            "produced": values["produced"],
            "delivered": values["delivered"],
            "dropped": values["dropped"],
            "refused": values["refused"],
            "queued": queued,
            "queued_bytes": queued_bytes,
            "dropped_by_kind": {kind: values[f"dropped.{kind}"] for kind in KINDS},
        }


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT/ROLLBACK on an autocommit connection (the caller holds the lock).
    ``on_rollback`` resynchronises in-memory state with what the file still holds."""

    def __init__(self, db: sqlite3.Connection, *, on_rollback: Callable[[], None]) -> None:
        self._db = db
        self._on_rollback = on_rollback

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self._db.execute("COMMIT")
        else:
            self._db.execute("ROLLBACK")
            self._on_rollback()


class Forwarder:
    """Drains an :class:`Outbox` over an :class:`MqttTransport`, oldest first, on its own thread.

    Up to ``window`` messages are in flight at once; each is removed from the outbox only when
    its PUBACK arrives (so "delivered" means the broker has it). Messages are published with at
    least QoS 1, since a QoS 0 publish has no acknowledgement to wait for. While the connection
    is down nothing new is published; what is in flight stays in paho's session queue and is
    resent by paho on reconnect, so the forwarder does not publish it a second time.
    The acknowledgement callbacks only enqueue sequence numbers: all database work happens on
    this thread, never on the MQTT network thread or the inference path.
    """

    def __init__(self, outbox: Outbox, transport: MqttTransport, *, window: int = 16, poll: float = 1.0) -> None:
        if window < 1:
            raise UsageError("forwarder window must be at least 1")
        self.outbox = outbox
        self.transport = transport
        self.window = window
        self.poll = poll
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._done: deque[tuple[int, bool]] = deque()
        self._in_flight: set[int] = set()
        self._last_sent = 0
        self._thread: threading.Thread | None = None
        outbox.watch(self._wake.set)
        transport.on_connected(self._wake.set)

    def start(self) -> Forwarder:
        if self._thread is not None:
            raise UsageError("Forwarder.start() called twice")
        self._thread = threading.Thread(target=self._run, name="outbox-forwarder", daemon=True)
        self._thread.start()
        return self

    def stop(self, flush_timeout: float = 0.0) -> None:
        """Stop the thread, first waiting up to ``flush_timeout`` s for the in-flight messages'
        acknowledgements. What is not acknowledged stays queued and is sent after a restart."""
        deadline = time.monotonic() + flush_timeout
        while self._in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        self._settle()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def _acknowledged(self, seq: int, accepted: bool) -> None:
        self._done.append((seq, accepted))
        self._wake.set()

    def _settle(self) -> None:
        while self._done:
            seq, accepted = self._done.popleft()
            self._in_flight.discard(seq)
            if accepted:
                self.outbox.ack(seq)
            else:
                log.warning("broker refused outbox message %d; dropped", seq)
                self.outbox.refuse(seq)

    def _fill(self) -> None:
        room = self.window - len(self._in_flight)
        if room <= 0 or not self.transport.connected:
            return
        for message in self.outbox.peek(room, after=self._last_sent):
            self._in_flight.add(message.seq)
            try:
                accepted = self.transport.publish(
                    message.topic, message.payload, max(1, message.qos), message.retain,
                    on_done=functools.partial(self._acknowledged, message.seq),
                )
            except InvalidPublishError as err:  # e.g. a topic MQTT rejects: retrying cannot help
                log.warning("outbox message %d cannot be published (%s); dropped", message.seq, err)
                self._in_flight.discard(message.seq)
                self.outbox.refuse(message.seq)
                self._last_sent = message.seq
                continue
            if not accepted:  # paho's queue is full or the connection just dropped: retry later
                self._in_flight.discard(message.seq)
                return
            self._last_sent = message.seq

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()  # before the work, so a wake-up that arrives during it is not lost
            try:
                self._settle()
                self._fill()
            except EdgepackError:
                log.exception("outbox forwarder error; retrying")
            self._wake.wait(self.poll)
