"""The deploy flow of the update service: fetch, verify + admit + stage, test, swap, watch the
health window, and roll back a version that fails it; every state change through
:func:`device_agent.updates.jobs.advance` (the service's ``_set``).

A mixin of :class:`~device_agent.updates.service.UpdateService`, split out so each module stays
one concern and under the project's size limit; it reads the service's state (declared below for
the type checker) and calls its job bookkeeping.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_agent.errors import AdmissionRefused, DownloadCancelled, DownloadError, StoreError, TransferError
from device_agent.models import ModelSlot
from device_agent.runtime import LoadedModel
from device_agent.store import InstalledModel
from device_agent.updates import jobs as J
from device_agent.updates import rejected as R
from device_agent.updates.admission import DEVICE_STATE_RULES, DevicePolicy, refusal
from device_agent.updates.golden_stream import check_golden_stream, failure_detail
from device_agent.updates.health import (
    Probes,
    judge,
    needs_probes,
    traffic_between,
    traffic_of,
)
from device_agent.updates.jobs import Job
from edgepack_core.errors import ArtifactError, EdgepackError
from edgepack_core.manifest import Manifest
from edgepack_core.versions import Version

log = logging.getLogger("edgepack.agent.updates")


def job_model(job: Job) -> str | None:
    """The model a job is for: the name its deploy or rollback command gives, or the one the
    device chose when the command named none (``detail.model``); None: not known yet (a deploy
    that names no model, to a device that holds none). Pure."""
    command = job.command
    rolled_back = command.get("from_version")
    named = job.detail.get("model") or command.get("name") or command.get("model") or (
        rolled_back.get("name") if isinstance(rolled_back, dict) else None)
    return str(named) if named else None


@dataclass
class _Running:
    """The deploy the deploy lane is working on, and how another thread may stop it."""

    job_id: str
    model: str | None = None  # the model it installs (None: not named yet)
    stop: threading.Event = field(default_factory=threading.Event)
    why: str = ""
    rolled_back_by: str = ""  # set when a rollback command took over during the health window
    in_window: bool = False

    def cancel(self, why: str) -> None:
        self.why = self.why or why
        self.stop.set()


class DeployFlow:
    """The deploy jobs' steps, run on a model's deploy lane."""

    if TYPE_CHECKING:
        from device_agent.updates.origins import Bounds
        from device_agent.updates.service import AgentHost

        host: AgentHost
        bounds: Bounds
        health: Any
        window: Any
        reporter: Any
        transport: Any
        topics: Any
        downloads: Path
        device_id: str
        allowed_names: Any
        _store_lock: threading.RLock
        _lock: threading.Lock
        _stop: threading.Event
        _running: dict[str, _Running]
        _pending: dict[str, Job]

        def _set(self, job: Job, state: str, reason: str, *, final: bool | None = None, publish: bool = True,
                 **detail: Any) -> Job: ...

        def _slot(self, job: Job) -> ModelSlot: ...

        @staticmethod
        def _serving(slot: ModelSlot) -> str: ...

        @staticmethod
        def _lane_key(job: Job) -> str: ...

        def _safe_rollback(self, slot: ModelSlot, fallback: LoadedModel | None = None, *, from_sha256: str = "",
                           forget_active: bool = False) -> InstalledModel | None: ...

    # ---------------------------------------------------------------- deploy

    def _run_deploy(self, job: Job) -> None:
        key = self._lane_key(job)
        with self._lock:
            if self._pending.pop(job.id, None) is None:
                return  # cancelled or superseded while queued
            running = self._running[key] = _Running(job.id, job_model(job))
        try:
            self._deploy(job, running)
        finally:
            with self._lock:
                self._running.pop(key, None)

    def _fetch(self, job: Job, running: _Running) -> Path:
        """The artifact over HTTP(S) or the MQTT transfer; each is imported by the first deploy
        that uses it (``http.client`` and ``urllib`` are not held by an agent that never downloads)."""
        command = job.command
        target = self.downloads / f"{command['sha256']}.edgepkg"
        reference = command["artifact"]
        if "url" in reference:
            from device_agent.updates.download import download

            return download(reference["url"], target, size=command["size"], sha256=command["sha256"],
                            bounds=self.bounds, cancelled=running.stop.is_set)
        if command["size"] > self.bounds.max_bytes:
            raise DownloadError(f"artifact of {command['size']} bytes is over the download limit")
        from device_agent.updates.xfer import Receiver, XferSpec

        spec = XferSpec(reference["xfer"]["id"], reference["xfer"]["chunk_size"], reference["xfer"]["chunks"])
        receiver = Receiver(self.transport, self.topics, self.device_id, spec, size=command["size"],
                            sha256=command["sha256"], target=target)
        try:
            return receiver.run(timeout=self.bounds.deadline_s, cancelled=running.stop.is_set)
        except TransferError as err:
            if running.stop.is_set():
                raise DownloadCancelled("transfer cancelled") from err
            raise

    def _deploy(self, job: Job, running: _Running) -> None:
        job = self._set(job, J.DOWNLOADING, "fetching the artifact")
        try:
            artifact = self._fetch(job, running)
        except DownloadCancelled:
            self._end_cancelled(job, running)
            return
        except (DownloadError, TransferError) as err:
            self._set(job, J.FAILED, str(err))
            return
        try:
            self._install_downloaded(job, artifact, running)
        finally:
            # Whatever the outcome, the download is no longer needed (a kill -9 skips this,
            # and the resumed job then finds the file complete and does not fetch it again).
            artifact.unlink(missing_ok=True)

    def _policy(self, slot: ModelSlot) -> DevicePolicy:
        """The versions admission compares against: those the slot really held (the previous
        and the active model), never one it rejected (``updates/rejected.py``)."""
        known: dict[str, str] = {}
        store = slot.store
        try:
            previous = store.previous()
        except (EdgepackError, OSError):
            previous = None
        if previous is not None and store.rejected.find(previous.name, previous.version) is None:
            known[previous.name] = previous.version
        active = self._active_manifest(slot)
        if active is not None and (active.name not in known or Version(active.version) > Version(known[active.name])):
            known[active.name] = active.version
        return DevicePolicy(profile=self.host.config.profile, allowed_names=self.allowed_names, known_versions=known)

    @staticmethod
    def _active_manifest(slot: ModelSlot) -> Manifest | None:
        model = slot.service.model
        return None if model is None else model.manifest

    def _install_downloaded(self, job: Job, artifact: Path, running: _Running) -> None:
        """Verify, admit and stage in one pass over the artifact: admission judges the signed
        manifest before any member is read, and every member is hashed once, as it is written
        into the store (so what is staged is exactly what was verified)."""
        job = self._set(job, J.VERIFYING, "checking signature, hashes, name, version, target and I/O contract")
        # Recorded before the verifier runs: if it kills the agent (memory), the restart fails
        # the job instead of verifying the same file again.
        job = self._set(job, J.VERIFYING, job.reason, publish=False, verify_started=True)
        slot = self._slot(job)
        active, policy, command = self._active_manifest(slot), self._policy(slot), job.command
        signed_names: list[str] = []

        def admission(manifest: Manifest) -> None:
            signed_names.append(manifest.name)
            if slot.name and manifest.name != slot.name:  # a deploy that named no model, to the only one
                raise AdmissionRefused(f"artifact is model {manifest.name!r}, this device's model is {slot.name!r}: "
                                       "a deploy of another model must name it", rule="name")
            refused = refusal(manifest, active, command, policy)
            if refused is not None:
                raise AdmissionRefused(refused[1], rule=refused[0])

        try:
            with self._store_lock:
                # admission applies the version rules (within a name), so the store's own
                # cross-name check is overridden here
                staged = slot.store.stage(artifact, force=True, admit=admission)
        except (ArtifactError, AdmissionRefused) as err:
            if getattr(err, "rule", "") in DEVICE_STATE_RULES:
                self._set(job, J.REJECTED, str(err))
                return
            note = self._remember_rejected(job, "admission", str(err), name=next(iter(signed_names), None))
            self._set(job, J.REJECTED, f"{err}{note}", rejected_at="admission")
            return
        except EdgepackError as err:
            self._set(job, J.FAILED, str(err))
            return
        if running.stop.is_set():
            slot.store.discard(staged)
            self._end_cancelled(job, running)
            return
        job = self._set(job, J.STAGING, f"staged {staged.name} {staged.version}", model=staged.name)
        running.model = staged.name
        self._test_and_activate(job, dataclasses.replace(slot, name=staged.name), staged, running)

    def _test_and_activate(self, job: Job, slot: ModelSlot, staged: InstalledModel, running: _Running) -> None:
        job = self._set(job, J.TESTING, "golden samples on a shadow session")
        try:
            loaded = self.host.load(staged)
            stream = check_golden_stream(loaded)  # the golden clip's events, when the artifact has one
        except EdgepackError as err:
            slot.store.discard(staged)
            note = self._remember_rejected(job, "smoke_test", str(err), name=staged.name)
            self._set(job, J.FAILED, f"{err} (the previous model keeps serving){note}", rejected_at="smoke_test",
                      **failure_detail(err))
            return
        job = dataclasses.replace(job, detail={**job.detail, **stream.job_detail()})  # carried by the next _set
        self._activate_and_watch(job, slot, staged, loaded, running)

    def _window_of(self, job: Job) -> float:
        return float(job.command.get("health_window_s", self.window.default))

    def _activate_and_watch(self, job: Job, slot: ModelSlot, staged: InstalledModel, loaded: LoadedModel,
                            running: _Running) -> None:
        service = slot.service
        with self._store_lock:
            if running.stop.is_set():
                slot.store.discard(staged)
                self._end_cancelled(job, running)
                return
            before = service.stats.snapshot()
            slot.store.activate(staged)
            old = self.host.activate_loaded(loaded, slot)
            running.in_window = True
        window = self._window_of(job)
        job = self._set(job, J.ACTIVE, f"hot-swapped; watching health for {window:g} s", final=False,
                        provider=loaded.provider)
        running.stop.wait(window)
        after = service.stats.snapshot()
        traffic = traffic_between(before, after)
        probes = Probes()
        if not running.stop.is_set() and needs_probes(traffic, self.health):
            from device_agent.updates.golden_probe import probe

            probes = probe(service, loaded)
        self._close_window(job, running, old, traffic_of(before), traffic, probes)

    def _end_cancelled(self, job: Job, running: _Running) -> None:
        """End a deploy stopped before the switch: ``cancelled``, unless the agent itself is
        stopping, in which case the journal keeps the job's state for the restart to resume."""
        if not self._stop.is_set():
            self._set(job, J.CANCELLED, running.why or "cancelled")

    def _close_window(self, job: Job, running: _Running, old: LoadedModel | None, before: Any, traffic: Any,
                      probes: Probes) -> None:
        if self._stop.is_set():
            return  # the agent is stopping: the restart rolls an unproven model back
        with self._store_lock:
            if running.rolled_back_by:
                reason = f"rolled back by command {running.rolled_back_by}"
                note = self._remember_rejected(job, "health_window", f"{reason} before its health window closed")
                self._set(job, J.ROLLED_BACK, reason + note, rejected_at="health_window")
                return
            if running.stop.is_set():
                verdict_reason = running.why
            else:
                verdict = judge(traffic, before, probes, self.health)
                if verdict.healthy:
                    self._passed(job)
                    self._set(job, J.ACTIVE, f"health window passed: {verdict.reason}", final=True)
                    return
                verdict_reason = f"unhealthy: {verdict.reason}"
            self._roll_back_rejected(job, verdict_reason, old)

    def _roll_back_rejected(self, job: Job, why: str, fallback: LoadedModel | None = None) -> None:
        """Record the job's version as rejected at its health window, then roll back to the last
        version that passed one, forgetting the rejected one (never a rollback target again)."""
        note = self._remember_rejected(job, "health_window", why)
        slot = self._slot(job)
        try:
            target = self._safe_rollback(slot, fallback=fallback, forget_active=True)
            assert target is not None  # no from_sha256 given: it rolls back or raises
        except (EdgepackError, OSError) as err:
            self._set(job, J.FAILED, f"{why}; rollback failed: {err}; serving {self._serving(slot)}{note}",
                      rejected_at="health_window")
            return
        self._set(job, J.ROLLED_BACK, f"{why}; back on {target.name} {target.version}{note}",
                  rejected_at="health_window")

    # ---------------------------------------------------------------- rejected versions

    def _remember_rejected(self, job: Job, stage: str, reason: str, *, name: str | None = None) -> str:
        """Record the job's artifact as rejected at ``stage`` (``updates/rejected.py``) and publish
        the state that lists it. Returns "" or a note for the job's reason when the record could
        not be kept (a read-only store keeps it in memory; a command without an artifact, or an
        empty device with no name to file it under, has nothing to record)."""
        command = job.command
        slot = self._slot(job)
        serving = self._active_manifest(slot)
        name = name or command.get("name") or (serving.name if serving is not None else None)
        try:
            entry = R.record(str(name), str(command.get("version")), str(command.get("sha256")), stage, reason,
                             round(time.time(), 3))
        except ValueError as err:
            log.warning("job %s: rejected version not recorded: %s", job.id, err)
            return ""
        try:
            slot.store.rejected.add(entry)
        except StoreError as err:
            log.error("job %s: %s", job.id, err)
            return f" (rejected version not persisted: {err})"
        finally:
            self.reporter.publish_state()
        return ""

    def _passed(self, job: Job) -> None:
        """The job's version passed its health window: it is no longer a rejected version."""
        slot = self._slot(job)
        model = slot.service.model
        if model is None:
            return
        try:
            slot.store.rejected.forget(model.manifest.name, model.manifest.version)
        except StoreError as err:
            log.error("job %s: %s", job.id, err)
        self.reporter.publish_state()
