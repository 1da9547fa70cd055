"""Report cards on the fleet server (issue 26 item 7): ingest keeps each device's cards equal to
its newest online state's, GET /api/devices/{id} lists them, GET /api/report-cards gives the
median per model version over devices; on SQLite and PostgreSQL. And end to end: a real agent
process measures its card, publishes it through a real mosquitto, and the real fleet server
stores and answers it."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from edgepack_core.protocol.messages import parse_state
from sdk.broker import BrokerOptions
from sdk.deploy import DeployOptions, deploy
from sdk.fleet_server.db import Database, open_database
from sdk.fleet_server.ingest import Writer
from sdk.fleet_server.log_tables import device_log_chunks, device_logs
from sdk.fleet_server.queries import decommission_device, get_device
from sdk.fleet_server.report_cards import aggregate
from tests.agent_process import AgentProcess
from tests.artifacts import build_artifact
from tests.postgres import postgres_server, postgres_url  # noqa: F401  (fixtures)

SHA = "a" * 64


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path: Path):
    url = f"sqlite:///{tmp_path / 'fleet.db'}" if request.param == "sqlite" else \
        request.getfixturevalue("postgres_url")
    opened = open_database(url)
    yield opened
    opened.dispose()


def _card(p50: float, p99: float, provider: str = "CPUExecutionProvider", **changes) -> dict:
    return {"provider": provider, "runs": 20, "p50_ms": p50, "p99_ms": p99, "first_inference_ms": 40.0,
            "peak_rss_bytes": 200 << 20, "nodes": 10, "accelerated_nodes": 0, "accelerated_share": 0.0,
            "measured_at": 1.7e9, "budget_hit": False, **changes}


def _state(device: str, models: list[tuple[str, str, dict | None]], status: str = "online") -> bytes:
    entries = [{"name": name, "version": version, "sha256": SHA, "state": "serving",
                **({"report_card": card} if card is not None else {})} for name, version, card in models]
    return json.dumps({"schema": "edgepack.state/1", "device": device, "status": status, "ts": time.time(),
                       "provider": "CPU", "models": entries}).encode()


def _write(database: Database, *states: tuple[str, bytes]) -> None:
    with database.write() as connection:
        Writer(database).states(connection, [(parse_state(device, payload), time.time()) for device, payload in states])


def test_the_cards_of_a_device_are_those_of_its_newest_online_state(database):
    _write(database, ("d1", _state("d1", [("det", "1.0", _card(2.0, 3.0)), ("cls", "1.0", _card(1.0, 1.5))])))
    cards = get_device(database, "d1", now=time.time(), silence_s=60)["report_cards"]
    assert [(c["name"], c["version"], c["p50_ms"], c["p99_ms"]) for c in cards] == [
        ("cls", "1.0", 1.0, 1.5), ("det", "1.0", 2.0, 3.0)]
    assert cards[0]["provider"] == "CPUExecutionProvider" and cards[0]["peak_rss_bytes"] == 200 << 20
    _write(database, ("d1", _state("d1", [("det", "1.1", _card(4.0, 5.0)), ("cls", "1.0", None)])))
    cards = get_device(database, "d1", now=time.time(), silence_s=60)["report_cards"]
    assert [(c["name"], c["version"], c["p50_ms"]) for c in cards] == [("det", "1.1", 4.0)]
    _write(database, ("d1", _state("d1", [], status="offline")))  # a last will changes no card
    assert len(get_device(database, "d1", now=time.time(), silence_s=60)["report_cards"]) == 1


def test_a_state_with_a_bad_report_card_is_stored_without_the_card(database):
    _write(database, ("d1", _state("d1", [("det", "1.0", _card(5.0, 4.0)), ("cls", "1.0", _card(1.0, 1.0))])))
    device = get_device(database, "d1", now=time.time(), silence_s=60)
    assert device["status"] == "online" and [c["name"] for c in device["report_cards"]] == ["cls"]


def test_the_median_per_model_version_over_devices(database):
    _write(database,
           ("d1", _state("d1", [("det", "1.0", _card(1.0, 2.0))])),
           ("d2", _state("d2", [("det", "1.0", _card(3.0, 6.0, "CUDAExecutionProvider", accelerated_share=0.9))])),
           ("d3", _state("d3", [("det", "1.0", _card(2.0, 9.0)), ("cls", "2.0", _card(7.0, 8.0))])),
           ("d4", _state("d4", [("det", "1.1", _card(10.0, 20.0))])))
    versions = aggregate(database, "det")["versions"]
    assert [(v["version"], v["devices"]) for v in versions] == [("1.0", 3), ("1.1", 1)]
    first = versions[0]
    assert first["median"]["p50_ms"] == 2.0 and first["median"]["p99_ms"] == 6.0
    assert first["median"]["accelerated_share"] == 0.0 and first["model_sha256"] == SHA
    assert first["providers"] == {"CPUExecutionProvider": 2, "CUDAExecutionProvider": 1}
    assert [v["name"] for v in aggregate(database, None)["versions"]] == ["cls", "det", "det"]
    assert aggregate(database, "absent") == {"versions": []}


def test_a_decommissioned_device_takes_its_cards_along(database):
    _write(database, ("d1", _state("d1", [("det", "1.0", _card(1.0, 2.0))])))
    decommission_device(database, "d1", reason="gone", actor="op", remote="test")
    assert aggregate(database, None) == {"versions": []}


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_a_real_agent_s_report_card_reaches_the_fleet_server_and_its_api(
    tmp_path: Path, keypair, mosquitto_broker, server_keys
):
    from tests.fleet_server_process import FleetServerProcess, wait_for

    artifact = build_artifact(tmp_path / "art", keypair[0])
    newer = build_artifact(tmp_path / "art", keypair[0], version="1.1.0", factor=3.0)
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    agent = AgentProcess(tmp_path, device="cam-01", broker_port=mosquitto_broker.port, trust=keypair[1],
                         artifact=artifact).start()
    try:
        health = agent.health()
        card = health["models"][0]["report_card"]
        assert card["provider"] == "CPUExecutionProvider" and 1 <= card["runs"] <= 20
        assert card["p99_ms"] >= card["p50_ms"] > 0 and card["first_inference_ms"] > 0
        assert card["peak_rss_bytes"] > 0 and card["accelerated_share"] == 0.0 and card["nodes"] >= 1

        def stored() -> list:
            status, device = server.call("GET", "/api/devices/cam-01")
            return device.get("report_cards", []) if status == 200 else []

        assert wait_for(lambda: stored() != [], 30), server.call("GET", "/api/devices/cam-01")
        [row] = stored()
        assert row["name"] == "scale" and row["version"] == "1.0.0"
        assert {key: row[key] for key in card} == card  # exactly what the device measured
        versions = server.get("/api/report-cards?model=scale")["versions"]
        assert [(v["version"], v["devices"]) for v in versions] == [("1.0.0", 1)]
        assert versions[0]["median"]["p50_ms"] == card["p50_ms"]
        status, error = server.call("GET", "/api/report-cards?model=no/such")
        assert status == 400 and "model" in json.dumps(error)
        # An update's activation (the update service's load) measures the new version's card.
        result = deploy(DeployOptions(newer, BrokerOptions(mosquitto_broker.address), devices=("cam-01",), timeout=60))
        assert result.succeeded, result
        assert wait_for(lambda: [r["version"] for r in stored()] == ["1.1.0"], 30), stored()
        assert agent.health()["models"][0]["report_card"]["measured_at"] >= card["measured_at"]
        assert [v["version"] for v in server.get("/api/report-cards")["versions"]] == ["1.1.0"]
    finally:
        agent.stop()
        server.stop()


def test_a_decommissioned_device_takes_its_fetched_logs_along_and_another_keeps_its_own(database):
    from edgepack_core.protocol.logs import LogChunk, LogLine
    from sdk.fleet_server.device_logs import LogQuery, read_logs
    from sdk.fleet_server.log_ingest import write_chunks

    _write(database, ("d1", _state("d1", [])), ("d2", _state("d2", [])))
    line = LogLine(seq=1, ts=time.time(), level="info", logger="edgepack.agent", message="serving")
    with database.write() as connection:
        write_chunks(database, connection, [(LogChunk(device, f"r-{device}", 0, True, time.time(), (line,)),
                                             time.time()) for device in ("d1", "d2")])
    assert [r["message"] for r in read_logs(database, "d1", LogQuery())["records"]] == ["serving"]
    decommission_device(database, "d1", reason="gone", actor="op", remote="test")
    with database.read() as connection:
        left = {table.name: sorted(connection.execute(select(table.c.device)).scalars())
                for table in (device_logs, device_log_chunks)}
    assert left == {"device_logs": ["d2"], "device_log_chunks": ["d2"]}
