"""`edgepack fleet serve` and `edgepack rollout` refuse what they cannot use with one line and exit
1 (failed) or 2 (bad usage), before serving anything, never with a traceback."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from tests.broker import free_port
from tests.fleet_server_process import edgepack, make_keys


@pytest.fixture
def keys(tmp_path: Path, keypair):
    return make_keys(tmp_path / "keys", release=keypair)


def _serve(keys, *extra: str, broker: str = "127.0.0.1:1", db: str | None = None,
           tmp: Path | None = None) -> subprocess.CompletedProcess:
    args = ["fleet", "serve", "--broker", broker, "--trust", str(keys.release_pub), "--token-file",
            str(keys.token_file), "--operator-key", str(keys.operator_key), "--listen", f"127.0.0.1:{free_port()}",
            "--db", db or f"sqlite:///{tmp / 'fleet.db'}", "--artifacts", str(tmp / "artifacts"), *extra]
    return edgepack(*args, timeout=60)


def _one_line(result: subprocess.CompletedProcess, code: int, text: str) -> None:
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.startswith("edgepack:") or "Error" in line]
    assert len(lines) == 1 and text in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_an_unreachable_broker_is_one_line(keys, tmp_path):
    _one_line(_serve(keys, tmp=tmp_path), 1, "cannot reach the broker at 127.0.0.1:1")


def test_a_token_file_others_can_read_is_refused(keys, tmp_path):
    keys.token_file.chmod(0o644)
    _one_line(_serve(keys, tmp=tmp_path), 2, "readable by others")


def test_a_short_token_is_refused_naming_the_line(keys, tmp_path):
    keys.token_file.write_text("# one\nadmin:short\n")
    _one_line(_serve(keys, tmp=tmp_path), 2, "line 2")


def test_an_operator_key_others_can_read_is_refused(keys, tmp_path):
    keys.operator_key.chmod(0o644)
    _one_line(_serve(keys, tmp=tmp_path), 1, "operator key is readable by others")  # as edgepack deploy says it


def test_a_database_that_cannot_be_used_is_one_line(keys, tmp_path):
    _one_line(_serve(keys, db="mysql://u@h/db", tmp=tmp_path), 2, "not supported")
    _one_line(_serve(keys, db="postgresql://u:secret@127.0.0.1:1/db", tmp=tmp_path), 1, "cannot use the database")


def test_a_busy_port_is_one_line(keys, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        _one_line(_serve(keys, "--listen", f"127.0.0.1:{port}", tmp=tmp_path), 2, f"cannot listen on 127.0.0.1:{port}")


def test_a_wildcard_listen_address_needs_a_public_url(keys, tmp_path):
    _one_line(_serve(keys, "--listen", "0.0.0.0:8760", tmp=tmp_path), 2, "--public-url")
    _one_line(_serve(keys, "--public-url", "ftp://x/y", tmp=tmp_path), 2, "--public-url must be an http(s) URL")


def test_bad_retention_values_are_usage_errors(keys, tmp_path):
    result = _serve(keys, "--retention-raw", "soon", tmp=tmp_path)
    assert result.returncode == 2 and "not a duration" in result.stderr
    _one_line(_serve(keys, "--retention-raw", "2d", "--retention-rollups", "1d", tmp=tmp_path), 2,
              "shorter than the raw window")


def test_rollout_commands_need_a_server_and_a_token(keys, tmp_path):
    artifact = tmp_path / "a.edgepkg"
    artifact.write_bytes(b"x")
    missing = edgepack("rollout", "create", str(artifact), "--group", "g", "--server", "http://127.0.0.1:1")
    assert missing.returncode == 2 and "--token-file" in missing.stderr
    both = edgepack("rollout", "create", str(artifact), "--group", "g", "--device", "d", "--server",
                    "http://127.0.0.1:1", "--token-file", str(keys.token_file))
    assert both.returncode == 2 and "--group G or --device ID" in both.stderr
    _one_line(edgepack("rollout", "status", "ro-1", "--server", "http://127.0.0.1:1", "--token-file",
                       str(keys.token_file)), 1, "cannot reach the fleet server at http://127.0.0.1:1")
    _one_line(edgepack("rollout", "status", "ro-1", "--server", "file:///etc/passwd", "--token-file",
                       str(keys.token_file)), 2, "--server must be the server's http(s) URL")


@pytest.mark.parametrize(("flag", "value"), [("--budget-job", "10"), ("--budget-state", "0/200"),
                                             ("--budget-telemetry", "20/0.5"), ("--budget-job", "nan/200"),
                                             ("--budget-job", "1000001/1")])
def test_a_budget_that_is_not_a_rate_is_one_line(keys, tmp_path, flag, value):
    _one_line(_serve(keys, flag, value, tmp=tmp_path), 2, flag)


def test_a_job_events_kept_of_zero_is_one_line(keys, tmp_path):
    _one_line(_serve(keys, "--job-events-kept", "0", tmp=tmp_path), 2, "--job-events-kept")
