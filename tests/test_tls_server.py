"""HTTPS end to end on loopback: a real `edgepack fleet serve --tls-cert/--tls-key
[--tls-client-ca]` with a private CA made in the test, the real CLI with and without `--ca`,
wrong host names, expired certificates, mutual TLS, and plain HTTP on the TLS port."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgepack_core.tls import first_bytes_kind, tls_failure
from sdk.fleet_server.client import ClientTls, tls_hint
from tests.broker import free_port, start_mosquitto
from tests.conftest import cli, run_cli
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for
from tests.tls_certs import make_ca, serve_https


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(folder / "ca"), make_ca(folder / "other", "another CA")
    return {"folder": folder, "ca": ca, "other": other,
            "server": ca.issue(folder / "server", "fleet", hosts=("127.0.0.1",)),
            "expired": ca.issue(folder / "expired", "old", expired=True),
            "client": ca.issue(folder / "clients", "operator-laptop", client=True),
            "stranger": other.issue(folder / "clients", "stranger", client=True)}


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    running = start_mosquitto(workdir=tmp_path_factory.mktemp("mosquitto"))
    yield running
    running.kill()


@pytest.fixture(scope="module")
def keys(tmp_path_factory, keypair):
    return make_keys(tmp_path_factory.mktemp("keys"), release=keypair)


def _server(folder: Path, broker, keys, pki: dict, *extra: str, client: bool = False) -> FleetServerProcess:
    context = ssl.create_default_context(cafile=str(pki["ca"].cert))
    if client:
        context.load_cert_chain(pki["client"].cert, pki["client"].key)
    return FleetServerProcess(folder, broker=broker.address, keys=keys, context=context,
                              extra=("--tls-cert", str(pki["server"].cert), "--tls-key", str(pki["server"].key),
                                     *extra))


@pytest.fixture(scope="module")
def https_server(tmp_path_factory, broker, keys, pki) -> Iterator[FleetServerProcess]:
    server = _server(tmp_path_factory.mktemp("https"), broker, keys, pki, "--head-timeout", "2s").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory, broker, keys, pki) -> Iterator[FleetServerProcess]:
    server = _server(tmp_path_factory.mktemp("mtls"), broker, keys, pki,
                     "--tls-client-ca", str(pki["ca"].cert), client=True).start()
    yield server
    server.stop()


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([cli(args[0]), *args[1:]], capture_output=True, text=True, timeout=60, env=env,
                          stdin=subprocess.DEVNULL)


def _status(url: str, keys, *flags: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return _run("edgepack", "fleet", "status", "--server", url, "--token-file", str(keys.token_file), "--json",
                *flags, env=env)


def _env_without_ca(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EDGEPACK_SERVER")}
    return {**env, "PYTHONWARNINGS": "ignore", **extra}


def _one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


# ---------------------------------------------------------------- the server over HTTPS, the CLI's --ca


def test_the_cli_with_the_private_ca_reads_the_fleet_over_https(https_server, keys, pki):
    by_flag = _status(https_server.url, keys, "--ca", str(pki["ca"].cert), env=_env_without_ca())
    assert by_flag.returncode == 0, by_flag.stderr
    assert json.loads(by_flag.stdout)["devices"] == []
    by_env = _status(https_server.url, keys, env=_env_without_ca(EDGEPACK_SERVER_CA=str(pki["ca"].cert)))
    assert by_env.returncode == 0, by_env.stderr
    assert https_server.get("/api/status")["artifact_base_url"].startswith(f"https://127.0.0.1:{https_server.port}/")


def test_the_cli_without_the_ca_says_certificate_verify_failed_in_one_line(https_server, keys):
    line = _one_line(_status(https_server.url, keys, env=_env_without_ca()))
    assert line.endswith(f"certificate verify failed: unable to get local issuer certificate ({https_server.url}); "
                         "pass --ca FILE or set EDGEPACK_SERVER_CA"), line


def test_a_server_certificate_from_another_ca_is_refused_by_the_cli(https_server, keys, pki):
    line = _one_line(_status(https_server.url, keys, "--ca", str(pki["other"].cert), env=_env_without_ca()))
    assert "certificate verify failed: unable to get local issuer certificate" in line, line


def test_a_certificate_for_another_host_name_is_refused_in_one_line(https_server, keys, pki):
    url = f"https://localhost:{https_server.port}"  # the certificate names 127.0.0.1 only
    line = _one_line(_status(url, keys, "--ca", str(pki["ca"].cert), env=_env_without_ca()))
    assert "certificate verify failed: Hostname mismatch, certificate is not valid for 'localhost'." in line, line
    assert f"({url})" in line and "use a host name the server's certificate names" in line


def test_an_expired_server_certificate_is_refused_in_one_line(keys, pki):
    with serve_https(pki["expired"]) as server:
        url = server.url
        line = _one_line(_status(url, keys, "--ca", str(pki["ca"].cert), env=_env_without_ca()))
    assert line.endswith(f"certificate verify failed: certificate has expired ({url})"), line


# ---------------------------------------------------------------- mutual TLS


def test_mutual_tls_takes_a_client_certificate_from_its_ca(mtls_server, keys, pki):
    result = _status(mtls_server.url, keys, "--ca", str(pki["ca"].cert), "--client-cert", str(pki["client"].cert),
                     "--client-key", str(pki["client"].key), env=_env_without_ca())
    assert result.returncode == 0, result.stderr


def test_a_client_without_a_certificate_is_refused_by_mutual_tls(mtls_server, keys, pki):
    line = _one_line(_status(mtls_server.url, keys, "--ca", str(pki["ca"].cert), env=_env_without_ca()))
    assert line.startswith("error: TLS handshake failed") or "TLS handshake failed" in line, line
    assert "pass --client-cert FILE and --client-key FILE" in line, line
    assert "devices" not in line


def test_a_client_certificate_from_another_ca_is_refused(mtls_server, keys, pki):
    result = _status(mtls_server.url, keys, "--ca", str(pki["ca"].cert), "--client-cert", str(pki["stranger"].cert),
                     "--client-key", str(pki["stranger"].key), env=_env_without_ca())
    line = _one_line(result)
    assert "TLS handshake failed" in line and mtls_server.url in line, line
    assert result.stdout == ""
    # the server's side: one line naming the client (the first refusal of this server, this one or
    # the one without a certificate)
    assert wait_for(lambda: "(client 127.0.0.1:" in mtls_server.log_text(), 10)
    refused = next(ln for ln in mtls_server.log_text().splitlines() if "(client 127.0.0.1:" in ln)
    assert "WARNING edgepack.fleet_server.tls: " in refused, refused
    assert ": certificate verify failed: " in refused or ": TLS handshake failed: " in refused, refused


def test_refused_handshakes_are_logged_at_most_once_a_minute_with_a_count(caplog):
    """A scanner's thousand refused handshakes are a line a minute: the first at once, none until
    60 s passed (59.9 s holds), then one that counts those held back."""
    from sdk.fleet_server.tls_listener import RefusalLog

    now = [100.0]
    refusals = RefusalLog(60.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="edgepack.fleet_server.tls")
    assert refusals.refused("certificate verify failed: x (client a:1)")
    now[0] += 59.9
    assert not refusals.refused("b") and not refusals.refused("c")
    now[0] += 0.1
    assert refusals.refused("certificate verify failed: y (client d:4)")
    assert [r.getMessage() for r in caplog.records] == [
        "certificate verify failed: x (client a:1)",
        "certificate verify failed: y (client d:4) (2 more refused since the last line)"]


# ---------------------------------------------------------------- plain HTTP and the guard on the TLS port


def _answer(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_a_plain_http_request_to_the_tls_port_is_told_to_use_https(https_server):
    with socket.create_connection(("127.0.0.1", https_server.port), timeout=20) as sock:
        sock.sendall(f"GET /api/status HTTP/1.1\r\nHost: 127.0.0.1:{https_server.port}\r\n\r\n".encode())
        answer = _answer(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), answer
    assert json.loads(body)["error"] == {"status": 400, "code": "tls_required", "message":
                                         f"this port speaks HTTPS: use https://127.0.0.1:{https_server.port}"}
    plain = _status(f"http://127.0.0.1:{https_server.port}", https_server.keys, env=_env_without_ca())
    assert plain.returncode == 2 and "Traceback" not in plain.stderr, plain.stderr  # a wrong URL: bad usage
    assert plain.stderr.strip().endswith(f"this port speaks HTTPS: use https://127.0.0.1:{https_server.port}")
    assert https_server.get("/api/status")["http"]["dropped"].get("plain_http_on_tls", 0) >= 2
    assert 'edgepack_fleet_http_connections_dropped_total{reason="plain_http_on_tls"}' in \
        https_server.get("/metrics").decode()


def test_a_tls_handshake_that_never_finishes_is_closed_at_the_head_deadline(https_server):
    """Half a ClientHello holds nothing: the connection counts against the guard and is closed at
    --head-timeout (2 s here), as a plain connection that never sends its head."""
    before = https_server.get("/api/status")["http"]["dropped"].get("head_timeout", 0)
    with socket.create_connection(("127.0.0.1", https_server.port), timeout=30) as sock:
        sock.sendall(b"\x16\x03\x01\x02\x00\x01")  # a handshake record's header, then silence
        assert _answer(sock) == b""  # closed by the server (a hang would fail on the socket timeout)
    assert https_server.get("/api/status")["http"]["dropped"].get("head_timeout", 0) >= before


def test_a_tls_key_readable_by_others_is_refused_at_start(tmp_path, broker, keys, pki: dict):
    loose = tmp_path / "loose.key"
    loose.write_bytes(Path(pki["server"].key).read_bytes())
    loose.chmod(0o644)
    result = run_cli("edgepack", "fleet", "serve", "--broker", broker.address, "--db", f"sqlite:///{tmp_path}/f.db",
                     "--trust", str(keys.release_pub), "--token-file", str(keys.token_file), "--operator-key",
                     str(keys.operator_key), "--tls-cert", str(pki["server"].cert), "--tls-key", str(loose),
                     "--listen", f"127.0.0.1:{free_port()}", timeout=60)
    assert result.returncode == 2  # a ServerConfigError: the command line is wrong
    assert result.stderr.strip().splitlines()[-1].endswith(f"--tls-key {loose} is readable by others (mode 644); "
                                                           "chmod 600 it"), result.stderr


# ---------------------------------------------------------------- the pure parts


@pytest.mark.parametrize(("data", "kind"), [
    (b"", "more"), (b"\x16", "tls"), (b"G", "more"), (b"GET", "more"), (b"GET ", "http"), (b"GETX", "other"),
    (b"OPTIONS /", "http"), (b"OPTION", "more"), (b"SSH-2.0", "other"), (b"\x80\x2e\x01", "other"),
])
def test_first_bytes_are_told_apart(data: bytes, kind: str):
    assert first_bytes_kind(data) == kind


def test_a_tls_failure_is_found_under_the_url_error_and_hinted():
    import urllib.error

    verify = ssl.SSLCertVerificationError(1, "x")
    verify.verify_message = "unable to get local issuer certificate"
    line = tls_failure(urllib.error.URLError(verify), "https://h:1")
    assert line == "certificate verify failed: unable to get local issuer certificate (https://h:1)"
    assert tls_hint(line, None).endswith("; pass --ca FILE or set EDGEPACK_SERVER_CA")
    assert tls_failure(urllib.error.URLError(ConnectionRefusedError(111, "refused")), "https://h:1") is None
    assert tls_hint("TLS handshake failed: the server refused this client's certificate or wants one (x) (u)",
                    ClientTls(cert=Path("c"), key=Path("k"))).endswith("(u)")


def test_connections_stalled_in_their_tls_handshake_cannot_take_the_https_server_down(tmp_path, broker, keys, pki):
    """600 connections that start a TLS handshake (or send nothing) and stall, under a 512-descriptor
    limit the server cannot raise: they count against the connection cap from the moment they are
    accepted, the ones that waited longest are dropped, and a real HTTPS client is answered."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 900:
        if hard != resource.RLIM_INFINITY and hard < 900:
            pytest.skip(f"the test needs 900 open files; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (900, hard))
    server = _server(tmp_path / "server", broker, keys, pki, "--head-timeout", "60s").start(fd_limits=(512, 512))
    held: list[socket.socket] = []
    try:
        for index in range(600):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=20)
            if index % 2:
                sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00")  # the start of a ClientHello, never finished
            held.append(sock)
        status, doc = server.call("GET", "/api/status")
        assert status == 200, doc
        http = doc["http"]
        assert http["max_connections"] == 512 - 256 and http["open"] <= http["max_connections"]
        assert http["dropped"].get("evicted", 0) >= 600 - http["max_connections"]
        assert server.proc.poll() is None
    finally:
        for sock in held:
            sock.close()
        server.stop()


