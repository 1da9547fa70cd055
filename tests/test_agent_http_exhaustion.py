"""Connections that cost their sender (issue 21, item 5), against a real ``edgepack-agent run``
process: bodies declared and never sent reserve nothing, half-open heads are dropped for a new
connection, and health checks keep slots of their own while every other slot is busy."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from device_agent.http.admission import EVICT_AFTER_S, HEALTH_CONNECTIONS
from tests.agent_process import AgentProcess
from tests.artifacts import build_artifact
from tests.test_http_attacks import OK_JSON, connect, error_of, exchange, metrics, read_response, request_bytes

MIB = 1 << 20


@pytest.fixture(scope="module")
def scale_artifact(tmp_path_factory, keypair) -> Path:
    return build_artifact(tmp_path_factory.mktemp("scale"), keypair[0])


@pytest.fixture()
def agent(tmp_path, keypair, scale_artifact) -> Iterator[callable]:
    """An agent process (no MQTT) with some ``api:`` keys; stopped after the test."""
    started: list[AgentProcess] = []

    def start(**api) -> AgentProcess:
        process = AgentProcess(
            tmp_path, device=f"a{len(started)}", broker_port=None, trust=keypair[1], artifact=scale_artifact, api=api
        )
        started.append(process)
        return process.start()

    yield start
    for process in started:
        process.stop()


def wait_for_gauge(port: int, name: str, value: float, timeout: float = 15.0) -> None:
    """Until ``/metrics`` shows the gauge at ``value`` (the server has seen what the test sent)."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = metrics(port).get(name)
        if seen == value:
            return
        time.sleep(0.02)
    pytest.fail(f"{name} stayed {seen}, never {value}")


def predict_status(port: int, body: bytes = OK_JSON) -> int:
    return exchange(port, request_bytes("POST", "/predict", body))[0]


def test_four_connections_declaring_16_mib_bodies_and_sending_nothing_leave_predict_served(agent):
    process = agent()  # defaults: 16 MiB bodies, 64 MiB of them held at once
    port = process.port
    held = [connect(port) for _ in range(4)]
    try:
        for sock in held:
            sock.sendall(
                f"POST /predict HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\n"
                f"Content-Length: {16 * MIB}\r\n\r\n".encode()
            )
        wait_for_gauge(port, "edgepack_http_requests_in_progress", 4)
        assert metrics(port)["edgepack_http_body_bytes_held"] == 0  # declared, not sent: nothing reserved
        for _ in range(3):
            assert predict_status(port) == 200
        assert process.health()["status"] == "ok"
    finally:
        for sock in held:
            sock.close()


def padded(size: int) -> bytes:
    """A valid /predict JSON body of exactly ``size`` bytes (trailing whitespace is JSON)."""
    return OK_JSON + b" " * (size - len(OK_JSON))


def test_body_bytes_count_when_they_arrive_the_budget_holds_at_its_limit_and_refuses_one_byte_more(agent):
    process = agent(max_body_bytes=MIB, max_buffered_bytes=MIB)
    port = process.port
    part = 600_000
    with connect(port) as slow:  # declares 1 MiB, sends 600,000 bytes of it, then waits
        slow.sendall(request_bytes("POST", "/predict", b" " * MIB)[: -(MIB - part)])
        wait_for_gauge(port, "edgepack_http_body_bytes_held", part)
        assert predict_status(port, padded(MIB - part)) == 200  # exactly what is left
        status, headers, body = exchange(port, request_bytes("POST", "/predict", padded(MIB - part + 1)))
        assert (status, error_of(body)["kind"]) == (503, "busy") and headers["retry-after"] == "1"
    wait_for_gauge(port, "edgepack_http_body_bytes_held", 0)  # the slow client left: its bytes are given back
    assert predict_status(port, padded(MIB)) == 200


def half_open_head(port: int) -> socket.socket:
    sock = connect(port)
    sock.sendall(b"GET /predict HTTP/1.1\r\nHost: agent\r\n")  # the head never ends
    return sock


def health_statuses(port: int) -> list[int]:
    return [exchange(port, request_bytes("GET", path))[0] for path in ("/healthz", "/metrics", "/v2/health/live")]


def test_64_half_open_heads_do_not_block_healthz_or_predict(agent):
    process = agent()  # defaults: 64 connections, 30 s for a head
    port = process.port
    heads = [half_open_head(port) for _ in range(64)]
    try:
        assert health_statuses(port) == [200, 200, 200]  # at once, in the health checks' own slots
        served_once_a_head_is_evictable(port)  # a half-open head is dropped for it, not the newcomer
        heads += [half_open_head(port) for _ in range(64 + HEALTH_CONNECTIONS)]  # every slot, twice over
        assert health_statuses(port) == [200, 200, 200]
        served_once_a_head_is_evictable(port)
        closed, _, _ = select.select(heads, [], [], 2)  # a dropped one reads its EOF (or reset)
        assert heads[0] in closed and len(heads) - len(closed) <= 64 + HEALTH_CONNECTIONS  # the oldest went first
    finally:
        for sock in heads:
            sock.close()


def served_once_a_head_is_evictable(port: int) -> None:
    """/predict is answered 503 ``busy`` while every head is younger than EVICT_AFTER_S, then 200."""
    deadline = time.monotonic() + 10 + EVICT_AFTER_S
    while (status := predict_status(port)) != 200:
        assert status == 503 and time.monotonic() < deadline
        time.sleep(0.05)


def busy_request(port: int) -> socket.socket:
    """A connection whose request is in progress: its head arrived, its body is late."""
    sock = connect(port)
    sock.sendall(request_bytes("POST", "/predict", b"x" * 10)[:-10])
    return sock


def test_every_connection_busy_with_a_slow_body_leaves_healthz_its_reserved_slots(agent):
    process = agent(max_connections=3)
    port = process.port
    busy = [busy_request(port) for _ in range(3)]
    try:
        wait_for_gauge(port, "edgepack_http_requests_in_progress", 3)
        for _ in range(2 * HEALTH_CONNECTIONS):  # each answer closes its reserved slot: they never run out
            with connect(port) as sock:
                sock.sendall(request_bytes("GET", "/healthz"))
                status, headers, body = read_response(sock)
                assert status == 200 and json.loads(body)["status"] == "ok" and headers["connection"] == "close"
        status, headers, body = exchange(port, request_bytes("POST", "/predict", OK_JSON))
        assert (status, error_of(body)["kind"], headers["connection"]) == (503, "busy", "close")
        for _ in range(HEALTH_CONNECTIONS):  # a health check declaring a body it never sends holds no slot
            status, headers, body = exchange(port, request_bytes("GET", "/healthz", b"x" * 10)[:-10])
            assert (status, error_of(body)["kind"], headers["connection"]) == (503, "busy", "close")
        assert exchange(port, request_bytes("GET", "/healthz"))[0] == 200
    finally:
        for sock in busy:
            sock.close()
    deadline = time.monotonic() + 10
    while predict_status(port) != 200:  # the server sees the busy ones go; /predict is served again
        assert time.monotonic() < deadline
        time.sleep(0.05)
