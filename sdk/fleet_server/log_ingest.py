"""The fleet server's ingest of device logs: the chunks devices publish on
``{root}/dev/{d}/logs`` in answer to a ``fetch-logs`` command, into ``device_logs``.

Its own MQTT connection, like the telemetry one of :mod:`.ingest` (an MQTT 5 shared
subscription, so several servers split the chunks; a clean session: a fetch lost in a crash
is fetched again), because logs are bulk that must never delay a state or a job event. The
same shape of bounds: a per-device token bucket (:mod:`.budgets`; the excess is dropped and
counted), a queue bounded in items and bytes, one writer thread storing batches, every chunk
parsed by :func:`edgepack_core.protocol.logs.parse_logs_chunk` before any value is used. A
record already stored (the same device, ts and seq) is not stored twice; the newest
:data:`MAX_RECORDS_PER_DEVICE` records, :data:`MAX_CHUNKS_PER_DEVICE` chunk marks and
:data:`MAX_FETCHES_PER_DEVICE` recorded fetch commands of a device are kept. A decommissioned device's logs are dropped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError, SQLAlchemyError

from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.logs import LogChunk, parse_logs_chunk
from edgepack_core.protocol.topics import Topics
from sdk.broker import BrokerOptions
from sdk.fleet_server import db as tables
from sdk.fleet_server.budgets import Buckets, Rate
from sdk.fleet_server.db import Database
from sdk.fleet_server.ingest import ITEM_OVERHEAD, ByteQueue
from sdk.fleet_server.log_tables import device_log_chunks, device_logs

log = logging.getLogger("edgepack.fleet_server.logs")

MAX_RECORDS_PER_DEVICE = 10_000
MAX_CHUNKS_PER_DEVICE = 1_000
MAX_FETCHES_PER_DEVICE = 100
"""``fetch-logs`` commands kept per device in ``commands`` (the live tail sends one every few
seconds; a fetch is never resent once older than these, and the history leaves them out)."""
QUEUE_ITEMS = 10_000
QUEUE_BYTES = 16 * 1024 * 1024
MAX_BATCH = 200
LOG_RATE = Rate(per_s=10.0, burst=200.0)
"""Chunks per device: one fetch of a whole default ring is about 17 chunks."""


@dataclass(frozen=True)
class _Chunk:
    device: str
    payload: bytes
    received_at: float

    @property
    def cost(self) -> int:
        return len(self.payload) + ITEM_OVERHEAD


class LogIngest:
    """The logs consumer: one MQTT connection, per-device budgets, a bounded queue, a writer."""

    def __init__(self, database: Database, broker: BrokerOptions, *, server_id: str,
                 share_group: str = "edgepack-fleet", rate: Rate = LOG_RATE) -> None:
        self.database = database
        self.broker = broker
        self.topics = Topics(broker.topic_root)
        self.server_id, self.share_group = server_id, share_group
        self.budget = Buckets(rate)
        self.counters: dict[str, Counter[str]] = {"received": Counter(), "stored": Counter(), "dropped": Counter()}
        self._queue = ByteQueue(QUEUE_ITEMS, QUEUE_BYTES)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.transport: MqttTransport | None = None

    def _on_message(self, message: Incoming) -> None:
        parsed = self.topics.parse(message.topic)
        if parsed is None or parsed.device is None or parsed.kind != "logs":
            self.counters["dropped"]["bad_topic"] += 1
            return
        self.counters["received"]["chunks"] += 1
        now = time.time()
        if not self.budget.allow(parsed.device, now):
            self.counters["dropped"]["logs_rate"] += 1
            return
        if not self._queue.put(_Chunk(parsed.device, message.payload, now)):  # type: ignore[arg-type]
            self.counters["dropped"]["queue_full"] += 1

    def start(self, connect_timeout: float = 10.0) -> None:
        self._thread = threading.Thread(target=self._run, name="fleet-logs", daemon=True)
        self._thread.start()
        base = self.broker.settings("edgepack-fleet")
        client_id = f"edgepack-fleet-{self.server_id[:40]}-l{uuid.uuid4().hex[:6]}"
        self.transport = MqttTransport(replace(base, client_id=client_id, session_expiry=0, max_queued=1000))
        self.transport.subscribe(f"$share/{self.share_group}/{self.topics.root}/dev/+/logs", 1, self._on_message)
        self.transport.connect_or_raise(connect_timeout)

    def stop(self) -> None:
        if self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.close(timeout=1.0)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(15)

    def _run(self) -> None:
        while not (self._stop.is_set() and self._queue.empty()):
            batch = self._queue.take(MAX_BATCH, 0.2, 0.05)
            if batch:
                self._store_until_done(batch)  # type: ignore[arg-type]
                self._queue.release(batch)

    def _store_until_done(self, batch: list[_Chunk]) -> None:
        """Store ``batch``; a database that is away is waited for, a batch the database refuses
        for its data is dropped and counted (the device is asked again by the next fetch)."""
        while True:
            try:
                self.store(batch)
                return
            except (OperationalError, InterfaceError) as err:
                log.warning("storing %d log chunk(s) failed (%s); retrying", len(batch), str(err)[:200])
                if self._stop.wait(1.0):
                    return
            except (DBAPIError, SQLAlchemyError) as err:
                log.error("%d log chunk(s) could not be stored: %s", len(batch), str(err)[:300])
                self.counters["dropped"]["store_failed"] += len(batch)
                return

    def store(self, batch: list[_Chunk]) -> None:
        """Parse each chunk and store the good ones in one transaction."""
        chunks: list[tuple[LogChunk, float]] = []
        for item in batch:
            parsed = parse_logs_chunk(item.device, item.payload)
            if isinstance(parsed, str):
                self.counters["dropped"][parsed] += 1
            else:
                chunks.append((parsed, item.received_at))
        if not chunks:
            return
        with self.database.write() as connection:
            gone = _decommissioned(connection, {chunk.device for chunk, _ in chunks})
            kept = [(chunk, at) for chunk, at in chunks if chunk.device not in gone]
            self.counters["dropped"]["decommissioned"] += len(chunks) - len(kept)
            stored = write_chunks(self.database, connection, kept)
        self.counters["stored"]["chunks"] += len(kept)
        self.counters["stored"]["records"] += stored


def _decommissioned(connection: Any, devices: set[str]) -> set[str]:
    d = tables.decommissioned
    return {row[0] for row in connection.execute(select(d.c.device).where(d.c.device.in_(devices)))}


def write_chunks(database: Database, connection: Any, chunks: list[tuple[LogChunk, float]]) -> int:
    """Insert the records and chunk marks (duplicates ignored), then prune each device touched
    to its newest rows; the number of records offered."""
    records = [{"device": chunk.device, "seq": line.seq, "ts": line.ts, "level": line.level, "logger": line.logger,
                "message": line.message, "request": chunk.request, "received_at": at}
               for chunk, at in chunks for line in chunk.records]
    if records:
        connection.execute(database.insert(device_logs).on_conflict_do_nothing(), records)
    marks = [{"request": chunk.request, "chunk": chunk.chunk, "device": chunk.device, "records": len(chunk.records),
              "last": chunk.last, "received_at": at} for chunk, at in chunks]
    if marks:
        connection.execute(database.insert(device_log_chunks).on_conflict_do_nothing(), marks)
    for device in {chunk.device for chunk, _ in chunks}:
        _prune(connection, device)
    return len(records)


def _prune(connection: Any, device: str) -> None:
    logs, marks = device_logs, device_log_chunks
    edge = connection.execute(select(logs.c.ts).where(logs.c.device == device).order_by(logs.c.ts.desc())
                              .offset(MAX_RECORDS_PER_DEVICE).limit(1)).scalar()
    if edge is not None:
        connection.execute(delete(logs).where(logs.c.device == device, logs.c.ts <= edge))
    edge = connection.execute(select(marks.c.received_at).where(marks.c.device == device)
                              .order_by(marks.c.received_at.desc()).offset(MAX_CHUNKS_PER_DEVICE).limit(1)).scalar()
    if edge is not None:
        connection.execute(delete(marks).where(marks.c.device == device, marks.c.received_at <= edge))
    sent = tables.commands
    edge = connection.execute(select(sent.c.created_at).where(sent.c.device == device, sent.c.kind == "fetch-logs")
                              .order_by(sent.c.created_at.desc()).offset(MAX_FETCHES_PER_DEVICE).limit(1)).scalar()
    if edge is not None:
        connection.execute(delete(sent).where(sent.c.device == device, sent.c.kind == "fetch-logs",
                                              sent.c.created_at <= edge))