def _commands(group, path=()):
    import click

    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name), command


def test_every_command_that_takes_server_takes_ca_and_a_client_certificate():
    """Found by walking the CLI, so a command added later with its own --server is caught."""
    from sdk.cli import main

    with_server = {" ".join(path): {opt for p in cmd.params for opt in p.opts}
                   for path, cmd in _commands(main) if any("--server" in p.opts for p in cmd.params)}
    assert {"rollout list", "fleet status", "device ping", "target show"} <= set(with_server)
    missing = [name for name, opts in with_server.items() if not {"--ca", "--client-cert", "--client-key"} <= opts]
    assert missing == []


@pytest.mark.parametrize("command", [("rollout", "list"), ("fleet", "token", "list"), ("target", "show")])
def test_server_commands_say_certificate_verify_failed_in_one_line_and_work_with_ca(https_server, keys, pki, command):
    flags = ("--server", https_server.url, "--token-file", str(keys.token_file))
    line = _one_line(_run("edgepack", *command, *flags, env=_env_without_ca()))
    assert line.endswith(f"({https_server.url}); pass --ca FILE or set EDGEPACK_SERVER_CA"), line
    ok = _run("edgepack", *command, *flags, "--ca", str(pki["ca"].cert), env=_env_without_ca())
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize(("flags", "message"), [
    (("--tls-cert", "CERT"), "give both --tls-cert and --tls-key"),
    (("--tls-client-ca", "CA"), "--tls-client-ca goes with --tls-cert and --tls-key"),
    (("--broker-tls-cert", "CERT"), "--broker-tls-cert and --broker-tls-key go together"),
])
def test_fleet_serve_tls_flags_that_do_not_go_together_are_usage_errors(tmp_path, broker, keys, pki, flags, message):
    """On fleet serve, --tls-cert/--tls-key are its HTTPS certificate; the broker's client
    certificate is --broker-tls-cert/--broker-tls-key."""
    files = {"CERT": str(pki["server"].cert), "CA": str(pki["ca"].cert)}
    result = run_cli("edgepack", "fleet", "serve", "--broker", broker.address, "--trust", str(keys.release_pub),
                     "--token-file", str(keys.token_file), "--operator-key", str(keys.operator_key),
                     "--db", f"sqlite:///{tmp_path}/f.db", *(files.get(flag, flag) for flag in flags), timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_plain_request_whose_client_half_closes_still_gets_the_answer(https_server):
    """`printf 'GET / ...' | nc host port` sends its FIN right after the request."""
    with socket.create_connection(("127.0.0.1", https_server.port), timeout=20) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        sock.shutdown(socket.SHUT_WR)
        answer = _answer(sock)
    assert answer.startswith(b"HTTP/1.1 400 ") and b"this port speaks HTTPS: use https://127.0.0.1:" in answer


def test_a_client_certificate_without_its_key_or_a_ca_file_that_is_no_certificate_is_one_line(tmp_path, keys, pki):
    flags = ("--server", "https://127.0.0.1:9", "--token-file", str(keys.token_file))
    alone = _run("edgepack", "rollout", "list", *flags, "--client-cert", str(pki["client"].cert),
                 env=_env_without_ca())
    assert alone.returncode == 2 and "give --client-cert and --client-key together" in alone.stderr, alone.stderr
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    bad = _run("edgepack", "rollout", "list", *flags, "--ca", str(junk), env=_env_without_ca())
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    assert f"cannot load the TLS files ({junk})" in bad.stderr


def test_the_servers_connections_have_nagle_off():
    """asyncio sets TCP_NODELAY only on accepted sockets whose protocol is IPPROTO_TCP; the
    listening socket from bind() must say so (else every HTTPS answer's body waited 40 ms for a
    delayed ACK: measured 44 ms a request, 0.3 ms with it)."""
    import asyncio

    from sdk.fleet_server.server import bind

    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):  # type: ignore[no-untyped-def]
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = bind("127.0.0.1", free_port())
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", listener.getsockname()[1])
            value = await asyncio.wait_for(seen, 10)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) == 1
