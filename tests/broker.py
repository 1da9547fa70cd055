"""A real mosquitto broker for tests and benchmarks, on a free loopback port.

Why a helper module and not only a fixture: the ACL test needs its own config, the outbox test
restarts the broker on the same port, and tools/bench/mqtt_rtt.py starts brokers outside pytest.

The default config mirrors deploy/mosquitto/mosquitto.conf where it matters for behaviour:
``set_tcp_nodelay true`` (Nagle off on the broker side of every connection) and an unlimited
message count per client queue bounded by bytes instead (mosquitto's default of 1000 queued
messages drops QoS 1 messages silently once a subscriber falls behind; see docs/mqtt.md).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from edgepack_core.mqtt_settings import MqttSettings

MOSQUITTO_CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")
HOST = "127.0.0.1"


class BrokerError(RuntimeError):
    """mosquitto is missing, exited at start, or never accepted connections."""


def mosquitto_binary() -> str:
    """Path of the mosquitto executable; :class:`BrokerError` if it is not installed."""
    found = shutil.which("mosquitto")
    if found:
        return found
    for candidate in MOSQUITTO_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    raise BrokerError("mosquitto is not installed (apt-get install mosquitto)")


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def port_accepts(port: int) -> bool:
    """Whether something accepts TCP connections on ``port`` of the loopback interface."""
    try:
        with socket.create_connection((HOST, port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class Broker:
    """A running mosquitto. ``stop``/``restart`` keep the port, so clients can reconnect."""

    port: int
    workdir: Path
    config_path: Path
    log_path: Path
    process: subprocess.Popen | None = field(default=None, repr=False)
    host: str = HOST

    @property
    def address(self) -> str:
        """``HOST:PORT`` as the CLIs' ``--broker`` flag takes it."""
        return f"{self.host}:{self.port}"

    def settings(self, **overrides: object) -> MqttSettings:
        """Client settings for this broker with quick reconnects, for tests."""
        values: dict[str, object] = {"host": self.host, "port": self.port, "reconnect_min": 0.05, "reconnect_max": 0.5}
        values.update(overrides)
        return MqttSettings(**values)  # type: ignore[arg-type]

    def start(self, timeout: float = 10.0) -> Broker:
        """Start mosquitto with this config and wait until the port accepts connections."""
        log = self.log_path.open("ab")
        try:
            self.process = subprocess.Popen(
                [mosquitto_binary(), "-c", str(self.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
            )
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrokerError(f"mosquitto exited with {self.process.returncode}:\n{self.log()}")
            if port_accepts(self.port):
                return self
            time.sleep(0.02)
        self.kill()
        raise BrokerError(f"mosquitto did not accept connections on {self.address} within {timeout} s:\n{self.log()}")

    def stop(self, timeout: float = 5.0) -> None:
        """Graceful stop (SIGTERM), as a service manager would do it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        """Abrupt stop (SIGKILL): a crash or power cut of the broker."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process = None

    def restart(self, timeout: float = 10.0) -> Broker:
        """Stop (if running) and start again on the same port with the same config."""
        self.stop()
        return self.start(timeout)

    def publish(self, messages: list[tuple[str, bytes]]) -> None:
        """Publish each ``(topic, payload)`` at QoS 1 as an outside client (a device, a hostile
        one) would, each acknowledged by the broker before this returns."""
        import paho.mqtt.client as mqtt

        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"pub-{time.monotonic_ns()}",
                             protocol=mqtt.MQTTv5)
        client.connect(self.host, self.port)
        client.loop_start()
        try:
            for topic, payload in messages:
                client.publish(topic, payload, qos=1).wait_for_publish(10)
        finally:
            client.disconnect()
            client.loop_stop()

    def log(self) -> str:
        """Everything mosquitto wrote so far (for assertion messages)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def default_config(
    port: int, *, anonymous: bool = True, persistence_dir: Path | None = None, tcp_nodelay: bool = True
) -> str:
    """The base config every test broker gets; ``config_extra`` is appended to it. With a
    ``persistence_dir`` the broker saves sessions and queued messages there on stop, so a
    restart keeps persistent sessions (as a production broker would)."""
    persistence = ["persistence false"] if persistence_dir is None else [
        "persistence true", f"persistence_location {persistence_dir}/", "autosave_interval 0",
    ]
    lines = [
        f"listener {port} {HOST}",
        # mosquitto drops root privileges to user "mosquitto" unless told otherwise, and could
        # then not read password files in a temp dir; as a non-root user this line is ignored.
        f"user {getpass.getuser()}",
        *persistence,
        f"set_tcp_nodelay {'true' if tcp_nodelay else 'false'}",
        "max_queued_messages 0",
        "max_queued_bytes 268435456",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "log_type information",
        "log_timestamp_format %H:%M:%S",
    ]
    if anonymous:
        lines.append("allow_anonymous true")
    return "\n".join(lines) + "\n"


def start_mosquitto(
    config_extra: str = "",
    port: int | None = None,
    *,
    anonymous: bool = True,
    workdir: Path | None = None,
    persistence: bool = False,
    config: str | None = None,
    tcp_nodelay: bool = True,
) -> Broker:
    """Start a broker on ``port`` (or a free loopback port) and return once it accepts connections.

    ``config_extra`` is appended to :func:`default_config`; pass ``anonymous=False`` when it
    brings its own ``allow_anonymous false`` / ``password_file`` / ``acl_file``. Files live in
    ``workdir`` (a new temp dir by default), and so does the persistence file if ``persistence``.
    A complete ``config`` replaces the default one (its listener must use ``port``);
    ``tcp_nodelay=False`` turns Nagle back on in the broker (for tools/bench/mqtt_rtt.py).
    """
    if config is not None and port is None:
        raise BrokerError("a complete config needs the port its listener uses")
    folder = workdir or Path(tempfile.mkdtemp(prefix="mosquitto-"))
    folder.mkdir(parents=True, exist_ok=True)
    chosen = port or free_port()
    persistence_dir = folder if persistence else None
    if config is None:
        config = default_config(chosen, anonymous=anonymous, persistence_dir=persistence_dir, tcp_nodelay=tcp_nodelay)
    config_path = folder / "mosquitto.conf"
    config_path.write_text(config + config_extra)
    broker = Broker(port=chosen, workdir=folder, config_path=config_path, log_path=folder / "mosquitto.log")
    return broker.start()


@pytest.fixture
def mosquitto_broker(tmp_path: Path) -> Iterator[Broker]:
    """A fresh anonymous broker per test, stopped afterwards."""
    broker = start_mosquitto(workdir=tmp_path / "mosquitto")
    try:
        yield broker
    finally:
        with contextlib.suppress(Exception):
            broker.kill()


def wait_until(predicate: Callable[[], object], timeout: float = 5.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it is truthy or ``timeout`` passes; return its last truthiness."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
