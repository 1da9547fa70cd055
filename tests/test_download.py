"""HTTP delivery: streamed to disk, resumed with a Range request, size-limited, hash-checked."""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from device_agent.updates.download import (
    FETCH_FAILED,
    Bounds,
    DownloadCancelled,
    DownloadError,
    allowed_origins,
    download,
)
from sdk.deploy import ArtifactServer


@pytest.fixture()
def served(tmp_path):
    data = np.random.default_rng(0).bytes(3 * 1024 * 1024 + 17)
    source = tmp_path / "a.edgepkg"
    source.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    server = ArtifactServer(source, sha)
    yield server, data, sha
    server.stop()


def test_download_resumes_a_partial_file_with_a_range_request(served, tmp_path):
    server, data, sha = served
    target = tmp_path / "dl" / "x.edgepkg"
    target.parent.mkdir()
    partial = target.with_name(target.name + ".part")
    partial.write_bytes(data[:1_000_000])  # what an interrupted download left
    requests: list[str] = []
    original = server.RequestHandlerClass.do_GET

    def spy(handler):
        requests.append(handler.headers.get("Range", ""))
        original(handler)

    server.RequestHandlerClass.do_GET = spy
    try:
        result = download(server.url, target, size=len(data), sha256=sha, bounds=_bounds(server.url, 10 * 1024 * 1024))
    finally:
        server.RequestHandlerClass.do_GET = original
    assert result.read_bytes() == data
    assert requests == ["bytes=1000000-"], "only the missing part was fetched"
    assert not partial.exists()


def _bounds(url: str, max_bytes: int) -> Bounds:
    return Bounds(origins=allowed_origins([url.rsplit("/", 1)[0]]), max_bytes=max_bytes)


def test_download_over_the_size_limit_is_refused_before_fetching(served, tmp_path):
    server, data, sha = served
    with pytest.raises(DownloadError, match="over the download limit"):
        download(server.url, tmp_path / "x", size=len(data), sha256=sha, bounds=_bounds(server.url, 1024))
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.part").exists()


def test_download_with_a_wrong_hash_is_discarded(served, tmp_path):
    server, data, _ = served
    with pytest.raises(DownloadError, match="sha256"):
        download(
            server.url, tmp_path / "x", size=len(data), sha256="0" * 64, bounds=_bounds(server.url, 10 * 1024 * 1024)
        )
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.part").exists()


def test_server_sending_more_than_announced_is_cut_off(served, tmp_path):
    server, data, sha = served
    with pytest.raises(DownloadError):
        download(
            server.url,
            tmp_path / "x",
            size=len(data) - 100,
            sha256=sha,
            bounds=_bounds(server.url, 10 * 1024 * 1024),
            attempts=1,
        )


# --------------------------------------------------------------------------- the port oracle
# With the default allowed origin (any port on the broker's host), anyone who may send a deploy
# could point its URL at each port and read from the job event which ones are closed, silent or
# speaking something else. Every such failure must read the same and take the same time.

STALL = 0.5
ATTEMPTS = 2


class _Peer:
    """A real listening socket on loopback whose accepted connections get ``behaviour``."""

    def __init__(self, behaviour) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.behaviour = behaviour
        self.threads: list[threading.Thread] = []
        if behaviour is not None:
            self._spawn(self._accept)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            self.behaviour(conn, self.stop)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        for thread in self.threads:
            thread.join(timeout=5)


def _banner(conn: socket.socket, stop: threading.Event) -> None:
    conn.sendall(b"SSH-2.0-OpenSSH_9.6 secret-host-banner\r\n")
    stop.wait(0.2)


def _drip(conn: socket.socket, stop: threading.Event) -> None:
    """Something that is not HTTP and never finishes a line: one byte at a time, forever."""
    while not stop.wait(0.02):
        conn.sendall(b"S")


def _not_found(conn: socket.socket, stop: threading.Event) -> None:
    conn.recv(4096)
    conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


@pytest.fixture()
def ports() -> Iterator[dict[str, int]]:
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    peers = {
        "silent": _Peer(None),
        "non-HTTP": _Peer(_banner),
        "dripping non-HTTP": _Peer(_drip),
        "HTTP 404": _Peer(_not_found),
    }
    try:
        yield {"closed": closed_port, **{name: peer.port for name, peer in peers.items()}}
    finally:
        for peer in peers.values():
            peer.close()


def _failed_fetch(
    port: int, target: Path, *, stall_s: float = STALL, expect: type = DownloadError, scheme: str = "http", **options
) -> DownloadError:
    """A download from ``port`` on loopback (any port allowed, as on the broker's host) that must fail."""
    bounds = Bounds(origins=frozenset(), any_port_hosts=frozenset({"127.0.0.1"}), max_bytes=1 << 20, stall_s=stall_s)
    with pytest.raises(expect) as info:
        download(f"{scheme}://127.0.0.1:{port}/a.edgepkg", target, size=100, sha256="0" * 64, bounds=bounds, **options)
    return info.value


def test_closed_silent_and_non_http_ports_give_the_same_error_in_a_bounded_time(ports, tmp_path):
    floor = ATTEMPTS * STALL  # each failed attempt is held to the stall time, however it failed
    ceiling = ATTEMPTS * STALL + 0.2 + 10.0  # + the one back-off, + slack for a loaded machine
    reported: dict[str, str] = {}
    for kind, port in ports.items():
        started = time.monotonic()
        reported[kind] = str(_failed_fetch(port, tmp_path / kind / "a.edgepkg", attempts=ATTEMPTS))
        elapsed = time.monotonic() - started
        assert floor <= elapsed < ceiling, (kind, elapsed)
    assert set(reported.values()) == {f"download failed: {FETCH_FAILED}"}, reported


@pytest.mark.parametrize("kind", ["silent", "dripping non-HTTP"])
def test_over_https_a_silent_or_dripping_port_reads_the_same_in_a_bounded_time(ports, tmp_path, kind):
    """The head deadline holds for a TLS handshake too: a peer that never finishes it is cut off."""
    started = time.monotonic()
    error = _failed_fetch(ports[kind], tmp_path / "a", scheme="https", attempts=ATTEMPTS)
    assert ATTEMPTS * STALL <= time.monotonic() - started < ATTEMPTS * STALL + 10.2
    assert str(error) == f"download failed: {FETCH_FAILED}"


def test_a_cancel_is_seen_while_a_failed_attempt_is_held(ports, tmp_path):
    calls = []

    def cancelled() -> bool:
        calls.append(1)
        return len(calls) > 3  # the check before the attempt, then while held

    _failed_fetch(ports["closed"], tmp_path / "a", stall_s=3600, expect=DownloadCancelled, cancelled=cancelled)


def test_failed_attempts_past_the_rate_grace_still_read_the_same(ports, tmp_path):
    """The minimum rate is a rule for bytes that flow: between failed attempts (each held to the
    stall time) it would end every failing download after 10 s with a text of its own."""
    ticks = iter(range(0, 10**6, 3))  # a clock that runs 3 s per look: 5 attempts span ~60 s
    error = _failed_fetch(ports["closed"], tmp_path / "a", attempts=5, clock=lambda: float(next(ticks)))
    assert str(error) == f"download failed: {FETCH_FAILED}"
