"""Attacks on the fleet server's ingest by one device with its own credentials: poisoned text,
counters that overflow when summed, floods, claimed groups and lying clocks. Each must cost
the sender only; the ingest goes on for everyone else, across restarts, on SQLite and
PostgreSQL. Real mosquitto, real databases, `edgepack fleet serve` as a subprocess."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from sqlalchemy import func, select

from edgepack_core.protocol import bounds
from edgepack_core.protocol.bounds import BIG
from edgepack_core.protocol.messages import DeviceState, parse_job_event, parse_state, parse_telemetry
from sdk.broker import BrokerOptions
from sdk.errors import ApiError
from sdk.fleet_server import db as db_module
from sdk.fleet_server import db as tables
from sdk.fleet_server import ingest as ingest_module
from sdk.fleet_server.budgets import Buckets, DropLedger, Rate, parse_rate
from sdk.fleet_server.db import Database, open_database
from sdk.fleet_server.driver import Driver
from sdk.fleet_server.ingest import ByteQueue, Ingest, Writer, _Item
from sdk.fleet_server.queries import DeviceFilter, RolloutRequest, create_rollout, dead_letters, list_devices
from sdk.fleet_server.retention import MAX_BIGINT, Pruner, RetentionPolicy
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for
from tests.postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)

ROOT = "edgepack/v1"
SURROGATE = '"\\ud800"'  # the JSON escape of a lone surrogate, as the attacker writes it
INT64_MAX = 2**63 - 1


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'fleet.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def database(backend: str):
    opened = open_database(backend)
    yield opened
    opened.dispose()


@pytest.fixture
def keys(tmp_path: Path, keypair):
    return make_keys(tmp_path / "keys", release=keypair)


# ------------------------------------------------------------------ helpers


def _state(
    device: str, ts: float, *, status: str = "online", groups: list[str] | None = None, provider: str = '"CPU"'
) -> bytes:
    """A state message; ``provider`` is raw JSON text (so a test can put an escape in it)."""
    head = json.dumps(
        {
            "schema": "edgepack.state/1",
            "device": device,
            "status": status,
            "ts": ts,
            **({"groups": groups} if groups is not None else {}),
        }
    )
    return f'{head[:-1]}, "provider": {provider}}}'.encode()


def _job(device: str, job: str, state: str, final: bool, ts: float, reason: str = '""') -> bytes:
    head = json.dumps(
        {
            "schema": "edgepack.job/1",
            "device": device,
            "ts": ts,
            "job": job,
            "type": "deploy",
            "state": state,
            "final": final,
        }
    )
    return f'{head[:-1]}, "reason": {reason}}}'.encode()


def _telemetry(device: str, seq: int, *, inferences: int = 10, errors: dict[str, int] | None = None) -> bytes:
    return json.dumps(
        {
            "schema": "edgepack.telemetry/1",
            "device": device,
            "seq": seq,
            "latency_ms": {"p50": 2.0, "p99": 3.0},
            "inferences": {"interval": inferences, "total": 1},
            "errors_interval": errors or {"m": 1},
            "errors": errors or {"m": 1},
            "throughput_per_s": 5.0,
        }
    ).encode()


class Publisher:
    """A device (or an attacker with a device's credentials) on the broker."""

    def __init__(self, port: int, client_id: str = "attacker") -> None:
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=f"{client_id}-{time.monotonic_ns()}", protocol=mqtt.MQTTv5
        )
        self.client.max_inflight_messages_set(1000)
        self.client.max_queued_messages_set(0)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def send(self, topic: str, payload: bytes, *, retain: bool = False, wait: bool = True) -> mqtt.MQTTMessageInfo:
        info = self.client.publish(f"{ROOT}/{topic}", payload, qos=1, retain=retain)
        if wait:
            info.wait_for_publish(10)
        return info

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _publish(port: int, *messages: tuple[str, bytes, bool]) -> None:
    publisher = Publisher(port)
    try:
        for topic, payload, retain in messages:
            publisher.send(topic, payload, retain=retain)
    finally:
        publisher.close()


def _status(server: FleetServerProcess) -> dict:
    return server.get("/api/status")["ingest"]


def _device(server: FleetServerProcess, device: str) -> dict | None:
    status, doc = server.call("GET", f"/api/devices/{device}")
    return doc if status == 200 else None


def _ingest(database: Database) -> Ingest:
    """An ingest that is never connected: tests hand it batches as the MQTT side would."""
    return Ingest(database, BrokerOptions("127.0.0.1:1"), server_id="test")


