"""Simulate a fleet: N devices, each with its own MQTT connection, birth/last will and telemetry,
answering commands with real job events.

One thread drives every simulated device's paho client through a selector (paho's external
event loop: ``loop_read``/``loop_write``/``loop_misc``), so 1,000 devices cost 1,000 sockets,
not 1,000 threads. Each device publishes a retained "online" state, then telemetry at
``--rate`` messages per second with a sequence number, QoS 1 (schema-valid
``edgepack.telemetry/1``). A checker connection counts what arrives per device, so the run
reports loss exactly; ``edgepack fleet status --json`` is then run against the same broker to
show it sees every device.

Each device also answers the commands on its ``cmd`` topic like an agent does, with job
events on its ``job`` topic (``edgepack.job/1``): a ``deploy`` goes queued, downloading
(with ``--fetch``: a real HTTP download of the artifact, checked against the command's sha256),
verifying, staging, testing, active, then active and final after the health window, and the
device's state and telemetry report the new version; a duplicate command id is answered with
the job as it stands; ``rollback``, ``cancel``, ``ping`` and ``get-state`` end ``done`` (a
``rollback`` whose ``from_version`` is not the model the device runs is ``rejected``, as by the
agent). Knobs for rollout tests: ``--rollback-version V`` (deploys of V fail their health window and end
``rolled_back``) and ``--error-version V`` (once V runs, telemetry reports half of the
inferences as errors). With ``--operator-pub`` a device refuses commands that are not signed
by that operator key, as an agent with ``operator_keys`` does.

A device reports the model file's sha256 of what it installed, as an agent does: with
``--fetch --trust KEY`` the downloaded artifact is verified and its manifest's model hash is
used (once per artifact sha256); otherwise ``null`` (unknown), so the fleet server compares by
version alone. ``--faults SHARE`` gives that share of the devices (chosen by ``--seed``) one
fault each, the kinds in turn (:data:`FAULT_KINDS`): ``power_cut`` (the first deploy's download
is cut: the device drops off the broker, its will says offline, and ``--outage`` seconds later
it comes back on its old version and answers the job ``failed``), ``link_loss`` (the first
deploy's download stalls while the device is off the broker for ``--outage`` seconds; it then
reconnects and finishes), ``disk_full`` (every deploy fails ``no space left on device``) and
``bad_version`` (every new version fails its health window and is rolled back). The broker
options are the host commands' (``--username``, ``--password-file``, ``--tls``, ``--tls-ca``,
``--tls-cert``, ``--tls-key``; sdk/cli/broker_options.py).

    python tools/fleet_sim.py --devices 1000 --rate 1 --duration 30 --start-broker
    python tools/fleet_sim.py --devices 100 --broker HOST:8883 --tls-ca ca.crt --username sim \
        --password-file sim.password --fetch --trust release.pub --faults 0.05 --duration 600
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import heapq
import itertools
import json
import os
import platform
import random
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.reasoncodes import ReasonCode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from edgepack_core.artifact import verify_artifact  # noqa: E402
from edgepack_core.command_auth import authorize_command  # noqa: E402
from edgepack_core.errors import ArtifactError, CommandSignatureError  # noqa: E402
from edgepack_core.protocol.commands import Command, parse_command  # noqa: E402
from edgepack_core.protocol.messages import JobEvent  # noqa: E402
from edgepack_core.protocol.payloads import STATE_SCHEMA_ID, TELEMETRY_SCHEMA_ID  # noqa: E402
from edgepack_core.protocol.topics import Topics  # noqa: E402
from edgepack_core.signing import OPERATOR, RELEASE, TrustStore  # noqa: E402
from sdk.broker import BrokerOptions  # noqa: E402
from sdk.errors import BrokerOptionError  # noqa: E402

STATE_SCHEMA = STATE_SCHEMA_ID
TELEMETRY_SCHEMA = TELEMETRY_SCHEMA_ID
JOB_STEPS = ("downloading", "verifying", "staging", "testing")
MAX_FETCH_BYTES = 512 * 1024 * 1024
FAULT_KINDS = ("power_cut", "link_loss", "disk_full", "bad_version")
ONE_SHOT_FAULTS = frozenset({"power_cut", "link_loss"})  # the device recovers; the others persist


def _nodelay(_client: Any, _userdata: Any, sock: Any) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(needed, soft), hard), hard))


@dataclass
class Behaviour:
    """How simulated devices answer deploys (shared by every device of a run)."""

    step_s: float = 0.05  # between two job states
    health_window_s: float = 0.5  # when the command does not say
    rollback_versions: frozenset[str] = frozenset()
    error_versions: frozenset[str] = frozenset()
    error_kind: str = "model"  # the kind telemetry names those errors by (an agent's: non_finite_output, runtime)
    fetch: bool = False
    operator_trust: TrustStore | None = None
    groups: tuple[str, ...] = ("sim",)
    model_name: str = "sim-model"
    model_version: str = "1.0.0"
    release_trust: TrustStore | None = None  # with ``fetch``: verify downloads, report the manifest's model hash
    model_hashes: dict[str, str] = field(default_factory=dict)  # artifact sha256 -> model file sha256 (a cache)
    faults: dict[int, str] = field(default_factory=dict)  # device index -> one of FAULT_KINDS
    outage_s: float = 5.0  # how long a power cut or a link loss keeps a device off the broker
    broker: BrokerOptions | None = None  # credentials and TLS (the address is the drive's)


def assign_faults(count: int, share: float, seed: int = 0) -> dict[int, str]:
    """``round(count * share)`` devices, chosen by ``seed``, each given a fault kind in turn."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"--faults is a share from 0 to 1, not {share}")
    chosen = sorted(random.Random(seed).sample(range(count), round(count * share)))
    return {index: FAULT_KINDS[n % len(FAULT_KINDS)] for n, index in enumerate(chosen)}


