"""``edgepack deploy``: the orchestrator. One :class:`DeployOptions` in, a :class:`DeployResult`
out; each step is a small function (read the manifest, find the targets, start the delivery,
send a wave, wait for its verdict), and the decisions are :mod:`sdk.deploy.policy`'s.

Delivery, three ways: the built-in HTTP server (:mod:`.server`, Range requests so a device
resumes), chunks over MQTT (:mod:`.sender`, for devices that reach only the broker), or a URL
where the artifact is already hosted (an object store or CDN). Devices verify the signature
and hashes themselves, so none of these needs to be trusted.

A staged rollout sends the command to a canary share first and to the rest only if every
canary ends ``active``; the same command id goes to everyone, so a device that gets it twice
(as a canary and as a group member) answers with its existing job instead of installing twice.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from edgepack_core.artifact import verify_artifact
from edgepack_core.fsutil import sha256_file
from edgepack_core.mqtt_transport import MqttTransport
from edgepack_core.protocol.commands import new_command_id
from edgepack_core.protocol.ids import validate_id
from edgepack_core.protocol.messages import JobEvent
from edgepack_core.protocol.topics import Topics
from edgepack_core.signing import SigningKey, TrustStore
from sdk.broker import BrokerOptions
from sdk.deploy.messaging import command_messages, listen_for_jobs, make_command, publish_acknowledged
from sdk.deploy.policy import DeviceJob, JobBoard, WaveVerdict, all_active, plan_waves, wave_verdict
from sdk.deploy.sender import XferSender
from sdk.deploy.server import ArtifactServer
from sdk.errors import DeployError
from sdk.fleet import collect
from sdk.inspect import read_unverified_for_display

DEFAULT_CHUNK = 256 * 1024
COMMAND_TTL_S = 24 * 3600
SEND_TIMEOUT_S = 10.0

EventCallback = Callable[[str, JobEvent], None]


@dataclass(frozen=True)
class DeployOptions:
    """Everything one deployment needs. Exactly one of ``devices`` or ``group``."""

    artifact: Path
    broker: BrokerOptions
    devices: tuple[str, ...] = ()
    group: str | None = None
    wait: bool = True
    timeout: float = 600.0
    canary_percent: float | None = None
    url: str | None = None
    transfer: Literal["http", "mqtt"] = "http"
    serve_host: str = "127.0.0.1"
    trust: TrustStore | None = None
    force_downgrade: bool = False
    health_window_s: float | None = None
    allow_contract_change: bool = False
    expect: int | None = None
    chunk_size: int = DEFAULT_CHUNK
    operator_key: SigningKey | None = field(default=None, repr=False)
    on_event: EventCallback | None = None

    def __post_init__(self) -> None:
        if bool(self.devices) == (self.group is not None):
            raise DeployError("a deployment targets either devices or one group")
        for device in self.devices:
            validate_id(device, "device")
        if self.group is not None:
            validate_id(self.group, "group")
        if self.transfer not in ("http", "mqtt"):
            raise DeployError(f"unknown transfer {self.transfer!r} (http or mqtt)")


@dataclass
class DeployResult:
    command_id: str
    jobs: dict[str, DeviceJob]
    aborted: str = ""

    @property
    def succeeded(self) -> bool:
        return not self.aborted and all_active(self.jobs)


def group_members(broker: BrokerOptions, group: str, wait_s: float = 2.0) -> list[str]:
    """Online devices whose retained birth message lists ``group``."""
    view = collect(broker, wait_s=wait_s, quiet_s=0.5)
    return sorted(r.device for r in view.rows(time.time()) if group in r.groups and r.status == "online")


def _manifest(options: DeployOptions) -> Mapping[str, Any]:
    if options.trust is not None:
        return verify_artifact(options.artifact, options.trust).manifest.raw
    return read_unverified_for_display(options.artifact).manifest


def _targets(options: DeployOptions) -> list[str]:
    if options.group is None:
        return list(options.devices)
    Topics(options.broker.topic_root).group_cmd(options.group)  # validates the name
    targets = group_members(options.broker, options.group)
    if options.expect is not None and len(targets) < options.expect:
        raise DeployError(f"group {options.group}: {len(targets)} device(s) online, expected {options.expect}")
    if not targets:
        raise DeployError(f"group {options.group}: no online device found (is the broker right?)")
    return targets


@contextlib.contextmanager
def _delivery(options: DeployOptions, transport: MqttTransport, topics: Topics, sha: str,
              targets: list[str]) -> Iterator[dict[str, Any]]:
    """The command's ``artifact`` field, with whatever serves it running until the block ends."""
    if options.url is not None:
        yield {"url": options.url}
    elif options.transfer == "mqtt":
        transfer_id = uuid.uuid4().hex[:12]
        sender = XferSender(transport, topics, options.artifact, transfer_id, options.chunk_size, targets)
        try:
            yield {"xfer": {"id": transfer_id, "chunk_size": options.chunk_size, "chunks": sender.chunks}}
        finally:
            sender.close()
    else:
        server = ArtifactServer(options.artifact, sha, host=options.serve_host)
        try:
            yield {"url": server.url}
        finally:
            server.stop()