def _item(kind: str, device: str, payload: bytes, at: float | None = None) -> _Item:
    return _Item(kind, device, payload, time.time() if at is None else at, None, f"{ROOT}/dev/{device}/{kind}")


def _count(database: Database, table, *where) -> int:
    with database.read() as connection:
        return connection.execute(select(func.count()).select_from(table).where(*where)).scalar()


# ------------------------------------------------------------------ poison text and numbers, end to end


def test_a_lone_surrogate_in_a_retained_state_does_not_stop_the_ingest_nor_a_restart(
    tmp_path, mosquitto_broker, keys, backend
):
    """The retained poison is replayed at every subscribe: the server drops it (bad_text) each
    time, stores what comes after it, and starts again without a stall."""
    broker = mosquitto_broker
    now = time.time()
    _publish(broker.port, ("dev/evil/state", _state("evil", now, provider=SURROGATE), True))
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys, db_url=backend).start()
    try:
        _publish(broker.port, ("dev/good-1/state", _state("good-1", now), True))
        assert wait_for(lambda: _device(server, "good-1"), 15) is not None
        ingest = _status(server)
        assert ingest["dropped"].get("bad_text") == 1 and ingest["dropped_by_device"]["evil"] == {"bad_text": 1}
        assert _device(server, "evil") is None
        server.stop()
        server.start()  # the poison is replayed to the new subscription
        _publish(broker.port, ("dev/good-2/state", _state("good-2", now), True))
        assert wait_for(lambda: _device(server, "good-2"), 15) is not None
        assert _status(server)["dropped"].get("bad_text") == 1
        assert server.get("/api/dead-letters") == {"dead_letters": []}  # refused at parse: nothing reached SQL
    finally:
        server.stop()
        _publish(broker.port, ("dev/evil/state", b"", True))


def test_a_nul_in_a_redelivered_job_event_does_not_stop_the_ingest(tmp_path, mosquitto_broker, keys, backend):
    """A job event with a NUL (PostgreSQL text refuses it) sent while the server was down comes
    with the persistent session's backlog: dropped and acknowledged once, never again."""
    broker = mosquitto_broker
    server = FleetServerProcess(
        tmp_path / "server", broker=broker.address, keys=keys, db_url=backend, server_id="nul-test"
    ).start()
    server.stop()  # the persistent session now exists: the broker queues job events for it
    now = time.time()
    _publish(
        broker.port,
        ("dev/evil/job", _job("evil", "j-1", "failed", True, now, reason='"a\\u0000b"'), False),
        ("dev/good/job", _job("good", "j-2", "active", True, now), False),
    )
    server.start()
    try:
        assert wait_for(lambda: _status(server)["stored"].get("job") == 1, 15)
        assert _status(server)["dropped"] == {"bad_text": 1}
        server.stop()
        server.start()
        _publish(broker.port, ("dev/good/job", _job("good", "j-3", "active", True, now + 1), False))
        assert wait_for(lambda: _status(server)["stored"].get("job") == 1, 15)
        assert _status(server)["received"].get("job") == 1  # the poison was acknowledged: not redelivered
    finally:
        server.stop()


def test_error_counters_summing_past_2_63_are_clamped_and_flagged(tmp_path, mosquitto_broker, keys, backend):
    """Three error counters each below 2^62 sum past 2^63 (a BIGINT overflow that stopped the
    ingest for good): the sum is clamped to 2^62, stored, counted in /metrics."""
    broker = mosquitto_broker
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys, db_url=backend).start()
    try:
        errors = {"a": BIG - 1, "b": BIG - 1, "c": BIG - 1}
        _publish(
            broker.port,
            ("dev/evil/telemetry", _telemetry("evil", 1, inferences=BIG - 1, errors=errors), False),
            ("dev/good/telemetry", _telemetry("good", 1), False),
        )
        assert wait_for(lambda: _status(server)["stored"].get("telemetry") == 2, 15)
        evil = _device(server, "evil")
        assert evil["errors_total"] == BIG and evil["inferences_total"] == 1
        assert _status(server)["clamped"] == {"errors_total": 1, "errors_interval": 1}
        metrics = server.get("/metrics").decode()
        assert 'edgepack_fleet_ingest_clamped_total{field="errors_total"} 1' in metrics
    finally:
        server.stop()