def _login(client: mqtt.Client, options: BrokerOptions | None) -> None:
    """The host commands' credentials and TLS on one simulated device's client."""
    if options is None:
        return
    if options.username is not None:
        client.username_pw_set(options.username, options.password)
    if options.tls is not None:
        import ssl

        client.tls_set(ca_certs=options.tls.ca, certfile=options.tls.cert, keyfile=options.tls.key,
                       cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)


@dataclass
class SimJob:
    id: str
    type: str
    state: str = "queued"
    reason: str = ""
    final: bool = False
    version: str | None = None


@dataclass
class Scheduler:
    """Timed callbacks run by the drive loop (no thread per job)."""

    _heap: list[tuple[float, int, Callable[[], None]]] = field(default_factory=list)
    _counter: itertools.count = field(default_factory=itertools.count)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def at(self, when: float, action: Callable[[], None]) -> None:
        with self._lock:
            heapq.heappush(self._heap, (when, next(self._counter), action))

    def run_due(self, now: float) -> None:
        while True:
            with self._lock:
                if not self._heap or self._heap[0][0] > now:
                    return
                _, _, action = heapq.heappop(self._heap)
            action()


class SimDevice:
    def __init__(self, index: int, topics: Topics, host: str, port: int, *, prefix: str = "sim",
                 behaviour: Behaviour | None = None, scheduler: Scheduler | None = None,
                 fetcher: concurrent.futures.Executor | None = None) -> None:
        self.device = f"{prefix}-{index:05d}"
        self.topics = topics
        self.behaviour = behaviour or Behaviour()
        self.scheduler = scheduler or Scheduler()
        self.fetcher = fetcher
        self.seq = 0
        self.acked = 0
        self.expected_acks = 0
        self.name, self.version = self.behaviour.model_name, self.behaviour.model_version
        self.model_sha256: str | None = hashlib.sha256(f"{self.name}-{self.version}".encode()).hexdigest()
        self.previous: tuple[str, str, str | None] | None = None  # (name, version, model sha256) a rollback returns to
        self.fault = self.behaviour.faults.get(index)
        self.outages = 0  # power cuts and link losses gone through
        self.selector: selectors.BaseSelector | None = None  # the drive's, once it runs
        self._on_reconnect: Callable[[], None] | None = None
        self.jobs: dict[str, SimJob] = {}
        self.commands_received = 0
        self.subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=self.device, protocol=mqtt.MQTTv5)
        self.client.on_socket_open = _nodelay
        self.client.on_publish = self._on_publish
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.on_subscribe = lambda *_: self.subscribed.set()
        self.client.max_queued_messages_set(0)
        self.client.max_inflight_messages_set(100)
        self.client.will_set(topics.state(self.device), self._state("offline"), qos=1, retain=True)
        _login(self.client, self.behaviour.broker)
        self.client.connect(host, port, keepalive=60)

    # ---------------------------------------------------------------- publishing

    def _on_publish(self, *_args: Any) -> None:
        self.acked += 1

    def _publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.expected_acks += 1
        self.client.publish(topic, payload, qos=1, retain=retain)

    def _model(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "sha256": self.model_sha256}

    def _swap_back(self) -> None:
        """Back to the previous model (a rollback, a failed health window, a cancel)."""
        if self.previous is not None:
            self.name, self.version, self.model_sha256 = self.previous
        self.previous = None

    def _state(self, status: str) -> bytes:
        doc = {"schema": STATE_SCHEMA, "device": self.device, "status": status, "ts": time.time(),
               "groups": list(self.behaviour.groups),
               "capabilities": {"arch": platform.machine(), "profile": "x86", "simulated": True},
               "model": self._model(), "provider": "CPUExecutionProvider"}
        if status == "offline":
            doc["reason"] = "last will"
        return json.dumps(doc).encode()

    def birth(self) -> None:
        self._publish(self.topics.state(self.device), self._state("online"), retain=True)

    def telemetry(self) -> None:
        self.seq += 1
        latency = random.lognormvariate(1.0, 0.3)
        inferences = 10
        errors = inferences // 2 if self.version in self.behaviour.error_versions else 0
        doc = {"schema": TELEMETRY_SCHEMA, "device": self.device, "seq": self.seq, "ts": time.time(),
               "model": self._model(), "provider": "CPUExecutionProvider", "interval_s": 1.0,
               "inferences": {"interval": inferences, "total": inferences * self.seq},
               "errors": {self.behaviour.error_kind: errors * self.seq} if errors else {},
               "errors_interval": {self.behaviour.error_kind: errors} if errors else {},
               "latency_ms": {"p50": round(latency, 3), "p90": round(latency * 1.4, 3), "p99": round(latency * 2, 3),
                              "max": round(latency * 3, 3), "mean": round(latency * 1.1, 3)},
               "throughput_per_s": float(inferences), "cpu_percent": 12.5, "memory_rss_bytes": 50_000_000,
               "temperature_c": None, "uptime_s": float(self.seq), "queue": {"depth": 0, "dropped": 0,
                                                                            "produced": self.seq,
                                                                            "delivered": self.seq}}
        self._publish(self.topics.telemetry(self.device), json.dumps(doc).encode())

    def _event(self, job: SimJob, *, duplicate: bool = False) -> None:
        event = JobEvent(self.device, job.id, job.type, job.state, job.final, time.time(), reason=job.reason,
                         version=job.version or None, duplicate=duplicate)
        self._publish(self.topics.job(self.device), event.encode())

    def _set(self, job: SimJob, state: str, reason: str, final: bool = False) -> None:
        job.state, job.reason, job.final = state, reason, final
        self._event(job)

    # ---------------------------------------------------------------- commands

    def _on_connect(self, client: mqtt.Client, *_args: Any) -> None:
        filters = [self.topics.cmd(self.device), *(self.topics.group_cmd(g) for g in self.behaviour.groups)]
        client.subscribe([(topic, 1) for topic in filters])  # one SUBACK: ``subscribed`` means all of them
        if self._on_reconnect is not None:
            after, self._on_reconnect = self._on_reconnect, None
            self.birth()
            self.scheduler.at(time.time(), after)

    # ---------------------------------------------------------------- faults

    @property
    def dark(self) -> bool:
        """Off the broker (a power cut or a link loss in progress)."""
        return self._on_reconnect is not None

    def _go_dark(self, then: Callable[[], None]) -> None:
        """Off the broker for ``outage_s`` (the broker publishes the will: offline), then back,
        where ``then`` runs once the device is connected and subscribed again."""
        self.outages += 1
        if self.selector is not None:
            self.selector.unregister(self.client.socket())
        # MQTT 5 reason 0x04: the broker publishes the will, as for a dropped connection.
        self.client.disconnect(reasoncode=ReasonCode(PacketTypes.DISCONNECT, "Disconnect with will message"))
        self.client.loop_write()
        self._on_reconnect = then
        self.scheduler.at(time.time() + self.behaviour.outage_s, self._come_back)

    def _come_back(self) -> None:
        self.client.reconnect()
        if self.selector is not None:
            self.selector.register(self.client.socket(), selectors.EVENT_READ, self)

    def _faulted_deploy(self, job: SimJob, body: dict[str, Any]) -> bool:
        """Run this device's fault on a deploy; True when it took the deploy over."""
        if self.fault == "disk_full":
            self.scheduler.at(time.time() + self.behaviour.step_s, lambda: self._set(
                job, "failed", "download failed: [Errno 28] No space left on device", final=True))
            return True
        if self.fault not in ONE_SHOT_FAULTS:
            return False
        fault, self.fault = self.fault, None  # once: the next deploy goes through
        if fault == "power_cut":
            def reboot() -> None:
                self._set(job, "failed", f"interrupted: the device restarted during the download; serving "
                                         f"{self.name} {self.version}", final=True)
            self.scheduler.at(time.time() + self.behaviour.step_s, lambda: self._go_dark(reboot))
            return True
        self.scheduler.at(time.time() + self.behaviour.step_s,
                          lambda: self._go_dark(lambda: self._fetch_then_install(job, body)))
        return True

    def _on_message(self, _client: Any, _userdata: Any, message: Any) -> None:
        self.commands_received += 1
        parsed = parse_command(message.payload, time.time())
        if not isinstance(parsed, Command):
            self._set(SimJob(parsed.ref, "unknown"), "rejected", parsed.reason, final=True)
            return
        existing = self.jobs.get(parsed.id)
        if existing is not None:
            self._event(existing, duplicate=True)
            return
        try:
            authorize_command(parsed.body, self.behaviour.operator_trust, device_id=self.device,
                              groups=self.behaviour.groups, now=time.time())
        except CommandSignatureError as err:
            self._set(SimJob(parsed.id, parsed.type), "rejected", str(err), final=True)
            return
        job = self.jobs[parsed.id] = SimJob(parsed.id, parsed.type, version=parsed.body.get("version"))
        handler = {"deploy": self._deploy, "rollback": self._rollback, "cancel": self._cancel}.get(parsed.type)
        if handler is None:
            self._set(job, "done", "pong" if parsed.type == "ping" else parsed.type, final=True)
            return
        handler(job, parsed.body)

    def _deploy(self, job: SimJob, body: dict[str, Any]) -> None:
        self._set(job, "queued", "queued")
        self.scheduler.at(time.time() + self.behaviour.step_s,
                          lambda: self._set(job, "downloading", "fetching the artifact"))
        if self.fault is not None and self._faulted_deploy(job, body):
            return
        self._fetch_then_install(job, body)

    def _fetch_then_install(self, job: SimJob, body: dict[str, Any]) -> None:
        if self.behaviour.fetch and "url" in body.get("artifact", {}) and self.fetcher is not None:
            future = self.fetcher.submit(_fetch, body["artifact"]["url"], body["sha256"], body["size"], self.behaviour)
            future.add_done_callback(
                lambda done: self.scheduler.at(time.time(), lambda: self._after_fetch(job, body, done.result())))
            return
        self.scheduler.at(time.time() + 2 * self.behaviour.step_s, lambda: self._after_fetch(job, body, ""))

    def _after_fetch(self, job: SimJob, body: dict[str, Any], problem: str) -> None:
        if job.final:
            return
        if problem:
            self._set(job, "failed", problem, final=True)
            return
        now, step = time.time(), self.behaviour.step_s
        for number, state in enumerate(JOB_STEPS[1:], 1):
            self.scheduler.at(now + number * step, lambda s=state: job.final or self._set(job, s, s))
        self.scheduler.at(now + len(JOB_STEPS) * step, lambda: self._activate(job, body))

    def _activate(self, job: SimJob, body: dict[str, Any]) -> None:
        if job.final:
            return
        self.previous = (self.name, self.version, self.model_sha256)
        self.name, self.version = str(body.get("name") or self.name), str(body["version"])
        self.model_sha256 = self.behaviour.model_hashes.get(str(body.get("sha256")))  # None: not known here
        self.birth()
        window = float(body.get("health_window_s") or self.behaviour.health_window_s)
        self._set(job, "active", f"hot-swapped; watching health for {window:g} s")
        self.scheduler.at(time.time() + window, lambda: self._close_window(job))

    def _close_window(self, job: SimJob) -> None:
        if job.final:
            return
        if self.version in self.behaviour.rollback_versions or self.fault == "bad_version":
            bad = self.version
            self._swap_back()
            self.birth()
            self._set(job, "rolled_back", f"unhealthy: simulated failure of {bad}; back on {self.version}",
                      final=True)
            return
        self._set(job, "active", "health window passed", final=True)

    def _rollback(self, job: SimJob, body: dict[str, Any]) -> None:
        wanted = body["from_version"]  # required by the schema, as on the agent
        if (wanted["name"], wanted["version"]) != (self.name, self.version):
            self._set(job, "rejected", f"the device has moved on: this rollback is from {wanted['name']} "
                                       f"{wanted['version']}, the device serves {self.name} "
                                       f"{self.version}", final=True)
            return
        if self.previous is None:
            self._set(job, "failed", f"rollback failed: no previous model; serving {self.version}", final=True)
            return
        for other in self.jobs.values():
            if other.type == "deploy" and not other.final:
                self._set(other, "rolled_back", f"rolled back by command {job.id}", final=True)
        self._swap_back()
        self.birth()
        self._set(job, "done", f"rolled back to {self.name} {self.version}", final=True)

    def _cancel(self, job: SimJob, body: dict[str, Any]) -> None:
        target = self.jobs.get(str(body.get("job")))
        if target is None or target.final:
            self._set(job, "failed", f"no queued or running deploy {body.get('job')}", final=True)
            return
        if target.state == "active":
            self._swap_back()
            self.birth()
            self._set(target, "rolled_back", f"cancelled by command {job.id}", final=True)
        else:
            self._set(target, "cancelled", f"cancelled by command {job.id}", final=True)
        self._set(job, "done", f"stopped deploy {target.id}", final=True)


