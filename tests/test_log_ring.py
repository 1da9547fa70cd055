"""Remote logs (issue 25, item 5), the parts one at a time: the agent's log ring and its bounds
(the cap keeps the newest; a restart keeps what was on disk; a torn or corrupt segment is cut or
dropped with a warning, never fatal), the redaction of secrets, the chunks' 64 KiB bound, the
device's rate limit at its boundary, the server's storage of chunks (duplicates once, the
newest per device kept) on SQLite and PostgreSQL, agent.yaml ``logs:`` validated up front, and
``--since`` parsing."""

from __future__ import annotations

import gc
import json
import logging
import math
import time
from types import SimpleNamespace

import click
import pytest
from sqlalchemy import func, select

from device_agent.config import check_config
from device_agent.errors import ConfigError
from device_agent.log_redact import RedactingFilter, Redactor, configured_secrets
from device_agent.logring import CURRENT, PREVIOUS, LogRing, LogSettings, encode_line
from device_agent.updates.fetch_logs import LogFetcher
from device_agent.updates.log_rate import Bucket, Rate, take
from edgepack_core.errors import SchemaError
from edgepack_core.protocol.logs import MAX_CHUNK_BYTES, LogLine, chunk_records, parse_logs_chunk
from edgepack_core.protocol.topics import Topics
from sdk.cli.device_logs import parse_since
from sdk.fleet_server import db as tables
from sdk.fleet_server import log_ingest
from sdk.fleet_server.db import Database
from sdk.fleet_server.log_tables import device_log_chunks, device_logs
from sdk.keys import write_keypair
from tests.postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)
from tests.test_fleet_server_db import database  # noqa: F401  (the fixture: SQLite and PostgreSQL)

NOW = 1_800_000_000.0


def _logger(ring: LogRing, name: str = "edgepack.test") -> logging.Logger:
    logger = logging.getLogger(name)
    logger.handlers = [ring]
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    return logger


def _line(seq: int, message: str = "m", ts: float = NOW) -> LogLine:
    return LogLine(seq, ts + seq, "info", "edgepack.agent", message)


# ------------------------------------------------------------------ the ring


def test_the_ring_cap_keeps_the_newest_records_by_count_and_by_bytes(tmp_path):
    ring = LogRing(LogSettings(max_bytes=16 * 1024, max_records=10), None)
    logger = _logger(ring)
    for number in range(25):
        logger.info("record %d", number)
    assert [line.message for line in ring.records()] == [f"record {n}" for n in range(15, 25)]
    size = len(encode_line(next(iter(ring.records()))))
    by_bytes = LogRing(LogSettings(max_bytes=16 * 1024, max_records=1_000_000), None)
    logger = _logger(by_bytes, "edgepack.bytes")
    fits = 16 * 1024 // (size + 128)
    for number in range(fits * 3):
        logger.info("record %d %s", number % 10, "x" * 128)
    records, held = by_bytes.size
    assert held <= 16 * 1024 < held + size + 128 and records < fits * 3
    assert list(by_bytes.records())[-1].seq == fits * 3 - 1  # the newest is kept


def test_the_ring_survives_a_restart_and_its_files_stay_within_the_bounds(tmp_path):
    settings = LogSettings(max_bytes=16 * 1024, max_records=40)
    ring = LogRing(settings, tmp_path)
    assert ring.load() == []
    logger = _logger(ring)
    for number in range(200):
        logger.warning("before the restart %d", number)
    ring.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [CURRENT, PREVIOUS]
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= settings.max_bytes
    again = LogRing(settings, tmp_path)
    assert again.load() == []
    kept = list(again.records())
    assert 20 <= len(kept) <= 40 and kept[-1].message == "before the restart 199"
    _logger(again).info("after")
    assert list(again.records())[-1].seq == 200  # the numbering goes on
    assert all((p.stat().st_mode & 0o777) == 0o600 for p in tmp_path.iterdir())