# ------------------------------------------------------------------ parse boundaries (pure)


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        ('"plain"', False),
        ('"\\u00e9\\ud83d\\ude00"', False),  # a surrogate pair is a valid character
        ('"\\ud800"', True),
        ('"\\udfff"', True),
        ('"a\\u0000b"', True),
        ('"\\u0001"', False),
    ],
)
def test_text_with_a_nul_or_a_lone_surrogate_is_refused_anywhere_in_a_message(text, refused):
    for payload in (
        _state("d", 1.0, provider=text),
        f'{{"schema": "edgepack.state/1", "device": "d", "status": "online", "ts": 1, '
        f'"capabilities": {{{text}: 1}}}}'.encode(),
    ):
        result = parse_state("d", payload)
        assert (result == "bad_text") is refused, result


def test_an_error_sum_at_2_62_passes_and_past_it_is_clamped():
    exact = parse_telemetry("d", _telemetry("d", 1, errors={"a": BIG - 1, "b": 1}))
    assert exact.errors_total == BIG and exact.clamped == ()
    over = parse_telemetry("d", _telemetry("d", 1, errors={"a": BIG - 1, "b": 2}))
    assert over.errors_total == BIG and over.clamped == ("errors_total", "errors_interval")
    assert parse_telemetry("d", _telemetry("d", 1, inferences=BIG)).inferences_interval is None  # 2^62: refused


def test_a_message_with_too_many_strings_is_refused():
    def state(strings: int) -> bytes:  # 8 strings besides the list: 5 keys, 3 values
        return json.dumps(
            {"schema": "edgepack.state/1", "device": "d", "status": "online", "ts": 1, "x": ["s"] * (strings - 8)}
        ).encode()

    assert isinstance(parse_state("d", state(bounds.MAX_STRINGS)), DeviceState)
    assert parse_state("d", state(bounds.MAX_STRINGS + 1)) == "bad_text"


# ------------------------------------------------------------------ the dead-letter table


@pytest.mark.parametrize("poison", ["lone_surrogate", "nul", "counter_past_2_63"])
def test_a_message_that_still_fails_to_store_is_a_dead_letter_and_the_batch_goes_on(database, monkeypatch, poison):
    """With the parse guards off, the poison reaches the database and fails there: the batch is
    split until that message is alone, it becomes a dead letter, the rest is stored. (SQLite
    stores a NUL: there it is no poison.)"""
    monkeypatch.setattr(bounds, "has_bad_text", lambda _doc: False)
    monkeypatch.setattr(bounds, "BIG", 2**70)  # counters and their sums unbounded
    ingest = _ingest(database)
    now = time.time()
    evil = {
        "lone_surrogate": _item("state", "evil", _state("evil", now, provider=SURROGATE)),
        "nul": _item("state", "evil", _state("evil", now, provider='"a\\u0000b"')),
        "counter_past_2_63": _item("telemetry", "evil", _telemetry("evil", 1, errors={"a": 2**62, "b": 2**62})),
    }[poison]
    batch = [_item("state", f"good-{n}", _state(f"good-{n}", now)) for n in range(5)]
    batch.insert(3, evil)
    batch.append(_item("telemetry", "good-0", _telemetry("good-0", 1)))
    assert ingest.store(batch) is True
    letters = dead_letters(database, limit=10, before=None, device=None)
    if poison == "nul" and database.is_sqlite:
        assert letters == [] and _count(database, tables.devices) == 6
        return
    assert _count(database, tables.devices) == 5
    assert [(d["device"], d["kind"], d["topic"]) for d in letters] == [("evil", evil.kind, evil.topic)]
    assert letters[0]["reason"].isascii() and letters[0]["size"] == len(evil.payload), letters
    assert ingest.counters.dead_letters == {evil.kind: 1} and ingest.counters.stored["telemetry"] == 1
    assert ingest.drops.of("evil") == {"dead_letter": 1}
    assert dead_letters(database, limit=10, before=None, device="good-1") == []


def test_the_dead_letter_table_keeps_only_the_newest(database, monkeypatch):
    monkeypatch.setattr(bounds, "has_bad_text", lambda _doc: False)
    monkeypatch.setattr(ingest_module, "MAX_DEAD_LETTERS", 3)
    ingest = _ingest(database)
    for n in range(5):
        ingest.store([_item("state", f"evil-{n}", _state(f"evil-{n}", 1.0, provider=SURROGATE))])
    kept = dead_letters(database, limit=10, before=None, device=None)
    assert [d["device"] for d in kept] == ["evil-4", "evil-3", "evil-2"]
    assert [d["device"] for d in dead_letters(database, limit=1, before=kept[0]["id"], device=None)] == ["evil-3"]