class _Rollout:
    """One deployment's moving parts: the board, its condition variable, the sends."""

    def __init__(self, options: DeployOptions, transport: MqttTransport, topics: Topics, command_id: str,
                 fields: dict[str, Any], targets: list[str]) -> None:
        self.options, self.transport, self.topics = options, transport, topics
        self.command_id, self.fields = command_id, fields
        self.board = JobBoard(command_id, targets)
        self.changed = threading.Condition()

    def on_event(self, event: JobEvent) -> None:
        with self.changed:
            taken = self.board.fold(event)
            self.changed.notify_all()
        if taken and self.options.on_event is not None:
            self.options.on_event(event.device, event)

    def send(self, wave: list[str], via_group: bool) -> None:
        """One command per destination (each names its target, which the signature covers)."""
        key, group = self.options.operator_key, self.options.group
        common = {"command_id": self.command_id, "ttl_s": COMMAND_TTL_S, "operator_key": key, **self.fields}
        if via_group and group is not None:
            commands = [(self.topics.group_cmd(group), make_command("deploy", group=group, **common))]
        else:
            commands = [(self.topics.cmd(d), make_command("deploy", device=d, **common)) for d in wave]
        publish_acknowledged(self.transport, command_messages(self.topics, commands), SEND_TIMEOUT_S)

    def wait(self, wave: list[str]) -> WaveVerdict:
        """Block until the wave passes, fails or runs out of time."""
        end = time.monotonic() + self.options.timeout
        with self.changed:
            while True:
                remaining = end - time.monotonic()
                verdict = wave_verdict(self.board, wave, timed_out=remaining <= 0)
                if verdict.outcome != "pending":
                    return verdict
                self.changed.wait(min(remaining, 0.5))


def _fields(options: DeployOptions, manifest: Mapping[str, Any], sha: str) -> dict[str, Any]:
    return {"name": manifest["name"], "version": manifest["version"], "size": options.artifact.stat().st_size,
            "sha256": sha, "force_downgrade": options.force_downgrade or None,
            "health_window_s": options.health_window_s,
            "allow_contract_change": options.allow_contract_change or None}


def _run_waves(rollout: _Rollout, waves: list[list[str]]) -> str:
    """Send wave after wave; stop at the first that fails. Returns why it stopped, or ""."""
    for number, wave in enumerate(waves):
        last = number == len(waves) - 1
        rollout.send(wave, via_group=last and rollout.options.group is not None)
        if last and not rollout.options.wait:
            return ""
        verdict = rollout.wait(wave)
        if verdict.outcome == "passed":
            continue
        if verdict.timed_out:
            reason = f"timed out after {rollout.options.timeout:g} s: {verdict.reason}"
        else:
            reason = verdict.reason
        if not last:
            rollout.board.skip([d for later in waves[number + 1:] for d in later], "canary failed")
            return f"canary failed on {reason}"
        return reason
    return ""


def deploy(options: DeployOptions) -> DeployResult:
    """Deploy an artifact as ``options`` say; with ``wait``, follow every job to its end."""
    manifest = _manifest(options)
    targets = _targets(options)
    sha = sha256_file(options.artifact)
    topics = Topics(options.broker.topic_root)
    command_id = new_command_id("deploy", manifest["name"], manifest["version"])
    transport = options.broker.connect("edgepack-deploy")
    try:
        with _delivery(options, transport, topics, sha, targets) as artifact_ref:
            rollout = _Rollout(options, transport, topics, command_id,
                               {**_fields(options, manifest, sha), "artifact": artifact_ref}, targets)
            listen_for_jobs(transport, topics.all_of("job"), topics, rollout.on_event)
            aborted = _run_waves(rollout, plan_waves(targets, options.canary_percent))
            return DeployResult(command_id, rollout.board.jobs, aborted=aborted)
    finally:
        transport.close()
