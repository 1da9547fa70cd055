"""``edgepack deploy``: send an artifact to devices over MQTT and follow their jobs.

Delivery, three ways: a built-in HTTP server on the operator's machine (Range requests, so a
device resumes), chunked transfer over MQTT (devices that can reach only the broker), or a URL
where the artifact is already hosted (``--url``: an object store or CDN, for large fleets).
Devices verify the signature and hashes themselves, so none of these needs to be trusted.

A staged rollout sends the command to a canary share first and to the rest only if every
canary ends ``active``; the same command id goes to everyone, so a device that gets it twice
(as a canary and as a group member) answers with its existing job instead of installing twice.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from device_agent.mqtt.topics import DEFAULT_ROOT, Topics
from device_agent.mqtt.transport import MqttSettings, MqttTransport
from device_agent.updates.commands import COMMAND_SCHEMA_ID
from device_agent.updates.xfer import chunk_count, encode_chunk, parse_request
from edgepack_core.artifact import verify_artifact
from edgepack_core.errors import EdgepackError
from edgepack_core.signing import TrustStore
from sdk.fleet import collect, parse_broker
from sdk.inspect import read_unverified_for_display

DEFAULT_CHUNK = 256 * 1024
COMMAND_TTL_S = 24 * 3600


class DeployError(EdgepackError):
    """The deployment could not be started or did not reach every device."""


@dataclass
class DeviceJob:
    device: str
    state: str = "sent"
    reason: str = ""
    final: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class DeployResult:
    command_id: str
    jobs: dict[str, DeviceJob]
    aborted: str = ""

    @property
    def succeeded(self) -> bool:
        return not self.aborted and bool(self.jobs) and all(j.final and j.state == "active"
                                                             for j in self.jobs.values())


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


class ArtifactServer(ThreadingHTTPServer):
    """Serves one file at ``/<sha256>.edgepkg`` with Range support (for resumed downloads)."""

    daemon_threads = True

    def __init__(self, artifact: Path, sha256: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.artifact = artifact
        self.path_name = f"/{sha256}.edgepkg"
        self.size = artifact.stat().st_size
        super().__init__((host, port), _ArtifactHandler)
        threading.Thread(target=self.serve_forever, name="artifact-server", daemon=True).start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}{self.path_name}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _ArtifactHandler(BaseHTTPRequestHandler):
    server: ArtifactServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != self.server.path_name:
            self.send_error(404)
            return
        size = self.server.size
        start, end = 0, size - 1
        status = 200
        header = self.headers.get("Range", "")
        if header.startswith("bytes="):
            first, _, last = header[6:].partition("-")
            if first.isdigit():
                start = int(first)
                end = int(last) if last.isdigit() else size - 1
                status = 206
            if start >= size or end < start:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        with open(self.server.artifact, "rb") as handle:
            handle.seek(start)
            remaining = end - start + 1
            while remaining > 0:
                block = handle.read(min(1 << 20, remaining))
                if not block:
                    break
                try:
                    self.wfile.write(block)
                except (BrokenPipeError, ConnectionResetError):
                    return
                remaining -= len(block)


class XferSender:
    """Answers devices' chunk requests for one transfer over MQTT."""

    def __init__(self, transport: MqttTransport, topics: Topics, artifact: Path, transfer_id: str,
                 chunk_size: int) -> None:
        self.transport = transport
        self.topics = topics
        self.data = artifact.read_bytes()
        self.transfer_id = transfer_id
        self.chunk_size = chunk_size
        self.chunks = chunk_count(len(self.data), chunk_size)
        self.sent = 0
        transport.subscribe(f"{topics.root}/dev/+/xfer/{transfer_id}/req", 1, self._on_request)

    def _on_request(self, message: Any) -> None:
        parsed = self.topics.parse(message.topic)
        if parsed is None or parsed.device is None:
            return
        for index in parse_request(message.payload, self.chunks):
            chunk = self.data[index * self.chunk_size:(index + 1) * self.chunk_size]
            self.transport.publish(self.topics.xfer(parsed.device, self.transfer_id, "data"),
                                   encode_chunk(index, chunk), qos=1)
            self.sent += 1


