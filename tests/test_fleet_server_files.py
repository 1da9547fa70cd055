"""The fleet server's own files: the SQLite database is whole after a clean stop, a lost database
is not silently a new fleet, a damaged stored artifact is never served, a full disk is a 507
(a real `edgepack fleet serve`, a real mosquitto, a real small filesystem where one can be mounted)."""

from __future__ import annotations

import errno
import json
import shutil
import signal
import sqlite3
import subprocess
from pathlib import Path

import pytest

from sdk.errors import ApiError
from sdk.fleet_server.startup import new_fleet_refusal
from tests.artifacts import build_artifact
from tests.broker import free_port
from tests.fleet_server_process import FleetServerProcess, edgepack, make_keys


@pytest.fixture(scope="module")
def keys(tmp_path_factory, keypair):
    return make_keys(tmp_path_factory.mktemp("keys"), release=keypair)


@pytest.fixture
def artifact(tmp_path, keypair) -> Path:
    """A signed artifact (built per test: a few hundred milliseconds)."""
    return build_artifact(tmp_path / "arts", keypair[0], version="1.1.0")


def _upload(server: FleetServerProcess, data: bytes) -> tuple[int, dict]:
    return server.call("POST", "/api/artifacts", data=data, headers={"Content-Type": "application/octet-stream"})


# ------------------------------------------------------------------ the database


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_after_a_clean_stop_the_database_file_alone_holds_the_fleet(tmp_path, mosquitto_broker, keys, artifact, stop):
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=keys).start()
    try:
        status, stored = _upload(server, artifact.read_bytes())
        assert status == 201, stored
    finally:
        server.proc.send_signal(stop)
        assert server.proc.wait(30) in (0, 130)
    database = server.folder / "fleet.db"
    wal = database.with_name("fleet.db-wal")
    assert not wal.exists() or wal.stat().st_size == 0, wal.stat().st_size
    alone = tmp_path / "copy" / "fleet.db"  # the file without its WAL, as a backup of it would be
    alone.parent.mkdir()
    shutil.copyfile(database, alone)
    with sqlite3.connect(f"file:{alone}?mode=ro", uri=True) as connection:
        assert connection.execute("SELECT sha256 FROM artifacts").fetchall() == [(stored["sha256"],)]
        assert connection.execute("SELECT count(*) FROM audit_log").fetchone()[0] >= 1


def _serve(keys, tmp: Path, *extra: str) -> subprocess.CompletedProcess:
    """`fleet serve` against an unreachable broker: the database checks come before the broker's."""
    return edgepack(
        "fleet",
        "serve",
        "--broker",
        "127.0.0.1:1",
        "--trust",
        str(keys.release_pub),
        "--token-file",
        str(keys.token_file),
        "--operator-key",
        str(keys.operator_key),
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--db",
        f"sqlite:///{tmp / 'fleet.db'}",
        "--artifacts",
        str(tmp / "artifacts"),
        *extra,
        timeout=60,
    )


def _refused(result: subprocess.CompletedProcess, text: str) -> None:
    assert result.returncode == 1, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("edgepack:")]
    assert len(lines) == 1 and text in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def _store_with_one_artifact(tmp: Path) -> None:
    (tmp / "artifacts").mkdir(parents=True)
    (tmp / "artifacts" / f"{'a' * 64}.edgepkg").write_bytes(b"stored")


def test_a_0_byte_database_beside_an_artifact_store_refuses_to_start_with_one_line(keys, tmp_path):
    _store_with_one_artifact(tmp_path)
    (tmp_path / "fleet.db").write_bytes(b"")
    _refused(_serve(keys, tmp_path), "is an empty file (0 bytes), not a fleet")
    assert (tmp_path / "fleet.db").stat().st_size == 0  # nothing was created in it
    # --init says a new fleet is meant: it gets past the database (to the unreachable broker)
    _refused(_serve(keys, tmp_path, "--init"), "cannot reach the broker")
    _refused(_serve(keys, tmp_path, "--init"), "already holds a fleet; start without --init")


def test_a_database_without_a_fleet_beside_stored_artifacts_refuses_to_start(keys, tmp_path):
    _store_with_one_artifact(tmp_path)
    with sqlite3.connect(tmp_path / "fleet.db") as connection:
        connection.execute("CREATE TABLE notes (text TEXT)")
    _refused(_serve(keys, tmp_path), "holds no fleet but the artifact store holds 1 artifact(s)")


def test_a_first_start_with_no_database_and_an_empty_store_creates_the_fleet(keys, tmp_path):
    _refused(_serve(keys, tmp_path), "cannot reach the broker")  # past the database: it was created
    with sqlite3.connect(tmp_path / "fleet.db") as connection:
        assert connection.execute("SELECT count(*) FROM alembic_version").fetchone()[0] == 1


def test_a_lost_database_is_refused_unless_init_says_a_new_fleet_is_meant():
    where = "the database X"
    assert new_fleet_refusal(has_schema=True, empty_file=False, stored_artifacts=3, init=False, where=where) is None
    assert "already holds" in new_fleet_refusal(
        has_schema=True, empty_file=False, stored_artifacts=0, init=True, where=where
    )
    assert new_fleet_refusal(has_schema=False, empty_file=False, stored_artifacts=0, init=False, where=where) is None
    assert "0 bytes" in new_fleet_refusal(
        has_schema=False, empty_file=True, stored_artifacts=0, init=False, where=where
    )
    assert "1 artifact" in new_fleet_refusal(
        has_schema=False, empty_file=False, stored_artifacts=1, init=False, where=where
    )
    assert new_fleet_refusal(has_schema=False, empty_file=True, stored_artifacts=5, init=True, where=where) is None


