"""The ingest's writes: parsed device messages (states, telemetry, job events) into the database,
in the batch's transaction (:class:`Writer`), with the pure rules they follow (which state
replaces the stored one, a sequence number's restart). :mod:`.ingest` consumes and batches."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import case, delete, func, or_, select, update

from edgepack_core.protocol.messages import (
    Decommissioned,
    DeviceState,
    JobEvent,
    ModelRef,
    SessionMark,
    Telemetry,
)
from sdk.fleet_server import db as tables
from sdk.fleet_server import device_pipelines, report_card_table, report_cards, settings_db
from sdk.fleet_server.db import Database
from sdk.fleet_server.liveness import HeardState, supersedes
from sdk.fleet_server.retention import kinds_json
from sdk.fleet_server.rollout_golden import golden_values

log = logging.getLogger("edgepack.fleet_server.ingest")


def ascii_text(value: str, limit: int) -> str:
    """``value`` as printable ASCII (anything else escaped), at most ``limit`` characters."""
    escaped = value.encode("ascii", "backslashreplace").decode("ascii")
    return "".join(c if " " <= c <= "~" else f"\\x{ord(c):02x}" for c in escaped)[:limit]


def _model_values(model: ModelRef | None) -> dict[str, str | None]:
    if model is None:
        return {"model_name": None, "model_version": None, "model_sha256": None}
    return {"model_name": model.name, "model_version": model.version, "model_sha256": model.sha256}


def _device_values(record: DeviceState, heard: float) -> dict[str, Any]:
    mark = record.session
    return {
        "id": record.device,
        "status": record.status,
        "status_reason": record.reason,
        "first_seen": heard,
        "last_seen": heard,
        "state_ts": record.ts,
        "state_heard": heard,
        "provider": record.provider,
        "state_epoch": None if mark is None else mark.epoch,
        "state_session": None if mark is None else mark.n,
        "profile": record.profile,
        "capabilities": record.capabilities,
        **_model_values(record.model),
        "groups_enrolled_at": heard if record.groups is not None else None,
    }


def _without(devices: set[str], records: list[Any], *, keep_clears: bool = False) -> list[Any]:
    """``records`` less those of ``devices`` (an empty retained state, which clears one, stays)."""
    return [(r, at) for r, at in records if r.device not in devices or (keep_clears and isinstance(r, Decommissioned))]


def _heard(record: DeviceState, heard: float) -> HeardState:
    return HeardState(record.session, record.status, heard)


def _replaces_stored(new: HeardState, row: Any) -> bool:
    """Whether ``new`` supersedes the state stored in ``row`` (a devices row)."""
    if row.state_heard is None:
        return True
    mark = (
        None
        if row.state_epoch is None or row.state_session is None
        else SessionMark(row.state_epoch, row.state_session)
    )
    return supersedes(new, HeardState(mark, row.status, row.state_heard))


_TELEMETRY_FIELDS = (
    "latency_p50",
    "latency_p90",
    "latency_p99",
    "latency_mean",
    "throughput_per_s",
    "inferences_total",
    "errors_total",
    "inferences_interval",
    "errors_interval",
    "cpu_percent",
    "memory_rss_bytes",
    "temperature_c",
)


class Writer:
    """Turns parsed records into rows. Separate from the MQTT side so tests and tools can feed
    it directly; every method runs inside one write transaction."""

    def __init__(self, database: Database) -> None:
        self.database = database

    @staticmethod
    def decommissioned(connection: Any, devices: list[str]) -> set[str]:
        """Which of ``devices`` were decommissioned: their messages are dropped until an
        operator enrolls them again (``POST /api/devices/{id}/enroll``)."""
        wanted = sorted(set(devices))
        found: set[str] = set()
        table = tables.decommissioned
        for start in range(0, len(wanted), 500):
            found.update(
                connection.execute(
                    select(table.c.device).where(table.c.device.in_(wanted[start : start + 500]))
                ).scalars()
            )
        return found

    def states(self, connection: Any, records: list[tuple[DeviceState | Decommissioned, float]]) -> None:
        """Apply states, each with when the server heard it (``heard``: the receipt for a live
        message; for a retained one, replayed by the broker at every subscribe, no later than the
        device's own ts). States are ordered by ``heard``, never by the device's ts alone (a
        device clock 10 days ahead must not make every later state look older), except between
        states that carry connection marks of one epoch (:func:`.liveness.supersedes`: a will
        heard late still beats the birth it follows); ``last_seen`` only ever moves forward.
        Groups: see :meth:`_groups`."""
        gone = [r.device for r, _ in records if isinstance(r, Decommissioned)]
        latest: dict[str, tuple[DeviceState, float]] = {}
        for record, heard in records:
            if isinstance(record, DeviceState):
                if record.device not in latest or supersedes(_heard(record, heard), _heard(*latest[record.device])):
                    latest[record.device] = (record, heard)
            else:
                latest.pop(record.device, None)
        if gone:
            connection.execute(delete(tables.devices).where(tables.devices.c.id.in_(gone)))
            for table in (
                tables.device_groups,
                tables.device_claimed_groups,
                tables.device_rejected,
                tables.device_models,
                tables.settings_reports,
                report_card_table.device_report_cards,
                device_pipelines.device_pipelines,
            ):
                connection.execute(delete(table).where(table.c.device.in_(gone)))
        if not latest:
            return
        devices = tables.devices
        stored = {
            row.id: row
            for row in connection.execute(
                select(
                    devices.c.id,
                    devices.c.status,
                    devices.c.state_heard,
                    devices.c.state_epoch,
                    devices.c.state_session,
                    devices.c.groups_enrolled_at,
                ).where(devices.c.id.in_(list(latest)))
            )
        }
        fresh = [
            (r, heard)
            for r, heard in latest.values()
            if r.device not in stored or _replaces_stored(_heard(r, heard), stored[r.device])
        ]
        if not fresh:
            return
        stmt = self.database.insert(devices)
        keep = ("model_name", "model_version", "model_sha256", "provider", "profile", "capabilities")
        updates = {
            name: stmt.excluded[name]
            for name in ("status", "status_reason", "state_ts", "state_heard", "state_epoch", "state_session")
        }
        updates["last_seen"] = case(
            (stmt.excluded.last_seen > devices.c.last_seen, stmt.excluded.last_seen), else_=devices.c.last_seen
        )
        for name in (*keep, "groups_enrolled_at"):  # an offline will without a model does not erase what it ran
            updates[name] = (
                _coalesce(devices.c[name], stmt.excluded[name])
                if name == "groups_enrolled_at"
                else _coalesce(stmt.excluded[name], devices.c[name])
            )
        connection.execute(
            stmt.on_conflict_do_update(index_elements=["id"], set_=updates),
            [_device_values(r, heard) for r, heard in fresh],
        )
        unenrolled = {d for d in latest if d not in stored or stored[d].groups_enrolled_at is None}
        self._groups(connection, [r for r, _ in fresh if r.groups is not None], unenrolled)
        self._rejected(connection, [(r, heard) for r, heard in fresh if r.status == "online"])
        self._models(connection, [r for r, _heard in fresh if r.status == "online" and r.models])
        settings_db.save_reports(self.database, connection, [(r, heard) for r, heard in fresh if r.status == "online"])
        report_cards.save(connection, fresh)

    def _models(self, connection: Any, records: list[DeviceState]) -> None:
        """Keep ``device_models`` equal to the models each device's newest online state lists
        (states of agents before several models list none and change nothing)."""
        if not records:
            return
        table = tables.device_models
        devices = [record.device for record in records]
        for start in range(0, len(devices), 500):
            connection.execute(delete(table).where(table.c.device.in_(devices[start : start + 500])))
        connection.execute(
            table.insert(),
            [
                {"device": record.device, "name": model.name, "version": model.version, "model_sha256": model.sha256}
                for record in records
                for model in record.models
            ],
        )

    def _rejected(self, connection: Any, records: list[tuple[DeviceState, float]]) -> None:
        """Keep ``device_rejected`` in step with each device's newest online state (the device's
        own ledger, bounded by the parser): records it no longer lists go, new ones are added
        with when the server first heard them (an existing one keeps its first hearing). One
        read per 500 devices; writes only where something changed (most devices list none)."""
        table = tables.device_rejected
        listed = {record.device: {ref.sha256 for ref in record.rejected} for record, _heard in records}
        devices = sorted(listed)
        stored: set[tuple[str, str]] = set()
        for start in range(0, len(devices), 500):
            part = devices[start : start + 500]
            stored |= {
                (row.device, row.sha256)
                for row in connection.execute(select(table.c.device, table.c.sha256).where(table.c.device.in_(part)))
            }
        for device, sha in sorted(pair for pair in stored if pair[1] not in listed[pair[0]]):
            connection.execute(delete(table).where(table.c.device == device, table.c.sha256 == sha))
        rows = [
            {
                "device": record.device,
                "sha256": ref.sha256,
                "name": ref.name,
                "version": ref.version,
                "stage": ref.stage,
                "reason": ref.reason[:500],
                "device_ts": ref.ts,
                "heard_at": heard,
            }
            for record, heard in records
            for ref in record.rejected
            if (record.device, ref.sha256) not in stored
        ]
        if rows:
            connection.execute(self.database.insert(table).on_conflict_do_nothing(), rows)

    def _groups(self, connection: Any, claiming: list[DeviceState], unenrolled: set[str]) -> None:
        """A device's claimed groups are recorded, never used: rollouts target the groups the
        server enrolled. The claim of a device's first state with groups is enrolled (trust on
        first use); later claims change only ``device_claimed_groups`` (an operator enrolls
        with ``PUT /api/devices/{id}/groups``)."""
        if not claiming:
            return
        tables_to_set = [
            (tables.device_claimed_groups, claiming),
            (tables.device_groups, [r for r in claiming if r.device in unenrolled]),
        ]
        for table, records in tables_to_set:
            if not records:
                continue
            connection.execute(delete(table).where(table.c.device.in_([r.device for r in records])))
            rows = [{"device": r.device, "group_name": g} for r in records for g in r.groups or ()]
            if rows:
                connection.execute(self.database.insert(table).on_conflict_do_nothing(), rows)

    def telemetry(self, connection: Any, records: list[tuple[Telemetry, float]]) -> None:
        """Store every sample (raw, at its receipt) and make the newest by the device's ``seq``
        the device's latest figures (see :func:`newer_seq`); ``last_seen`` is the receipt."""
        if not records:
            return
        connection.execute(
            tables.telemetry_raw.insert(),
            [
                {
                    "device": r.device,
                    "ts": at,
                    "seq": r.seq,
                    "latency_p50": r.latency_p50,
                    "latency_p99": r.latency_p99,
                    "latency_mean": r.latency_mean,
                    "throughput_per_s": r.throughput_per_s,
                    "inferences": r.inferences_interval,
                    "errors": r.errors_interval,
                    "cpu_percent": r.cpu_percent,
                    "memory_rss_bytes": r.memory_rss_bytes,
                    "error_kinds": kinds_json(dict(r.error_kinds_interval)),
                }
                for r, at in records
            ],
        )
        latest: dict[str, tuple[Telemetry, float]] = {}
        heard: dict[str, float] = {}
        for record, at in records:
            heard[record.device] = max(at, heard.get(record.device, at))
            if record.device not in latest or newer_seq(record.seq, latest[record.device][0].seq):
                latest[record.device] = (record, at)
        devices = tables.devices  # (every integer below 2^62: the protocol's bounds clamp them)
        stmt = self.database.insert(devices)
        rows = []
        for record, at in latest.values():
            row = {
                "id": record.device,
                "status": "online",
                "status_reason": "",
                "first_seen": at,
                "last_seen": heard[record.device],
                "telemetry_at": at,
                "telemetry_seq": record.seq,
                **_model_values(record.model),
                "provider": record.provider,
            }
            row.update({name: getattr(record, name) for name in _TELEMETRY_FIELDS})
            rows.append(row)
        new, old = stmt.excluded, devices.c
        applies = or_(
            old.telemetry_seq.is_(None),
            new.telemetry_seq.is_(None),
            old.telemetry_at.is_(None),
            new.telemetry_seq > old.telemetry_seq,
            new.telemetry_seq < old.telemetry_seq - SEQ_RESTART_GAP,
            old.telemetry_at < new.telemetry_at - SEQ_STALE_S,
        )
        updates: dict[str, Any] = {
            "last_seen": case((new.last_seen > old.last_seen, new.last_seen), else_=old.last_seen)
        }
        for name in ("telemetry_at", "telemetry_seq", *_TELEMETRY_FIELDS):
            updates[name] = case((applies, new[name]), else_=old[name])
        for name in ("model_name", "model_version", "model_sha256", "provider"):
            updates[name] = case((applies, _coalesce(new[name], old[name])), else_=old[name])
        connection.execute(stmt.on_conflict_do_update(index_elements=["id"], set_=updates), rows)
        device_pipelines.save(self.database, connection, list(latest.values()), replaces_latest)

    def jobs(self, connection: Any, records: list[tuple[JobEvent, float]]) -> int:
        """Store job events (a repeat is ignored) and fold them into the rollouts they belong
        to. Returns how many were repeats."""
        if not records:
            return 0
        repeats = 0
        for record, at in records:
            new = self.database.insert_new(
                connection,
                tables.job_events,
                {
                    "device": record.device,
                    "job": record.job,
                    "type": record.type,
                    "state": record.state,
                    "final": record.final,
                    "reason": record.reason,
                    "ts": record.ts,
                    "received_at": at,
                },
            )
            if not new:
                repeats += 1
                continue
            rd = tables.rollout_devices
            # A final event ends the job whatever its ts (a device clock stepped back must not
            # leave the wave to time out); a non-final one loses to a newer ts already applied.
            in_order = rd.c.job_ts.is_(None) | (rd.c.job_ts <= record.ts) if not record.final else rd.c.final.is_(False)
            connection.execute(
                update(rd)
                .where(
                    rd.c.command_id == record.job,
                    rd.c.device == record.device,
                    rd.c.final.is_(False),
                    in_order,
                )
                .values(state=record.state, final=record.final, reason=record.reason, job_ts=record.ts, updated_at=at,
                        **golden_values(record.golden_stream))
            )
            connection.execute(
                update(rd)
                .where(rd.c.undo_command_id == record.job, rd.c.device == record.device)
                .values(undo_state=record.state, undo_reason=record.reason)
            )
        return repeats


SEQ_RESTART_GAP = 1_000_000
"""A ``seq`` this far below the stored one is a restarted sequence (the agent's outbox replays
at most tens of thousands of older samples), not a late sample."""
SEQ_STALE_S = 300.0
"""Figures not replaced for this long give way to any sample (a sequence restarted lower)."""


def newer_seq(seq: int | None, than: int | None) -> bool:
    """Whether a telemetry sample numbered ``seq`` replaces the latest figures numbered ``than``:
    higher numbers win (a late sample from the device's outbox, or committed late by another
    server of the share group, does not), unknown numbers always do, and a number far below
    is a restarted sequence. Pure."""
    return seq is None or than is None or seq > than or seq < than - SEQ_RESTART_GAP


def replaces_latest(seq: int | None, heard: float, stored_seq: int | None, stored_heard: float | None) -> bool:
    """The rule of :meth:`Writer.telemetry`'s SQL (``applies``) in Python, for rows kept beside
    the latest figures (:mod:`.device_pipelines`). Pure."""
    return stored_heard is None or newer_seq(seq, stored_seq) or stored_heard < heard - SEQ_STALE_S


def _coalesce(new: Any, old: Any) -> Any:
    return func.coalesce(new, old)