def test_a_locked_database_is_waited_for_not_dead_lettered(tmp_path, monkeypatch):
    """An operational failure (the database locked or away) is the database's, not the data's:
    the batch is kept whole and retried, nothing becomes a dead letter."""

    def impatient(dbapi_connection, record):  # fail at once on a lock instead of after 10 s
        pragmas(dbapi_connection, record)
        dbapi_connection.execute("PRAGMA busy_timeout=0")

    pragmas = db_module._sqlite_pragmas
    monkeypatch.setattr(db_module, "_sqlite_pragmas", impatient)
    path = tmp_path / "fleet.db"
    database = open_database(f"sqlite:///{path}")
    holder = sqlite3.connect(path, timeout=10)
    try:
        ingest = _ingest(database)
        monkeypatch.setattr(ingest._stop, "wait", lambda _s: False)  # retry at once: the lock decides
        attempts: list[int] = []
        real_flush = ingest.flush

        def flush(batch):
            attempts.append(len(batch))
            if len(attempts) == 3:
                holder.rollback()  # the other writer lets go
            return real_flush(batch)

        monkeypatch.setattr(ingest, "flush", flush)
        holder.execute("BEGIN IMMEDIATE")
        assert ingest.store([_item("state", "d1", _state("d1", 1.0)), _item("state", "d2", _state("d2", 1.0))])
        assert attempts == [2, 2, 2]  # the whole batch each time: never split, never a dead letter
        assert _count(database, tables.devices) == 2 and _count(database, tables.dead_letters) == 0
    finally:
        holder.close()
        database.dispose()


# ------------------------------------------------------------------ budgets


def test_a_bucket_passes_its_burst_and_refuses_one_more_then_refills():
    buckets = Buckets(Rate(per_s=10.0, burst=200.0))
    assert all(buckets.allow("flood", 100.0) for _ in range(200))
    assert buckets.allow("flood", 100.0) is False
    assert buckets.allow("other", 100.0) is True  # another device's budget is its own
    assert [buckets.allow("flood", 100.25) for _ in range(3)] == [True, True, False]  # 0.25 s at 10/s: 2.5


def test_buckets_and_the_drop_ledger_are_bounded_in_devices():
    buckets = Buckets(Rate(1.0, 1.0), max_devices=3)
    for device in ("a", "b", "c", "d"):
        assert buckets.allow(device, 0.0)
    assert buckets.allow("a", 0.0) is True  # evicted (least recently used): starts full again
    assert buckets.allow("d", 0.0) is False
    ledger = DropLedger(max_devices=2)
    for device in ("a", "b", "c", "d"):
        ledger.add(device, "job_rate")
    assert ledger.top() == {"(other)": {"job_rate": 2}, "a": {"job_rate": 1}, "b": {"job_rate": 1}}


def test_the_queue_is_bounded_in_bytes_as_well_as_items():
    queue = ByteQueue(max_items=100, max_bytes=3 * (1000 + ingest_module.ITEM_OVERHEAD))
    item = _item("telemetry", "d", b"x" * 1000)
    assert [queue.put(item) for _ in range(4)] == [True, True, True, False]
    taken = queue.take(10, 0.0, 0.0)
    assert len(taken) == 3 and queue.bytes == 3 * item.cost  # the writer holds them: still counted
    assert queue.put(item) is False
    queue.release(taken)
    assert queue.bytes == 0
    huge = _item("telemetry", "d", b"x" * 10**6)
    assert queue.put(huge) is True  # an empty queue takes any one message (it was bounded at parse)
    assert queue.put(item) is False


