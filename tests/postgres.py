"""A real PostgreSQL for tests, from Debian's ``postgresql`` package, on a free loopback port.

The cluster lives in a temporary directory (``initdb``), trusts local connections, and runs
with ``fsync=off`` (tests kill the fleet server, never the database). ``initdb`` refuses to
run as root, so as root the cluster belongs to the ``postgres`` user (or ``nobody``) and its
tools run through ``runuser``. Without the binaries the fixture skips, saying why; CI installs
the package (.ci/run), where a missing PostgreSQL fails instead.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.broker import free_port, port_accepts


class PostgresError(RuntimeError):
    """PostgreSQL is missing or would not start."""


def pg_binary(name: str) -> str:
    """Path of a PostgreSQL server tool (``initdb``, ``pg_ctl``): on PATH or under
    /usr/lib/postgresql/<version>/bin (Debian keeps them there)."""
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)
    found = shutil.which(name) or (candidates[0] if candidates else None)
    if found is None:
        raise PostgresError(f"{name} not found (apt-get install postgresql)")
    return found


def _run_as() -> list[str]:
    """The prefix that runs a command as a non-root user when we are root."""
    if os.geteuid() != 0:
        return []
    for user in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(user)
            return ["runuser", "-u", user, "--"]
    raise PostgresError("running as root and there is no postgres or nobody user to run PostgreSQL as")


@dataclass
class Postgres:
    root: Path
    port: int
    prefix: list[str]

    @property
    def data(self) -> Path:
        return self.root / "data"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://edgepack@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A fresh, empty database; its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=edgepack dbname=postgres",
                             autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        subprocess.run([*self.prefix, pg_binary("pg_ctl"), "-D", str(self.data), "-m", "immediate", "stop"],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> Postgres:
    prefix = _run_as()
    root = Path(tempfile.mkdtemp(prefix="edgepack-pg-", dir="/tmp"))
    os.chmod(root, 0o755)
    if prefix:
        user = prefix[2]
        shutil.chown(root, user=user)
    port = free_port()
    initdb = subprocess.run([*prefix, pg_binary("initdb"), "-D", str(root / "data"), "-U", "edgepack", "-A", "trust",
                             "-E", "UTF8", "--no-sync"], capture_output=True, text=True, timeout=120)
    if initdb.returncode != 0:
        raise PostgresError(f"initdb failed: {initdb.stderr[-2000:]}")
    options = (f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off "
               "-c full_page_writes=off -c max_connections=200")
    started = subprocess.run([*prefix, pg_binary("pg_ctl"), "-D", str(root / "data"), "-o", options,
                              "-l", str(root / "postgres.log"), "-w", "-t", "60", "start"],
                             capture_output=True, text=True, timeout=90)
    if started.returncode != 0:
        log = (root / "postgres.log").read_text(errors="replace") if (root / "postgres.log").exists() else ""
        raise PostgresError(f"pg_ctl start failed: {started.stderr[-1000:]} {log[-2000:]}")
    deadline = time.monotonic() + 30
    while not port_accepts(port):
        if time.monotonic() > deadline:
            raise PostgresError("PostgreSQL did not accept connections")
        time.sleep(0.05)
    return Postgres(root, port, prefix)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Postgres]:
    try:
        server = start_postgres()
    except PostgresError as err:
        if os.environ.get("CI") == "true":  # CI installs it (.ci/run): a skip there would hide a failure
            pytest.fail(f"PostgreSQL did not start: {err}")
        pytest.skip(f"PostgreSQL is not available here: {err}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: Postgres) -> str:
    """A fresh database on the session's PostgreSQL."""
    return postgres_server.create_database()