def _fetch(url: str, sha256: str, size: int, behaviour: Behaviour | None = None) -> str:
    """Download ``url`` and check it; "" when it matches, else a fixed reason (like the agent).
    With ``behaviour.release_trust`` the first download of each artifact is verified and its
    manifest's model hash kept in ``behaviour.model_hashes`` (what the device then reports)."""
    digest = hashlib.sha256()
    received = 0
    keep = behaviour is not None and behaviour.release_trust is not None and sha256 not in behaviour.model_hashes
    blocks: list[bytes] = []
    try:
        with urllib.request.urlopen(url, timeout=30) as answer:
            while block := answer.read(256 * 1024):
                received += len(block)
                if received > min(size, MAX_FETCH_BYTES):
                    return "download larger than announced"
                digest.update(block)
                if keep:
                    blocks.append(block)
    except OSError:
        return "download failed"
    if received != size or digest.hexdigest() != sha256:
        return "download does not match the command's sha256"
    if keep and behaviour is not None and behaviour.release_trust is not None:
        return _learn_model_hash(b"".join(blocks), sha256, behaviour)
    return ""


def _learn_model_hash(data: bytes, sha256: str, behaviour: Behaviour) -> str:
    """Verify one downloaded artifact as an agent does and keep its model file's sha256."""
    import tempfile

    assert behaviour.release_trust is not None
    with tempfile.NamedTemporaryFile(suffix=".edgepkg") as handle:
        handle.write(data)
        handle.flush()
        try:
            verified = verify_artifact(handle.name, behaviour.release_trust)
        except ArtifactError as err:
            return f"artifact refused: {err}"
    behaviour.model_hashes[sha256] = verified.manifest.model_sha256
    return ""


