"""The fleet server's database on real SQLite files and a real PostgreSQL: migrations build exactly
the tables of db.py, the leader lease, idempotent writes of what devices say, retention."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import func, inspect, select

from edgepack_core.protocol.messages import parse_job_event, parse_state, parse_telemetry
from sdk.errors import FleetServerError, ServerConfigError
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database, normalise_url, open_database
from sdk.fleet_server.driver import Lease
from sdk.fleet_server.ingest import Writer
from sdk.fleet_server.retention import Pruner, RetentionPolicy
from tests.postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path: Path):
    sqlite = f"sqlite:///{tmp_path / 'fleet.db'}"
    url = sqlite if request.param == "sqlite" else request.getfixturevalue("postgres_url")
    opened = open_database(url)
    yield opened
    opened.dispose()


def test_migrations_build_exactly_the_tables_of_db_py(database: Database):
    with database.engine.connect() as connection:
        differences = compare_metadata(MigrationContext.configure(connection, opts={"compare_type": True}),
                                       tables.metadata)
        version = connection.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()
    assert differences == []
    scripts = ScriptDirectory(str(Path(tables.__file__).parent / "migrations"))
    assert len(scripts.get_heads()) == 1  # helpers adding migrations in parallel must chain them
    assert version == scripts.get_current_head() and version >= "0003"
    assert set(inspect(database.engine).get_table_names()) == {*tables.metadata.tables, "alembic_version"}


def test_migrating_twice_changes_nothing(database: Database):
    tables_before = set(inspect(database.engine).get_table_names())
    again = open_database(database.url)  # a restart: upgrade head on a database already at head
    again.dispose()
    assert set(inspect(database.engine).get_table_names()) == tables_before


def test_sqlite_runs_in_wal_mode(tmp_path: Path):
    opened = open_database(f"sqlite:///{tmp_path / 'wal.db'}")
    try:
        with opened.read() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
    finally:
        opened.dispose()


@pytest.mark.parametrize(("url", "problem"), [
    ("sqlite://", "in-memory"), ("sqlite:///:memory:", "in-memory"), ("mysql://x@y/z", "not supported"),
    ("postgresql+psycopg2://x@y/z", "not supported"), ("not a url", "not a database URL"),
])
def test_database_urls_that_cannot_be_used_are_one_line(url, problem):
    with pytest.raises(ServerConfigError, match=problem):
        normalise_url(url)


def test_postgresql_urls_mean_psycopg_3():
    assert normalise_url("postgresql://u:p@h:5/db").startswith("postgresql+psycopg://u:p@h:5/db")


def test_an_unreachable_database_is_one_line_without_the_password():
    with pytest.raises(FleetServerError) as failed:
        open_database("postgresql://user:secret@127.0.0.1:1/db")
    assert "cannot use the database" in str(failed.value) and "secret" not in str(failed.value)
    assert "\n" not in str(failed.value)


# ------------------------------------------------------------------ the lease


def test_one_lease_holder_at_a_time_until_expiry_or_release(database: Database):
    first, second = Lease(database, "a", ttl_s=5.0), Lease(database, "b", ttl_s=5.0)
    assert first.hold(100.0) is True
    assert second.hold(100.0) is False
    assert first.hold(104.0) is True  # renewed: expires at 109 now
    assert second.hold(108.999) is False
    assert second.hold(109.001) is True  # expired: taken over
    assert first.hold(109.5) is False
    assert first.current()["holder"] == "b"
    second.release()
    assert first.hold(110.0) is True  # given back: no need to wait for the expiry


def test_acquired_at_is_kept_while_renewing(database: Database):
    lease = Lease(database, "a", ttl_s=5.0)
    lease.hold(100.0)
    lease.hold(103.0)
    assert lease.current()["acquired_at"] == 100.0
    assert lease.current()["expires_at"] == 108.0


# ------------------------------------------------------------------ idempotent writes


def _state(device: str, ts: float, status: str = "online", groups: list[str] | None = None,
           version: str | None = "1.0.0") -> bytes:
    return json.dumps({"schema": "edgepack.state/1", "device": device, "status": status, "ts": ts,
                       "groups": groups or ["g1"], "model": {"name": "m", "version": version} if version else None,
                       "provider": "CPU"}).encode()


def _write_states(database: Database, *payloads: tuple[str, bytes], heard: float | None = None) -> None:
    with database.write() as connection:
        Writer(database).states(connection, [(parse_state(d, p), heard or time.time()) for d, p in payloads])


def _device(database: Database, device: str):
    with database.read() as connection:
        row = connection.execute(select(tables.devices).where(tables.devices.c.id == device)).mappings().first()
        groups = sorted(connection.execute(select(tables.device_groups.c.group_name).where(
            tables.device_groups.c.device == device)).scalars())
    return row, groups


def test_an_older_retained_state_never_overwrites_a_newer_one(database: Database):
    """A retained state replayed at a subscribe counts as heard at its own ts (at the latest):
    older than the live state stored, it loses."""
    _write_states(database, ("d1", _state("d1", 20.0, groups=["new"])), heard=20.0)
    _write_states(database, ("d1", _state("d1", 10.0, status="offline", groups=["old"])), heard=10.0)
    row, groups = _device(database, "d1")
    assert (row["status"], row["state_ts"], groups) == ("online", 20.0, ["new"])
    _write_states(database, ("d1", _state("d1", 30.0, status="offline", version=None)), heard=30.0)
    row, groups = _device(database, "d1")
    assert (row["status"], row["model_version"]) == ("offline", "1.0.0")  # a will without a model keeps it


def test_last_seen_never_moves_back(database: Database):
    """A retained state the broker replays at every subscribe says when the device was heard:
    no later than its own ts, never at the replay."""
    _write_states(database, ("d1", _state("d1", 500.0)), heard=1000.0)
    _write_states(database, ("d1", _state("d1", 500.0)), heard=500.0)  # the same state, replayed as retained
    row, _ = _device(database, "d1")
    assert (row["last_seen"], row["first_seen"]) == (1000.0, 1000.0)
    _write_states(database, ("d1", _state("d1", 600.0)), heard=2000.0)
    assert _device(database, "d1")[0]["last_seen"] == 2000.0


def test_an_empty_retained_state_removes_the_device(database: Database):
    _write_states(database, ("d1", _state("d1", 1.0)), ("d2", _state("d2", 1.0)))
    _write_states(database, ("d1", b""))
    assert _device(database, "d1") == (None, [])
    assert _device(database, "d2")[0] is not None


def _job(device: str, job: str, state: str, final: bool, ts: float) -> bytes:
    return json.dumps({"schema": "edgepack.job/1", "device": device, "ts": ts, "job": job, "type": "deploy",
                       "state": state, "final": final, "reason": state}).encode()


def _seed_rollout(database: Database) -> None:
    with database.write() as connection:
        connection.execute(tables.artifacts.insert().values(sha256="a" * 64, name="m", version="2.0.0", size=1,
                                                            key_id="k", targets="[]", created_at=0, created_by="t"))
        connection.execute(tables.rollouts.insert().values(
            id="ro-1", artifact_sha256="a" * 64, name="m", version="2.0.0", state="running", wave=0, waves="[100]",
            wave_count=1, min_success_share=1.0, soak_s=0, wave_timeout_s=60, rollback_on_failure=False,
            force_downgrade=False, allow_contract_change=False, reason="", created_at=0, created_by="t",
            updated_at=0, revision=0))
        connection.execute(tables.rollout_devices.insert().values(rollout_id="ro-1", device="d1", wave=0,
                                                                  command_id="ro-1-d0-x", state="sent", final=False,
                                                                  reason=""))


def _write_jobs(database: Database, *events: bytes) -> int:
    with database.write() as connection:
        return Writer(database).jobs(connection, [(parse_job_event("d1", e), time.time()) for e in events])


def _rollout_device(database: Database):
    with database.read() as connection:
        return connection.execute(select(tables.rollout_devices)).mappings().first()


def test_job_events_are_stored_once_and_fold_into_their_rollout(database: Database):
    _seed_rollout(database)
    queued, active = _job("d1", "ro-1-d0-x", "queued", False, 1.0), _job("d1", "ro-1-d0-x", "active", False, 2.0)
    assert _write_jobs(database, queued, active) == 0
    assert _write_jobs(database, queued) == 1  # a redelivery: a repeat, changes nothing
    assert _rollout_device(database)["state"] == "active"
    with database.read() as connection:
        assert connection.execute(select(func.count()).select_from(tables.job_events)).scalar() == 2


def test_a_late_job_event_does_not_move_a_device_backwards_nor_past_final(database: Database):
    _seed_rollout(database)
    _write_jobs(database, _job("d1", "ro-1-d0-x", "testing", False, 5.0))
    _write_jobs(database, _job("d1", "ro-1-d0-x", "downloading", False, 3.0))  # older ts, arrived later
    assert _rollout_device(database)["state"] == "testing"
    _write_jobs(database, _job("d1", "ro-1-d0-x", "active", True, 6.0))
    _write_jobs(database, _job("d1", "ro-1-d0-x", "rolled_back", True, 7.0))  # after final: ignored
    row = _rollout_device(database)
    assert (row["state"], row["final"]) == ("active", True)


def test_an_event_for_another_command_or_device_changes_no_rollout(database: Database):
    _seed_rollout(database)
    _write_jobs(database, _job("d1", "other-job", "failed", True, 1.0))
    assert _rollout_device(database)["state"] == "sent"



def test_a_golden_stream_refusal_reaches_the_rollout_driver_as_typed_counts_not_its_reason(database: Database):
    """The ingest stores the job detail's counts as the protocol parsed them; the driver reads
    them back typed. A reason that only reads like a refusal carries no counts."""
    from edgepack_core.golden_stream import GoldenCounts
    from sdk.fleet_server.driver import Driver
    from sdk.fleet_server.rollouts import DeviceStatus

    _seed_rollout(database)
    refused = json.loads(_job("d1", "ro-1-d0-x", "failed", True, 2.0))
    refused.update(reason="refused", detail={"golden_stream": {"events": 6, "mismatches": 12}})
    _write_jobs(database, _job("d1", "ro-1-d0-x", "testing", False, 1.0), json.dumps(refused).encode())
    driver = Driver(database, None, None, None, str, "s1")  # type: ignore[arg-type]  (reads only)
    [status] = driver.device_statuses({"id": "ro-1", "wave": 0, "soak_started_at": None}, time.time())
    assert isinstance(status, DeviceStatus) and status.golden_stream == GoldenCounts(6, 12)
    assert status.reason == "refused"
    with database.write() as connection:  # a second rollout device whose reason only looks like one
        connection.execute(tables.rollout_devices.update().values(final=False, state="sent"))
    lookalike = json.loads(_job("d1", "ro-1-d0-x", "failed", True, 3.0))
    lookalike["reason"] = "golden stream of m 2.0.0 failed: 12 event(s) differ from the 6 expected; first: x"
    _write_jobs(database, json.dumps(lookalike).encode())
    [status] = driver.device_statuses({"id": "ro-1", "wave": 0, "soak_started_at": None}, time.time())
    assert status.golden_stream is None and status.reason == lookalike["reason"]


# ------------------------------------------------------------------ retention


def _telemetry(device: str, seq: int, inferences: int = 10, errors: int = 1) -> bytes:
    return json.dumps({"schema": "edgepack.telemetry/1", "device": device, "seq": seq,
                       "latency_ms": {"p50": 2.0, "p99": float(seq)}, "inferences": {"interval": inferences},
                       "errors_interval": {"m": errors}, "throughput_per_s": 5.0}).encode()


def _counts(database: Database) -> tuple[int, int]:
    with database.read() as connection:
        raw = connection.execute(select(func.count()).select_from(tables.telemetry_raw)).scalar()
        rolled = connection.execute(select(func.count()).select_from(tables.telemetry_rollup)).scalar()
    return raw, rolled


def test_pruning_folds_old_samples_into_rollups_and_forgets_old_rollups(database: Database):
    writer = Writer(database)
    with database.write() as connection:
        # 3 devices, one sample every 10 s from t=1000 to t=1590: 60 samples each
        writer.telemetry(connection, [(parse_telemetry(d, _telemetry(d, s)), 1000.0 + 10 * s)
                                      for d in ("a", "b", "c") for s in range(60)])
    pruner = Pruner(database, RetentionPolicy(raw_s=120, rollup_s=600, step_s=60, interval_s=1))
    # The raw window starts at 1480, aligned down to the bucket 1440: samples before it fold.
    pruner.run_once(now=1600.0)
    raw, rolled = _counts(database)
    assert raw == 3 * 16 and pruner.folded == 3 * 44
    assert rolled == 3 * 8  # buckets 960 (2 samples), 1020, ..., 1380 (6 samples each)
    with database.read() as connection:
        first = connection.execute(select(tables.telemetry_rollup).where(
            tables.telemetry_rollup.c.device == "a", tables.telemetry_rollup.c.bucket == 1020)).mappings().one()
    assert (first["samples"], first["inferences"], first["errors"], first["latency_p99_max"]) == (6, 60, 6, 7.0)
    # 600 s later everything is folded, and only the rollups from bucket 1560 on are kept.
    pruner.run_once(now=2200.0)
    assert _counts(database) == (0, 3)
    with database.read() as connection:
        kept = connection.execute(select(tables.telemetry_rollup.c.bucket, tables.telemetry_rollup.c.samples)).all()
    assert sorted(kept) == [(1560, 4)] * 3
    pruner.run_once(now=5000.0)
    assert _counts(database) == (0, 0)


# ------------------------------------------------------------------ the device documents


def test_device_documents_are_built_alike_on_both_backends(database: Database):
    """The list's documents come from SQL (json_object / json_build_object): the same keys, types
    and values on SQLite and PostgreSQL, and the same document as GET of one device."""
    from sdk.fleet_server.queries import DeviceFilter, get_device, list_devices

    now = time.time()
    _write_states(database, ("b", _state("b", 1.0, groups=["z", "a"])), ("a", _state("a", 1.0, status="offline")),
                  ("c", _state("c", 1.0, version=None)))
    with database.write() as connection:
        Writer(database).telemetry(connection, [(parse_telemetry("b", _telemetry("b", 4, inferences=8, errors=2)),
                                                 now)])
    listed = list_devices(database, DeviceFilter(), now=now, silence_s=60)
    assert [d["id"] for d in listed["devices"]] == ["a", "b", "c"]
    assert listed["total"] == 3 and listed["counts"] == {"online": 2, "offline": 1,
                                                         "by_version": {"1.0.0": 2, "none": 1},
                                                         "by_provider": {"CPU": 3}}
    b = listed["devices"][1]
    assert b["online"] is True and b["groups"] == ["a", "z"] and b["error_rate"] == 0.25
    assert b["latency_ms"] == {"p50": 2.0, "p90": None, "p99": 4.0, "mean": None}
    assert b["model"] == {"name": "m", "version": "1.0.0", "sha256": None} and b["inferences_total"] is None
    assert listed["devices"][0]["online"] is False and listed["devices"][2]["model"] is None
    assert listed["devices"][0]["error_rate"] is None and listed["devices"][0]["groups"] == ["g1"]
    single = get_device(database, "b", now=now, silence_s=60)
    assert {k: v for k, v in single.items() if k not in ("capabilities", "report_cards", "pipelines")} == b
    assert single["report_cards"] == []  # a device whose agent measured none (or predates report cards)
    assert single["pipelines"] == []  # nor runs a pipeline
    assert list_devices(database, DeviceFilter(group="z"), now=now, silence_s=60)["total"] == 1
    assert list_devices(database, DeviceFilter(online=False), now=now, silence_s=60)["devices"][0]["id"] == "a"
    assert list_devices(database, DeviceFilter(online=True, limit=1, offset=1), now=now,
                        silence_s=60)["devices"][0]["id"] == "c"
    assert list_devices(database, DeviceFilter(version="9"), now=now, silence_s=60) == {
        "devices": [], "total": 0, "limit": 1000, "offset": 0,
        "counts": {"online": 0, "offline": 0, "by_version": {}, "by_provider": {}}}


def test_history_transitions_and_external_commands_on_both_backends(database: Database):
    """A device's history (the server's command and a job it did not send), a rollout transition
    and the audit of a command the server did not send, built alike on SQLite and PostgreSQL."""
    from sdk.fleet_server.audit import EXTERNAL, entries, record_external, seen_command
    from sdk.fleet_server.driver import rollout_of, save_rollout
    from sdk.fleet_server.history import Page, device_history
    from sdk.fleet_server.queries import get_device, rollout_transitions
    from sdk.fleet_server.rollouts import transition

    _seed_rollout(database)
    _write_states(database, ("d1", _state("d1", 1.0)))
    body = {"id": "ro-1-d0-x", "type": "deploy", "sha256": "a" * 64, "name": "m", "version": "2.0.0",
            "expires_at": 9e9, "sig": {"key_id": "k", "value": "never kept"}}
    with database.write() as connection:
        connection.execute(tables.commands.insert().values(
            id="ro-1-d0-x", rollout_id="ro-1", device="d1", kind="deploy", topic="t", payload=json.dumps(body).encode(),
            created_at=5.0, created_by="s", attempts=1))
    _write_jobs(database, _job("d1", "ro-1-d0-x", "queued", False, 1.0), _job("d1", "ro-1-d0-x", "rolled_back",
                                                                              True, 2.0))
    assert get_device(database, "d1", now=time.time(), silence_s=60)["update_status"] == "failed"
    _write_jobs(database, _job("d1", "by-hand", "active", False, 3.0))
    assert get_device(database, "d1", now=time.time(), silence_s=60)["update_status"] == "updating"
    doc = device_history(database, "d1", Page(limit=1), now=10.0)
    [newest] = doc["entries"]
    assert (newest["job"], newest["sent_by_server"], newest["outcome"]) == ("by-hand", False, "in_progress")
    older = device_history(database, "d1", Page(limit=1, before=doc["next_before"]), now=10.0)
    [deploy] = older["entries"]
    assert (deploy["job"], deploy["rollout"], deploy["outcome"], deploy["reason"]) == (
        "ro-1-d0-x", {"id": "ro-1", "state": "running"}, "failed", "rolled_back")
    assert deploy["artifact"] == {"sha256": "a" * 64, "name": "m", "version": "2.0.0"}
    assert [s["state"] for s in deploy["states"]] == ["queued", "rolled_back"] and older["next_before"] is None
    assert deploy["target"] is None
    with database.write() as connection:
        connection.execute(tables.commands.insert().values(
            id="tg-1", device="d1", kind="deploy", topic="t", payload=json.dumps({**body, "id": "tg-1"}).encode(),
            created_at=9.0, created_by="s", attempts=1))
        connection.execute(tables.target_commands.insert().values(
            id="tg-1", device="d1", model="m", artifact="a" * 64, source="group:g1", revision=1, attempt=1,
            created_at=9.0))
    unanswered = device_history(database, "d1", Page(), now=9e9 + 1)["entries"]
    assert [(e["job"], e["target"], e["outcome"]) for e in unanswered][1:] == [
        ("tg-1", "group:g1", "unanswered"), ("ro-1-d0-x", None, "failed")]
    with database.write() as connection:
        row = connection.execute(select(tables.rollouts)).mappings().one()
        assert save_rollout(connection, row, transition(rollout_of(row), "pause", 7.0, "lunch"), 7.0, event="pause",
                            actor="admin", reason="lunch")
        assert not save_rollout(connection, row, transition(rollout_of(row), "abort", 8.0, "x"), 8.0,
                                event="abort", actor="admin", reason="x")  # a stale revision writes nothing
        assert rollout_transitions(connection, "ro-1") == [{"at": 7.0, "event": "pause", "from": "running",
                                                            "to": "paused", "wave": 1, "actor": "admin",
                                                            "reason": "lunch"}]
        seen = [(seen_command("dev/d1/cmd", "d1", json.dumps(body).encode(), 1.0), 1.0),
                (seen_command("dev/d1/cmd", "d1", json.dumps({**body, "id": "other"}).encode(), 1.0), 1.0)]
        assert record_external(connection, seen) == 1  # the server's own command is not external
    [external] = entries(database, action=EXTERNAL)
    assert external["detail"]["id"] == "other" and "sig" not in json.dumps(external["detail"])
