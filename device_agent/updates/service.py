"""The device-side executor of remote commands: deploy pipeline, rollback, ping, state.

Threads: command messages arrive on the MQTT network thread, where they are only parsed,
de-duplicated against the journal and queued (a ping is answered right there, because a
round trip should cost a fraction of a millisecond); one worker thread runs jobs one at a
time, never on the inference path. Every state change is saved to the journal first, then
published on ``dev/{d}/job`` through the outbox (queued while offline).

Threat model: anyone who can publish to the broker can send commands. A deploy still needs
an artifact signed by a key in the device's trust store, of a newer version (a downgrade only
when the command asks for it, and still signed), built for this device's profile, that
passes its golden smoke test; the worst such an attacker can do is make a device install a
validly signed, newer artifact.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from device_agent.runtime import LoadedModel
from device_agent.store import simulate_power_cut_if_testing
from device_agent.updates import jobs as J
from device_agent.updates.commands import Command, Rejection, parse_command
from device_agent.updates.download import DownloadError, download
from device_agent.updates.jobs import Job, advance, on_restart
from device_agent.updates.journal import Journal
from device_agent.updates.xfer import Receiver, TransferError, XferSpec
from edgepack_core.artifact import verify_artifact
from edgepack_core.errors import ArtifactError, DowngradeError, EdgepackError
from edgepack_core.protocol.payloads import JOB_SCHEMA_ID
from edgepack_core.versions import check_upgrade

if TYPE_CHECKING:
    from device_agent.daemon import Daemon

log = logging.getLogger("edgepack.agent.updates")

DEFAULT_HEALTH_WINDOW_S = 30.0
DEFAULT_MAX_ERROR_RATE = 0.05
DEFAULT_MAX_LATENCY_FACTOR = 3.0
DEFAULT_MAX_DOWNLOAD = 1024**3
MIN_REQUESTS_FOR_LATENCY = 20


@dataclasses.dataclass(frozen=True)
class HealthVerdict:
    healthy: bool
    reason: str


def judge_health(before: dict[str, Any], after: dict[str, Any], baseline_mean_s: float | None, *,
                 max_error_rate: float, max_latency_factor: float) -> HealthVerdict:
    """Decide from two RequestStats snapshots whether the new model is healthy. Pure."""
    ok = after["requests"]["ok"] - before["requests"]["ok"]
    server_errors = after["requests"]["server_error"] - before["requests"]["server_error"]
    non_finite = after["non_finite"] - before["non_finite"]
    total = ok + server_errors
    if total and (server_errors + non_finite) / total > max_error_rate:
        return HealthVerdict(False, f"{server_errors} errors and {non_finite} non-finite outputs in {total} "
                                    f"requests (limit {max_error_rate:.0%})")
    if baseline_mean_s and ok >= MIN_REQUESTS_FOR_LATENCY:
        mean = (after["latency_sum"] - before["latency_sum"]) / ok
        if mean > baseline_mean_s * max_latency_factor:
            return HealthVerdict(False, f"mean latency {mean * 1000:.2f} ms is over {max_latency_factor}x the "
                                        f"previous model's {baseline_mean_s * 1000:.2f} ms")
    return HealthVerdict(True, f"{total} requests, no problem found")


class UpdateService:
    def __init__(self, daemon: Daemon) -> None:
        assert daemon.reporter is not None, "updates need MQTT"
        self.daemon = daemon
        self.reporter = daemon.reporter
        self.transport = daemon.reporter.transport
        self.topics = daemon.reporter.topics
        self.device_id = daemon.config.device_id
        settings = daemon.config.updates
        self.health_window_s = float(settings.get("health_window_s", DEFAULT_HEALTH_WINDOW_S))
        self.max_error_rate = float(settings.get("max_error_rate", DEFAULT_MAX_ERROR_RATE))
        self.max_latency_factor = float(settings.get("max_latency_factor", DEFAULT_MAX_LATENCY_FACTOR))
        self.max_download = int(settings.get("max_download_bytes", DEFAULT_MAX_DOWNLOAD))
        self.downloads = Path(settings.get("download_dir") or daemon.config.store / "downloads")
        self.downloads.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(daemon.config.store / "jobs")
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._resume_jobs()
        self.transport.subscribe(self.topics.cmd(self.device_id), 1, self._on_command)
        for group in self.reporter.groups:
            self.transport.subscribe(self.topics.group_cmd(group), 1, self._on_command)
        self._thread = threading.Thread(target=self._work, name="updates", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(10)

    # ---------------------------------------------------------------- job bookkeeping

    def _set(self, job: Job, state: str, reason: str, *, final: bool | None = None, **detail: Any) -> Job:
        job = advance(job, state, reason, time.time(), final=final, **detail)
        self.journal.save(job)
        if job.final:
            self.journal.prune()
        self.reporter.publish_job_event(job.event())
        log.info("job %s: %s (%s)", job.id, state, reason)
        simulate_power_cut_if_testing(f"job-{state}")
        return job

    def _reply(self, command_id: str, kind: str, reason: str, *, record: bool = True, **detail: Any) -> None:
        """Answer a command that is not a job (ping, get-state, ...) right away. Read-only
        commands are not journaled: answering a duplicate again is harmless, and a monitor
        pinging every minute must not grow the journal."""
        job = Job(id=command_id, type=kind, state=J.DONE, reason=reason, final=True, detail=detail)
        if record:
            self.journal.save(job)
            self.journal.prune()
        self.transport.publish(self.topics.job(self.device_id), {"schema": JOB_SCHEMA_ID,
                               "device": self.device_id, "ts": round(time.time(), 3), **job.event()}, qos=1)

    # ---------------------------------------------------------------- commands (network thread)

    def _on_command(self, message: Any) -> None:
        parsed = parse_command(message.payload, time.time())
        with self._lock:
            command_id = parsed.id
            existing = self.journal.get(command_id) if command_id else None
            if existing is not None:
                # A duplicate delivery (QoS 1 redelivery, a group and a device command with one
                # id, an operator retrying): answer with the job as it stands, never re-run.
                self.reporter.publish_job_event({**existing.event(), "duplicate": True})
                return
            if isinstance(parsed, Rejection):
                job = Job(id=command_id or f"invalid-{int(time.time() * 1000)}", type="unknown",
                          state=J.REJECTED, reason=parsed.reason, final=True)
                if command_id:
                    self.journal.save(job)
                self.reporter.publish_job_event(job.event())
                log.warning("rejected a command: %s", parsed.reason)
                return
            self._accept(parsed)

    def _accept(self, command: Command) -> None:
        if command.type == "ping":
            self._reply(command.id, "ping", "pong", record=False)
        elif command.type == "get-state":
            self._reply(command.id, "get-state", "state", record=False, **self.state_detail())
        elif command.type == "set-telemetry-interval":
            self.reporter.set_interval(float(command.body["seconds"]))
            self._reply(command.id, "set-telemetry-interval", f"telemetry every {command.body['seconds']} s")
        else:
            job = Job(id=command.id, type=command.type, command=command.body, history=((J.QUEUED, time.time()),),
                      reason="queued")
            self.journal.save(job)
            self.reporter.publish_job_event(job.event())
            self._queue.put(job)

    def state_detail(self) -> dict[str, Any]:
        model = self.daemon.service.model
        return {"active": None if model is None else model.describe(), "store": self.daemon.store.status(),
                "profile": self.daemon.config.profile}

    # ---------------------------------------------------------------- worker

    def _work(self) -> None:
        while not self._stop.is_set():
            job = self._queue.get()
            if job is None:
                return
            try:
                if job.type == "deploy":
                    self._deploy(job)
                elif job.type == "rollback":
                    self._rollback_command(job)
            except Exception as err:  # a job must end with an event, whatever went wrong
                log.exception("job %s crashed", job.id)
                latest = self.journal.get(job.id) or job
                if not latest.final and J.FAILED in J.TRANSITIONS[latest.state]:
                    self._set(latest, J.FAILED, f"internal error: {type(err).__name__}: {err}")

    def _rollback_command(self, job: Job) -> None:
        try:
            previous = self.daemon.store.rollback()
            loaded = self.daemon.load(previous)
        except EdgepackError as err:
            self._set(job, J.FAILED, str(err))
            return
        self.daemon.activate_loaded(loaded)
        self._set(job, J.DONE, f"rolled back to {previous.name} {previous.version}")

    def _fetch(self, job: Job) -> Path:
        command = job.command
        target = self.downloads / f"{command['sha256']}.edgepkg"
        reference = command["artifact"]
        if "url" in reference:
            return download(reference["url"], target, size=command["size"], sha256=command["sha256"],
                            max_bytes=self.max_download)
        if command["size"] > self.max_download:
            raise DownloadError(f"artifact of {command['size']} bytes is over the download limit")
        spec = XferSpec(reference["xfer"]["id"], reference["xfer"]["chunk_size"], reference["xfer"]["chunks"])
        receiver = Receiver(self.transport, self.topics, self.device_id, spec, size=command["size"],
                            sha256=command["sha256"], target=target)
        return receiver.run(timeout=max(60.0, command["size"] / 50_000), cancelled=self._stop.is_set)

    def _deploy(self, job: Job) -> None:
        job = self._set(job, J.DOWNLOADING, "fetching the artifact")
        try:
            artifact = self._fetch(job)
        except (DownloadError, TransferError) as err:
            self._set(job, J.FAILED, str(err))
            return
        try:
            self._install_downloaded(job, artifact)
        finally:
            # Whatever the outcome, the download is no longer needed (a kill -9 skips this,
            # and the resumed job then finds the file complete and does not fetch it again).
            artifact.unlink(missing_ok=True)

    def _install_downloaded(self, job: Job, artifact: Path) -> None:
        command = job.command
        job = self._set(job, J.VERIFYING, "checking signature, hashes, version and target")
        store = self.daemon.store
        try:
            verified = verify_artifact(artifact, self.daemon.trust, store.limits)
            manifest = verified.manifest
            if manifest.version != command["version"] or command.get("name", manifest.name) != manifest.name:
                raise ArtifactError(f"artifact is {manifest.name} {manifest.version}, the command announced "
                                    f"{command.get('name', manifest.name)} {command['version']}")
            force = bool(command.get("force_downgrade"))
            check_upgrade(manifest.version, store.active_version(), force=force)
            profile = self.daemon.config.profile
            if manifest.targets and profile not in manifest.targets:
                raise ArtifactError(f"built for {', '.join(manifest.targets)}, not for this device's "
                                    f"profile {profile}")
        except (ArtifactError, DowngradeError) as err:
            self._set(job, J.REJECTED, str(err))
            return
        job = self._set(job, J.STAGING, f"extracting {manifest.name} {manifest.version}")
        try:
            staged = store.stage(artifact, force=force)
        except EdgepackError as err:
            self._set(job, J.FAILED, str(err))
            return
        job = self._set(job, J.TESTING, "golden samples on a shadow session")
        try:
            loaded = self.daemon.load(staged)
        except EdgepackError as err:
            store.discard(staged)
            self._set(job, J.FAILED, f"{err} (the previous model keeps serving)")
            return
        self._activate_and_watch(job, staged, loaded)

    def _activate_and_watch(self, job: Job, staged: Any, loaded: LoadedModel) -> None:
        service = self.daemon.service
        before = service.stats.snapshot()
        baseline = before["latency_sum"] / before["requests"]["ok"] if before["requests"]["ok"] else None
        self.daemon.store.activate(staged)
        old = self.daemon.activate_loaded(loaded)
        window = float(job.command.get("health_window_s", self.health_window_s))
        job = self._set(job, J.ACTIVE, f"hot-swapped; watching health for {window:g} s", final=window <= 0,
                        provider=loaded.provider)
        if window <= 0:
            return
        service.check_finite = True
        try:
            self._stop.wait(window)
        finally:
            service.check_finite = False
        verdict = judge_health(before, service.stats.snapshot(), baseline, max_error_rate=self.max_error_rate,
                               max_latency_factor=self.max_latency_factor)
        if verdict.healthy:
            self._set(job, J.ACTIVE, f"health window passed: {verdict.reason}", final=True)
            return
        previous = self.daemon.store.rollback()
        restored = old if old is not None else self.daemon.load(previous)
        self.daemon.activate_loaded(restored)
        self._set(job, J.ROLLED_BACK, f"unhealthy: {verdict.reason}; back on {previous.name} {previous.version}")

    # ---------------------------------------------------------------- restart

    def _resume_jobs(self) -> None:
        active_version = self.daemon.store.active_version()
        for job in self.journal.all():
            action = on_restart(job, active_is_job_version=active_version == job.command.get("version"))
            if action == J.RESUME:
                # Start over from the download: it resumes where it stopped, and staging is
                # idempotent (store.recover() removed anything half-extracted).
                resumed = dataclasses.replace(job, state=J.QUEUED, reason="resumed after an agent restart")
                self.journal.save(resumed)
                self.reporter.publish_job_event(resumed.event())
                self._queue.put(resumed)
            elif action == J.ROLL_BACK:
                self._rollback_after_restart(job)
            elif action == J.FAIL:
                self._set(job, J.FAILED, "the agent restarted before the command completed")
        self.journal.prune()

    def _rollback_after_restart(self, job: Job) -> None:
        """The agent died while the new model was being tested or watched: it may be the cause,
        so go back to the previous model."""
        store = self.daemon.store
        current = job if job.state == J.ACTIVE else dataclasses.replace(job, state=J.ACTIVE)
        try:
            previous = store.rollback()
            self.daemon.activate_loaded(self.daemon.load(previous))
            reason = f"agent restarted before the health window closed; back on {previous.name} {previous.version}"
        except EdgepackError as err:
            reason = f"agent restarted before the health window closed; rollback failed: {err}"
        self._set(current, J.ROLLED_BACK, reason)