class Checker:
    """Counts telemetry per device on a separate connection (QoS 1)."""

    def __init__(self, topics: Topics, host: str, port: int, login: BrokerOptions | None = None) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()
        self.ready = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"fleet-sim-checker-{os.getpid()}",
                                  protocol=mqtt.MQTTv5)
        self.client.on_socket_open = _nodelay
        self.client.on_connect = lambda c, *_: (c.subscribe(topics.all_of("telemetry"), qos=1), self.ready.set())
        self.client.on_message = self._on_message
        _login(self.client, login)
        self.client.connect(host, port, keepalive=60)
        self.client.loop_start()

    def _on_message(self, _c: Any, _u: Any, message: Any) -> None:
        device = message.topic.split("/")[-2]
        with self.lock:
            self.counts[device] = self.counts.get(device, 0) + 1

    def total(self) -> int:
        with self.lock:
            return sum(self.counts.values())


def _pump(devices: list[SimDevice], selector: selectors.BaseSelector, timeout: float) -> None:
    """One round of socket I/O for every simulated device (writes first, then whatever is readable)."""
    for dev in devices:
        if dev.client.want_write():
            dev.client.loop_write()
    for key, _events in selector.select(timeout=timeout):
        key.data.client.loop_read()


def drive(devices: list[SimDevice], rate: float, duration: float, *, stop: threading.Event | None = None,
          scheduler: Scheduler | None = None) -> dict[str, float]:
    """Publish births and telemetry for ``duration`` seconds (or until ``stop``), answer commands,
    then wait for every PUBACK."""
    selector = selectors.DefaultSelector()
    for dev in devices:
        selector.register(dev.client.socket(), selectors.EVENT_READ, dev)
        dev.selector = selector
    for dev in devices:
        dev.birth()
    started = time.monotonic()
    period = 1.0 / rate if rate > 0 else float("inf")
    # Spread devices evenly over one period so the broker sees a steady stream, not bursts.
    next_due = [started + (period * i / len(devices) if rate > 0 else 0) for i in range(len(devices))]
    last_misc = started
    while True:
        now = time.monotonic()
        if now - started >= duration or (stop is not None and stop.is_set()):
            break
        if rate > 0:
            _publish_due(devices, next_due, period, now)
        if scheduler is not None:
            scheduler.run_due(time.time())
        _pump(devices, selector, 0.002)
        if now - last_misc >= 1.0:
            for dev in devices:
                dev.client.loop_misc()
            last_misc = now
    _drain(devices, selector)
    elapsed = time.monotonic() - started
    return {"elapsed_s": elapsed}


