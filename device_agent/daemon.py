"""``edgepack-agent run``: the daemon that composes store, runtime, HTTP API, telemetry and updates.

Start order: recover the store (crash cleanup, re-verify), install the configured first
artifact if the store is empty, load the active model (provider choice, smoke test), then
serve: HTTP API, MQTT telemetry, remote updates. Stop order is the reverse; SIGTERM and
SIGINT stop it gracefully (a clean retained "offline" state, the outbox flushed).
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any

from device_agent.config import AgentConfig
from device_agent.http.server import ApiServer
from device_agent.runtime import InferenceService, LoadedModel, load_model
from device_agent.store import InstalledModel, ModelStore
from device_agent.telemetry.metrics import ModelInfo
from device_agent.telemetry.reporter import AgentStatus, TelemetryReporter, settings_from_config
from device_agent.telemetry.session import ConnectionCounter
from device_agent.updates.disk import FreeSpace
from device_agent.updates.rejected import for_state
from device_agent.updates.service import UpdateService
from edgepack_core.errors import EdgepackError
from edgepack_core.signing import TrustStore

log = logging.getLogger("edgepack.agent")


class Daemon:
    """One running agent. ``start``/``stop`` are idempotent enough for tests and signals."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.trust = TrustStore.from_paths(config.trust)
        # Operator keys sign commands (edgepack keygen --operator); without them, anyone who can
        # publish to the broker may order deploys, rollbacks and downgrades (warned at start).
        self.operator_trust = TrustStore.from_paths(config.operator_keys) if config.operator_keys else None
        self.store = ModelStore(config.store, self.trust, config.limits.reader_limits())
        self.space = FreeSpace(config.store, config.updates.min_free_bytes)
        self.service = InferenceService(max_streams=config.api.max_streams, stream_idle_s=config.api.stream_idle_s)
        self.api: ApiServer | None = None
        self.reporter: TelemetryReporter | None = None
        self.updates: UpdateService | None = None
        self._stopped = threading.Event()

    # ---------------------------------------------------------------- models

    def load(self, installed: InstalledModel) -> LoadedModel:
        """Load an installed model with this device's profile; runs its smoke test."""
        return load_model(installed.directory, installed.verified.manifest, profile=self.config.profile,
                          threads=self.config.threads)

    def install_artifact(self, artifact: Path, *, force: bool = False) -> LoadedModel:
        """Verify, stage, smoke-test and activate an artifact, then hot-swap it in."""
        loaded: list[LoadedModel] = []
        installed = self.store.install(artifact, force=force, smoke_test=lambda m: loaded.append(self.load(m)))
        self.activate_loaded(loaded[0])
        log.info("installed %s %s", installed.name, installed.version)
        return loaded[0]

    def activate_loaded(self, model: LoadedModel) -> LoadedModel | None:
        old = self.service.swap(model)
        if self.reporter is not None:
            self.reporter.publish_state()
        return old

    def health(self) -> dict[str, Any]:
        """What /healthz adds to the model: the store's condition and, on a full disk, ``degraded``."""
        return {**self.store.health(), **self.space.health()}

    def status(self) -> AgentStatus:
        import onnxruntime as ort

        model = self.service.model
        info = None if model is None else ModelInfo(model.manifest.name, model.manifest.version,
                                                    model.manifest.model_sha256)
        return AgentStatus(model=info, provider=None if model is None else model.provider,
                           profile=self.config.profile, available_providers=list(ort.get_available_providers()),
                           provider_fallbacks=[] if model is None else model.fallbacks_json(),
                           rejected=for_state(self.store.rejected.records()),
                           extra=self.store.health())

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Daemon:
        active = self.store.recover()
        if active is None and self.config.artifact is not None:
            log.info("store is empty: installing %s", self.config.artifact)
            self.install_artifact(self.config.artifact)
        elif active is not None:
            self._load_active(active)
        mqtt = self.config.mqtt
        if mqtt is not None:
            counter = ConnectionCounter(self.config.store / "mqtt_session.json")
            self.reporter = TelemetryReporter(
                self.config.device_id, settings_from_config(mqtt, self.config.device_id, counter),
                mqtt.queue.path or self.config.store / "outbox.db", self.status, groups=list(mqtt.groups),
                interval=mqtt.telemetry_interval, outbox_limits=mqtt.queue, counter=counter)
            self.service.observers.append(self._observe)
            self.reporter.start()
            self._start_updates()
        address = self.config.api.address
        if address is not None:
            self.api = ApiServer(address, self.service, settings=self.config.api, health=self.health).start()
            log.info("HTTP API on http://%s:%d", address[0], self.api.port)
        return self

    def _load_active(self, active: InstalledModel) -> None:
        """Serve the store's active model. If it verified but no longer loads (e.g. after an
        onnxruntime upgrade), load and smoke-test the previous one *before* the store's commit
        point changes, then commit and serve it; if that fails too, nothing changed on disk and
        the original error stands."""
        try:
            self.service.swap(self.load(active))
            return
        except EdgepackError as err:
            failure = err
        log.error("active model %s does not load (%s); trying the previous one", active.key, failure)
        try:
            previous = self.store.rollback_target()
            loaded = self.load(previous)
            self.store.rollback()
        except EdgepackError as err:
            log.error("the previous model cannot serve either (%s)", err)
            raise failure from err
        self.service.swap(loaded)
        log.warning("serving %s %s after rolling back from %s", previous.name, previous.version, active.key)

    def _start_updates(self) -> None:
        """Remote updates over MQTT (the update service knows the daemon only as an AgentHost)."""
        if not self.config.updates.enabled:
            return
        if self.operator_trust is not None:  # without: `edgepack-agent run` warns on stderr at every start
            log.info("commands that change what runs must be signed by one of %d operator key(s)",
                     len(self.operator_trust))
        self.updates = UpdateService(self)
        self.updates.start()

    def _observe(self, latency: float | None, error: str | None) -> None:
        if self.reporter is None:
            return
        if error is None and latency is not None:
            self.reporter.record_inference(latency)
        elif error is not None:
            self.reporter.record_error(error)

    def stop(self, reason: str = "agent stopped") -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.api is not None:
            self.api.stop()
        if self.updates is not None:
            self.updates.stop()
        if self.reporter is not None:
            self.reporter.stop(reason)

    def wait(self) -> None:
        self._stopped.wait()

    def run_until_signal(self) -> None:
        """Serve until SIGTERM/SIGINT, then stop gracefully."""
        stop_requested = threading.Event()

        def handle(signum: int, _frame: Any) -> None:
            log.info("received %s: stopping", signal.Signals(signum).name)
            stop_requested.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        self.start()
        while not stop_requested.wait(1.0):
            pass
        self.stop("agent stopped (signal)")