def test_a_job_event_flood_from_one_device_stores_at_most_its_budget(tmp_path, mosquitto_broker, keys):
    """One device sends 20,000 distinct job events as fast as it can: at most its burst (200)
    plus 10 a second are stored, the rest dropped as job_rate and counted against it; another
    device's event is stored meanwhile."""
    broker = mosquitto_broker
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys).start()
    publisher = Publisher(broker.port, "flood")
    try:
        started = time.time()
        infos = [
            publisher.send("dev/flood/job", _job("flood", "j-1", "downloading", False, started + n / 1e4), wait=False)
            for n in range(20_000)
        ]
        for info in infos:
            info.wait_for_publish(60)
        _publish(broker.port, ("dev/good/job", _job("good", "j-2", "active", True, started), False))
        done = wait_for(
            lambda: (lambda s: s if s["stored"].get("job", 0) + s["dropped"].get("job_rate", 0) == 20_001 else None)(
                _status(server)
            ),
            90,
        )
        elapsed = time.time() - started
        assert done is not None, _status(server)
        stored_flood = done["stored"]["job"] - 1
        assert 200 <= stored_flood <= 200 + 10 * elapsed + 10, (stored_flood, elapsed)
        assert done["dropped_by_device"]["flood"] == {"job_rate": 20_000 - stored_flood}
        assert "good" not in done["dropped_by_device"]
        with sqlite3.connect(f"file:{server.folder / 'fleet.db'}?mode=ro", uri=True, timeout=10) as connection:
            rows = dict(connection.execute("SELECT device, count(*) FROM job_events GROUP BY device").fetchall())
        assert rows == {"flood": stored_flood, "good": 1}
    finally:
        publisher.close()
        server.stop()


def _rss_peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


def test_a_telemetry_flood_while_the_database_is_stalled_keeps_memory_bounded(tmp_path, mosquitto_broker, keys):
    """The writer is stalled (another process holds the SQLite write lock); 1,500 telemetry
    messages of 60 kB (90 MB) arrive from 5 devices: the queue holds at most its 64 MiB, the
    rest is dropped as queue_full and counted per device, and after the lock goes the held
    messages are stored."""
    broker = mosquitto_broker
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys).start()
    holder = sqlite3.connect(server.folder / "fleet.db", timeout=10)
    publisher = Publisher(broker.port, "bulk")
    try:
        baseline = _rss_peak_kib(server.proc.pid)
        holder.execute("BEGIN IMMEDIATE")
        pad = "x" * 60_000
        infos = []
        for n in range(1500):
            device = f"bulk-{n % 5}"
            doc = json.loads(_telemetry(device, n))
            doc["pad"] = pad
            infos.append(publisher.send(f"dev/{device}/telemetry", json.dumps(doc).encode(), wait=False))
        for info in infos:
            info.wait_for_publish(60)
        flooded = wait_for(
            lambda: (lambda s: s if s["received"].get("telemetry", 0) == 1500 else None)(_status(server)), 60
        )
        assert flooded is not None
        assert flooded["queue_bytes"] <= ingest_module.QUEUE_BYTES
        grown_mib = (_rss_peak_kib(server.proc.pid) - baseline) / 1024
        assert grown_mib < 64 * 1.75, grown_mib  # 65.5 MiB measured; on main every message stayed queued
        holder.rollback()
        done = wait_for(
            lambda: (
                lambda s: s if s["stored"].get("telemetry", 0) + s["dropped"].get("queue_full", 0) == 1500 else None
            )(_status(server)),
            60,
        )
        assert done is not None, _status(server)
        dropped = done["dropped"]["queue_full"]
        assert dropped >= 1500 - ingest_module.QUEUE_BYTES // (60_000 + ingest_module.ITEM_OVERHEAD) - 20
        assert sum(r.get("queue_full", 0) for r in done["dropped_by_device"].values()) == dropped
    finally:
        holder.close()
        publisher.close()
        server.stop()


def test_job_events_kept_per_device_are_capped_by_retention(database):
    now = time.time()
    with database.write() as connection:
        Writer(database).jobs(
            connection,
            [(parse_job_event("flood", _job("flood", "j", "downloading", False, n)), now) for n in range(1, 13)]
            + [(parse_job_event("good", _job("good", "j", "active", True, 1)), now)],
        )
    Pruner(database, RetentionPolicy(), job_rows_per_device=10).run_once(now)
    with database.read() as connection:
        kept = connection.execute(select(tables.job_events.c.device, tables.job_events.c.ts)).all()
    assert sorted(ts for device, ts in kept if device == "flood") == [float(n) for n in range(3, 13)]
    assert [ts for device, ts in kept if device == "good"] == [1.0]


# ------------------------------------------------------------------ groups


def _states(database: Database, *states: tuple[str, bytes, float]) -> None:
    with database.write() as connection:
        Writer(database).states(connection, [(parse_state(d, payload), heard) for d, payload, heard in states])