def test_a_torn_last_line_is_cut_and_a_corrupt_segment_is_dropped_with_a_warning(tmp_path):
    settings = LogSettings(max_bytes=16 * 1024, max_records=100)
    (tmp_path / PREVIOUS).write_bytes(b"this is not a log record\n")
    (tmp_path / CURRENT).write_bytes(encode_line(_line(7)) + b'{"seq": 8, "ts"')  # a crash mid-write
    ring = LogRing(settings, tmp_path)
    notes = ring.load()
    assert len(notes) == 1 and "previous.jsonl is unreadable" in notes[0] and "dropped" in notes[0]
    assert not (tmp_path / PREVIOUS).exists()
    assert [line.seq for line in ring.records()] == [7]
    _logger(ring).info("next")
    ring.close()
    reloaded = LogRing(settings, tmp_path)
    assert reloaded.load() == [] and [line.seq for line in reloaded.records()] == [7, 8]


def test_a_segment_over_its_bound_is_dropped_not_read(tmp_path):
    settings = LogSettings(max_bytes=16 * 1024, max_records=100)
    (tmp_path / CURRENT).write_bytes(encode_line(_line(1)) * 2000)
    ring = LogRing(settings, tmp_path)
    assert "over its bound" in ring.load()[0] and list(ring.records()) == []


def test_the_ring_holds_its_records_as_their_lines_not_as_objects_and_a_restart_makes_none(tmp_path):
    """Issue 25 item 10: a full ring held ``LogLine`` objects with their strings (2.2 MiB of heap
    for 1 MiB of lines); it holds the JSON lines and decodes them when a fetch reads them."""
    gc.collect()
    before = sum(isinstance(item, LogLine) for item in gc.get_objects())
    settings = LogSettings(max_bytes=64 * 1024, max_records=300)
    ring = LogRing(settings, tmp_path)
    logger = _logger(ring)
    for number in range(500):
        logger.info("served %d", number)
    ring.close()
    again = LogRing(settings, tmp_path)
    assert again.load() == []
    gc.collect()
    assert sum(isinstance(item, LogLine) for item in gc.get_objects()) == before  # none held by either ring
    assert ring.size[0] == 300 and again.size[0] >= 150
    kept = again.query(since=None, level="info", lines=2)
    assert [line.message for line in kept] == ["served 498", "served 499"] and kept[-1].seq == 499


# ------------------------------------------------------------------ redaction

PEM = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIGc0ZmRmZWJkYzE0ZjI4YjQ1ZDY3ZTU2OWY4\n-----END PRIVATE KEY-----"


@pytest.mark.parametrize(("text", "shown"), [
    ("login with hunter22", "login with [redacted]"),
    (f"key {PEM} end", "key [redacted private key] end"),
    ("-----BEGIN EC PRIVATE KEY-----\nabc", "[redacted private key]"),  # cut short: the rest goes too
    ("Authorization: Bearer abcdefgh12345678", "Authorization: Bearer [redacted]"),
    ("sent bearer abcdefgh12345678 to x", "sent bearer [redacted] to x"),
    ('{"token": "t0k3n", "password":"p"}', '{"token": "[redacted]", "password":"[redacted]"}'),
    ("enroll_token=abc other=1", "enroll_token=[redacted] other=1"),
    ("a public key is fine: -----BEGIN PUBLIC KEY-----", "a public key is fine: -----BEGIN PUBLIC KEY-----"),
])
def test_secrets_are_redacted(text, shown):
    assert Redactor(["hunter22", "abc"])(text) == shown  # "abc" is too short to search for alone


def test_the_configured_mqtt_password_and_client_key_material_are_the_secrets(tmp_path):
    key, public = tmp_path / "client.key", tmp_path / "client.pub"
    write_keypair(key, public)
    tls = SimpleNamespace(key=str(key))
    found = configured_secrets(SimpleNamespace(mqtt=SimpleNamespace(password="s3cret-pw", tls=tls)))
    text = key.read_text()
    body = [line for line in text[text.index("-----BEGIN"):].splitlines() if not line.startswith("-----")]
    assert found == ["s3cret-pw", *body] and body
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "pw %s, key %s", ("s3cret-pw", body[0]), None)
    assert RedactingFilter(Redactor(found)).filter(record)
    assert record.getMessage() == "pw [redacted], key [redacted]"
    assert configured_secrets(SimpleNamespace(mqtt=None)) == []


# ------------------------------------------------------------------ chunks