def _publish_due(devices: list[SimDevice], next_due: list[float], period: float, now: float) -> None:
    """Telemetry from each device whose turn has come, and its next turn one period later."""
    for i, dev in enumerate(devices):
        if now >= next_due[i]:
            if dev.dark is False:
                dev.telemetry()
            next_due[i] += period


def _drain(devices: list[SimDevice], selector: selectors.BaseSelector) -> None:
    """Wait (30 s at most) for every QoS 1 PUBACK."""
    deadline = time.monotonic() + 30
    # A device that went off the broker may have lost messages in flight: not waited for.
    while time.monotonic() < deadline and any(d.acked < d.expected_acks and not d.outages for d in devices):
        _pump(devices, selector, 0.01)


class SimFleet:
    """Simulated devices on a background thread, for tests and benchmarks:
    ``with SimFleet(host, port, 20) as fleet: ...``."""

    def __init__(self, host: str, port: int, count: int, *, rate: float = 1.0, prefix: str = "sim",
                 behaviour: Behaviour | None = None, topic_root: str = "edgepack/v1") -> None:
        raise_fd_limit(2 * count + 256)
        self.behaviour = behaviour or Behaviour()
        self.scheduler = Scheduler()
        self.fetcher = concurrent.futures.ThreadPoolExecutor(max_workers=8) if self.behaviour.fetch else None
        topics = Topics(topic_root)
        self.devices = [SimDevice(i, topics, host, port, prefix=prefix, behaviour=self.behaviour,
                                  scheduler=self.scheduler, fetcher=self.fetcher) for i in range(count)]
        self.rate = rate
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleet-sim", daemon=True)

    def wait_ready(self, timeout: float = 30.0) -> bool:
        """Every device connected and subscribed to its commands."""
        deadline = time.monotonic() + timeout
        return all(d.subscribed.wait(max(0.0, deadline - time.monotonic())) for d in self.devices)

    def _run(self) -> None:
        drive(self.devices, self.rate, float("inf"), stop=self._stop, scheduler=self.scheduler)

    def __enter__(self) -> SimFleet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(40)
        for dev in self.devices:
            dev.client.disconnect()
        if self.fetcher is not None:
            self.fetcher.shutdown(wait=False, cancel_futures=True)

    @property
    def telemetry_sent(self) -> int:
        return sum(d.seq for d in self.devices)

    def versions(self) -> dict[str, str]:
        return {d.device: d.version for d in self.devices}

    def faulted(self) -> dict[str, str]:
        """Device id -> the fault it was given (a one-shot fault stays named after it fired)."""
        return {self.devices[i].device: kind for i, kind in self.behaviour.faults.items()}

    def final_deploys(self) -> int:
        """Deploy jobs that ended (their final event published), over every device."""
        return sum(1 for d in self.devices for job in list(d.jobs.values()) if job.type == "deploy" and job.final)