def group_members(broker: str, group: str, root: str, wait_s: float = 2.0) -> list[str]:
    """Online devices whose retained birth message lists ``group``."""
    view = collect(broker, wait_s=wait_s, quiet_s=0.5, root=root)
    return sorted(r.device for r in view.rows(time.time()) if group in r.groups and r.status == "online")


def deploy(
    artifact: Path,
    *,
    broker: str,
    devices: list[str] | None = None,
    group: str | None = None,
    wait: bool = True,
    timeout: float = 600.0,
    canary_percent: float | None = None,
    url: str | None = None,
    transfer: str = "http",
    serve_host: str = "127.0.0.1",
    trust: TrustStore | None = None,
    force_downgrade: bool = False,
    health_window_s: float | None = None,
    expect: int | None = None,
    root: str = DEFAULT_ROOT,
    chunk_size: int = DEFAULT_CHUNK,
    username: str | None = None,
    password: str | None = None,
    on_event: Callable[[str, dict[str, Any]], None] | None = None,
) -> DeployResult:
    """Deploy ``artifact`` to ``devices`` or ``group``; with ``wait``, follow every job to its end."""
    if (devices is None) == (group is None):
        raise DeployError("give --device or --group")
    if trust is not None:
        manifest = verify_artifact(artifact, trust).manifest.raw
    else:
        manifest = read_unverified_for_display(artifact).manifest
    host, port = parse_broker(broker)
    topics = Topics(root)
    targets = list(devices or [])
    if group is not None:
        topics.group_cmd(group)  # validates the name
        targets = group_members(broker, group, root)
        if expect is not None and len(targets) < expect:
            raise DeployError(f"group {group}: {len(targets)} device(s) online, expected {expect}")
        if not targets:
            raise DeployError(f"group {group}: no online device found (is the broker right?)")
    size = artifact.stat().st_size
    sha = sha256_file(artifact)
    command_id = f"deploy-{manifest['name']}-{manifest['version']}-{uuid.uuid4().hex[:8]}"
    command: dict[str, Any] = {
        "schema": COMMAND_SCHEMA_ID, "id": command_id, "type": "deploy", "issued_at": time.time(),
        "expires_at": time.time() + COMMAND_TTL_S, "name": manifest["name"], "version": manifest["version"],
        "size": size, "sha256": sha,
    }
    if force_downgrade:
        command["force_downgrade"] = True
    if health_window_s is not None:
        command["health_window_s"] = health_window_s

    transport = MqttTransport(MqttSettings(host=host, port=port, client_id=f"edgepack-deploy-{uuid.uuid4().hex[:8]}",
                                           topic_root=root, username=username, password=password))
    server: ArtifactServer | None = None
    jobs = {d: DeviceJob(d) for d in targets}
    changed = threading.Condition()

    def on_job(message: Any) -> None:
        parsed = topics.parse(message.topic)
        try:
            event = json.loads(message.payload)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return
        if parsed is None or parsed.device not in jobs or not isinstance(event, dict) or event.get("job") != command_id:
            return
        with changed:
            job = jobs[parsed.device]
            job.events.append(event)
            if not job.final:
                job.state, job.reason, job.final = event.get("state", "?"), event.get("reason", ""), \
                    bool(event.get("final"))
            changed.notify_all()
        if on_event is not None:
            on_event(parsed.device, event)

    try:
        transport.start()
        if not transport.wait_connected(10):
            raise DeployError(f"cannot reach the broker at {broker}")
        transport.subscribe(topics.all_of("job"), 1, on_job)
        deadline = time.monotonic() + 5
        while not transport.is_subscribed(topics.all_of("job")) and time.monotonic() < deadline:
            time.sleep(0.01)
        if url is not None:
            command["artifact"] = {"url": url}
        elif transfer == "mqtt":
            transfer_id = uuid.uuid4().hex[:12]
            XferSender(transport, topics, artifact, transfer_id, chunk_size)
            command["artifact"] = {"xfer": {"id": transfer_id, "chunk_size": chunk_size,
                                            "chunks": chunk_count(size, chunk_size)}}
        else:
            server = ArtifactServer(artifact, sha, host=serve_host)
            command["artifact"] = {"url": server.url}
        payload = json.dumps(command).encode()

        def send(to: list[str], via_group: bool) -> None:
            if via_group and group is not None:
                transport.publish(topics.group_cmd(group), payload, qos=1)
            else:
                for device in to:
                    transport.publish(topics.cmd(device), payload, qos=1)

        def wait_for(devices_: list[str]) -> bool:
            end = time.monotonic() + timeout
            with changed:
                while not all(jobs[d].final for d in devices_):
                    remaining = end - time.monotonic()
                    if remaining <= 0:
                        return False
                    changed.wait(min(remaining, 0.5))
            return True

        if canary_percent is not None and len(targets) > 1:
            count = max(1, math.ceil(len(targets) * canary_percent / 100))
            canaries, rest = targets[:count], targets[count:]
            send(canaries, via_group=False)
            finished = wait_for(canaries)
            failed = [d for d in canaries if jobs[d].state != "active" or not jobs[d].final]
            if not finished or failed:
                for device in rest:
                    jobs[device].state, jobs[device].reason = "skipped", "canary failed"
                return DeployResult(command_id, jobs, aborted=f"canary failed on {', '.join(failed)}: "
                                    f"{jobs[failed[0]].state} ({jobs[failed[0]].reason})")
            send(rest, via_group=group is not None)
        else:
            send(targets, via_group=group is not None)
        if not wait:
            time.sleep(0.2)  # let the QoS 1 publish reach the broker before disconnecting
            return DeployResult(command_id, jobs)
        if not wait_for(targets):
            return DeployResult(command_id, jobs, aborted=f"timed out after {timeout:g} s")
        return DeployResult(command_id, jobs)
    finally:
        transport.close()
        if server is not None:
            server.stop()


