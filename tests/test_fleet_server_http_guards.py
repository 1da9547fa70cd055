"""The fleet server's HTTP connections cost their sender: half-open connections, heads and bodies
that never finish, and connections without a token are dropped, never held (a real `edgepack
fleet serve` under a real open-file limit, raw sockets)."""

from __future__ import annotations

import contextlib
import json
import resource
import socket
from pathlib import Path

import pytest

from sdk.errors import ServerConfigError
from sdk.fleet_server.http_limits import RESERVED_FDS, HttpLimits, body_too_slow, connection_cap
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for

ATTACK_CONNECTIONS = 1100


@pytest.fixture(scope="module")
def keys(tmp_path_factory, keypair):
    return make_keys(tmp_path_factory.mktemp("keys"), release=keypair)


def _server(tmp_path: Path, broker, keys, *extra: str) -> FleetServerProcess:
    return FleetServerProcess(tmp_path / "server", broker=broker.address, keys=keys, extra=extra)


def _connect(server: FleetServerProcess, timeout: float = 20.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _answer(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _one_response(sock: socket.socket) -> bytes:
    """One whole answer (head and Content-Length body) from a connection that stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def _error_of(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _need_fds(count: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count:
        if hard != resource.RLIM_INFINITY and hard < count:
            pytest.skip(f"the test needs {count} open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, hard))


def test_1100_half_open_connections_leave_the_api_and_the_dashboard_answering(tmp_path, mosquitto_broker, keys):
    """Under a 1,024-descriptor limit it cannot raise, 1,100 connections that send nothing or half a
    head cannot take the API or the dashboard down: the cap (1,024 less the reserve) drops the
    connections that waited longest for a head, and the requests after them are answered."""
    _need_fds(ATTACK_CONNECTIONS + 200)
    server = _server(tmp_path, mosquitto_broker, keys).start(fd_limits=(1024, 1024))
    held: list[socket.socket] = []
    try:
        for index in range(ATTACK_CONNECTIONS):
            sock = _connect(server)
            if index % 2:
                sock.sendall(b"GET /api/status HTTP/1.1\r\nHost: fleet\r\n")  # a head that never ends
            held.append(sock)
        status, doc = server.call("GET", "/api/status")
        assert status == 200, doc
        assert server.call("GET", "/ui/", token=None)[0] == 200
        assert server.call("GET", "/healthz", token=None)[0] == 200
        http = server.get("/api/status")["http"]
        assert http["fd_limit"] == 1024 and http["max_connections"] == 1024 - RESERVED_FDS
        assert http["open"] <= http["max_connections"]
        dropped = http["dropped"]
        assert (
            dropped.get("evicted", 0) + dropped.get("head_timeout", 0) >= ATTACK_CONNECTIONS - http["max_connections"]
        )
        assert 'edgepack_fleet_http_connections_dropped_total{reason="evicted"}' in server.get("/metrics").decode()
        assert server.proc.poll() is None
    finally:
        for sock in held:
            sock.close()
        server.stop()


def test_the_open_file_limit_is_raised_to_fit_the_connection_cap_where_the_hard_limit_allows(
    tmp_path, mosquitto_broker, keys
):
    server = _server(tmp_path, mosquitto_broker, keys, "--max-connections", "1000").start(fd_limits=(1024, 4096))
    try:
        http = server.get("/api/status")["http"]
        assert http["fd_limit"] == 1000 + RESERVED_FDS and http["max_connections"] == 1000
        limits = Path(f"/proc/{server.proc.pid}/limits").read_text()
        assert any(
            line.startswith("Max open files") and line.split()[3:5] == [str(1000 + RESERVED_FDS), "4096"]
            for line in limits.splitlines()
        ), limits
    finally:
        server.stop()


def test_a_head_that_does_not_arrive_in_time_is_408_and_a_silent_connection_is_closed(tmp_path, mosquitto_broker, keys):
    server = _server(tmp_path, mosquitto_broker, keys, "--head-timeout", "0.5s").start()
    try:
        with _connect(server) as silent, _connect(server) as partial:
            partial.sendall(b"GET /api/status HTTP/1.1\r\nHost: fleet\r\n")
            assert _answer(silent) == b""
            status, doc = _error_of(_answer(partial))
            assert status == 408 and doc["error"]["code"] == "timeout" and "--head-timeout" in doc["error"]["message"]
        # the deadline is renewed after each answer: a kept-alive connection gets a whole new one
        with _connect(server) as kept:
            kept.sendall(b"GET /healthz HTTP/1.1\r\nHost: fleet\r\n\r\n")
            assert _one_response(kept).startswith(b"HTTP/1.1 200")
            kept.sendall(b"GET /healthz HTTP/1.1\r\n")
            status, _doc = _error_of(_answer(kept))
            assert status == 408
        assert server.get("/api/status")["http"]["dropped"]["head_timeout"] == 3
    finally:
        server.stop()


def test_a_body_slower_than_the_rate_floor_is_cut_with_408(tmp_path, mosquitto_broker, keys):
    server = _server(tmp_path, mosquitto_broker, keys, "--head-timeout", "0.5s", "--body-min-rate", "1K").start()
    try:
        with _connect(server) as slow:
            slow.sendall(
                f"POST /api/rollouts HTTP/1.1\r\nHost: fleet\r\nAuthorization: Bearer {keys.token}\r\n"
                "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{".encode()
            )
            status, doc = _error_of(_answer(slow))
            assert status == 408 and "--body-min-rate" in doc["error"]["message"], doc
        assert server.get("/api/status")["http"]["dropped"]["body_too_slow"] == 1
        # a body that keeps up is read whole (the 400 is about its content)
        body = json.dumps({"artifact": "0" * 64, "waves": [100], "group": "g", "pad": "x" * 60000}).encode()
        status, doc = server.call("POST", "/api/rollouts", data=body, headers={"Content-Type": "application/json"})
        assert status == 400 and "pad" in doc["error"]["message"]
    finally:
        server.stop()


def test_over_the_connection_cap_the_connection_waiting_longest_is_dropped_else_503(tmp_path, mosquitto_broker, keys):
    """With 16 connections at most: 16 idle connections, then a request: the oldest idle one is
    dropped and the request answered. 16 connections inside requests (bodies still coming): the
    17th is answered 503 and none of them is dropped."""
    server = _server(tmp_path, mosquitto_broker, keys, "--max-connections", "16", "--body-min-rate", "0").start()
    try:
        idle = [_connect(server) for _ in range(16)]
        assert server.call("GET", "/healthz", token=None)[0] == 200
        assert _answer(idle[0]) == b""  # the first one waited longest: dropped (reset or closed)
        for sock in idle:
            sock.close()
        assert wait_for(lambda: server.get("/api/status")["http"]["open"] == 1)  # only the status call itself
        busy = []
        for _ in range(16):
            sock = _connect(server)
            sock.sendall(
                f"POST /api/rollouts HTTP/1.1\r\nHost: fleet\r\nAuthorization: Bearer {keys.token}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\nExpect: 100-continue\r\n"
                "Connection: close\r\n\r\n".encode()
            )
            assert sock.recv(65536).startswith(b"HTTP/1.1 100")  # the head was parsed: a request is in progress
            sock.sendall(b"{")
            busy.append(sock)
        with _connect(server) as extra:
            status, doc = _error_of(_answer(extra))
        assert status == 503 and "--max-connections" in doc["error"]["message"]
        for sock in busy:  # every request in progress still gets its answer
            sock.sendall(b" " * 999)
            assert _error_of(_answer(sock))[0] == 400
            sock.close()
    finally:
        server.stop()


def test_a_connection_without_a_valid_token_is_answered_and_closed(tmp_path, mosquitto_broker, keys):
    server = _server(tmp_path, mosquitto_broker, keys).start()
    try:
        with _connect(server) as sock:
            sock.sendall(b"GET /api/status HTTP/1.1\r\nHost: fleet\r\nAuthorization: Bearer wrong\r\n\r\n")
            answer = _answer(sock)  # returns only because the server closed the connection
        status, doc = _error_of(answer)
        assert doc["error"]["code"] == "unauthorized"
        assert status == 401 and b"connection: close" in answer.lower()
    finally:
        server.stop()


def test_http_limits_are_bounded_and_the_cap_fits_the_descriptor_limit():
    assert connection_cap(HttpLimits(max_connections=1000), 1024) == 1024 - RESERVED_FDS
    assert connection_cap(HttpLimits(max_connections=1000), 1000 + RESERVED_FDS) == 1000
    assert connection_cap(HttpLimits(max_connections=16), RESERVED_FDS + 16) == 16
    with pytest.raises(ServerConfigError, match="open-file limit"):
        connection_cap(HttpLimits(max_connections=1000), RESERVED_FDS + 15)
    HttpLimits(max_connections=16, head_timeout_s=0.1, body_min_rate=0)
    for bad in ({"max_connections": 15}, {"head_timeout_s": 0.09}, {"body_min_rate": -1}):
        with pytest.raises(ServerConfigError):
            HttpLimits(**bad)
    assert body_too_slow(1023, 1.0, 1024) and not body_too_slow(1024, 1.0, 1024)
    assert not body_too_slow(0, 10.0, 0)