# ------------------------------------------------------------------ the artifact store


def test_a_damaged_stored_artifact_is_quarantined_and_answered_410_never_served(
    tmp_path, mosquitto_broker, keys, artifact
):
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=keys).start()
    try:
        status, stored = _upload(server, artifact.read_bytes())
        assert status == 201
        sha = stored["sha256"]
        assert server.call("GET", f"/artifacts/{sha}.edgepkg", token=None) == (200, artifact.read_bytes())
        path = server.artifacts / f"{sha}.edgepkg"
        with open(path, "r+b") as handle:  # one byte changes on the server's disk
            handle.seek(len(artifact.read_bytes()) // 2)
            byte = handle.read(1)
            handle.seek(-1, 1)
            handle.write(bytes([byte[0] ^ 0x01]))
        for headers in ({}, {"Range": "bytes=0-9"}):
            status, doc = server.call("GET", f"/artifacts/{sha}.edgepkg", token=None, headers=headers)
            assert status == 410 and doc["error"]["code"] == "gone", (status, doc)
            assert "quarantined" in doc["error"]["message"] and "hash to" in doc["error"]["message"]
        assert not path.exists() and (server.artifacts / ".quarantine" / f"{sha}.edgepkg").is_file()
        assert "not to its name" in (server.artifacts / ".quarantine" / f"{sha}.reason").read_text()
        assert _upload(server, artifact.read_bytes())[0] == 200  # uploaded again: restored
        assert server.call("GET", f"/artifacts/{sha}.edgepkg", token=None) == (200, artifact.read_bytes())
    finally:
        server.stop()


def test_a_full_disk_during_an_upload_is_507_with_the_reason(tmp_path, keypair):
    """ENOSPC as the OS reports it at the write boundary (where no small filesystem can be mounted,
    the real one below covers it): 507 naming the cause, the partial file removed."""
    from edgepack_core.signing import TrustStore
    from sdk.fleet_server.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "store", TrustStore.from_paths([keypair[1]]))
    upload = store.begin_upload()
    upload.write(b"x" * 1000)

    class FullDisk:
        def write(self, _chunk: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            pass

    upload._handle = FullDisk()  # type: ignore[assignment]
    with pytest.raises(ApiError) as refused:
        upload.write(b"y" * 1000)
    assert refused.value.status == 507 and "no space left" in refused.value.message
    assert list(store.incoming.iterdir()) == []


def _can_mount_tmpfs(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {tmp_path}"], capture_output=True, timeout=30
    )
    return probe.returncode == 0


def test_an_upload_to_a_full_artifact_disk_is_507_and_the_server_goes_on(tmp_path, mosquitto_broker, keys, artifact):
    """The artifact store on a real 1 MiB tmpfs (its own mount namespace): a 3 MiB upload fills
    it: 507 with the reason, nothing left behind, and a small upload afterwards is stored."""
    if not _can_mount_tmpfs(tmp_path):
        pytest.skip("no mount namespace with tmpfs here (unshare -rm)")
    server = FleetServerProcess(
        tmp_path / "server", broker=mosquitto_broker.address, keys=keys, extra=("--max-upload", "8M")
    )
    server.artifacts.mkdir(parents=True)
    server.args = [
        "unshare",
        "-rm",
        "sh",
        "-c",
        'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$@"',
        str(server.artifacts),
        *server.args,
    ]
    server.start()
    try:
        status, doc = _upload(server, b"\0" * (3 * 1024 * 1024))
        assert status == 507 and doc["error"]["code"] == "insufficient_storage", (status, doc)
        assert "no space left" in doc["error"]["message"]
        assert server.call("GET", "/healthz", token=None)[0] == 200
        assert _upload(server, artifact.read_bytes())[0] == 201  # the partial file was removed: room again
    finally:
        server.stop()


def test_a_database_with_no_space_left_is_a_507_not_a_500(tmp_path):
    """SQLite's own "database or disk is full" (a page limit stands in for the full disk: the same
    error code the OS's ENOSPC gives), raised through SQLAlchemy, is answered 507 naming it."""
    import asyncio

    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError
    from starlette.requests import Request

    from sdk.fleet_server.api import _database_error

    engine = create_engine(f"sqlite:///{tmp_path / 'full.db'}")
    with engine.connect() as connection, pytest.raises(OperationalError) as full:
        connection.exec_driver_sql("CREATE TABLE t (x BLOB)")
        connection.exec_driver_sql("PRAGMA max_page_count = 2")
        connection.exec_driver_sql("INSERT INTO t VALUES (?)", (b"x" * 100_000,))
    engine.dispose()
    request = Request({"type": "http", "method": "POST", "path": "/api/artifacts", "headers": []})
    response = asyncio.run(_database_error(request, full.value))
    assert response.status_code == 507
    assert json.loads(response.body)["error"]["code"] == "insufficient_storage"