def test_a_device_claiming_a_group_later_is_not_enrolled_in_it(database):
    """The claim at first sight is enrolled; a later claim is recorded and shown, never used: a
    rollout to the claimed group does not reach the device."""
    now = time.time()
    _states(
        database,
        ("pi-1", _state("pi-1", now, groups=["kitchen"]), now),
        ("pi-2", _state("pi-2", now, groups=["prod"]), now),
    )
    _states(database, ("pi-1", _state("pi-1", now + 1, groups=["kitchen", "prod"]), now + 1))
    pi1 = list_devices(database, DeviceFilter(), now=now + 1, silence_s=60)["devices"][0]
    assert pi1["groups"] == ["kitchen"] and pi1["unenrolled_groups"] == ["prod"]
    prod = list_devices(database, DeviceFilter(group="prod"), now=now + 1, silence_s=60)
    assert [d["id"] for d in prod["devices"]] == ["pi-2"]
    with database.write() as connection:
        connection.execute(
            tables.artifacts.insert().values(
                sha256="a" * 64, name="m", version="2", size=1, key_id="k", targets="[]", created_at=0, created_by="t"
            )
        )
    request = RolloutRequest.from_json({"artifact": "a" * 64, "waves": [100], "group": "prod"})
    rollout = create_rollout(database, request, actor="op", remote="", silence_s=60, now=now + 1)
    with database.read() as connection:
        targets = (
            connection.execute(
                select(tables.rollout_devices.c.device).where(tables.rollout_devices.c.rollout_id == rollout)
            )
            .scalars()
            .all()
        )
    assert targets == ["pi-2"]
    _states(database, ("pi-1", _state("pi-1", now + 2, groups=[]), now + 2))  # a claim of nothing changes nothing
    assert list_devices(database, DeviceFilter(group="kitchen"), now=now + 2, silence_s=60)["total"] == 1


def test_groups_are_enrolled_by_an_operator_with_an_audited_put(tmp_path, mosquitto_broker, keys):
    broker = mosquitto_broker
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys).start()
    try:
        now = time.time()
        _publish(broker.port, ("dev/pi-9/state", _state("pi-9", now, groups=["kitchen"]), False))
        assert wait_for(lambda: _device(server, "pi-9"), 15) is not None
        _publish(broker.port, ("dev/pi-9/state", _state("pi-9", now + 1, groups=["prod"]), False))
        device = wait_for(
            lambda: (lambda d: d if d and d["unenrolled_groups"] == ["prod"] else None)(_device(server, "pi-9")), 15
        )
        assert device["groups"] == ["kitchen"]
        status, answer = server.call("PUT", "/api/devices/pi-9/groups", {"groups": ["prod", "kitchen", "prod"]})
        assert status == 200 and answer["groups"] == ["kitchen", "prod"] and answer["unenrolled_groups"] == []
        entry = server.get("/api/audit?action=device.groups")["entries"][0]
        assert (entry["target"], entry["detail"]) == ("pi-9", {"before": ["kitchen"], "after": ["kitchen", "prod"]})
        most = [f"g{n}" for n in range(64)]
        assert server.call("PUT", "/api/devices/pi-9/groups", {"groups": most})[0] == 200
        assert server.call("PUT", "/api/devices/pi-9/groups", {"groups": [*most, "g64"]})[0] == 400
        assert server.call("PUT", "/api/devices/pi-9/groups", {"groups": ["bad/one"]})[0] == 400
        assert server.call("PUT", "/api/devices/pi-9/groups", {"groups": []})[1]["groups"] == []
        assert server.call("PUT", "/api/devices/nobody/groups", {"groups": []})[0] == 404
        assert server.call("PUT", "/api/devices/pi-9/groups", {"groups": []}, token="wrong-token-0123456789")[0] == 401
        refused = server.get("/api/audit?action=device.groups")["entries"]
        assert [e["outcome"] for e in refused[:3]] == ["refused", "ok", "refused"]
    finally:
        server.stop()


# ------------------------------------------------------------------ clocks that lie


def test_a_state_ten_days_in_the_future_does_not_pin_a_device_offline(database):
    now = time.time()
    ingest = _ingest(database)
    ingest.store([_item("state", "pi-1", _state("pi-1", now + 10 * 86400, status="offline"), at=now)])
    ingest.store([_item("state", "pi-1", _state("pi-1", now + 1), at=now + 1)])
    device = list_devices(database, DeviceFilter(), now=now + 1, silence_s=60)["devices"][0]
    assert (device["status"], device["online"]) == ("online", True) and device["last_seen"] == pytest.approx(now + 1)
    with database.read() as connection:
        assert connection.execute(select(tables.devices.c.state_ts)).scalar() == now + 1  # kept as reported


