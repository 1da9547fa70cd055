"""The device-side executor of remote commands: a thin shell of I/O around pure decisions.

Decisions live elsewhere and are unit-tested: who may order what
(:mod:`edgepack_core.command_auth`), which artifact this device accepts
(:mod:`device_agent.updates.admission`), whether a new model is healthy
(:mod:`device_agent.updates.health`), which job state follows which and what a restart does
(:mod:`device_agent.updates.jobs`). This module fetches, verifies, stages, swaps and records,
and every job state change goes through :func:`jobs.advance`.

Threads: command messages arrive on the MQTT network thread, where they are only parsed,
authorised, de-duplicated and queued (a ping is answered right there). Worker lanes run
jobs: a deploy lane per model name (download, verify, stage, test, swap, health window: a
device holding several models updates each on its own, ``device_agent/models.py``) and the
control lane (rollback), so a rollback never waits behind a download. Every job works on the
slot of the model it names. The stores' commit points and the hot-swaps are serialised by one
lock, held only for local steps (never for a download or a health window). A ``cancel``
command, or a newer deploy of the same model, ends a queued or running deploy at its next
safe point (the download is interrupted).

Threat model: see docs/updates.md. With ``operator_keys`` configured, every command that
changes what runs or how it is judged must carry an operator signature naming this device
(or one of its groups) and an expiry; without them the agent warns at start, and anyone who
can publish to the broker can order what a valid artifact signature allows.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Protocol

from device_agent.config import AgentConfig
from device_agent.models import ModelSet, ModelSlot, deploy_refusal, deploy_target, describe_service
from device_agent.runtime import InferenceService, LoadedModel
from device_agent.store import InstalledModel, ModelStore
from device_agent.telemetry.outbox import OutboxError
from device_agent.updates import jobs as J
from device_agent.updates.admission import policy_names, rollback_refusal
from device_agent.updates.deploy_flow import DeployFlow, _Running, job_model
from device_agent.updates.disk import FreeSpace
from device_agent.updates.fetch_logs import LogFetcher
from device_agent.updates.health import (
    check_window,
)
from device_agent.updates.jobs import Job, advance, on_restart, restart_reason
from device_agent.updates.journal import Journal, JournalError
from device_agent.updates.origins import Bounds, allowed_origins
from device_agent.updates.replay import UNSIGNED, ReplayError, ReplayGuard
from edgepack_core import faults
from edgepack_core.errors import CommandSignatureError, EdgepackError
from edgepack_core.protocol.commands import Command, Rejection, parse_command
from edgepack_core.signing import TrustStore

log = logging.getLogger("edgepack.agent.updates")


class AgentHost(Protocol):
    """What the update service needs from the agent that runs it, and nothing more. ``store``
    and ``service`` are the root store's (``device_agent/models.py``); every job works on the
    slot of the model it names."""

    config: AgentConfig
    store: ModelStore
    trust: TrustStore
    operator_trust: TrustStore | None
    service: InferenceService
    reporter: Any
    models: ModelSet

    def load(self, installed: InstalledModel) -> LoadedModel: ...

    def new_slot(self, name: str) -> ModelSlot: ...

    def remove_slot(self, slot: ModelSlot) -> None: ...

    def activate_loaded(self, model: LoadedModel, slot: ModelSlot | None = None) -> LoadedModel | None: ...


class UpdateService(DeployFlow):
    def __init__(self, host: AgentHost) -> None:
        assert host.reporter is not None, "updates need MQTT"
        self.host = host
        self.reporter = host.reporter
        self.transport = host.reporter.transport
        self.topics = host.reporter.topics
        config = host.config
        self.device_id = config.device_id
        self.groups = list(config.mqtt.groups) if config.mqtt is not None else []
        settings = config.updates
        self.window = settings.health_window_s
        self.health = settings.health_policy()
        self.bounds = self._bounds(config)
        self.allowed_names = policy_names(settings.allowed_names)
        self.downloads = settings.download_dir or config.store / "downloads"
        self.downloads.mkdir(parents=True, exist_ok=True)
        self.space = FreeSpace(config.store, settings.min_free_bytes)
        self.journal = Journal(config.store / "jobs")
        self.replay = ReplayGuard(config.store / "command-ids.json")
        self.logs = LogFetcher(getattr(host, "log_ring", None), self.transport, self.topics, self.device_id,
                               config.logs, time.time())
        # One deploy lane per model name (deploys of two models run side by side, two of one model
        # one after the other), and one for deploys that name no model (key "")
        self._deploys: dict[str, queue.Queue[Job | None]] = {}
        self._control: queue.Queue[Job | None] = queue.Queue()
        self._pending: dict[str, Job] = {}  # queued deploys not started yet, by id
        self._running: dict[str, _Running] = {}  # the deploy each lane is working on, by lane
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()         # command intake and the pending/running bookkeeping
        self._store_lock = threading.RLock()  # the store's commit point and the hot-swap

    @staticmethod
    def _bounds(config: AgentConfig) -> Bounds:
        settings = config.updates
        origins = settings.allowed_origins
        broker_host = config.mqtt.host.lower() if config.mqtt is not None else ""
        return Bounds(origins=allowed_origins(origins),
                      any_port_hosts=frozenset() if origins else frozenset({broker_host} - {""}),
                      max_bytes=settings.max_download_bytes, deadline_s=settings.download_deadline_s,
                      min_rate_bytes_s=settings.min_rate_bytes_s, ca=settings.ca, client=config.client_certificate())

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._resume_jobs()
        self.transport.subscribe(self.topics.cmd(self.device_id), 1, self._on_command)
        for group in self.reporter.groups:
            self.transport.subscribe(self.topics.group_cmd(group), 1, self._on_command)
        self._start_lane("updates-control", self._control)

    def _start_lane(self, name: str, lane: queue.Queue[Job | None]) -> None:
        thread = threading.Thread(target=self._work, args=(lane,), name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _deploy_lane(self, job: Job) -> queue.Queue[Job | None]:
        """The lane of the model ``job`` deploys (made with its thread on first use: one per model
        name, bounded by the models a device may hold)."""
        key = self._lane_key(job)
        lane = self._deploys.get(key)
        if lane is None:
            lane = self._deploys[key] = queue.Queue()
            self._start_lane(f"updates-deploy-{key or 'new'}", lane)
        return lane

    @staticmethod
    def _lane_key(job: Job) -> str:
        return job_model(job) or ""

    def stop(self) -> None:
        self._stop.set()
        for running in list(self._running.values()):
            running.cancel("the agent is stopping")
        for lane in (*self._deploys.values(), self._control):
            lane.put(None)
        for thread in self._threads:
            thread.join(10)

    # ---------------------------------------------------------------- job bookkeeping

    def _set(self, job: Job, state: str, reason: str, *, final: bool | None = None, publish: bool = True,
             **detail: Any) -> Job:
        job = advance(job, state, reason, time.time(), final=final, **detail)
        self.journal.save(job)
        if job.final:
            self.journal.prune()
        if publish:
            self._publish(job)
            log.info("job %s: %s (%s)", job.id, state, reason)
            faults.point(f"job-{state}")
        return job

    def _publish(self, job: Job, *, duplicate: bool = False) -> None:
        """Publish ``job``'s event through the outbox, or straight to the broker when the disk is
        full (or the outbox cannot take it): the sender hears back either way."""
        event = job.event(self.device_id, time.time(), duplicate=duplicate)
        if not self.space.problem():
            try:
                self.reporter.publish_job_event(event)
                return
            except OutboxError as err:
                log.warning("job event %s not queued (%s): publishing it without the outbox", event.job, err)
        self.reporter.publish_job_event(event, direct=True)

    def _new_job(self, command: Command) -> Job:
        return Job(id=command.id, type=command.type, command=command.body, reason="queued",
                   history=((J.QUEUED, round(time.time(), 3)),))

    def _reply(self, command: Command, state: str, reason: str, *, record: bool = True, **detail: Any) -> None:
        """Answer a command that is not a queued job (ping, get-state, cancel, ...) right away.
        Read-only commands are not journaled: answering a duplicate again is harmless, and a
        monitor pinging every minute must not grow the journal."""
        job = advance(self._new_job(command), state, reason, time.time(), **detail)
        if record:
            self.journal.save(job)
            self.journal.prune()
        self._publish(job)

    def _refuse(self, ref: str, kind: str, reason: str, *, state: str = J.REJECTED) -> None:
        """A ``rejected`` (or ``failed``) event for a command that will not run. Not journaled,
        only counted: a flood of bad commands must not fill the disk, and a refused id stays
        usable for a proper command."""
        job = Job(id=ref, type=kind, reason="received")
        self._publish(advance(job, state, reason, time.time()))
        total = self.journal.count_rejected(reason)
        log.warning("refused command %s (%d so far): %s", ref, total, reason)

    # ---------------------------------------------------------------- commands (network thread)

    def _on_command(self, message: Any) -> None:
        now = time.time()
        parsed = parse_command(message.payload, now)
        if isinstance(parsed, Rejection):
            ref = getattr(parsed, "ref", None) or parsed.id or f"invalid-{int(now * 1000)}"
            self._refuse(ref, "unknown", parsed.reason)
            return
        no_space = self.space.problem()
        if no_space:  # answered from memory: nothing journaled, no id recorded, nothing queued
            self._refuse(parsed.id, parsed.type, no_space, state=J.FAILED)
            return
        with self._lock:
            try:
                self._intake(parsed, now)
            except JournalError as err:  # the store cannot be written (read-only or full medium)
                self._refuse(parsed.id, parsed.type, f"command not run: {err}", state=J.FAILED)

    def _intake(self, command: Command, now: float) -> None:
        existing = self.journal.get(command.id)
        if existing is not None:
            # A duplicate delivery (QoS 1 redelivery, a group and a device command with one
            # id, an operator retrying): answer with the job as it stands, never re-run.
            self._publish(existing, duplicate=True)
            return
        # Commands are rare: their authorization (and the modules below) load with the first one.
        from edgepack_core.command_auth import authorize_command, requires_signature

        try:
            keyid = authorize_command(command.body, self.host.operator_trust, device_id=self.device_id,
                                      groups=self.groups, now=now)
            self._check_settings(command)
            if requires_signature(command.body):  # read-only commands change nothing: never recorded
                self.replay.remember(command.id, command.expires_at, now, sender=keyid or UNSIGNED, kind=command.type)
        except (CommandSignatureError, ReplayError, ValueError) as err:
            self._refuse(command.id, command.type, str(err))
            return
        no_slot = self._model_refusal(command)
        if no_slot:  # a deploy this device does not take is rejected, like one admission refuses
            self._refuse(command.id, command.type, no_slot, state=J.REJECTED if command.type == "deploy" else J.FAILED)
            return
        moved_on = self._moved_on(command)
        if moved_on:  # after its id was recorded: a late signed rollback cannot be replayed later either
            self._refuse(command.id, command.type, moved_on)
            return
        self._accept(command)

    def _moved_on(self, command: Command) -> str:
        """Why a rollback no longer applies: the device serves another model than the one it
        names in ``from_version`` ("" for every other command)."""
        if command.type != "rollback":
            return ""
        slot = self.host.models.get(command.body["from_version"]["name"])
        model = None if slot is None else slot.service.model
        serving = None if model is None else (model.manifest.name, model.manifest.version)
        return rollback_refusal(command.body["from_version"], serving)

    def _model_refusal(self, command: Command) -> str:
        """Why a deploy or rollback has no model slot to go to ("" when it has): a deploy of a
        name not held that ``updates.allowed_names`` does not list, or one naming no model on a
        device holding several (``device_agent/models.py``); a rollback of a model not held."""
        held = self.host.models.names
        if command.type == "deploy":
            return deploy_refusal(held, command.body.get("name"), self.allowed_names) or ""
        named = {"rollback": (command.body.get("from_version") or {}).get("name"), "remove": command.body.get("model")}
        name = named.get(command.type)
        if name is not None and name not in held:
            verb = "roll back" if command.type == "rollback" else "remove"
            return f"no model {name!r} on this device to {verb} (installed: {', '.join(held) or 'none'})"
        return ""

    def _check_settings(self, command: Command) -> None:
        """Values the device bounds itself, whoever signed them: the health window's range."""
        if "health_window_s" in command.body:
            check_window(command.body["health_window_s"], low=self.window.min, high=self.window.max)

    def _accept(self, command: Command) -> None:
        kind = command.type
        if kind == "ping":
            self._reply(command, J.DONE, "pong", record=False)
        elif kind == "get-state":
            self._reply(command, J.DONE, "state", record=False, **self.state_detail())
        elif kind == "fetch-logs":  # device_agent/updates/fetch_logs.py
            answer = self.logs.answer(command.id, command.body, time.time())
            self._reply(command, answer.state, answer.reason, **answer.detail)
        elif kind == "set-telemetry-interval":
            self.reporter.set_interval(float(command.body["seconds"]))
            self._reply(command, J.DONE, f"telemetry every {command.body['seconds']} s")
        elif kind == "renew-certificate":  # on a thread of its own (device_agent/updates/renewal.py)
            from device_agent.updates import renewal

            renewal.start(self.host.config, self.transport, command, self._reply)
        elif kind == "apply-settings":
            from device_agent.updates import settings_apply

            settings_apply.handle(self, command)
        elif kind == "cancel":
            found = self._cancel(command.body["job"], f"cancelled by command {command.id}")
            self._reply(command, J.DONE if found else J.FAILED,
                        found or f"no queued or running deploy {command.body['job']}")
        else:
            self._queue(command)

    def _queue(self, command: Command) -> None:
        """A deploy, rollback or remove: journaled, published, then on its lane."""
        kind = command.type
        job = self._new_job(command)
        model = deploy_target(self.host.models.names, job_model(job))
        if model is not None:  # job events name the model
            job = dataclasses.replace(job, detail={"model": model})
        slot = self.host.models.get(model) if model is not None else None
        serving = None if slot is None else slot.service.model
        if kind == "rollback" and serving is not None:
            job = dataclasses.replace(job, detail={**job.detail, "from_sha256": serving.manifest.model_sha256})
        self.journal.save(job)
        self._publish(job)
        if kind in ("rollback", "remove"):
            self._supersede_deploys(f"superseded by {kind} {command.id}", model)
            self._control.put(job)
        else:
            self._supersede_deploys(f"superseded by deploy {command.id}", model)
            self._pending[job.id] = job
            self._deploy_lane(job).put(job)

    def _cancel(self, job_id: str, why: str) -> str:
        """Stop a queued deploy now, or a running one at its next safe point. Returns what was
        done, or "" when there is no such deploy."""
        pending = self._pending.pop(job_id, None)
        if pending is not None:
            self._set(pending, J.CANCELLED, why)
            return f"cancelled queued deploy {job_id}"
        for running in list(self._running.values()):
            if running.job_id == job_id:
                running.cancel(why)
                return f"stopping deploy {job_id}" + (" and rolling it back" if running.in_window else "")
        return ""

    def _supersede_deploys(self, why: str, model: str | None) -> None:
        """Cancel the queued deploys of ``model`` and its running one still before its switch;
        a deploy of another model goes on (None: the deploy names no model yet: all)."""
        for job_id, job in list(self._pending.items()):
            if model is None or job_model(job) in (None, model):
                self._cancel(job_id, why)
        for running in list(self._running.values()):
            if not running.in_window and (model is None or running.model in (None, model)):
                running.cancel(why)

    def state_detail(self) -> dict[str, Any]:
        """``get-state``: the first model as ``active`` and its store (for readers that know one
        model), and every model with its store in ``models``."""
        slots = self.host.models.slots
        first = slots[0] if slots else ModelSlot("", self.host.store, self.host.service)
        model = first.service.model
        return {"active": None if model is None else model.describe(), "store": first.store.status(),
                "profile": self.host.config.profile,
                "models": [{**describe_service(slot.name, slot.service), "store": slot.store.status()}
                           for slot in slots]}

    def _slot(self, job: Job) -> ModelSlot:
        """The slot of the model ``job`` is for (the root store's while it names none)."""
        name = job_model(job)
        return self.host.new_slot(name) if name else ModelSlot("", self.host.store, self.host.service)

    # ---------------------------------------------------------------- workers

    def _work(self, lane: queue.Queue[Job | None]) -> None:
        while not self._stop.is_set():
            job = lane.get()
            if job is None:
                return
            try:
                if job.type == "deploy":
                    self._run_deploy(job)
                elif job.type == "rollback":
                    self._rollback_command(job)
                elif job.type == "remove":
                    self._remove_command(job)
            except Exception as err:  # a job must end with an event, whatever went wrong
                log.exception("job %s crashed", job.id)
                self._end_crashed(job, err)

    def _end_crashed(self, job: Job, err: Exception) -> None:
        """Close a job whose lane raised. If even the journal cannot be written (the medium
        failed), the ``failed`` event is still published, unrecorded, and the lane lives on."""
        latest = self.journal.get(job.id) or job
        if latest.final or J.FAILED not in J.TRANSITIONS[latest.state]:
            return
        reason = f"internal error: {type(err).__name__}: {err}; serving {self._serving(self._slot(latest))}"
        try:
            self._set(latest, J.FAILED, reason)
        except JournalError as journal_err:
            failed = advance(latest, J.FAILED, f"{reason}; {journal_err}", time.time())
            self._publish(failed)

    @staticmethod
    def _serving(slot: ModelSlot) -> str:
        model = slot.service.model
        return "nothing" if model is None else model.label

    # ---------------------------------------------------------------- rollback

    def _safe_rollback(self, slot: ModelSlot, fallback: LoadedModel | None = None, *, from_sha256: str = "",
                       forget_active: bool = False) -> InstalledModel | None:
        """Go back to the store's rollback target, the last version that passed its health window
        (never a rejected one: ``ModelStore.rollback_target``): load and smoke-test it (or reuse
        ``fallback``, the same model still in memory) *before* the store's commit point changes,
        then commit, then swap. Raises EdgepackError with nothing changed if there is no target
        or it does not load. ``forget_active``: the model rolled back from failed or never
        finished its health window, so it does not become the next rollback target.

        With ``from_sha256``, roll back only if that model still serves (None otherwise): a
        rollback command racing a health-window rollback must not toggle back to the bad model."""
        store = slot.store
        with self._store_lock:
            serving = slot.service.model
            if from_sha256 and (serving is None or serving.manifest.model_sha256 != from_sha256):
                return None
            target = store.rollback_target()
            if fallback is not None and fallback.manifest.model_sha256 == target.verified.manifest.model_sha256:
                loaded = fallback
            else:
                loaded = self.host.load(target)
            store.rollback(forget_active=forget_active)
            self.host.activate_loaded(loaded, slot)
            return target

    def _rollback_command(self, job: Job) -> None:
        slot = self._slot(job)
        running = next((r for r in list(self._running.values()) if r.model == slot.name and r.in_window), None)
        in_window = running is not None
        if running is not None:
            running.rolled_back_by = job.id
            running.cancel(f"rolled back by command {job.id}")
        try:
            target = self._safe_rollback(slot, from_sha256=str(job.detail.get("from_sha256", "")),
                                         forget_active=in_window)
        except (EdgepackError, OSError) as err:
            self._set(job, J.FAILED, f"rollback failed: {err}; serving {self._serving(slot)}")
            return
        if target is None:
            self._set(job, J.DONE, f"the model this rollback was sent against no longer serves; serving "
                                   f"{self._serving(slot)}")
            return
        self._set(job, J.DONE, f"rolled back to {target.name} {target.version}")

    def _remove_command(self, job: Job) -> None:
        """Stop serving the job's model and delete its store (its target is absent). A deploy of
        it in its health window is stopped first; its requests then get 404 naming the others."""
        name = str(job_model(job))
        running = next((r for r in list(self._running.values()) if r.model == name), None)
        if running is not None:
            running.cancel(f"removed by command {job.id}")
        with self._store_lock:
            slot = self.host.models.get(name)
            if slot is None:
                self._set(job, J.DONE, f"{name} is not installed")
                return
            serving = self._serving(slot)
            try:
                self.host.remove_slot(slot)
            except (EdgepackError, OSError) as err:
                self._set(job, J.FAILED, f"remove failed: {err}; serving {self._serving(slot)}")
                return
        self._set(job, J.DONE, f"removed {serving}")

    # ---------------------------------------------------------------- restart

    def _resume_jobs(self) -> None:
        now = time.time()
        for job in self.journal.all():
            active_version = self._slot(job).store.active_version() if not job.final else None
            action = on_restart(job, active_is_job_version=active_version == job.command.get("version"), now=now)
            if action == J.RESUME:
                # Start over from the download: it resumes where it stopped, and staging is
                # idempotent (store.recover() removed anything half-extracted).
                resumed = self._set(job, J.QUEUED, "resumed after an agent restart")
                self._pending[resumed.id] = resumed
                self._deploy_lane(resumed).put(resumed)
            elif action == J.ROLL_BACK:
                self._rollback_after_restart(job)
            elif action == J.FAIL:
                self._set(job, J.FAILED, restart_reason(job, now))
        self.journal.prune()

    def _rollback_after_restart(self, job: Job) -> None:
        """The agent died while the new model was being tested or watched: it may be the cause,
        so go back to the previous model, loaded and tested before the store commits to it."""
        self._roll_back_rejected(job, "agent restarted before the health window closed")
