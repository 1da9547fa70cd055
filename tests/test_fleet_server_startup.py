"""A server joining a database another server led (issue 24, item 10 "Failover trap"): without
--public-url the server that took over sent its own address and the wave failed ("the artifact
URL is not on an origin this device allows"). Now it refuses to start, in one line, unless the
artifacts have one address (--public-url) or the operator says devices allow every server."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sdk.fleet_server.startup import joining_problem
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for


@pytest.mark.parametrize("holder, public_url, per_server, refused", [
    (None, None, False, False),  # a database no server led
    ("a", None, False, False),  # this server itself, restarted
    ("b", None, False, True),  # the failover trap
    ("b", "https://cdn.example/models", False, False),
    ("b", None, True, False),
])
def test_joining_rule_boundaries(holder, public_url, per_server, refused):
    problem = joining_problem(holder, "a", public_url=public_url, per_server_urls=per_server)
    assert bool(problem) is refused
    if refused:
        assert "'b'" in problem and "--public-url" in problem and "--per-server-urls" in problem


def test_a_second_server_without_public_url_refuses_to_join_in_one_line(tmp_path: Path, mosquitto_broker, keypair):
    keys = make_keys(tmp_path / "keys", release=keypair)
    database = f"sqlite:///{tmp_path / 'fleet.db'}"
    first = FleetServerProcess(tmp_path / "a", broker=mosquitto_broker.address, keys=keys, db_url=database,
                               server_id="alpha").start()
    try:
        assert wait_for(lambda: (first.get("/api/status").get("lease") or {}).get("holder") == "alpha", 30)
        second = FleetServerProcess(tmp_path / "b", broker=mosquitto_broker.address, keys=keys, db_url=database,
                                    server_id="beta")
        refused = subprocess.run(second.args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert refused.returncode in (1, 2), refused.stderr
        lines = [line for line in refused.stderr.splitlines() if "alpha" in line]
        assert len(lines) == 1 and "also uses this database" in lines[0], refused.stderr
        assert "Traceback" not in refused.stderr
        second.args.append("--per-server-urls")
        second.start()  # the explicit flag lets it join
        second.stop()
    finally:
        first.stop()
    FleetServerProcess(tmp_path / "a2", broker=mosquitto_broker.address, keys=keys, db_url=database,
                       server_id="alpha").start().stop()  # the server that led restarts without a word