def send_command(broker: str, device: str, command_type: str, *, root: str = DEFAULT_ROOT,
                 timeout: float = 10.0, **body: Any) -> tuple[dict[str, Any], float]:
    """Send one command (ping, get-state, rollback, ...) and wait for its final job event.
    Returns (event, round-trip seconds)."""
    host, port = parse_broker(broker)
    topics = Topics(root)
    command_id = f"{command_type}-{uuid.uuid4().hex[:12]}"
    done = threading.Event()
    answer: dict[str, Any] = {}

    def on_job(message: Any) -> None:
        try:
            event = json.loads(message.payload)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return
        if isinstance(event, dict) and event.get("job") == command_id and event.get("final"):
            answer.update(event)
            done.set()

    transport = MqttTransport(MqttSettings(host=host, port=port, client_id=f"edgepack-cmd-{os.getpid()}-"
                                           f"{uuid.uuid4().hex[:6]}", topic_root=root))
    try:
        transport.start()
        if not transport.wait_connected(10):
            raise DeployError(f"cannot reach the broker at {broker}")
        transport.subscribe(topics.job(device), 1, on_job)
        deadline = time.monotonic() + 5
        while not transport.is_subscribed(topics.job(device)) and time.monotonic() < deadline:
            time.sleep(0.005)
        command = {"schema": COMMAND_SCHEMA_ID, "id": command_id, "type": command_type,
                   "expires_at": time.time() + 60, **body}
        started = time.perf_counter()
        transport.publish(topics.cmd(device), json.dumps(command).encode(), qos=1)
        if not done.wait(timeout):
            raise DeployError(f"{device} did not answer {command_type} within {timeout:g} s")
        return answer, time.perf_counter() - started
    finally:
        transport.close()
