"""Request latency of `edgepack fleet serve` over HTTP and HTTPS on loopback (BENCHMARKS.md).

Starts a mosquitto and two real fleet servers (one plain, one with `--tls-cert/--tls-key` from
a CA made here), then times `GET /api/whoami` with a new connection per request (what the CLI
does: a TCP connect, and for HTTPS a TLS 1.3 handshake, each time) and on one kept-alive
connection (what a browser on the dashboard does). Prints the median and p95 of each.

    python tools/bench/fleet_https.py --requests 300
"""

from __future__ import annotations

import argparse
import http.client
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sdk.keys import write_keypair
from tests.broker import start_mosquitto
from tests.fleet_server_process import FleetServerProcess, make_keys
from tests.tls_certs import make_ca


def _connection(server: FleetServerProcess, context: ssl.SSLContext | None) -> http.client.HTTPConnection:
    if context is not None:
        return http.client.HTTPSConnection("127.0.0.1", server.port, context=context)
    return http.client.HTTPConnection("127.0.0.1", server.port)


def _timed(server: FleetServerProcess, context: ssl.SSLContext | None, token: str, requests: int,
           fresh: bool) -> tuple[float, float]:
    """(median, p95) in milliseconds of ``requests`` GETs."""
    times = []
    connection = _connection(server, context)
    for _ in range(requests):
        if fresh:
            connection = _connection(server, context)
        started = time.perf_counter()
        connection.request("GET", "/api/whoami", headers={"Authorization": f"Bearer {token}"})
        answer = connection.getresponse()
        answer.read()
        times.append(time.perf_counter() - started)
        if answer.status != 200:
            raise SystemExit(f"the server answered {answer.status}")
        if fresh:
            connection.close()
    times.sort()
    return statistics.median(times) * 1000, times[int(len(times) * 0.95)] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="fleet-https-"))
    release = (folder / "release.key", folder / "release.pub")
    write_keypair(*release)
    keys = make_keys(folder / "keys", release=release)
    broker = start_mosquitto(workdir=folder / "mosquitto")
    ca = make_ca(folder / "ca")
    issued = ca.issue(folder / "server", "fleet", hosts=("127.0.0.1",))
    context = ssl.create_default_context(cafile=str(ca.cert))
    plain = FleetServerProcess(folder / "plain", broker=broker.address, keys=keys).start()
    tls = FleetServerProcess(folder / "tls", broker=broker.address, keys=keys, context=context,
                             extra=("--tls-cert", str(issued.cert), "--tls-key", str(issued.key))).start()
    try:
        for name, server, server_context in (("http", plain, None), ("https", tls, context)):
            _timed(server, server_context, keys.token, 20, True)  # warm-up
            for label, fresh in (("new connection per request", True), ("kept-alive connection", False)):
                median, p95 = _timed(server, server_context, keys.token, args.requests, fresh)
                print(f"{name:<6} {label:<27} median {median:6.2f} ms  p95 {p95:6.2f} ms")
    finally:
        plain.stop()
        tls.stop()
        broker.kill()


if __name__ == "__main__":
    main()
