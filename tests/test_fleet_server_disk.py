"""Data stays safe on the server's disk (issue 25 item 8): file modes, the database password
outside the URL, Alembic quiet at start; and one real `fleet serve --alerts` run that sends an
offline alert to a webhook (item 7, end to end)."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from edgepack_core.protocol.payloads import STATE_SCHEMA_ID
from sdk.errors import ServerConfigError
from sdk.fleet_server.disk import read_db_password, resolve_password, tightened, url_with_password
from tests.conftest import run_cli
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for
from tests.test_fleet_alerts import Receiver


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_tightening_keeps_what_the_owner_may_and_drops_what_others_may():
    assert tightened(0o644, 0o600) == 0o600
    assert tightened(0o600, 0o600) is None
    assert tightened(0o400, 0o600) is None  # already narrower: left as it is
    assert tightened(0o755, 0o700) == 0o700
    assert tightened(0o710, 0o700) == 0o700  # one bit for the group is one too many


def test_a_new_sqlite_database_is_created_0600_with_its_wal_under_a_wide_umask(tmp_path: Path):
    from sdk.fleet_server.db import open_database

    old = os.umask(0o022)
    try:
        database = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")
        try:
            with database.write() as connection:
                connection.exec_driver_sql("CREATE TABLE IF NOT EXISTS t (x)")
            assert _mode(tmp_path / "fleet.db") == 0o600
            assert _mode(tmp_path / "fleet.db-wal") == 0o600  # SQLite gives its side files the database's mode
        finally:
            database.close()
    finally:
        os.umask(old)


def test_an_existing_0644_database_and_0755_store_are_tightened_with_one_line_each(tmp_path: Path, caplog):
    from sdk.fleet_server.artifacts import ArtifactStore
    from sdk.fleet_server.db import open_database

    open_database(f"sqlite:///{tmp_path / 'fleet.db'}").close()
    (tmp_path / "fleet.db").chmod(0o644)
    (tmp_path / "artifacts").mkdir(mode=0o755)
    (tmp_path / "artifacts").chmod(0o755)
    with caplog.at_level(logging.WARNING, logger="edgepack.fleet_server.disk"):
        open_database(f"sqlite:///{tmp_path / 'fleet.db'}").close()
        ArtifactStore(tmp_path / "artifacts", trust=None)  # type: ignore[arg-type]
    assert _mode(tmp_path / "fleet.db") == 0o600 and _mode(tmp_path / "artifacts") == 0o700
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 2, lines
    assert "was mode 644; made it 600" in lines[0] and "was mode 755; made it 700" in lines[1]


def test_a_new_artifact_store_is_0700(tmp_path: Path):
    from sdk.fleet_server.artifacts import ArtifactStore

    old = os.umask(0o022)
    try:
        ArtifactStore(tmp_path / "deep" / "artifacts", trust=None)  # type: ignore[arg-type]
    finally:
        os.umask(old)
    assert _mode(tmp_path / "deep" / "artifacts") == 0o700


def test_the_database_password_comes_from_a_file_or_the_environment_never_twice(tmp_path: Path):
    secret = tmp_path / "db.password"
    secret.write_text("pa:ss@word\n")
    secret.chmod(0o600)
    url = url_with_password("postgresql://edgepack@db/fleet", read_db_password(secret))
    assert url == "postgresql://edgepack:pa%3Ass%40word@db/fleet"
    assert resolve_password(None, {"EDGEPACK_DB_PASSWORD": "env-pw"}) == "env-pw"
    assert resolve_password(secret, {"EDGEPACK_DB_PASSWORD": "env-pw"}) == "pa:ss@word"  # the file wins
    assert resolve_password(None, {}) is None
    with pytest.raises(ServerConfigError, match="already holds a password"):
        url_with_password("postgresql://edgepack:old@db/fleet", "new")
    with pytest.raises(ServerConfigError, match="sqlite takes none"):
        url_with_password("sqlite:///fleet.db", "pw")
    secret.chmod(0o644)
    with pytest.raises(ServerConfigError, match="readable by others"):
        read_db_password(secret)


def test_a_password_file_others_can_read_is_refused_in_one_line_by_the_cli(tmp_path: Path):
    secret = tmp_path / "db.password"
    secret.write_text("pw\n")
    secret.chmod(0o644)
    run = run_cli(
        "edgepack",
        "fleet",
        "backup",
        "--db",
        "postgresql://edgepack@127.0.0.1:1/fleet",
        "--db-password-file",
        str(secret),
        str(tmp_path / "out.dump"),
    )
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "readable by others" in run.stderr and "Traceback" not in run.stderr


ALERTS = """\
offline:
  after_s: 1
