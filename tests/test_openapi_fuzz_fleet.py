"""schemathesis against a real `edgepack fleet serve`, from the server's own /openapi.json: every
check it has (status codes, response schemas and headers, schema-valid requests accepted and
schema-violating ones refused, 405 with Allow, ignored auth, ...) over examples generated
deterministically (the same requests on every run), with no failure and no 5xx.

The server holds real data first (two simulated devices, an uploaded artifact, a rollout), and
the path parameters name it, so the requests reach past the 404s into the routes' logic.
A schema-valid request may be refused with 422 only: the values are well-formed but cannot be
used together or with the fleet as it is (waves that do not grow, a range of more than 5,000
points, an artifact whose signature does not verify); no JSON Schema can say those."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.artifacts import build_artifact
from tests.conftest import cli
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for
from tools.fleet_sim import SimFleet

MAX_EXAMPLES = 10

CONFIG = """\
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "3xx", "401", "403", "404", "409", "422", "429"]

[parameters]
"path.device_id" = "{device}"
"path.sha256" = "{sha}"
"path.file_name" = "{sha}.edgepkg"
"path.rollout_id" = "{rollout}"
"""


def test_the_fleet_servers_openapi_document_holds_under_schemathesis(tmp_path: Path, mosquitto_broker, keypair):
    keys = make_keys(tmp_path / "keys", release=keypair)
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=keys).start()
    try:
        with SimFleet(mosquitto_broker.host, mosquitto_broker.port, 2, rate=1, prefix="fz"):
            assert wait_for(lambda: server.get("/api/devices?online=true")["total"] == 2)
            artifact = build_artifact(tmp_path / "arts", keypair[0], version="1.1.0")
            status, stored = server.call("POST", "/api/artifacts", data=artifact.read_bytes())
            assert status == 201, stored
            status, rollout = server.call(
                "POST", "/api/rollouts", {"artifact": stored["sha256"], "waves": [100], "devices": ["fz-00000"]}
            )
            assert status == 201, rollout
            config = tmp_path / "schemathesis.toml"
            config.write_text(CONFIG.format(device="fz-00001", sha=stored["sha256"], rollout=rollout["id"]))
            result = subprocess.run(
                [
                    cli("schemathesis"),
                    "--config-file",
                    str(config),
                    "run",
                    f"{server.url}/openapi.json",
                    "--checks",
                    "all",
                    "-H",
                    f"Authorization: Bearer {keys.token}",
                    "--max-examples",
                    str(MAX_EXAMPLES),
                    "--generation-deterministic",
                    "--workers",
                    "1",
                    "--no-color",
                    "--report-dir",
                    str(tmp_path / "report"),
                ],
                capture_output=True,
                text=True,
                timeout=300,
                cwd=tmp_path,
            )
        report = result.stdout[-8000:] + result.stderr[-2000:]
        assert result.returncode == 0, report
        generated = re.search(r"(\d+) generated, (\d+) passed", result.stdout)
        assert generated is not None and generated[1] == generated[2] and int(generated[1]) > 300, report
        assert "failures" not in result.stdout.split("SUMMARY")[-1].lower(), report
        log = server.log_text()
        assert "Traceback" not in log and " 500 " not in log, log[-3000:]
    finally:
        server.stop()