def test_a_final_job_event_with_a_backwards_ts_ends_the_job(database):
    with database.write() as connection:
        connection.execute(
            tables.artifacts.insert().values(
                sha256="a" * 64, name="m", version="2", size=1, key_id="k", targets="[]", created_at=0, created_by="t"
            )
        )
        connection.execute(
            tables.rollouts.insert().values(
                id="ro-1",
                artifact_sha256="a" * 64,
                name="m",
                version="2",
                state="running",
                wave=0,
                waves="[100]",
                wave_count=1,
                min_success_share=1.0,
                soak_s=0,
                wave_timeout_s=60,
                rollback_on_failure=False,
                force_downgrade=False,
                allow_contract_change=False,
                reason="",
                created_at=0,
                created_by="t",
                updated_at=0,
                revision=0,
            )
        )
        connection.execute(
            tables.rollout_devices.insert().values(
                rollout_id="ro-1", device="d1", wave=0, command_id="ro-1-d0-x", state="sent", final=False, reason=""
            )
        )
    ingest = _ingest(database)
    ingest.store([_item("job", "d1", _job("d1", "ro-1-d0-x", "testing", False, 1000.0))])
    ingest.store([_item("job", "d1", _job("d1", "ro-1-d0-x", "downloading", False, 400.0))])  # not final: loses
    ingest.store([_item("job", "d1", _job("d1", "ro-1-d0-x", "active", True, 500.0))])  # the clock stepped back
    with database.read() as connection:
        row = connection.execute(select(tables.rollout_devices)).mappings().one()
    assert (row["state"], row["final"]) == ("active", True)
    assert _count(database, tables.job_events) == 3 and ingest.counters.stored["job"] == 3


# ------------------------------------------------------------------ sums of the maximum values


def test_summed_counters_at_their_maximum_fold_into_rollups(database):
    """Every sample of a bucket at the largest counters the ingest accepts: the rollup saturates
    at 2^63 - 1 instead of failing the retention job (which then never pruned again)."""
    errors = {"a": BIG - 1, "b": BIG - 1}
    with database.write() as connection:
        Writer(database).telemetry(
            connection,
            [
                (parse_telemetry("d", _telemetry("d", n, inferences=BIG - 1, errors=errors)), 1000.0 + n)
                for n in range(6)
            ],
        )
    pruner = Pruner(database, RetentionPolicy(raw_s=120, rollup_s=6000, step_s=60, interval_s=1))
    pruner.run_once(now=2000.0)
    with database.write() as connection:  # a late sample for the same bucket merges into the saturated row
        Writer(database).telemetry(
            connection, [(parse_telemetry("d", _telemetry("d", 9, inferences=BIG - 1, errors=errors)), 1001.0)]
        )
    pruner.run_once(now=2000.0)
    with database.read() as connection:
        row = connection.execute(select(tables.telemetry_rollup)).mappings().one()
    assert (row["samples"], row["inferences"], row["errors"]) == (7, MAX_BIGINT, MAX_BIGINT)
    assert pruner.folded == 7


def test_summed_counters_at_their_maximum_do_not_stop_the_soak(database):
    wave = [f"d{n}" for n in range(3)]
    with database.write() as connection:
        Writer(database).telemetry(
            connection,
            [
                (
                    parse_telemetry(d, _telemetry(d, n, inferences=BIG - 1, errors={"a": BIG - 1, "b": BIG - 1})),
                    100.0 + n,
                )
                for d in wave
                for n in range(4)
            ],
        )
        figures = Driver._soak_figures(connection, {"soak_started_at": 50.0, "max_error_rate": 0.5}, wave)
    assert set(figures) == set(wave)
    for inferences, errors in figures.values():
        assert inferences == errors and 2**63 - 2**11 <= inferences <= INT64_MAX


def test_an_api_error_is_not_a_data_error():
    """The transient/data split: an operational error is retried, anything else is split."""
    from sqlalchemy.exc import DataError, OperationalError, StatementError

    assert ingest_module._is_transient(OperationalError("x", {}, Exception("locked")))
    assert not ingest_module._is_transient(DataError("x", {}, Exception("bigint out of range")))
    assert not ingest_module._is_transient(StatementError("x", "x", {}, UnicodeEncodeError("utf-8", "", 0, 1, "r")))
    assert not ingest_module._is_transient(ApiError(400, "invalid", "x"))