def test_chunks_stay_within_64_kib_and_a_record_at_the_limit_fits(tmp_path):
    records = [_line(n, "é" * 4096) for n in range(200)]
    chunks = chunk_records(records, device="pi-07", request="req-1", now=NOW)
    assert all(len(chunk) <= MAX_CHUNK_BYTES for chunk in chunks) and len(chunks) > 1
    parsed = [parse_logs_chunk("pi-07", chunk) for chunk in chunks]
    assert [p.chunk for p in parsed] == list(range(len(chunks))) and [p.last for p in parsed][-2:] == [False, True]
    assert [r.seq for p in parsed for r in p.records] == list(range(200))
    assert [len(c) for c in chunk_records([], device="pi-07", request="r", now=NOW)] and \
        parse_logs_chunk("pi-07", chunk_records([], device="pi-07", request="r", now=NOW)[0]).last
    head = len(chunk_records([], device="pi-07", request="req-1", now=NOW)[0])
    one = len(json.dumps(_line(1, "x").to_json(), separators=(",", ":")))
    limit = head + one + 8  # the chunk number's digits and the last flag's spelling vary
    assert len(chunk_records([_line(1, "x")], device="pi-07", request="req-1", now=NOW, max_bytes=limit)) == 1
    with pytest.raises(SchemaError, match="alone is over"):
        chunk_records([_line(1, "x" * 20)], device="pi-07", request="req-1", now=NOW, max_bytes=limit)


def test_a_chunk_over_64_kib_a_foreign_device_or_a_nan_time_is_refused():
    good = chunk_records([_line(1)], device="pi-07", request="r", now=NOW)[0]
    assert parse_logs_chunk("pi-08", good) == "device_mismatch"
    assert parse_logs_chunk("pi-07", good[:-1] + b" " * (MAX_CHUNK_BYTES - len(good)) + b"}") != "too_large"
    assert parse_logs_chunk("pi-07", good[:-1] + b" " * (MAX_CHUNK_BYTES - len(good) + 1) + b"}") == "too_large"
    nan = good.replace(b'"ts":1800000001.0', b'"ts":NaN')
    assert nan != good and parse_logs_chunk("pi-07", nan) == "bad_schema"
    assert parse_logs_chunk("pi-07", good.replace(b'"info"', b'"loud"')) == "bad_schema"


# ------------------------------------------------------------------ the rate limit


def test_the_fetch_rate_limit_passes_its_burst_and_refuses_the_next_with_the_wait():
    rate = Rate(burst=3, per_s=0.5)
    bucket = rate.full(NOW)
    for _ in range(3):
        bucket, wait = take(bucket, rate, NOW)
        assert wait == 0.0
    bucket, wait = take(bucket, rate, NOW)
    assert wait == pytest.approx(2.0)
    bucket, wait = take(bucket, rate, NOW + 1.999)
    assert wait > 0
    bucket, wait = take(bucket, rate, NOW + 2.0)
    assert wait == 0.0
    assert take(Bucket(0.0, NOW), rate, NOW - 100)[1] == pytest.approx(2.0)  # a clock gone back refills nothing


