"""An `edgepack-agent run` daemon as a real subprocess, plus an MQTT observer of its topics."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt

from tests.conftest import cli

ROOT = "edgepack/v1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class AgentProcess:
    def __init__(self, folder: Path, *, device: str, broker_port: int | None, trust: Path, artifact: Path | None,
                 groups: list[str] | None = None, health_window_s: float = 0.5, extra_env: dict | None = None,
                 operator_keys: list[Path] | None = None, updates: dict | None = None, api: dict | None = None):
        """``broker_port`` None: no ``mqtt:`` (the HTTP API alone); ``api``: more ``api:`` keys."""
        self.folder = folder
        self.device = device
        self.port = free_port()
        self.config = folder / f"{device}.yaml"
        lines = [f"device_id: {device}", f"store: {folder / (device + '-store')}", f"trust: [{trust}]",
                 f"api: {json.dumps({'listen': f'127.0.0.1:{self.port}', **(api or {})})}",
                 f"updates: {json.dumps({'health_window_s': health_window_s, **(updates or {})})}"]
        if broker_port is not None:
            lines.append(f"mqtt: {{host: 127.0.0.1, port: {broker_port}, telemetry_interval: 0.5, keepalive: 5, "
                         f"groups: [{', '.join(groups or [])}]}}")
        if operator_keys:
            lines.append(f"operator_keys: {json.dumps([str(k) for k in operator_keys])}")
        if artifact is not None:
            lines.append(f"artifact: {artifact}")
        self.config.write_text("\n".join(lines) + "\n")
        self.extra_env = extra_env or {}
        self.proc: subprocess.Popen | None = None
        self.log = folder / f"{device}.log"

    def start(self, env: dict | None = None) -> AgentProcess:
        environment = {**os.environ, **self.extra_env, **(env or {})}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([cli("edgepack-agent"), "run", "--config", str(self.config)],
                                         stdout=log, stderr=log, env=environment)
        deadline = time.time() + 30
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                if self.health().get("status") in ("ok", "degraded"):  # degraded: serving, a full disk
                    return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"agent did not come up: {self.log.read_text()[-2000:]}")

    def health(self) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2) as response:
                return json.load(response)
        except urllib.error.HTTPError as err:
            return json.load(err)

    def version(self) -> str | None:
        try:
            return self.health()["model"]["version"]
        except (OSError, KeyError):
            return None

    def predict(self, values: list[float], source: str | None = None) -> tuple[int, dict]:
        """POST one row; from the local address ``source`` (any of 127.0.0.0/8) when given."""
        body = json.dumps({"inputs": {"x": [values]}}).encode()
        if source is not None:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10, source_address=(source, 0))
            try:
                connection.request("POST", "/predict", body, {"Content-Type": "application/json"})
                response = connection.getresponse()
                return response.status, json.load(response)
            finally:
                connection.close()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/predict", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as err:
            return err.code, json.load(err)

    def wait_exit(self, timeout: float = 30) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Observer:
    """Collects every message under the topic root (QoS 1)."""

    def __init__(self, port: int) -> None:
        self.messages: list[tuple[str, Any]] = []
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"observer-{free_port()}",
                                  protocol=mqtt.MQTTv5)
        subscribed = threading.Event()  # the broker's SUBACK: every message published after it reaches us
        self.client.on_connect = lambda c, *_: c.subscribe(f"{ROOT}/#", qos=1)
        self.client.on_subscribe = lambda *_: subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        assert subscribed.wait(10), "the observer's subscription was not acknowledged"

    def _on_message(self, _c: Any, _u: Any, message: Any) -> None:
        try:
            payload = json.loads(message.payload)
        except (UnicodeDecodeError, json.JSONDecodeError):
            payload = message.payload
        with self.lock:
            self.messages.append((message.topic, payload))

    def of(self, suffix: str) -> list[dict]:
        """JSON payloads of the messages whose topic ends with ``suffix``."""
        with self.lock:
            return [p for t, p in self.messages if t.endswith(suffix) and isinstance(p, dict)]

    def jobs(self, device: str, job_id: str | None = None) -> list[dict]:
        with self.lock:
            return [p for t, p in self.messages if t == f"{ROOT}/dev/{device}/job" and isinstance(p, dict)
                    and (job_id is None or p.get("job") == job_id)]

    def wait_for(self, predicate, timeout: float = 30.0) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return False

    def publish(self, topic: str, payload: bytes | str) -> None:
        self.client.publish(topic, payload, qos=1).wait_for_publish(5)

    def close(self) -> None:
        self.client.disconnect()  # first: the network thread sends it and ends; stopped first, it waits 1 s
        self.client.loop_stop()


class LoadGenerator:
    """Continuous predict requests against an agent from a few threads, counting failures."""

    def __init__(self, agent: AgentProcess, threads: int = 3, values: list[float] | None = None,
                 sources: list[str] | None = None) -> None:
        self.agent = agent
        self.sources = sources  # one local source address per thread (distinct clients), or the default
        self.values = values or [1.0, 2.0, 3.0, 4.0]
        self.stop_event = threading.Event()
        self.ok = 0
        self.failures: list[str] = []
        self.versions: set[str] = set()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(sources[i] if sources else None,), daemon=True)
                        for i in range(len(sources) if sources else threads)]

    def _run(self, source: str | None) -> None:
        while not self.stop_event.is_set():
            try:
                status, answer = self.agent.predict(self.values, source)
            except OSError as err:
                with self.lock:
                    self.failures.append(f"connection: {err}")
                continue
            with self.lock:
                if status == 200:
                    self.ok += 1
                    self.versions.add(answer["model"]["version"])
                else:
                    self.failures.append(f"{status}: {answer}")

    def __enter__(self) -> LoadGenerator:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(10)
