"""The agent's MQTT presence: retained birth and last will, periodic telemetry, job events.

``TelemetryReporter`` composes the building blocks (``MqttTransport``, ``Outbox``,
``Forwarder``, ``TelemetryAggregator``) into what the daemon starts and stops. Everything it
publishes except the retained state goes through the on-disk outbox, so telemetry and job
events survive a broker outage and an agent restart. Inference threads only touch the
aggregator (a lock and a few integer adds); building and publishing happen on the reporter's
own thread, never on the request path.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from device_agent.config import BrokerSettings, OutboxSettings
from device_agent.telemetry.metrics import ModelInfo, SystemReading, TelemetryAggregator, read_system
from device_agent.telemetry.outbox import Forwarder, Outbox
from device_agent.telemetry.session import ConnectionCounter
from edgepack_core import __version__ as edgepack_version
from edgepack_core.mqtt_settings import MqttSettings, Will
from edgepack_core.mqtt_transport import MqttTransport
from edgepack_core.protocol.messages import MAX_MODELS, MAX_REJECTED, JobEvent, ModelTelemetry, SessionMark
from edgepack_core.protocol.payloads import STATE_SCHEMA_ID
from edgepack_core.protocol.pipeline_figures import MAX_PIPELINES, PipelineFigures
from edgepack_core.protocol.topics import Topics

log = logging.getLogger("edgepack.agent.telemetry")

SESSION_EXPIRY_S = 24 * 3600  # the broker keeps queued commands for a device offline up to a day
MAX_FALLBACKS = 16  # the state schema's bounds on provider_fallbacks
MAX_REASON_CHARS = 1000


@dataclass
class AgentStatus:
    """What the runtime reports about itself; the reporter asks for it at each publish."""

    model: ModelInfo | None = None
    provider: str | None = None
    profile: str | None = None
    available_providers: list[str] = field(default_factory=list)
    # Each provider of the profile not serving the model, with why (``LoadedModel.fallbacks_json``).
    provider_fallbacks: list[dict[str, str]] = field(default_factory=list)
    # The versions this device rejected, newest first (``updates.rejected.for_state``): the fleet
    # server marks (device, artifact) rejected from them and never re-targets one automatically.
    rejected: list[dict[str, Any]] = field(default_factory=list)
    # Every model the device holds (``device_agent.models.state_entry``), the first one ``model``.
    models: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    # Each pipeline's counters (``PipelineSet.figures``): telemetry's ``pipelines`` section.
    pipelines: tuple[PipelineFigures, ...] = ()


def capabilities(status: AgentStatus) -> dict[str, Any]:
    """The device's capabilities for the birth message: what an operator needs to target it."""
    try:
        import onnxruntime

        ort_version = onnxruntime.__version__
    except ImportError:  # pragma: no cover - the agent always has onnxruntime
        ort_version = None
    return {
        "arch": platform.machine(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "onnxruntime": ort_version,
        "providers": status.available_providers,
        "profile": status.profile,
        "agent": edgepack_version,
    }


def state_document(device_id: str, online: bool, status: AgentStatus, groups: list[str], *,
                   reason: str = "", ts: float | None = None, session: SessionMark | None = None) -> dict[str, Any]:
    """The retained ``state`` payload: "online" birth with capabilities, or "offline"; ``session``
    marks the connection it belongs to (device_agent/telemetry/session.py)."""
    doc: dict[str, Any] = {
        "schema": STATE_SCHEMA_ID,
        "device": device_id,
        "status": "online" if online else "offline",
        "ts": round(time.time() if ts is None else ts, 3),
        "groups": groups,
    }
    if session is not None:
        doc["session"] = session.to_json()
    if online:
        doc["capabilities"] = capabilities(status)
        doc["model"] = None if status.model is None else {
            "name": status.model.name, "version": status.model.version, "sha256": status.model.sha256}
        doc["provider"] = status.provider
        doc["provider_fallbacks"] = [{"provider": f["provider"], "reason": f["reason"][:MAX_REASON_CHARS]}
                                     for f in status.provider_fallbacks[:MAX_FALLBACKS]]
        doc["rejected"] = status.rejected[:MAX_REJECTED]
        doc["models"] = status.models[:MAX_MODELS]
        doc.update(status.extra)
    else:
        doc["reason"] = reason
    return doc


def settings_from_config(mqtt: BrokerSettings, device_id: str,
                         counter: ConnectionCounter | None = None, groups: list[str] | None = None) -> MqttSettings:
    """MqttSettings from agent.yaml's ``mqtt`` section, with the device's last will; with a
    ``counter``, each connection attempt advances it and the will carries the new mark.
    ``groups``: the reporter's own list, so a will made after a remote settings change names the
    groups the device is in now (default: a copy of ``mqtt.groups``)."""
    topics = Topics(mqtt.topic_root)
    groups = list(mqtt.groups) if groups is None else groups

    def will() -> bytes:
        # Called before every connection attempt: the broker publishes the will unchanged, so
        # its ts is the time of the connection whose loss it reports (never 0).
        mark = None if counter is None else counter.advance()
        doc = state_document(device_id, False, AgentStatus(), groups, reason="connection lost (last will)",
                             session=mark)
        return json.dumps(doc).encode()

    return MqttSettings(
        host=mqtt.host,
        port=mqtt.port,
        keepalive=mqtt.keepalive,
        protocol=mqtt.protocol,
        client_id=mqtt.client_id or device_id,
        username=mqtt.username,
        password=mqtt.password,
        tls=mqtt.tls,
        topic_root=topics.root,
        will=Will(topics.state(device_id), will),
        session_expiry=SESSION_EXPIRY_S,
    )


class TelemetryReporter:
    """Birth/last will, telemetry every ``interval`` seconds and job events, for one device."""

    def __init__(
        self,
        device_id: str,
        settings: MqttSettings,
        outbox_path: Path,
        status: Callable[[], AgentStatus],
        *,
        groups: list[str] | None = None,
        interval: float = 10.0,
        outbox_limits: OutboxSettings | None = None,
        counter: ConnectionCounter | None = None,
    ) -> None:
        self.device_id = device_id
        self.groups = groups if groups is not None else []  # the caller's list: its last will names it too
        self.topics = Topics(settings.topic_root)
        self.status = status
        self.counter = counter
        self._interval = interval
        self.aggregator = TelemetryAggregator(device_id, started=time.monotonic())
        limits = outbox_limits or OutboxSettings()
        self.outbox = Outbox(outbox_path, max_messages=limits.max_messages, max_bytes=limits.max_bytes)
        self.transport = MqttTransport(settings)
        self.forwarder = Forwarder(self.outbox, self.transport)
        self.transport.on_connected(self.publish_state)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._system: SystemReading | None = None
        self._models: dict[str, TelemetryAggregator] = {}  # per model name (several named models)
        self._models_lock = threading.Lock()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> TelemetryReporter:
        self._system = read_system()
        self.transport.start()
        self.forwarder.start()
        self._thread = threading.Thread(target=self._run, name="telemetry", daemon=True)
        self._thread.start()
        return self

    def stop(self, reason: str = "agent stopped") -> None:
        """Flush what is in flight, publish a clean retained "offline" and disconnect."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
        self.forwarder.stop(flush_timeout=2.0)
        offline = state_document(self.device_id, False, self.status(), self.groups, reason=reason,
                                 session=self._session())
        self.transport.close(json.dumps(offline).encode(), topic=self.topics.state(self.device_id))
        self.outbox.close()

    # ---------------------------------------------------------------- what the agent calls

    @property
    def interval(self) -> float:
        return self._interval

    def set_interval(self, seconds: float) -> None:
        """Change the telemetry period now (a remote ``set-telemetry-interval`` command)."""
        self._interval = max(0.1, float(seconds))
        self._wake.set()

    def record_inference(self, seconds: float, *, model: str | None = None) -> None:
        """One successful inference, of ``model`` when named (its own figures in ``models``)."""
        self.aggregator.record_inference(seconds)
        per_model = self._model_aggregator(model)
        if per_model is not None:
            per_model.record_inference(seconds)

    def record_error(self, kind: str, *, model: str | None = None) -> None:
        self.aggregator.record_error(kind)
        per_model = self._model_aggregator(model)
        if per_model is not None:
            per_model.record_error(kind)

    def _model_aggregator(self, model: str | None) -> TelemetryAggregator | None:
        """The figures of ``model``, made on its first request (at most :data:`MAX_MODELS`)."""
        if model is None:
            return None
        with self._models_lock:
            aggregator = self._models.get(model)
            if aggregator is None and len(self._models) < MAX_MODELS:
                aggregator = self._models[model] = TelemetryAggregator(model, started=time.monotonic())
            return aggregator

    def _model_figures(self, now: float, ts: float, versions: dict[str, str | None]) -> tuple[ModelTelemetry, ...]:
        """Each model's figures for the interval ending at ``now`` (reset like the device's)."""
        with self._models_lock:
            aggregators = dict(self._models)
        figures = []
        for name, aggregator in aggregators.items():
            sample = aggregator.build(now=now, ts=ts, model=None, provider=None, system=None, queue=None)
            figures.append(ModelTelemetry.from_sample(name, versions.get(name), sample))
        return tuple(figures)

    def publish_state(self) -> None:
        """Publish the retained "online" birth (on every connect, and when the model changes)."""
        doc = state_document(self.device_id, True, self.status(), self.groups, session=self._session())
        self.transport.publish(self.topics.state(self.device_id), json.dumps(doc).encode(), qos=1, retain=True)

    def _session(self) -> SessionMark | None:
        return None if self.counter is None else self.counter.current

    def publish_job_event(self, event: JobEvent, *, direct: bool = False) -> int:
        """Queue a job event on ``dev/{d}/job``; job events are never dropped before telemetry.
        ``direct``: hand it to the MQTT client without the on-disk outbox (a full disk), so it
        is lost if the agent stops before the broker has it; returns 0 then."""
        if direct:
            self.transport.publish(self.topics.job(self.device_id), event.encode(), 1)
            return 0
        return self.outbox.put(self.topics.job(self.device_id), event.encode(), 1, "job")

    def publish_telemetry_now(self) -> None:
        status = self.status()
        self._system = read_system(self._system)
        now, ts = time.monotonic(), time.time()
        sample = self.aggregator.build(now=now, ts=ts, model=status.model,
                                       provider=status.provider, system=self._system, queue=self.outbox.counters())
        versions = {str(m["name"]): m.get("version") for m in status.models}
        sample = dataclasses.replace(sample, models=self._model_figures(now, ts, versions),
                                     pipelines=status.pipelines[:MAX_PIPELINES])
        self.outbox.put(self.topics.telemetry(self.device_id), sample.encode(), 1, "telemetry")

    # ---------------------------------------------------------------- thread

    def _run(self) -> None:
        deadline = time.monotonic() + self._interval
        while not self._stop.is_set():
            self._wake.wait(max(0.0, deadline - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            if now < deadline and deadline - now > self._interval:
                deadline = now + self._interval  # the interval was shortened: do not wait out the old one
            if time.monotonic() >= deadline:
                try:
                    self.publish_telemetry_now()
                except Exception:  # a full disk must not kill the reporter thread
                    log.exception("could not queue telemetry")
                deadline += self._interval
                if deadline < time.monotonic():  # fell behind (suspend, overload): skip, do not burst
                    deadline = time.monotonic() + self._interval