def _behaviour(args: argparse.Namespace, broker: BrokerOptions | None) -> Behaviour:
    trust = TrustStore.from_paths(args.operator_pub, kind=OPERATOR) if args.operator_pub else None
    release = TrustStore.from_paths(args.trust, kind=RELEASE) if args.trust else None
    return Behaviour(health_window_s=args.health_window, rollback_versions=frozenset(args.rollback_version),
                     error_versions=frozenset(args.error_version), fetch=args.fetch, operator_trust=trust,
                     groups=tuple(args.group), release_trust=release,
                     faults=assign_faults(args.devices, args.faults, args.seed), outage_s=args.outage,
                     broker=broker)


def _broker_options(args: argparse.Namespace, address: str) -> BrokerOptions | None:
    """The host commands' broker options (sdk/cli/broker_options.py), same names and variables."""
    password = None if args.password_file else os.environ.get("EDGEPACK_MQTT_PASSWORD") or None
    options = BrokerOptions.build(address, username=args.username, password=password,
                                  password_file=args.password_file, tls=args.tls, tls_ca=args.tls_ca,
                                  tls_cert=args.tls_cert, tls_key=args.tls_key, topic_root=args.topic_root)
    return options if options.username is not None or options.tls is not None else None


def _login_flags(args: argparse.Namespace) -> list[str]:
    """The broker options again, for the ``edgepack fleet status`` this script runs."""
    flags = [f"--{name.replace('_', '-')}={value}" for name in ("username", "password_file", "tls_ca", "tls_cert",
                                                                 "tls_key") if (value := getattr(args, name))]
    return [*flags, *(["--tls"] if args.tls else [])]


