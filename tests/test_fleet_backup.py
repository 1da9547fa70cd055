"""Backup and restore of the fleet's database (issue 24, item 10): a consistent copy while a
server writes, restored under a server that then serves what the copy held; PostgreSQL through
pg_dump and pg_restore; bad input one line, never a half-written backup."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from edgepack_core.protocol.messages import parse_state
from sdk.errors import FleetServerError
from sdk.fleet_server import db as tables
from sdk.fleet_server.backup import backup
from sdk.fleet_server.db import Database, open_database
from sdk.fleet_server.ingest import Writer
from tests.fleet_server_process import edgepack
from tests.postgres import pg_binary, postgres_server, postgres_url  # noqa: F401  (fixtures)


def _add_devices(database: Database, names: list[str]) -> None:
    now = time.time()
    states = [(parse_state(name, json.dumps({"schema": "edgepack.state/1", "device": name, "status": "online",
                                             "ts": now}).encode()), now) for name in names]
    with database.write() as connection:
        Writer(database).states(connection, states)


def _devices(database: Database) -> list[str]:
    with database.read() as connection:
        return sorted(connection.execute(select(tables.devices.c.id)).scalars())


def test_an_sqlite_backup_taken_while_the_server_writes_restores_everything_committed(tmp_path: Path):
    live = tmp_path / "fleet.db"
    database = open_database(f"sqlite:///{live}")
    try:
        _add_devices(database, ["cam-01", "cam-02"])  # committed, still in the WAL: a plain cp may miss them
        out = tmp_path / "backups" / "fleet-copy.db"
        out.parent.mkdir()
        assert "SQLite online backup" in backup(f"sqlite:///{live}", out)
        _add_devices(database, ["cam-03"])  # after the backup: not in it
    finally:
        database.dispose()
    assert out.stat().st_mode & 0o777 == 0o600
    assert sqlite3.connect(out).execute("PRAGMA integrity_check").fetchone() == ("ok",)
    restored = open_database(f"sqlite:///{out}")  # what a server does at start: migrate, then serve
    try:
        assert _devices(restored) == ["cam-01", "cam-02"]
    finally:
        restored.dispose()


def test_a_postgresql_dump_restores_into_an_empty_database(postgres_server, tmp_path: Path):  # noqa: F811
    source_url, target_url = postgres_server.create_database(), postgres_server.create_database()
    source = open_database(source_url)
    try:
        _add_devices(source, ["pi-1", "pi-2", "pi-3"])
    finally:
        source.dispose()
    out = tmp_path / "fleet.dump"
    assert "pg_dump" in backup(source_url, out)
    restored = subprocess.run([pg_binary("pg_restore"), "--no-owner", "--dbname", target_url, str(out)],
                              capture_output=True, text=True, timeout=120)
    assert restored.returncode == 0, restored.stderr
    target = open_database(target_url)
    try:
        assert _devices(target) == ["pi-1", "pi-2", "pi-3"]
    finally:
        target.dispose()


@pytest.mark.parametrize("args, message", [
    (["--db", "sqlite:///{tmp}/missing.db", "{tmp}/out.db"], "no SQLite database at"),
    (["--db", "mysql://x/y", "{tmp}/out.db"], "is not supported"),
    (["--db", "sqlite:///{tmp}/fleet.db", "{tmp}/fleet.db"], "would overwrite the database itself"),
])
def test_bad_backup_input_is_one_line_and_leaves_no_file(tmp_path: Path, args, message):
    open_database(f"sqlite:///{tmp_path / 'fleet.db'}").dispose()
    before = sorted(p.name for p in tmp_path.iterdir())
    result = edgepack("fleet", "backup", *[a.format(tmp=tmp_path) for a in args])
    assert result.returncode in (1, 2) and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and message in result.stderr, result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_a_failed_backup_keeps_the_previous_one(tmp_path: Path):
    good = tmp_path / "out.db"
    good.write_bytes(b"the previous backup")
    with pytest.raises(Exception, match="no SQLite database"):
        backup(f"sqlite:///{tmp_path / 'gone.db'}", good)
    assert good.read_bytes() == b"the previous backup"


def test_a_database_migrated_by_a_newer_release_is_refused_in_one_line(tmp_path: Path):
    """The upgrade order in the docs: an older server must not run on a newer schema."""
    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    open_database(url).dispose()
    with sqlite3.connect(tmp_path / "fleet.db") as connection:
        connection.execute("UPDATE alembic_version SET version_num = '9999'")
    result = edgepack("fleet", "backup", "--db", url, str(tmp_path / "copy.db"))  # backup needs no migration
    assert result.returncode == 0, result.stderr
    with pytest.raises(FleetServerError, match=r"newer Edgepack release .*'9999'"):
        open_database(url)
