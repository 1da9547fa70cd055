"""The rollout driver: the I/O loop around :mod:`.rollouts`, run by whichever server holds the lease.

Every ``tick_s`` the server tries to take or renew the ``driver`` lease (a row in the
database: holder and expiry; :class:`Lease`). Only the holder advances rollouts: it reads each
pending or running rollout and its devices from the database, asks the pure
:func:`~.rollouts.next_step` what to do, and does it. Nothing lives only in memory, so a
server that restarts, or another server that takes the lease over when the holder dies
(within ``lease_ttl_s`` plus one tick), continues from the database.

**Sending a command exactly once.** A command's id is derived from (rollout, wave, device)
when the rollout is planned. Before a command is published it is recorded in the ``commands``
table (its signed bytes; the primary key is the id), in the same transaction that marks the
device ``sent`` and bumps the rollout's revision (optimistic concurrency: a pause or another
server's change in between makes the transaction a no-op). Only the server whose insert
created the row publishes it; the broker's PUBACK sets ``published_at``. A command recorded
but never acknowledged (the server died in between) is sent again, with the same id and
bytes, only when the device has not answered it ``resend_after_s`` after this server began
to lead: an answer proves delivery. Devices refuse a repeated id anyway (their replay
ledger), so even that resend cannot run twice.

**Answers lost in a restore.** A database restored from a copy lacks the job events after
the copy. A delivered deploy whose job has no final event and has been silent
``requery_after_s`` is published again (the same bytes): the device answers a repeated id
with the job as it stands and never runs it twice (:meth:`Driver._requery_silent`).

The server signs every command with its operator key (:mod:`edgepack_core.command_auth`);
it holds no release key, so it can only point devices to artifacts a release key signed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Float, and_, cast, func, select, update
from sqlalchemy.engine import Connection

from edgepack_core import faults
from edgepack_core.command_auth import sign_command
from edgepack_core.errors import EdgepackError
from edgepack_core.mqtt_transport import MqttTransport
from edgepack_core.protocol.commands import build_command, encode_command
from edgepack_core.protocol.topics import Topics
from edgepack_core.signing import SigningKey
from sdk.fleet_server import audit, bad_releases, settings_db, target_round
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database
from sdk.fleet_server.desired import apply_staged
from sdk.fleet_server.lease import LEASE_NAME, Lease  # noqa: F401  (imported from here by others)
from sdk.fleet_server.rollout_golden import golden_of
from sdk.fleet_server.rollouts import (
    NOT_SENT,
    RUNNING,
    SENT,
    DeviceStatus,
    Gates,
    Rollout,
    Step,
    command_id,
    fails_after_error,
    failure,
    next_step,
    transition,
)
from sdk.fleet_server.settings import signer_for
from sdk.fleet_server.targets import marked_bad

log = logging.getLogger("edgepack.fleet_server.driver")


@dataclass(frozen=True)
class DriverConfig:
    tick_s: float = 0.5
    lease_ttl_s: float = 5.0
    resend_after_s: float = 10.0
    requery_after_s: float = 60.0  # a deploy whose job has been silent this long is asked again (same bytes)
    reconcile_every_s: float = 2.0  # targets are reconciled this often, and at once after an API write
    command_ttl_s: float = 24 * 3600.0
    publish_timeout_s: float = 2.0
    silence_s: float = 60.0  # a device not heard from for this long is offline


def _bounded(total: float) -> int:
    """A float sum of counters as an int of at most 2^63 - 1."""
    return int(min(float(total), float(2**63 - 1024)))


def _one_line(err: BaseException) -> str:
    """An exception as one bounded line (it becomes a rollout's reason)."""
    text = " ".join(str(err).split()) or type(err).__name__
    return text[:500]


def rollout_of(row: Any) -> Rollout:
    """The pure view of a ``rollouts`` row."""
    return Rollout(
        id=row["id"], state=row["state"], wave=row["wave"], wave_count=row["wave_count"],
        gates=Gates(min_success_share=row["min_success_share"], soak_s=row["soak_s"],
                    wave_timeout_s=row["wave_timeout_s"], max_error_rate=row["max_error_rate"],
                    rollback_on_failure=row["rollback_on_failure"]),
        reason=row["reason"], started_at=row["started_at"], wave_started_at=row["wave_started_at"],
        soak_started_at=row["soak_started_at"], paused_at=row["paused_at"], finished_at=row["finished_at"])


def rollout_changes(before: Rollout, after: Rollout, now: float) -> dict[str, Any]:
    """The columns of ``after`` that a transition may change."""
    return {"state": after.state, "wave": after.wave, "reason": after.reason, "started_at": after.started_at,
            "wave_started_at": after.wave_started_at, "soak_started_at": after.soak_started_at,
            "paused_at": after.paused_at, "finished_at": after.finished_at, "updated_at": now}


def save_rollout(connection: Connection, row: Any, after: Rollout, now: float, *, event: str, actor: str,
                 reason: str = "") -> bool:
    """Write ``after`` if the row is still at the revision it was read at, with its transition
    (``event``, who, why, the 1-based wave) in ``rollout_transitions``; False if another writer
    (an API call, another server) changed it first (then nothing is written). The row's
    ``reason`` is only the latest; the transitions keep every one."""
    result = connection.execute(
        update(tables.rollouts).where(tables.rollouts.c.id == row["id"], tables.rollouts.c.revision == row["revision"])
        .values(**rollout_changes(rollout_of(row), after, now), revision=row["revision"] + 1))
    if not result.rowcount:
        return False
    connection.execute(tables.rollout_transitions.insert().values(
        rollout_id=row["id"], at=now, event=event, from_state=row["state"], to_state=after.state,
        wave=after.wave + 1, actor=actor[:128], reason=reason))
    return True


def command_summary(command: dict[str, Any]) -> dict[str, Any]:
    """What the audit keeps of a command: its id, kind, target and what it names (artifact sha256,
    name, version; a rollback's from_version; a cancel's job; a remove's model), never its signature. Pure."""
    kept = ("id", "type", "target", "sha256", "name", "version", "from_version", "job", "model", "force_downgrade",
            "expires_at")
    return {key: command[key] for key in kept if command.get(key) is not None}


def step_reason(step: Step, row: Any) -> str:
    """Why the driver takes ``step`` (kept in the rollout's transitions), 1-based waves. Pure."""
    if step.reason:
        return step.reason
    wave = f"wave {row['wave'] + 1} of {row['wave_count']}"
    return {"start": f"started: wave 1 of {row['wave_count']}",
            "soak": f"{wave}: its jobs passed their gate; soaking {row['soak_s']:g} s",
            "advance": f"{wave} passed its gates; wave {row['wave'] + 2} starts"}.get(step.kind, step.kind)


class Driver:
    """Advances rollouts while this server holds the lease; see the module docstring."""

    def __init__(self, database: Database, transport: MqttTransport, topics: Topics, operator_key: SigningKey,
                 artifact_url: Callable[[str], str], server_id: str, config: DriverConfig | None = None,
                 on_lead: Callable[[float], None] | None = None,
                 artifact_available: Callable[[str], bool] = lambda _sha: True,
                 rotation_keys: Sequence[SigningKey] = ()) -> None:
        self.database = database
        self.transport = transport
        self.topics = topics
        self.operator_key = operator_key
        self.operator_keys = (operator_key, *rotation_keys)  # signs with the first the device holds
        self.artifact_url = artifact_url
        self.artifact_available = artifact_available
        self.server_id = server_id
        self.actor = f"server:{server_id}"  # who the driver's transitions and commands are recorded as
        self.config = config or DriverConfig()
        self.lease = Lease(database, server_id, self.config.lease_ttl_s)
        self.leader = False
        self.leader_since: float | None = None
        self.on_lead = on_lead
        self.sent = 0
        self.resent = 0
        self.refused_by_broker = 0
        self.ticks = 0
        self.rollout_errors = 0  # rounds of one rollout that raised (each is that rollout's alone)
        self.reconcile_errors = 0  # rounds of the targets' reconciler that raised
        self.target_sent = 0  # deploys the reconciler recorded
        self.settings_sent = 0  # settings documents the reconciler recorded (settings_db.py)
        self.converged = 0  # devices on their effective target at the last round
        self.requeried = 0  # deploys published again because their job went silent
        self._requeried: dict[str, float] = {}  # command id: when it was last asked again
        self._next_reconcile = 0.0  # a round reads every device: at most every reconcile_every_s
        self._errors: dict[str, int] = {}  # rollout id: rounds in a row that raised
        self._stop = threading.Event()
        self._wake = threading.Event()

    # ---------------------------------------------------------------- loop

    def wake(self) -> None:
        """Tick now (after an API write), not at the next interval; reconcile targets in it."""
        self._next_reconcile = 0.0
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            self.step(time.time())
            self._wake.wait(self.config.tick_s)
        if self.leader:
            try:
                self.lease.release()
            except Exception:
                log.exception("could not release the driver lease")

    def step(self, now: float) -> None:
        """One round: hold the lease, then (as leader) advance every rollout and resend."""
        try:
            holding = self.lease.hold(now)
        except Exception:
            log.exception("the driver lease could not be taken or renewed")
            holding = False
        if holding and not self.leader:
            self.leader_since = now
            log.info("server %s leads the rollouts", self.server_id)
        if not holding and self.leader:
            log.warning("server %s lost the driver lease", self.server_id)
        self.leader = holding
        if not holding:
            self.leader_since = None
            return
        try:
            self.tick(now)
            if self.on_lead is not None:
                self.on_lead(now)
        except Exception:  # the next tick starts from the database again
            log.exception("driving the rollouts failed")

    def tick(self, now: float) -> None:
        self.ticks += 1
        with self.database.read() as connection:
            rows = connection.execute(select(tables.rollouts).where(
                tables.rollouts.c.state.in_(("pending", "running"))).order_by(tables.rollouts.c.created_at)) \
                .mappings().all()
            bad = bad_releases.marks(connection, {row["artifact_sha256"] for row in rows})
        for row in rows:
            mark = bad.get(row["artifact_sha256"])
            if mark is not None:
                self._pause_bad(row["id"], marked_bad(row["artifact_sha256"], mark.reason), now)
                continue
            self._advance_alone(row, now)
        try:
            if now >= self._next_reconcile:
                self._next_reconcile = now + self.config.reconcile_every_s
                self._reconcile(now)
                self.settings_sent += settings_db.reconcile(self, now)
        except Exception as err:  # the targets' round alone; rollouts and resends go on
            self.reconcile_errors += 1
            log.error("reconciling targets failed: %s", _one_line(err), exc_info=not isinstance(err, EdgepackError))
        self._resend_uncertain(now)
        self._requery_silent(now)

    # ---------------------------------------------------------------- targets

    def _reconcile(self, now: float) -> None:
        """The targets' round (:func:`.target_round.reconcile`)."""
        target_round.reconcile(self, now)

    def _advance_alone(self, row: Any, now: float) -> None:
        """One rollout's round, isolated: what it raises is counted against that rollout alone
        (and fails it, at once for a parameter no device accepts, else after a few rounds in a
        row: :func:`~.rollouts.fails_after_error`); the rollouts after it are driven anyway."""
        try:
            self._advance(row, now)
        except Exception as err:  # counted; the rollout fails (fails_after_error)
            self.rollout_errors += 1
            consecutive = self._errors.get(row["id"], 0) + 1
            self._errors[row["id"]] = consecutive
            log.error("rollout %s: the driver's round failed (%d in a row): %s", row["id"], consecutive,
                      _one_line(err), exc_info=not isinstance(err, EdgepackError))
            if fails_after_error(consecutive, permanent=isinstance(err, EdgepackError)):
                self._fail_alone(row["id"], f"the server could not drive it: {_one_line(err)}", now)
        else:
            self._errors.pop(row["id"], None)

    def _fail_alone(self, rollout_id: str, reason: str, now: float) -> None:
        """Fail one rollout the driver cannot act on (nothing more is sent for it). If even that
        write fails, the next round tries again."""
        try:
            with self.database.write() as connection:
                row = connection.execute(select(tables.rollouts).where(tables.rollouts.c.id == rollout_id)) \
                    .mappings().first()
                if row is None or row["state"] not in ("pending", "running"):
                    return
                save_rollout(connection, row, transition(rollout_of(row), "fail", now, reason), now, event="fail",
                             actor=self.actor, reason=reason)
        except Exception:  # retried next round, still counted per rollout
            log.exception("rollout %s could not be marked failed", rollout_id)
            return
        self._errors.pop(rollout_id, None)
        log.error("rollout %s failed: %s", rollout_id, reason)

    def _pause_bad(self, rollout_id: str, reason: str, now: float) -> None:
        """Pause (never fail) a rollout whose artifact the operator marked bad, with that reason
        (through the state machine, audited ``rollout.pause`` as the server). If another writer
        changed it first, the next round looks again."""
        with self.database.write() as connection:
            row = connection.execute(select(tables.rollouts).where(tables.rollouts.c.id == rollout_id)) \
                .mappings().first()
            if row is None or row["state"] not in ("pending", "running"):
                return
            after = transition(rollout_of(row), "pause", now, reason)
            if not save_rollout(connection, row, after, now, event="pause", actor=self.actor, reason=reason):
                return
            audit.record(connection, actor=self.actor, action="rollout.pause", target=rollout_id, now=now,
                         detail={"from": row["state"], "to": after.state, "wave": row["wave"] + 1,
                                 "wave_count": row["wave_count"], "reason": reason})
        log.warning("rollout %s paused: %s", rollout_id, reason)

    # ---------------------------------------------------------------- one rollout

    def device_statuses(self, row: Any, now: float) -> list[DeviceStatus]:
        """The rollout's devices with their job states, whether they are online, and, for the
        wave soaking now, their inferences and errors since the soak began."""
        rd, devices = tables.rollout_devices, tables.devices
        with self.database.read() as connection:
            found = connection.execute(
                select(rd.c.device, rd.c.wave, rd.c.state, rd.c.final, rd.c.reason, devices.c.status,
                       devices.c.last_seen, rd.c.golden_events, rd.c.golden_mismatches)
                .select_from(rd.outerjoin(devices, devices.c.id == rd.c.device))
                .where(rd.c.rollout_id == row["id"])).all()
            health = self._soak_figures(connection, row, [f.device for f in found if f.wave == row["wave"]])
        statuses = []
        for item in found:
            online = item.status == "online" and item.last_seen is not None and \
                now - item.last_seen <= self.config.silence_s
            inferences, errors = health.get(item.device, (0, 0))
            statuses.append(DeviceStatus(item.device, item.wave, item.state, bool(item.final), item.reason or "",
                                         online, inferences, errors,
                                         golden_of(item.golden_events, item.golden_mismatches)))
        return statuses

    @staticmethod
    def _soak_figures(connection: Connection, row: Any, wave: Sequence[str]) -> dict[str, tuple[int, int]]:
        if row["soak_started_at"] is None or row["max_error_rate"] is None or not wave:
            return {}
        raw = tables.telemetry_raw
        figures: dict[str, tuple[int, int]] = {}
        for start in range(0, len(wave), 500):
            part = list(wave[start:start + 500])
            # Summed as floats: an integer SUM of counters each below 2^62 overflows on SQLite (and
            # PostgreSQL's numeric sum would not fit the int64 the gate compares); the ratio is all
            # the gate needs, and a float keeps it.
            query = select(raw.c.device, func.coalesce(func.sum(cast(raw.c.inferences, Float)), 0.0),
                           func.coalesce(func.sum(cast(raw.c.errors, Float)), 0.0)) \
                .where(raw.c.device.in_(part), raw.c.ts >= row["soak_started_at"]).group_by(raw.c.device)
            figures.update({device: (_bounded(inf), _bounded(err)) for device, inf, err in connection.execute(query)})
        return figures

    def _advance(self, row: Any, now: float) -> None:
        rollout = rollout_of(row)
        devices = self.device_statuses(row, now)
        step = next_step(rollout, devices, now)
        if step.kind == "send" and not self.artifact_available(row["artifact_sha256"]):
            step = failure(rollout, devices, f"artifact {row['artifact_sha256'][:12]} is not in the artifact store of "
                                             f"server {self.server_id} (servers sharing a database must share "
                                             "--artifacts, or serve it from --public-url)")
        if step.kind == "wait":
            return
        if step.kind == "send":
            self._send_wave(row, step, now)
            return
        after = transition(rollout, step.kind, now, step.reason)  # the step names the event
        published: list[dict[str, Any]] = []
        with self.database.write() as connection:
            if not save_rollout(connection, row, after, now, event=step.kind, actor=self.actor,
                                reason=step_reason(step, row)):
                return
            if step.kind == "fail" and (step.rollback or step.cancel):
                published = self._record_undo(connection, row, step, now)
            if step.kind == "succeed" and apply_staged(connection, row["id"], now):
                self._next_reconcile = 0.0  # the new target's devices are judged at once
        log.info("rollout %s: %s%s", row["id"], step.kind, f" ({step.reason})" if step.reason else "")
        self._publish(published, now)
        if step.kind in ("start", "advance"):
            self.wake()  # the new wave's commands go out on the next round, without waiting a tick

    def _command_fields(self, row: Any, artifact: Any) -> dict[str, Any]:
        return {"name": row["name"], "version": row["version"], "size": artifact.size, "sha256": artifact.sha256,
                "artifact": {"url": self.artifact_url(artifact.sha256)}, "health_window_s": row["health_window_s"],
                "force_downgrade": True if row["force_downgrade"] else None,
                "allow_contract_change": True if row["allow_contract_change"] else None}

    def _record(self, connection: Connection, rollout_id: str | None, device: str, kind: str, command: dict[str, Any],
                now: float) -> dict[str, Any] | None:
        """Record one signed command; the row (to publish) if this call created it, else None."""
        signer = self.operator_key if len(self.operator_keys) == 1 else \
            signer_for(self.operator_keys, settings_db.held_operator_keys(connection, device))
        signed = sign_command(command, signer)
        topic = self.topics.cmd(device)
        values = {"id": command["id"], "rollout_id": rollout_id, "device": device, "kind": kind, "topic": topic,
                  "payload": encode_command(signed), "created_at": now, "created_by": self.server_id,
                  "published_at": None, "attempts": 1}
        if not self.database.insert_new(connection, tables.commands, values):
            return None
        audit.record(connection, actor=self.actor, action="command.sent", target=device, now=now,
                     detail={"command": command_summary(command), "rollout": rollout_id, "topic": topic})
        return values

    def record_command(self, connection: Connection, device: str, kind: str, command: dict[str, Any],
                       now: float) -> dict[str, Any] | None:
        """An operator's command outside any rollout (:mod:`.actions`), recorded as the driver
        records its own, in the caller's transaction: published by :meth:`publish`, and resent by
        whichever server leads if the broker never acknowledged it."""
        return self._record(connection, None, device, kind, command, now)

    def publish(self, commands: list[dict[str, Any]], now: float) -> None:
        self._publish(commands, now)

    def _send_wave(self, row: Any, step: Step, now: float) -> None:
        rd = tables.rollout_devices
        to_publish: list[dict[str, Any]] = []
        with self.database.write() as connection:
            bumped = connection.execute(
                update(tables.rollouts).where(tables.rollouts.c.id == row["id"],
                                              tables.rollouts.c.revision == row["revision"],
                                              tables.rollouts.c.state == RUNNING)
                .values(revision=row["revision"] + 1, updated_at=now))
            if not bumped.rowcount:
                return
            artifact = connection.execute(select(tables.artifacts).where(
                tables.artifacts.c.sha256 == row["artifact_sha256"])).first()
            ids = dict(connection.execute(select(rd.c.device, rd.c.command_id).where(
                rd.c.rollout_id == row["id"], rd.c.device.in_(step.devices), rd.c.state == NOT_SENT)).all())
            fields = self._command_fields(row, artifact)
            for device in step.devices:
                if device not in ids:
                    continue
                command = build_command("deploy", device=device, command_id=ids[device],
                                        ttl_s=self.config.command_ttl_s, now=now, **fields)
                recorded = self._record(connection, row["id"], device, "deploy", command, now)
                connection.execute(update(rd).where(rd.c.rollout_id == row["id"], rd.c.device == device,
                                                    rd.c.state == NOT_SENT).values(state=SENT, sent_at=now,
                                                                                   updated_at=now))
                if recorded is not None:
                    to_publish.append(recorded)
        faults.point(f"fleet-recorded-wave-{row['wave'] + 1}")
        self._publish(to_publish, now)
        log.info("rollout %s: wave %d sent to %d device(s)", row["id"], row["wave"] + 1, len(to_publish))

    def _record_undo(self, connection: Connection, row: Any, step: Step, now: float) -> list[dict[str, Any]]:
        rd = tables.rollout_devices
        recorded: list[dict[str, Any]] = []
        deploy_ids = dict(connection.execute(select(rd.c.device, rd.c.command_id).where(
            rd.c.rollout_id == row["id"])).all())
        for kind, devices in (("rollback", step.rollback), ("cancel", step.cancel)):
            for device in devices:
                undo_id = command_id(row["id"], kind, row["wave"], device)
                # a rollback names what it undoes: a device that has moved on (a newer deploy) refuses it
                extra = {"job": deploy_ids[device]} if kind == "cancel" else \
                    {"from_version": {"name": row["name"], "version": row["version"]}}
                command = build_command(kind, device=device, command_id=undo_id, ttl_s=self.config.command_ttl_s,
                                        now=now, **extra)
                created = self._record(connection, row["id"], device, kind, command, now)
                connection.execute(update(rd).where(rd.c.rollout_id == row["id"], rd.c.device == device,
                                                    rd.c.undo_command_id.is_(None))
                                   .values(undo_command_id=undo_id, undo_kind=kind, undo_state=SENT))
                if created is not None:
                    recorded.append(created)
        return recorded

    # ---------------------------------------------------------------- publishing

    def _publish(self, commands: Sequence[dict[str, Any]], now: float) -> None:
        """Publish at QoS 1 and record each PUBACK; what the broker did not acknowledge in
        time stays unpublished (and is looked at again by :meth:`_resend_uncertain`)."""
        if not commands:
            return
        acked: list[str] = []
        refused: list[str] = []
        done = threading.Semaphore(0)
        lock = threading.Lock()

        def on_done(command_id: str) -> Callable[[bool], None]:
            def callback(accepted: bool) -> None:
                with lock:
                    (acked if accepted else refused).append(command_id)
                done.release()
            return callback

        queued = 0
        for command in commands:
            if self.transport.publish(command["topic"], command["payload"], qos=1, on_done=on_done(command["id"])):
                queued += 1
        deadline = time.monotonic() + self.config.publish_timeout_s
        for _ in range(queued):
            if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
                break
        with lock:
            acked_now, refused_now = list(acked), list(refused)
        if refused_now:
            self.refused_by_broker += len(refused_now)
            log.error("the broker refused %d command(s) (is the server's MQTT user allowed to publish commands?)",
                      len(refused_now))
        if acked_now:
            self.sent += len(acked_now)
            with self.database.write() as connection:
                connection.execute(update(tables.commands).where(tables.commands.c.id.in_(acked_now),
                                                                 tables.commands.c.published_at.is_(None))
                                   .values(published_at=time.time()))

    def _requery_silent(self, now: float) -> None:
        """Deploys (of rollouts and of the reconciler) still within their lifetime, delivered,
        whose job has no final event and has been silent ``requery_after_s``, are published
        again, the same bytes, at most once per interval each. A device answers a repeated id
        with the job as it stands and never runs it twice, so this only brings back answers the
        server lost, e.g. after a restore from a copy taken mid-wave (the job events after the
        copy are gone; the devices will not send them again on their own)."""
        wait = self.config.requery_after_s
        if self.leader_since is None or now - self.leader_since < wait:
            return
        self._requeried = {cid: at for cid, at in self._requeried.items() if now - at < wait}
        commands, events = tables.commands, tables.job_events
        newest = select(func.max(events.c.received_at)).where(events.c.job == commands.c.id).scalar_subquery()
        ended = select(events.c.id).where(events.c.job == commands.c.id, events.c.final.is_(True)).exists()
        with self.database.read() as connection:
            silent = connection.execute(select(commands).where(
                commands.c.kind == "deploy", commands.c.published_at.is_not(None),
                commands.c.created_at > now - self.config.command_ttl_s + wait, ~ended,
                func.coalesce(newest, commands.c.created_at) <= now - wait)
                .order_by(commands.c.created_at).limit(1000)).mappings().all()
        again = [dict(c) for c in silent if c["id"] not in self._requeried]
        if not again:
            return
        for command in again:
            self._requeried[command["id"]] = now
        self.requeried += len(again)
        log.info("asking %d device(s) again about a job silent for %g s", len(again), wait)
        self._publish(again, now)

    def _resend_uncertain(self, now: float) -> None:
        """Commands recorded but never acknowledged by the broker: answered ones are marked
        delivered; the others, once the grace has passed, are published again (same bytes)."""
        grace = self.config.resend_after_s
        if self.leader_since is None or now - self.leader_since < grace:
            return
        commands, events = tables.commands, tables.job_events
        with self.database.read() as connection:
            uncertain = connection.execute(select(commands).where(
                commands.c.published_at.is_(None), commands.c.created_at <= now - grace)
                .order_by(commands.c.created_at).limit(1000)).mappings().all()
            if not uncertain:
                return
            answered = {job for (job,) in connection.execute(select(events.c.job).where(
                events.c.job.in_([c["id"] for c in uncertain])).distinct())}
        with self.database.write() as connection:
            if answered:
                connection.execute(update(commands).where(commands.c.id.in_(sorted(answered)),
                                                          commands.c.published_at.is_(None))
                                   .values(published_at=now))
            again = [dict(c) for c in uncertain if c["id"] not in answered]
            if again:
                connection.execute(update(commands).where(and_(commands.c.id.in_([c["id"] for c in again]),
                                                               commands.c.published_at.is_(None)))
                                   .values(attempts=commands.c.attempts + 1, created_at=now))
        if again:
            log.warning("publishing %d command(s) again that the broker never acknowledged", len(again))
            self.resent += len(again)
            self._publish(again, now)