def _add_broker_arguments(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--username", default=env("EDGEPACK_MQTT_USERNAME"), help="MQTT user of every device")
    parser.add_argument("--password-file", type=Path, default=env("EDGEPACK_MQTT_PASSWORD_FILE"),
                        help="file whose first line is the MQTT password (or EDGEPACK_MQTT_PASSWORD)")
    parser.add_argument("--tls", action="store_true", default=bool(env("EDGEPACK_MQTT_TLS")),
                        help="TLS, verifying the broker against the system's CAs (implied by --tls-ca)")
    parser.add_argument("--tls-ca", type=Path, default=env("EDGEPACK_MQTT_TLS_CA"), help="the broker's CA")
    parser.add_argument("--tls-cert", type=Path, default=env("EDGEPACK_MQTT_TLS_CERT"), help="client certificate")
    parser.add_argument("--tls-key", type=Path, default=env("EDGEPACK_MQTT_TLS_KEY"), help="its private key")


def _add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--faults", type=float, default=0.0,
                        help="share of the devices given one fault each (power_cut, link_loss, disk_full, "
                             "bad_version in turn)")
    parser.add_argument("--seed", type=int, default=0, help="which devices get the faults")
    parser.add_argument("--outage", type=float, default=5.0, help="seconds a power cut or a link loss lasts")
    parser.add_argument("--trust", action="append", default=[],
                        help="with --fetch: verify downloads with this release key and report the model's hash")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=100)
    parser.add_argument("--rate", type=float, default=1.0, help="telemetry messages per second per device")
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--broker", default=None, help="HOST:PORT of a running broker")
    parser.add_argument("--start-broker", action="store_true", help="start a local mosquitto for the run")
    parser.add_argument("--topic-root", default="edgepack/v1")
    parser.add_argument("--prefix", default="sim", help="device ids are PREFIX-00000, PREFIX-00001, ...")
    parser.add_argument("--group", action="append", default=None, help="group of every device (repeatable; sim)")
    parser.add_argument("--health-window", type=float, default=0.5, help="seconds, when a deploy does not say")
    parser.add_argument("--rollback-version", action="append", default=[],
                        help="deploys of this version fail their health window (repeatable)")
    parser.add_argument("--error-version", action="append", default=[],
                        help="running this version, telemetry reports half the inferences as errors (repeatable)")
    parser.add_argument("--fetch", action="store_true", help="really download deployed artifacts (checks sha256)")
    parser.add_argument("--operator-pub", action="append", default=[],
                        help="refuse commands not signed by this operator public key (repeatable)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_broker_arguments(parser)
    _add_fault_arguments(parser)
    args = parser.parse_args()
    args.group = args.group or ["sim"]
    if not args.broker and not args.start_broker:
        parser.error("give --broker HOST:PORT or --start-broker")
    try:  # the address is only known once a broker runs: these options are read for the login
        login = _broker_options(args, args.broker or "127.0.0.1:1883")
        behaviour = _behaviour(args, login)
    except (OSError, ValueError, BrokerOptionError) as err:
        print(f"fleet_sim: {err}", file=sys.stderr)
        return 2

    raise_fd_limit(2 * args.devices + 256)  # our sockets, and a broker started from here
    broker = None
    if args.start_broker:
        from tests.broker import start_mosquitto

        broker = start_mosquitto()
        host, port = broker.host, broker.port
    else:
        host, _, port_text = args.broker.rpartition(":")
        port = int(port_text)
    topics = Topics(args.topic_root)
    scheduler = Scheduler()
    fetcher = concurrent.futures.ThreadPoolExecutor(max_workers=8) if behaviour.fetch else None
    try:
        checker = Checker(topics, host, port, login)
        checker.ready.wait(5)
        connect_started = time.monotonic()
        devices = [SimDevice(i, topics, host, port, prefix=args.prefix, behaviour=behaviour, scheduler=scheduler,
                             fetcher=fetcher) for i in range(args.devices)]
        connect_s = time.monotonic() - connect_started
        cpu_before = os.times()
        timing = drive(devices, args.rate, args.duration, scheduler=scheduler)
        cpu = os.times()
        deadline = time.monotonic() + 30
        sent = sum(d.seq for d in devices)
        while checker.total() < sent and time.monotonic() < deadline:
            time.sleep(0.05)
        received = checker.total()
        status = subprocess.run(
            [str(Path(sys.executable).parent / "edgepack"), "fleet", "status", "--broker", f"{host}:{port}",
             "--json", "--wait", "10", "--topic-root", args.topic_root, *_login_flags(args)],
            capture_output=True, text=True, timeout=60,
        )
        fleet = json.loads(status.stdout) if status.returncode == 0 else {"devices": [], "error": status.stderr}
        result = {
            "devices": args.devices,
            "rate_per_device": args.rate,
            "duration_s": round(timing["elapsed_s"], 2),
            "connect_s": round(connect_s, 2),
            "sent": sent,
            "received": received,
            "lost": sent - received,
            "throughput_msg_s": round(received / timing["elapsed_s"], 1),
            "sim_cpu_s": round((cpu.user - cpu_before.user) + (cpu.system - cpu_before.system), 2),
            "fleet_status_devices": len(fleet.get("devices", [])),
            "fleet_status_online": fleet.get("online", 0),
            "commands_received": sum(d.commands_received for d in devices),
        }
        for dev in devices:
            dev.client.disconnect()
        checker.client.loop_stop()
    finally:
        if fetcher is not None:
            fetcher.shutdown(wait=False, cancel_futures=True)
        if broker is not None:
            broker.stop()
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    ok = result["lost"] == 0 and result["fleet_status_devices"] == args.devices
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