evaluate_every_s: 0.1
webhooks:
  - url: {url}
delivery:
  backoff_s: 0.05
  max_backoff_s: 0.1
"""


def test_fleet_serve_starts_quietly_keeps_its_files_private_and_sends_an_offline_alert(
    tmp_path: Path, mosquitto_broker
):
    hook = Receiver(fail_first=1)
    alerts = tmp_path / "alerts.yaml"
    alerts.write_text(ALERTS.format(url=hook.url))
    keys = make_keys(tmp_path / "keys")
    old = os.umask(0o022)
    try:
        server = FleetServerProcess(
            tmp_path / "server", broker=mosquitto_broker.address, keys=keys, extra=("--alerts", str(alerts))
        ).start()
    finally:
        os.umask(old)
    try:
        publisher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="cam-1")
        publisher.connect("127.0.0.1", mosquitto_broker.port)
        publisher.loop_start()
        state = {
            "schema": STATE_SCHEMA_ID,
            "device": "cam-1",
            "status": "online",
            "ts": time.time(),
            "groups": [],
            "capabilities": {"profile": "x86"},
            "model": None,
            "provider": "CPUExecutionProvider",
        }
        publisher.publish("edgepack/v1/dev/cam-1/state", json.dumps(state), qos=1).wait_for_publish(10)
        publisher.loop_stop()
        publisher.disconnect()
        document, _signature, _body = hook.next(timeout=30)  # silent for over 1 s: one alert, on the second try
        assert document["event"] == "fired" and document["key"] == "offline:cam-1"
        assert hook.attempts == 2
        opened = wait_for(lambda: server.get("/api/alerts")["open"], 10)
        assert [a["key"] for a in opened] == ["offline:cam-1"]
        sent = wait_for(lambda: server.get("/api/audit?action=alert.sent")["entries"], 10)
        assert sent and sent[0]["target"] == "offline:cam-1" and sent[0]["detail"]["attempts"] == 2
        (sink,) = server.get("/api/status")["alerts"]["sinks"]
        assert (sink["sent"], sink["given_up"], sink["queued"]) == (1, 0, 0)
        metrics = server.get("/metrics").decode()
        assert f'edgepack_fleet_alerts_total{{sink="{sink["name"]}",outcome="sent"}} 1' in metrics
        assert (_mode(server.folder / "fleet.db"), _mode(server.artifacts)) == (0o600, 0o700)
    finally:
        server.stop()
        hook.close()
    log = server.log_text()
    assert "alembic" not in log, log  # no "setup plugin" nor "Running upgrade" INFO lines at start


_START = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
from sdk.fleet_server.schema_upgrade import quiet_alembic
quiet_alembic(verbose=sys.argv[2] == "verbose")
from sdk.fleet_server.db import open_database
open_database("sqlite:///" + sys.argv[1]).close()
"""


@pytest.mark.parametrize("verbose", [False, True])
def test_alembic_speaks_at_a_start_only_when_asked_with_v(tmp_path: Path, verbose: bool):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _START, str(tmp_path / "fleet.db"), "verbose" if verbose else "quiet"],
                         capture_output=True, text=True, timeout=60, check=True)
    lines = [line for line in run.stderr.splitlines() if line.startswith("INFO alembic")]
    assert bool(lines) is verbose, run.stderr
    if verbose:
        assert any("Running upgrade" in line for line in lines)