class _Recorder:
    """The MQTT client's publish, recorded (the broker is not what this test is about)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> bool:
        self.sent.append((topic, payload))
        return True


def test_a_fetch_answers_newest_lines_at_a_level_in_chunks_and_the_burst_plus_one_is_refused():
    ring = LogRing(LogSettings(max_records=1000), None)
    logger = _logger(ring, "edgepack.fetch")
    for number in range(300):
        (logger.warning if number % 3 == 0 else logger.debug)("line %d %s", number, "y" * 1000)
    transport = _Recorder()
    fetcher = LogFetcher(ring, transport, Topics(), "pi-07", LogSettings(fetch_burst=2, fetch_per_minute=6), NOW)
    answer = fetcher.answer("req-1", {"lines": 50, "level": "warning"}, NOW)
    assert answer.state == "done" and answer.detail["records"] == 50 and answer.detail["chunks"] == len(transport.sent)
    records = [r for _, p in transport.sent for r in json.loads(p)["records"]]
    assert [r["message"].split()[1] for r in records] == [str(n) for n in range(150, 300, 3)]
    assert all(t == "edgepack/v1/dev/pi-07/logs" and len(p) <= MAX_CHUNK_BYTES for t, p in transport.sent)
    since = records[-2]["ts"]
    assert fetcher.answer("req-2", {"since": since}, NOW).detail["records"] == 5  # lines 295 to 299, any level
    refused = fetcher.answer("req-3", {}, NOW)
    assert refused.state == "failed" and refused.reason.startswith("log fetch refused: over the limit of 2")
    assert "retry in 10.0 s" in refused.reason
    assert LogFetcher(None, transport, Topics(), "pi-07", LogSettings(), NOW).answer("r", {}, NOW).state == "failed"


# ------------------------------------------------------------------ agent.yaml


def _config(**logs: object) -> dict:
    return {"device_id": "pi-07", "store": "/tmp/s", "trust": ["k.pub"], "logs": logs}


def test_the_logs_section_is_validated_up_front():
    config = check_config(_config(max_bytes=16 * 1024, max_records=10, persist=False), None)
    assert config.logs == LogSettings(max_bytes=16 * 1024, max_records=10, persist=False)
    assert check_config({k: v for k, v in _config().items() if k != "logs"}, None).logs == LogSettings()
    for bad in ({"max_bytes": 16 * 1024 - 1}, {"max_records": 9}, {"max_record": 10}, {"fetch_per_minute": 0}):
        with pytest.raises((ConfigError, SchemaError)):
            check_config(_config(**bad), None)


# ------------------------------------------------------------------ the server's storage


def _store(db: Database, *chunks: bytes, device: str = "pi-07") -> None:
    parsed = [(parse_logs_chunk(device, chunk), NOW) for chunk in chunks]
    with db.write() as connection:
        log_ingest.write_chunks(db, connection, parsed)  # type: ignore[arg-type]


def test_stored_logs_are_kept_once_and_the_newest_per_device(database, monkeypatch):  # noqa: F811
    monkeypatch.setattr(log_ingest, "MAX_RECORDS_PER_DEVICE", 50)
    with database.write() as connection:  # the fetches that asked (the live tail sends one every few seconds)
        connection.execute(tables.commands.insert(), [
            {"id": f"fetch-{n}", "rollout_id": None, "device": "pi-07", "kind": "fetch-logs", "topic": "t",
             "payload": b"{}", "created_at": NOW + n, "created_by": "s", "published_at": NOW + n, "attempts": 1}
            for n in range(log_ingest.MAX_FETCHES_PER_DEVICE + 5)])
    first = chunk_records([_line(n) for n in range(30)], device="pi-07", request="r1", now=NOW)
    _store(database, *first)
    _store(database, *first)  # a redelivery, or a fetch that overlaps the one before
    again = chunk_records([_line(n) for n in range(20, 80)], device="pi-07", request="r2", now=NOW)
    _store(database, *again)
    _store(database, *chunk_records([_line(n) for n in range(5)], device="pi-08", request="r3", now=NOW),
           device="pi-08")
    with database.read() as connection:
        seqs = [row[0] for row in connection.execute(select(device_logs.c.seq).where(
            device_logs.c.device == "pi-07").order_by(device_logs.c.seq))]
        other = connection.execute(select(func.count()).select_from(device_logs).where(
            device_logs.c.device == "pi-08")).scalar()
        marks = connection.execute(select(func.count()).select_from(device_log_chunks)).scalar()
        fetches = [row[0] for row in connection.execute(select(tables.commands.c.id).order_by(
            tables.commands.c.created_at))]
    assert seqs == list(range(30, 80)) and other == 5 and marks == 3
    assert fetches == [f"fetch-{n}" for n in range(5, log_ingest.MAX_FETCHES_PER_DEVICE + 5)]  # the newest kept


def test_since_is_unix_seconds_a_duration_ago_or_an_iso_time():
    assert parse_since("1800000000", NOW) == 1_800_000_000.0
    assert parse_since("10m", NOW) == NOW - 600 and parse_since("2h", NOW) == NOW - 7200
    assert parse_since("2027-01-15T08:00:00", NOW) == parse_since("2027-01-15T08:00:00+00:00", NOW)
    for bad in ("yesterday", "10y", "nan", "-5"):
        with pytest.raises(click.BadParameter, match="not unix seconds"):
            parse_since(bad, NOW)
    assert math.isfinite(parse_since("0", time.time()))
