"""`edgepack fleet serve` as a real subprocess, its keys and tokens, and an MQTT command counter."""

from __future__ import annotations

import json
import os
import resource
import secrets
import signal
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from sdk.keys import write_keypair, write_operator_keypair
from tests.broker import free_port
from tests.conftest import cli

ROOT = "edgepack/v1"


@dataclass(frozen=True)
class ServerKeys:
    """A release key (uploads are verified with its public half), an operator key (the server
    signs commands with it) and a token file."""

    release_key: Path
    release_pub: Path
    operator_key: Path
    operator_pub: Path
    token_file: Path
    token: str


def make_keys(folder: Path, release: tuple[Path, Path] | None = None) -> ServerKeys:
    folder.mkdir(parents=True, exist_ok=True)
    if release is None:
        release = (folder / "release.key", folder / "release.pub")
        write_keypair(*release)
    operator = (folder / "operator.key", folder / "operator.pub")
    write_operator_keypair(*operator)
    token = secrets.token_hex(24)
    token_file = folder / "tokens"
    token_file.write_text(f"# test tokens\nadmin:{token}\n")
    token_file.chmod(0o600)
    return ServerKeys(release[0], release[1], operator[0], operator[1], token_file, token)


class FleetServerProcess:
    """One `edgepack fleet serve`; ``kill()`` is kill -9, ``start()`` again reuses everything."""

    def __init__(self, folder: Path, *, broker: str, keys: ServerKeys, db_url: str | None = None,
                 server_id: str | None = None, extra: tuple[str, ...] = (), port: int | None = None,
                 artifacts: Path | None = None, context: ssl.SSLContext | None = None) -> None:
        self.folder = folder
        self.context = context  # set: the server speaks HTTPS (--tls-cert) and calls verify with it
        folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.keys = keys
        self.db_url = db_url or f"sqlite:///{folder / 'fleet.db'}"
        self.args = [cli("edgepack"), "fleet", "serve", "--broker", broker, "--db", self.db_url,
                     "--listen", f"127.0.0.1:{self.port}", "--artifacts", str(artifacts or folder / "artifacts"),
                     "--trust", str(keys.release_pub), "--token-file", str(keys.token_file),
                     "--operator-key", str(keys.operator_key), "--tick", "0.1", "--silence", "20s",
                     *(("--server-id", server_id) if server_id else ()),
                     *(() if "--ca-dir" in extra else ("--ca-dir", str(folder / "fleet-ca"))), *extra]
        self.artifacts = artifacts or folder / "artifacts"
        self.log = folder / "server.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.context else 'http'}://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0, env: dict[str, str] | None = None,
              fd_limits: tuple[int, int] | None = None) -> FleetServerProcess:
        """Start and wait for /healthz; ``fd_limits``: the (soft, hard) open-file limits it starts with."""
        def limit_fds() -> None:
            if fd_limits is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, fd_limits)

        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                         env={**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})},
                                         preexec_fn=limit_fds if fd_limits else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fleet serve exited with {self.proc.returncode}: {self.log_text()[-3000:]}")
            try:
                if self.call("GET", "/healthz", token=None)[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"fleet serve did not come up: {self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def call(self, method: str, path: str, body: Any = None, *, token: str | bool | None = True,
             data: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
        """(status, decoded JSON or bytes); ``token`` True means the server's admin token."""
        sent = dict(headers or {})
        if token is True:
            token = self.keys.token
        if token:
            sent["Authorization"] = f"Bearer {token}"
        payload = data
        if body is not None:
            payload = json.dumps(body).encode()
            sent.setdefault("Content-Type", "application/json")
        request = urllib.request.Request(self.url + path, data=payload, method=method, headers=sent)
        try:
            with urllib.request.urlopen(request, timeout=30, context=self.context) as answer:
                return answer.status, _decode(answer.read(), answer.headers.get("Content-Type", ""))
        except urllib.error.HTTPError as err:
            return err.code, _decode(err.read(), err.headers.get("Content-Type", ""))

    def get(self, path: str) -> Any:
        status, doc = self.call("GET", path)
        assert status == 200, (status, doc)
        return doc

    def finished(self, rollout_id: str, timeout: float = 120.0) -> dict:
        """The rollout once it has ended (succeeded, failed, aborted); fails the test after ``timeout``."""
        doc = wait_for(lambda: (lambda d: d if d["state"] in ("succeeded", "failed", "aborted") else None)(
            self.get(f"/api/rollouts/{rollout_id}")), timeout)
        assert doc is not None, f"rollout {rollout_id} did not end within {timeout:g} s"
        return doc

    def kill(self) -> None:
        """kill -9: no clean shutdown, no lease given back."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _decode(raw: bytes, content_type: str) -> Any:
    if "json" in content_type:
        return json.loads(raw)
    return raw


def wait_for(predicate: Any, timeout: float = 30.0, interval: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned) or time runs out (None)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


def enroll(server: FleetServerProcess, device: str, groups: tuple[str, ...] = (), *, password: bool = False) -> dict:
    """Enroll ``device`` as ``edgepack-agent enroll`` does: a one-time token from the server, then a
    CSR for a fresh key redeemed with it. The server's answer: a real certificate from the fleet
    CA (its ``serial``), or with ``password`` a broker password."""
    from device_agent.enroll import csr_pem, new_key

    status, token = server.call("POST", f"/api/devices/{device}/enrollment", {"groups": list(groups),
                                                                              "password": password})
    assert status == 201, token
    status, issued = server.call("POST", "/api/enroll", {"token": token["token"], "csr": csr_pem(new_key(), device)},
                                 token=None)
    assert status == 200, issued
    return issued


class CommandCounter:
    """Counts every command the broker delivers on ``dev/+/cmd``, by device and by command id."""

    def __init__(self, port: int) -> None:
        self.by_device: Counter[str] = Counter()
        self.by_id: Counter[str] = Counter()
        self.types: dict[str, str] = {}
        self.lock = threading.Lock()
        ready = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"cmd-counter-{free_port()}",
                                  protocol=mqtt.MQTTv5)
        self.client.on_connect = lambda c, *_: c.subscribe(f"{ROOT}/dev/+/cmd", qos=1)
        self.client.on_subscribe = lambda *_: ready.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert ready.wait(10)

    def _on_message(self, _c: Any, _u: Any, message: Any) -> None:
        doc = json.loads(message.payload)
        with self.lock:
            self.by_device[message.topic.split("/")[-2]] += 1
            self.by_id[doc["id"]] += 1
            self.types[doc["id"]] = doc["type"]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def edgepack(*args: str, env: dict[str, str] | None = None, timeout: float = 180,
             exact: bool = False) -> subprocess.CompletedProcess:
    """Run the `edgepack` CLI with no EDGEPACK_* variable from the outside, plus ``env``.
    ``exact``: stdout and stderr decoded from UTF-8 as they came (a ``\r`` stays a ``\r``)."""
    clean = {key: value for key, value in os.environ.items() if not key.startswith("EDGEPACK_")}
    done = subprocess.run([cli("edgepack"), *args], capture_output=True, text=not exact, timeout=timeout,
                          stdin=subprocess.DEVNULL, env={**clean, "PYTHONWARNINGS": "ignore", **(env or {})})
    if exact:
        done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return done
