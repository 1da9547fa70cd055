"""`edgepack fleet migrate-db` (issue 25 item 8): a SQLite fleet copied into the project's real
PostgreSQL (tests/postgres.py), every table equal after, a non-empty target refused without
--force, and the PostgreSQL sequences moved past the copied ids."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import insert, select

from sdk.fleet_server import alert_table, audit
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database, metadata, open_database
from sdk.fleet_server.migrate_db import NOT_COPIED, TableCount, migrate_db, occupied
from tests.conftest import run_cli
from tests.postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)
from tests.test_fleet_alerts import stored_rollout

NOW = 1_800_000_000.0
SHA = "b" * 64


def _fill(database: Database) -> None:
    """A small fleet: devices with groups, telemetry, an artifact, a rollout with its devices,
    commands and transitions, job events, targets, the audit, alerts."""
    with database.write() as c:
        c.execute(
            insert(tables.devices),
            [
                {
                    "id": f"cam-{i}",
                    "status": "online",
                    "status_reason": "",
                    "first_seen": NOW,
                    "last_seen": NOW + i,
                    "model_name": "m",
                    "model_version": "1.0.0",
                    "capabilities": json.dumps({"profile": "x86"}),
                }
                for i in range(5)
            ],
        )
        c.execute(insert(tables.device_groups), [{"device": f"cam-{i}", "group_name": "lobby"} for i in range(5)])
        c.execute(
            insert(tables.telemetry_raw),
            [{"device": "cam-1", "ts": NOW + i, "inferences": 10, "errors": i} for i in range(20)],
        )
        stored_rollout(
            c,
            "r1",
            "succeeded",
            [("start", "pending", "running", ""), ("succeed", "running", "succeeded", "")],
            sha256=SHA,
        )
        c.execute(
            insert(tables.rollout_devices),
            [
                {
                    "rollout_id": "r1",
                    "device": f"cam-{i}",
                    "wave": 0,
                    "command_id": f"r1-0-cam-{i}",
                    "state": "active",
                    "final": True,
                }
                for i in range(5)
            ],
        )
        c.execute(
            insert(tables.commands),
            [
                {
                    "id": f"r1-0-cam-{i}",
                    "rollout_id": "r1",
                    "device": f"cam-{i}",
                    "kind": "deploy",
                    "topic": f"edgepack/v1/dev/cam-{i}/cmd",
                    "payload": b"\x00signed\xff",
                    "created_at": NOW,
                    "created_by": "s1",
                    "published_at": NOW,
                    "attempts": 1,
                }
                for i in range(5)
            ],
        )
        c.execute(
            insert(tables.job_events),
            [
                {
                    "device": f"cam-{i}",
                    "job": f"r1-0-cam-{i}",
                    "type": "deploy",
                    "state": state,
                    "final": state == "active",
                    "reason": "",
                    "ts": NOW + n,
                    "received_at": NOW + n,
                }
                for i in range(5)
                for n, state in enumerate(("downloading", "active"))
            ],
        )
        c.execute(
            insert(tables.target_entries).values(
                scope="fleet", name="", model="m", artifact=SHA, revision=1, reason="", set_by="admin", set_at=NOW
            )
        )
        for n in range(30):
            audit.record(c, actor="admin", action="rollout.create", target="r1", detail={"n": n}, now=NOW + n)
        c.execute(
            insert(alert_table.alerts).values(
                kind="offline",
                subject="cam-4",
                state="open",
                open_key="offline:cam-4",
                opened_at=NOW,
                summary="silent",
                detail="{}",
            )
        )


def _dump(database: Database) -> dict[str, list[tuple]]:
    with database.read() as c:
        return {
            table.name: sorted(tuple(row) for row in c.execute(select(table)))
            for table in metadata.sorted_tables
            if table.name not in NOT_COPIED
        }


def test_the_copy_refuses_an_occupied_target_and_names_the_tables():
    assert occupied({"devices": 0, "audit_log": 0}) == ""
    assert "devices (1)" in occupied({"devices": 1, "audit_log": 0}) and "--force" in occupied({"devices": 1})
    assert TableCount("audit_log", 30, 30).problem == ""
    assert TableCount("audit_log", 30, 29).problem == "audit_log: 30 row(s) in the source, 29 in the target"


@pytest.mark.slow
def test_a_sqlite_fleet_is_copied_into_postgresql_with_every_table_equal(tmp_path: Path, postgres_url: str):  # noqa: F811
    source_url = f"sqlite:///{tmp_path / 'fleet.db'}"
    source = open_database(source_url)
    _fill(source)
    expected = _dump(source)
    source.close()
    password = tmp_path / "db.password"
    password.write_text("any\n")  # the test cluster trusts local connections: the password only travels
    password.chmod(0o600)

    run = run_cli(
        "edgepack",
        "fleet",
        "migrate-db",
        "--from",
        source_url,
        "--to",
        postgres_url,
        "--db-password-file",
        str(password),
    )
    assert run.returncode == 0, run.stderr
    assert "audit_log: 30 row(s)" in run.stdout and "devices: 5 row(s)" in run.stdout

    target = open_database(postgres_url)
    try:
        copied = _dump(target)
        assert copied == expected
        for name in ("devices", "job_events", "commands", "rollouts", "rollout_transitions", "audit_log", "alerts"):
            assert copied[name], f"{name} was not part of the fill"
        with target.write() as c:  # the server's next audit row gets a new id, not a copied one
            audit.record(c, actor="admin", action="rollout.pause", target="r1")
        newest = audit.entries(target, limit=1)[0]
        assert newest["action"] == "rollout.pause" and newest["id"] == 31
    finally:
        target.close()

    again = run_cli("edgepack", "fleet", "migrate-db", "--from", source_url, "--to", postgres_url)
    assert again.returncode == 1 and "already holds rows in" in again.stderr and "--force" in again.stderr
    assert again.stderr.count("\n") == 1 and "Traceback" not in again.stderr

    done = migrate_db(source_url, postgres_url, force=True)
    assert done.problems == () and {c.table: c.target for c in done.counts}["audit_log"] == 30
    target = open_database(postgres_url)
    try:
        assert _dump(target) == expected  # the pause row above is gone: replaced by the source's rows
    finally:
        target.close()


def test_migrate_db_refuses_the_same_database_twice(tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    run = run_cli("edgepack", "fleet", "migrate-db", "--from", url, "--to", url)
    assert run.returncode == 1 and "the same database" in run.stderr