def test_dead_letters_are_listed_by_the_api_and_counted_in_metrics(tmp_path, mosquitto_broker, keys):
    broker = mosquitto_broker
    server = FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys).start()
    try:
        with sqlite3.connect(server.folder / "fleet.db", timeout=10) as connection:
            connection.executemany(
                "INSERT INTO dead_letters (received_at, device, kind, topic, reason, size, payload_head) "
                "VALUES (?, ?, 'job', ?, 'DataError: x', 3, ?)",
                [(float(n), f"evil-{n}", f"{ROOT}/dev/evil-{n}/job", b"\x00\xff!") for n in range(3)],
            )
        letters = server.get("/api/dead-letters?limit=2")["dead_letters"]
        assert [d["device"] for d in letters] == ["evil-2", "evil-1"] and letters[0]["payload_head"] == "AP8h"
        assert server.get("/api/dead-letters?device=evil-0&limit=1000")["dead_letters"][0]["kind"] == "job"
        assert server.get(f"/api/dead-letters?before={letters[1]['id']}")["dead_letters"][0]["device"] == "evil-0"
        assert server.call("GET", "/api/dead-letters?limit=1001")[0] == 400
        assert server.call("GET", "/api/dead-letters?device=bad/one")[0] == 400
        assert server.call("GET", "/api/dead-letters?before=1000000000000000000")[0] == 400
        metrics = server.get("/metrics").decode()
        assert 'edgepack_fleet_ingest_dead_letters_total{kind="job"} 0' in metrics  # this process stored none
    finally:
        server.stop()


def _p50(database: Database, device: str) -> tuple[float, float]:
    with database.read() as connection:
        row = connection.execute(select(tables.devices).where(tables.devices.c.id == device)).mappings().one()
    return row["latency_p50"], row["last_seen"]


def test_a_late_telemetry_sample_does_not_replace_newer_figures_but_counts_as_heard(database):
    """The device's seq orders its figures (its outbox replays older samples after an outage,
    another server of the share group may commit later); liveness is the receipt."""

    def sample(seq: int, at: float) -> tuple:
        doc = json.loads(_telemetry("pi-1", seq))
        doc["latency_ms"]["p50"] = float(seq)
        return parse_telemetry("pi-1", json.dumps(doc).encode()), at

    def write(*samples: tuple) -> None:
        with database.write() as connection:
            Writer(database).telemetry(connection, list(samples))

    write(sample(10, 1000.0))
    write(sample(5, 1001.0))
    assert _p50(database, "pi-1") == (10.0, 1001.0)
    write(sample(11, 1002.0))
    write(sample(1, 1003.0))  # the sequence restarted (its state lost): not taken at once
    assert _p50(database, "pi-1") == (11.0, 1003.0)
    write(sample(2, 1002.0 + ingest_module.SEQ_STALE_S + 1))  # the figures went stale: taken
    assert _p50(database, "pi-1")[0] == 2.0
    write(sample(30, 2000.0), sample(29, 2001.0))  # in one batch too
    assert _p50(database, "pi-1") == (30.0, 2001.0)
    assert _count(database, tables.telemetry_raw) == 7


def test_a_seq_far_below_the_stored_one_is_a_restarted_sequence():
    gap = ingest_module.SEQ_RESTART_GAP
    assert ingest_module.newer_seq(11, 10) and not ingest_module.newer_seq(10, 10)
    assert not ingest_module.newer_seq(gap + 5 - gap, gap + 5)  # exactly the gap below: a late sample
    assert ingest_module.newer_seq(4, gap + 5)  # one more: a restart
    assert ingest_module.newer_seq(None, 3) and ingest_module.newer_seq(3, None)


@pytest.mark.parametrize(
    ("text", "rate"),
    [("10/200", (10.0, 200.0)), ("0.5/1", (0.5, 1.0)), (" 1000000/1000000000 ", (1e6, 1e9))],
)
def test_a_budget_is_per_second_over_burst(text, rate):
    parsed = parse_rate(text)
    assert (parsed.per_s, parsed.burst) == rate


@pytest.mark.parametrize("text", ["10", "0/200", "10/0.99", "1000001/1", "1/1000000001", "x/y", "inf/1", "nan/5"])
def test_a_budget_outside_its_bounds_is_refused(text):
    with pytest.raises(ValueError, match="--budget-job"):
        parse_rate(text, "--budget-job")
