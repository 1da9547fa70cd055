"""``edgepack fleet backup``: a consistent copy of the fleet's database while servers run.

SQLite: the online backup API (page by page, consistent under WAL while the server writes; a
plain ``cp`` of a WAL database can lose the last commits or copy a torn file). PostgreSQL:
``pg_dump --format=custom`` (one snapshot), with the password passed in the environment, never
on the command line (``ps`` shows arguments). Either way the copy is written beside ``out``
under a temporary name, mode 0600, and renamed into place only when complete, so a failed
backup never replaces a good one. Restoring is documented in docs/fleet-server.md ("Backup and
restore"); a server started on a restored copy resumes from the targets, rollouts and the states
devices report again.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from pathlib import Path

from sqlalchemy.engine import make_url

from edgepack_core.fsutil import staged_path
from sdk.errors import FleetServerError
from sdk.fleet_server.db import normalise_url, sqlite_file

PG_DUMP_TIMEOUT_S = 3600


def backup(db_url: str, out: Path) -> str:
    """Copy the database at ``db_url`` to ``out``; returns what was done, in one line."""
    url = normalise_url(db_url)
    file = sqlite_file(url)
    if file is not None:
        _backup_sqlite(file, out)
        return f"SQLite online backup of {file} written to {out}"
    _dump_postgresql(url, out)
    return f"pg_dump (custom format) of {make_url(url).render_as_string()} written to {out}"


def _backup_sqlite(file: Path, out: Path) -> None:
    if not file.is_file():
        raise FleetServerError(f"no SQLite database at {file}")
    if out.resolve() == file.resolve():
        raise FleetServerError(f"the backup {out} would overwrite the database itself")
    try:
        source = sqlite3.connect(f"file:{file}?mode=ro", uri=True)
    except sqlite3.Error as err:
        raise FleetServerError(f"cannot open {file}: {err}") from err
    try:
        with staged_path(out) as staging:
            staging.unlink()  # sqlite writes a database of its own, not into mkstemp's empty file
            target = sqlite3.connect(staging)
            try:
                source.backup(target)
            finally:
                target.close()
    except sqlite3.Error as err:
        raise FleetServerError(f"cannot back up {file}: {err}") from err
    finally:
        source.close()


def _dump_postgresql(url: str, out: Path) -> None:
    pg_dump = shutil.which("pg_dump")
    if pg_dump is None:
        raise FleetServerError("pg_dump is not on PATH (Debian: apt install postgresql-client)")
    parsed = make_url(url)
    env = {**os.environ}
    if parsed.password is not None:
        env["PGPASSWORD"] = str(parsed.password)
    plain = parsed.set(drivername="postgresql", password=None).render_as_string(hide_password=False)
    with staged_path(out) as staging:
        try:
            done = subprocess.run([pg_dump, "--format=custom", "--no-password", "--file", str(staging), plain],
                                  env=env, capture_output=True, text=True, timeout=PG_DUMP_TIMEOUT_S,
                                  stdin=subprocess.DEVNULL, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise FleetServerError(f"pg_dump failed: {err}") from err
        if done.returncode != 0:
            first = (done.stderr.strip().splitlines() or ["no message"])[0][:300]
            raise FleetServerError(f"pg_dump failed ({done.returncode}): {first}")
