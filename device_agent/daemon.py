"""``edgepack-agent run``: the daemon that composes store, runtime, HTTP API, telemetry and updates.

Start order: recover the store (crash cleanup, re-verify), install the configured first
artifact if the store is empty, load the active model (provider choice, smoke test), then
serve: HTTP API, MQTT telemetry, remote updates. Stop order is the reverse; SIGTERM and
SIGINT stop it gracefully (a clean retained "offline" state, the outbox flushed).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_agent.config import AgentConfig
from device_agent.errors import StoreError
from device_agent.http.server import ApiServer
from device_agent.logring import LogRing
from device_agent.memory import Released, read_memory, release_if_enabled
from device_agent.models import SLOTS_DIR, ModelSet, ModelSlot, slot_directory, state_entry
from device_agent.remote_settings import Held, held_keys, limits_for, load_held, overlay
from device_agent.runtime import InferenceService, LoadedModel, load_model
from device_agent.store import InstalledModel, ModelStore
from device_agent.updates.disk import FreeSpace
from device_agent.updates.golden_stream import check_golden_stream
from device_agent.updates.rejected import for_state
from edgepack_core.errors import EdgepackError
from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.signing import OPERATOR, RELEASE, TrustStore

if TYPE_CHECKING:  # imported when used: an agent without mqtt: never loads MQTT, telemetry or updates
    from device_agent.telemetry.reporter import AgentStatus, TelemetryReporter
    from device_agent.updates.service import UpdateService

log = logging.getLogger("edgepack.agent")


class Daemon:
    """One running agent. ``start``/``stop`` are idempotent enough for tests and signals.

    It holds a :class:`~device_agent.models.ModelSet`: one slot per model name, each with its own
    store and inference service (``device_agent/models.py``). ``store`` and ``service`` are the
    root store's, the slot of a single-model agent (and of the model a store laid out before
    named models holds)."""

    def __init__(self, config: AgentConfig, log_ring: LogRing | None = None) -> None:
        self.log_ring = log_ring  # what a fetch-logs command reads (device_agent/logring.py)
        # Settings from the fleet server (device_agent/remote_settings.py) win over agent.yaml's
        # for the keys they carry; ``base_config`` is agent.yaml alone, what a new document overlays.
        self.base_config = config
        self.held = load_held(config.store)
        self.config = overlay(config, self.held.applied(), self.held.pipelines)
        if config.mqtt is not None:
            # Before any session is made: imported after onnxruntime's start-up allocations, the
            # same modules cost 1.9 MiB more RSS (tools/bench/agent_rss.py --mqtt, BENCHMARKS.md).
            import device_agent.telemetry.reporter
            import device_agent.updates.service  # noqa: F401
        self._file_trust = TrustStore.from_paths(config.trust, kind=RELEASE)
        self.trust = TrustStore(self._file_trust.public_keys())
        # Operator keys sign commands (edgepack keygen --operator); without them, anyone who can
        # publish to the broker may order deploys, rollbacks and downgrades (warned at start).
        self._file_operators = TrustStore.from_paths(config.operator_keys, kind=OPERATOR) \
            if config.operator_keys else None
        self.operator_trust: TrustStore | None = None
        self.use_keys(self.held)
        self.store = ModelStore(config.store, self.trust, self.config.limits.reader_limits())
        self.space = FreeSpace(config.store, config.updates.min_free_bytes)
        self.service = self._new_service()
        self.models = ModelSet()
        self._models_lock = threading.Lock()
        self._root_claim: str | None = None  # the model name an empty root store was handed to
        self.api: ApiServer | None = None
        self.reporter: TelemetryReporter | None = None
        self.pipelines: Any = None  # device_agent.pipelines.host.PipelineSet, when agent.yaml has pipelines
        self.updates: UpdateService | None = None
        self.released: Released | None = None  # the last release of start-up pages (device_agent/memory.py)
        self._serving = False  # start() is done: an activation after it releases its pages too
        self._stopped = threading.Event()

    def use_keys(self, held: Held) -> None:
        """Trust the release and operator keys of the applied settings document, or agent.yaml's
        for a kind it does not carry (a store changed in place: every model store holds it)."""
        release = held_keys(held, "trust")
        self.trust.replace(release or self._file_trust.public_keys())
        operators = held_keys(held, "operator_keys")
        if not operators and self._file_operators is not None:
            operators = tuple(self._file_operators.public_keys())
        if not operators:
            self.operator_trust = None
        elif self.operator_trust is None:
            self.operator_trust = TrustStore(operators)
        else:
            self.operator_trust.replace(operators)

    def settings_report(self) -> dict[str, Any]:
        """The state message's ``settings``: the generation held, each key's result, the keys held."""
        return {"generation": self.held.generation, "results": dict(self.held.results),
                "keys": {"release": self.trust.key_ids,
                         "operator": [] if self.operator_trust is None else self.operator_trust.key_ids}}

    def _new_service(self) -> InferenceService:
        return InferenceService(max_streams=self.config.api.max_streams, stream_idle_s=self.config.api.stream_idle_s)

    # ---------------------------------------------------------------- models

    def load(self, installed: InstalledModel) -> LoadedModel:
        """Load an installed model with this device's profile; runs its smoke test and measures
        its report card (every activation: start, install, update, rollback)."""
        return load_model(installed.directory, installed.verified.manifest, profile=self.config.profile,
                          threads=self.config.threads, report_card=True)

    def install_artifact(self, artifact: Path, *, force: bool = False, slot: ModelSlot | None = None) -> LoadedModel:
        """Verify, stage, smoke-test and activate an artifact, then hot-swap it in; into the root
        store unless ``slot`` names another (whose name the artifact must carry)."""
        loaded: list[LoadedModel] = []

        def smoke_test(installed: InstalledModel) -> None:
            if slot is not None and installed.name != slot.name:
                raise StoreError(f"{artifact} holds model {installed.name!r}, not {slot.name!r} as models: says")
            loaded.append(self.load(installed))
            check_golden_stream(loaded[-1])  # a mismatch refuses the install, as a golden sample's would

        store = self.store if slot is None else slot.store
        installed = store.install(artifact, force=force, smoke_test=smoke_test)
        self.activate_loaded(loaded[0], slot or ModelSlot(installed.name, self.store, self.service))
        log.info("installed %s %s", installed.name, installed.version)
        return loaded[0]

    def new_slot(self, name: str) -> ModelSlot:
        """The slot a model of ``name`` goes to: the one held, else a new one (not yet in the set:
        it joins when a model is activated in it). The root store takes the first model of an
        agent without ``models:``; every other model gets ``slots/<name>/``."""
        held = self.models.get(name)
        if held is not None:
            return held
        with self._models_lock:  # the first name to ask claims an empty root store
            root_taken = bool(self.config.models) or any(slot.store is self.store for slot in self.models)
            if not root_taken and self._root_claim in (None, name) and self.store.active_version() is None:
                self._root_claim = name
                return ModelSlot(name, self.store, self.service)
        store = ModelStore(slot_directory(self.config.store, name), self.trust,
                           limits_for(self.config, self.held.applied(), name))
        return ModelSlot(name, store, self._new_service())

    def activate_loaded(self, model: LoadedModel, slot: ModelSlot | None = None) -> LoadedModel | None:
        """Hot-swap ``model`` into ``slot`` (default: the slot of its name, else the root's) and
        add the slot to the set if it is new; publishes the state."""
        slot = slot or self.models.get(model.manifest.name) or ModelSlot(model.manifest.name, self.store, self.service)
        old = slot.service.swap(model)
        self._register(slot)
        if self.reporter is not None:
            self.reporter.publish_state()
        if self._serving:
            self.released = release_if_enabled(self.config.memory, f"after activating {model.manifest.name}")
        return old

    def remove_slot(self, slot: ModelSlot) -> None:
        """Stop serving ``slot``'s model and delete its store (a ``remove`` command): it leaves the
        set first, so a request names it no more (404), then the store goes: ``slots/<name>/``
        renamed aside and deleted, or the root store's state cleared and its models pruned."""
        with self._models_lock:
            self.models = ModelSet(tuple(s for s in self.models if s.name != slot.name))
            if self._root_claim == slot.name:
                self._root_claim = None
        slot.service.swap(None)
        slot.service.observers.clear()  # a later model in this service registers its own
        slot.store.clear()
        if slot.store is not self.store:
            aside = slot.store.root.with_name(f".removed-{slot.name}")
            os.replace(slot.store.root, aside)
            shutil.rmtree(aside, ignore_errors=True)
        if self.reporter is not None:
            self.reporter.publish_state()

    def _register(self, slot: ModelSlot) -> None:
        with self._models_lock:
            if self.models.get(slot.name) is not None:
                return
            self.models = self.models.with_slot(slot)
        slot.service.observers.append(lambda latency, error: self._observe(slot.name, latency, error))

    def health(self) -> dict[str, Any]:
        """What /healthz adds to the models: the stores' condition, on a full disk ``degraded``,
        each pipeline's state (running with its counters, or refused with the reason), and the
        agent's resident memory (``device_agent/memory.py``)."""
        pipelines = {"pipelines": self.pipelines.status()} if self.pipelines is not None else {}
        reading = read_memory(self.released)
        memory = {"memory": reading.to_json()} if reading is not None else {}
        return {**self.health_of_stores(), **self.space.health(), **pipelines, **memory}

    def status(self) -> AgentStatus:
        import onnxruntime as ort

        from device_agent.telemetry.metrics import ModelInfo
        from device_agent.telemetry.reporter import AgentStatus

        slots = self.models.slots
        model = slots[0].service.model if slots else None
        info = None if model is None else ModelInfo(model.manifest.name, model.manifest.version,
                                                    model.manifest.model_sha256)
        stores = [self.store, *(slot.store for slot in slots if slot.store is not self.store)]
        return AgentStatus(model=info, provider=None if model is None else model.provider,
                           profile=self.config.profile, available_providers=list(ort.get_available_providers()),
                           provider_fallbacks=[] if model is None else model.fallbacks_json(),
                           rejected=for_state([r for store in stores for r in store.rejected.records()]),
                           models=[state_entry(slot) for slot in slots],
                           extra={**self.health_of_stores(), "settings": self.settings_report()},
                           pipelines=() if self.pipelines is None else self.pipelines.figures())

    def health_of_stores(self) -> dict[str, Any]:
        """The stores' condition (read-only, recovered): nothing while they are sound."""
        stores: dict[str, Any] = {}
        for slot in self.models:
            stores.update(slot.store.health())
        return {**stores, **self.store.health()}

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Daemon:
        self._recover_slots()
        root_model = next((slot.name for slot in self.models.slots if slot.store is self.store), None)
        self.store.limits = limits_for(self.config, self.held.applied(), root_model)  # its model's own limits
        if not self.models and self.config.artifact is not None:
            log.info("store is empty: installing %s", self.config.artifact)
            self.install_artifact(self.config.artifact)
        for entry in self.config.models:
            if self.models.get(entry.name) is None:
                log.info("no model %s in the store: installing %s", entry.name, entry.artifact)
                self.install_artifact(entry.artifact, slot=self.new_slot(entry.name))
        mqtt = self.config.mqtt
        if mqtt is not None:
            from device_agent.telemetry.reporter import TelemetryReporter, settings_from_config
            from device_agent.telemetry.session import ConnectionCounter

            counter = ConnectionCounter(self.config.store / "mqtt_session.json")
            groups = list(mqtt.groups)  # one list: the reporter's and its last will's (settings change it in place)
            self.reporter = TelemetryReporter(
                self.config.device_id, settings_from_config(mqtt, self.config.device_id, counter, groups),
                mqtt.queue.path or self.config.store / "outbox.db", self.status, groups=groups,
                interval=mqtt.telemetry_interval, outbox_limits=mqtt.queue, counter=counter)
            self.reporter.start()
            self._start_updates()
        self._start_pipelines()
        address = self.config.api.address
        if address is not None:
            self.api = ApiServer(address, self.service, settings=self.config.api, health=self.health,
                                 models=lambda: self.models.services(),
                                 pipelines=lambda: () if self.pipelines is None else self.pipelines.snapshot()).start()
            log.info("HTTP API on http://%s:%d", address[0], self.api.port)
        self._serving = True
        self.released = release_if_enabled(self.config.memory, "after start")
        return self

    def _recover_slots(self) -> None:
        """Recover the root store and every ``slots/<name>/`` store, and serve what each holds."""
        active = self.store.recover()
        if active is not None:
            self._load_active(ModelSlot(active.name, self.store, self.service), active)
        slots = self.config.store / SLOTS_DIR
        for directory in sorted(slots.iterdir()) if slots.is_dir() else ():
            if directory.name.startswith(".removed-"):  # a removal cut short: finish it
                shutil.rmtree(directory, ignore_errors=True)
                continue
            if not is_valid_id(directory.name) or not directory.is_dir() or self.models.get(directory.name):
                continue
            slot = self.new_slot(directory.name)
            active = slot.store.recover()
            if active is None:
                continue
            if active.name != slot.name:
                log.error("%s holds model %s, not %s: not served", directory, active.name, slot.name)
                continue
            self._load_active(slot, active)

    def _load_active(self, slot: ModelSlot, active: InstalledModel) -> None:
        """Serve a store's active model. If it verified but no longer loads (e.g. after an
        onnxruntime upgrade), load and smoke-test the previous one *before* the store's commit
        point changes, then commit and serve it; if that fails too, nothing changed on disk and
        the original error stands."""
        try:
            slot.service.swap(self.load(active))
            self._register(slot)
            return
        except EdgepackError as err:
            failure = err
        log.error("active model %s does not load (%s); trying the previous one", active.key, failure)
        try:
            previous = slot.store.rollback_target()
            loaded = self.load(previous)
            slot.store.rollback()
        except EdgepackError as err:
            log.error("the previous model cannot serve either (%s)", err)
            raise failure from err
        slot.service.swap(loaded)
        self._register(slot)
        log.warning("serving %s %s after rolling back from %s", previous.name, previous.version, active.key)

    def _start_updates(self) -> None:
        """Remote updates over MQTT (the update service knows the daemon only as an AgentHost)."""
        if not self.config.updates.enabled:
            return
        if self.operator_trust is not None:  # without: `edgepack-agent run` warns on stderr at every start
            log.info("commands that change what runs must be signed by one of %d operator key(s)",
                     len(self.operator_trust))
        from device_agent.updates.service import UpdateService

        self.updates = UpdateService(self)
        self.updates.start()

    def restart_pipelines(self) -> None:
        """Stop the running pipelines and start those of the config now (a settings document
        from the fleet server changed them): the sources reopen, the models stay loaded."""
        if self.pipelines is not None:
            self.pipelines.stop()
            self.pipelines = None
        self._start_pipelines()

    def _start_pipelines(self) -> None:
        """Start agent.yaml's pipelines, each checked against the models installed now
        (docs/agent.md, "Pipelines"); imported only when there are some (an idle agent pays nothing)."""
        if not self.config.pipelines:
            return
        from device_agent.pipelines.contracts import installed_contracts
        from device_agent.pipelines.host import PipelineSet

        reporter = self.reporter

        def publish(event: Any) -> None:
            if reporter is not None:
                reporter.outbox.put(reporter.topics.events(self.config.device_id), event.to_payload(), 1, "events")

        def service_of(name: str) -> Any:
            slot = self.models.get(name)
            return None if slot is None else slot.service

        self.pipelines = PipelineSet(self.config.pipelines, self.config.device_id, service_of,
                                     publish if reporter is not None else None)
        self.pipelines.start(installed_contracts(self.config))

    def _observe(self, name: str, latency: float | None, error: str | None) -> None:
        if self.reporter is None:
            return
        if error is None and latency is not None:
            self.reporter.record_inference(latency, model=name)
        elif error is not None:
            self.reporter.record_error(error, model=name)

    def stop(self, reason: str = "agent stopped") -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self.pipelines is not None:
            self.pipelines.stop()
        if self.api is not None:
            self.api.stop()
        if self.updates is not None:
            self.updates.stop()
        if self.reporter is not None:
            self.reporter.stop(reason)

    def wait(self) -> None:
        self._stopped.wait()

    def run_until_signal(self) -> None:
        """Serve until SIGTERM/SIGINT, then stop gracefully.

        The handler only records the signal: it runs on the main thread between two bytecodes,
        possibly inside a logging handler that holds its lock (the log ring's, a stream's), so
        logging from it deadlocked the agent when SIGTERM came while it logged (seen in a CI
        rehearsal: SIGTERM during start's last log line never stopped it). The main loop logs."""
        received: list[int] = []
        stop_requested = threading.Event()

        def handle(signum: int, _frame: Any) -> None:
            received.append(signum)
            stop_requested.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        self.start()
        while not stop_requested.wait(1.0):
            pass
        log.info("received %s: stopping", signal.Signals(received[0]).name)
        self.stop("agent stopped (signal)")
