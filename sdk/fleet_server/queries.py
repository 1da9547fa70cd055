"""The API's reads and writes on the tables: rollouts and artifacts (the devices' are in
:mod:`.device_queries`, re-exported here under their old import path).

Each function takes plain values (already bounded by :mod:`.api`) and returns the JSON
documents the API sends, so their shapes are defined in one place (and described in
:mod:`.openapi`). Writes record their audit row in the same transaction.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from edgepack_core.protocol.commands import field_schema
from edgepack_core.protocol.ids import ID_PATTERN
from sdk.deploy.policy import RolloutError, plan_wave_shares, planned_shares
from sdk.errors import ApiError
from sdk.fleet_server import audit, bad_releases
from sdk.fleet_server import db as tables
from sdk.fleet_server.artifacts import StoredArtifact
from sdk.fleet_server.db import Database
from sdk.fleet_server.device_queries import (
    GROUPS_REQUEST_SCHEMA,
    MAX_DEAD_LETTER_PAGE,
    MAX_DEVICES_PAGE,
    MAX_GROUPS,
    MAX_ROW_ID,
    DeviceFilter,
    dead_letters,
    decommission_device,
    decommissioned_devices,
    devices_online_by,
    enroll_device,
    get_device,
    is_online,
    list_devices,
    list_devices_json,
    set_device_groups,
    telemetry,
)
from sdk.fleet_server.driver import rollout_of, save_rollout
from sdk.fleet_server.rollouts import (
    NOT_SENT,
    PENDING,
    Gates,
    check_gates,
    command_id,
    new_rollout_id,
    transition,
)

__all__ = [  # the devices' names are re-exported: api.py, openapi.py, server.py and the tests import them here
    "ACTIONS", "GROUPS_REQUEST_SCHEMA", "MAX_DEAD_LETTER_PAGE", "MAX_DEVICES_PAGE", "MAX_GATE_S", "MAX_GROUPS",
    "MAX_ROLLOUT_DEVICES", "MAX_ROW_ID", "MAX_TRANSITIONS", "PAST_TENSE", "ROLLOUT_REQUEST_SCHEMA", "SHA256_PATTERN",
    "DeviceFilter", "RolloutRequest", "artifact_doc", "create_rollout", "dead_letters", "decommission_device",
    "decommissioned_devices", "devices_online_by", "enroll_device", "get_artifact", "get_device", "get_rollout",
    "is_online", "list_artifacts", "list_devices", "list_devices_json", "list_rollouts", "rollout_action",
    "rollout_state_counts", "rollout_summary", "rollout_transitions", "save_artifact", "set_device_groups",
    "telemetry",
]

MAX_ROLLOUT_DEVICES = 100_000
SHA256_PATTERN = "^[0-9a-f]{64}$"
MAX_GATE_S = 7 * 86400  # soak_s and wave_timeout_s (rollouts.check_gates)


def _signed_field(name: str, description: str) -> dict[str, Any]:
    """A rollout option signed into every deploy command: the deploy command schema's own bounds
    (what a device accepts), null allowed (the device's default). A value a device would refuse
    is refused when the rollout is created, naming the bound, not when its commands are built."""
    device_rule = field_schema("deploy", name)
    kinds = device_rule.pop("type")
    return {**device_rule, "type": [*([kinds] if isinstance(kinds, str) else kinds), "null"],
            "description": description}


ROLLOUT_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["artifact", "waves"],
    "properties": {
        "artifact": {"type": "string", "pattern": SHA256_PATTERN, "description": "sha256 of an uploaded artifact"},
        "group": {"type": "string", "pattern": ID_PATTERN, "maxLength": 64,
                  "description": "every device of this group that is online now (or give devices)"},
        "devices": {"type": "array", "minItems": 1, "maxItems": MAX_ROLLOUT_DEVICES,
                    "items": {"type": "string", "pattern": ID_PATTERN, "maxLength": 64}},
        "waves": {"type": "array", "minItems": 1, "maxItems": 20,
                  "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                  "description": "cumulative percentages of the targets, the last 100 (e.g. [5, 25, 100])"},
        "soak_s": {"type": "number", "minimum": 0, "maximum": MAX_GATE_S,
                   "description": "seconds a passed wave is watched before the next"},
        "min_success_share": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                              "description": "share of a wave that must end active (default 1)"},
        "wave_timeout_s": {"type": "number", "minimum": 1, "maximum": MAX_GATE_S,
                           "description": "a device without a final answer after this long counts as failed"},
        "max_error_rate": {"type": ["number", "null"], "minimum": 0, "maximum": 1,
                           "description": "during the soak, the largest error share of a device's inferences"},
        "rollback_on_failure": {"type": "boolean",
                                "description": "a failed wave rolls back (or cancels) what the rollout updated"},
        "health_window_s": _signed_field("health_window_s", "the devices' health window in seconds (signed into "
                                                            "the command; the deploy command's bounds)"),
        "force_downgrade": {"type": "boolean"},
        "allow_contract_change": {"type": "boolean"},
        "exclude_offline": {"type": "boolean",
                            "description": "with devices: leave out those offline now (a group takes only online "
                                           "devices anyway)"},
        "reason": {"type": "string", "maxLength": 500,
                   "description": "why (kept in the rollout's transitions and the audit)"},
    },
}


# --------------------------------------------------------------------------- artifacts


def artifact_doc(row: Any, url: str) -> dict[str, Any]:
    bad = None if row.get("bad_at") is None else {"at": row["bad_at"], "actor": row["bad_actor"],
                                                  "reason": row["bad_reason"]}
    return {"sha256": row["sha256"], "name": row["name"], "version": row["version"], "size": row["size"],
            "key_id": row["key_id"], "targets": json.loads(row["targets"]), "created_at": row["created_at"],
            "created_by": row["created_by"], "url": url, "bad": bad}


def _artifact_rows() -> Any:
    """Artifacts with their bad mark (``bad_*`` columns, None when not marked)."""
    a, bad = tables.artifacts, tables.artifact_bad
    return select(a, bad.c.at.label("bad_at"), bad.c.actor.label("bad_actor"), bad.c.reason.label("bad_reason")) \
        .select_from(a.outerjoin(bad, bad.c.sha256 == a.c.sha256))


def save_artifact(database: Database, stored: StoredArtifact, *, actor: str, remote: str) -> bool:
    """Record an uploaded artifact (and the upload in the audit table); False if it was known."""
    with database.write() as connection:
        created = database.insert_new(connection, tables.artifacts, stored.to_row(actor=actor, now=time.time()))
        audit.record(connection, actor=actor, action="artifact.upload", target=stored.sha256, remote=remote,
                     detail={"name": stored.name, "version": stored.version, "size": stored.size,
                             "new": created})
    return created


def list_artifacts(database: Database) -> list[Any]:
    with database.read() as connection:
        return list(connection.execute(_artifact_rows().order_by(tables.artifacts.c.created_at.desc()))
                    .mappings().all())


def get_artifact(database: Database, sha256: str) -> Any:
    with database.read() as connection:
        row = connection.execute(_artifact_rows().where(tables.artifacts.c.sha256 == sha256)).mappings().first()
    if row is None:
        raise ApiError(404, "not_found", f"no artifact {sha256}")
    return row


# --------------------------------------------------------------------------- rollouts


@dataclass(frozen=True)
class RolloutRequest:
    artifact: str
    waves: list[float]
    group: str | None
    devices: list[str] | None
    gates: Gates
    health_window_s: float | None
    force_downgrade: bool
    allow_contract_change: bool
    reason: str = ""
    exclude_offline: bool = False

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RolloutRequest:
        """After schema validation: one of group/devices, gates bounded."""
        if ("group" in body) == ("devices" in body):
            raise ApiError(400, "invalid", "give exactly one of group or devices")
        gates = check_gates(Gates(
            min_success_share=float(body.get("min_success_share", 1.0)), soak_s=float(body.get("soak_s", 0.0)),
            wave_timeout_s=float(body.get("wave_timeout_s", 1800.0)),
            max_error_rate=None if body.get("max_error_rate") is None else float(body["max_error_rate"]),
            rollback_on_failure=bool(body.get("rollback_on_failure", False))))
        window = body.get("health_window_s")
        return cls(artifact=body["artifact"], waves=[float(w) for w in body["waves"]], group=body.get("group"),
                   devices=list(dict.fromkeys(body["devices"])) if "devices" in body else None, gates=gates,
                   health_window_s=None if window is None else float(window),
                   force_downgrade=bool(body.get("force_downgrade", False)),
                   allow_contract_change=bool(body.get("allow_contract_change", False)),
                   reason=str(body.get("reason", "")), exclude_offline=bool(body.get("exclude_offline", False)))


def _targets(connection: Connection, request: RolloutRequest, now: float, silence_s: float) -> list[str]:
    devices = tables.devices
    if request.group is not None:
        rows = connection.execute(
            select(devices.c.id, devices.c.status, devices.c.last_seen)
            .where(devices.c.id.in_(select(tables.device_groups.c.device)
                                    .where(tables.device_groups.c.group_name == request.group)))
            .order_by(devices.c.id)).all()
        targets = [r.id for r in rows if is_online(r.status, r.last_seen, now, silence_s)]
        if not targets:
            raise ApiError(422, "invalid", f"group {request.group}: no online device")
        return targets
    wanted = request.devices or []
    known: set[str] = set()
    for start in range(0, len(wanted), 500):
        known.update(connection.execute(select(devices.c.id).where(devices.c.id.in_(wanted[start:start + 500])))
                     .scalars())
    unknown = [d for d in wanted if d not in known]
    if unknown:
        raise ApiError(422, "invalid", f"unknown device(s): {', '.join(unknown[:5])}"
                                       f"{f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''}")
    return _online_only(connection, wanted, now, silence_s) if request.exclude_offline else wanted


def _online_only(connection: Connection, wanted: list[str], now: float, silence_s: float) -> list[str]:
    """``exclude_offline``: the listed devices online now, in order (422 when none is)."""
    devices = tables.devices
    online: set[str] = set()
    for start in range(0, len(wanted), 500):
        online.update(r.id for r in connection.execute(
            select(devices.c.id, devices.c.status, devices.c.last_seen)
            .where(devices.c.id.in_(wanted[start:start + 500])))
            if is_online(r.status, r.last_seen, now, silence_s))
    kept = [d for d in wanted if d in online]
    if not kept:
        raise ApiError(422, "invalid", "exclude_offline: every listed device is offline")
    return kept


def create_rollout(database: Database, request: RolloutRequest, *, actor: str, remote: str, silence_s: float,
                   now: float | None = None, also: Callable[[Connection, str], None] | None = None) -> str:
    """Plan and store a rollout (``pending``: the driver starts it); returns its id. ``also``
    writes what the rollout carries in its transaction (a staged target change)."""
    now = time.time() if now is None else now
    rollout_id = new_rollout_id(os.urandom(8))
    with database.write() as connection:
        artifact = connection.execute(select(tables.artifacts).where(
            tables.artifacts.c.sha256 == request.artifact)).mappings().first()
        if artifact is None:
            raise ApiError(404, "not_found", f"no artifact {request.artifact} (upload it first)")
        bad_releases.refuse_if_bad(connection, request.artifact, "artifact")
        try:
            waves = plan_wave_shares(_targets(connection, request, now, silence_s), request.waves)
        except RolloutError as err:  # the shares' order: beyond what a schema can say
            raise ApiError(422, "invalid", str(err)) from err
        gates = request.gates
        connection.execute(tables.rollouts.insert().values(
            id=rollout_id, artifact_sha256=request.artifact, name=artifact["name"], version=artifact["version"],
            target_group=request.group, state=PENDING, wave=0,
            waves=json.dumps(planned_shares(sum(len(w) for w in waves), request.waves)),
            wave_count=len(waves), min_success_share=gates.min_success_share, soak_s=gates.soak_s,
            wave_timeout_s=gates.wave_timeout_s, max_error_rate=gates.max_error_rate,
            rollback_on_failure=gates.rollback_on_failure, health_window_s=request.health_window_s,
            force_downgrade=request.force_downgrade, allow_contract_change=request.allow_contract_change,
            reason=request.reason, created_at=now, created_by=actor, updated_at=now, revision=0))
        connection.execute(tables.rollout_transitions.insert().values(
            rollout_id=rollout_id, at=now, event="create", from_state="", to_state=PENDING, wave=1, actor=actor,
            reason=request.reason))
        connection.execute(tables.rollout_devices.insert(), [
            {"rollout_id": rollout_id, "device": device, "wave": index, "state": NOT_SENT, "final": False,
             "reason": "", "command_id": command_id(rollout_id, "deploy", index, device)}
            for index, wave in enumerate(waves) for device in wave])
        if also is not None:
            also(connection, rollout_id)
        audit.record(connection, actor=actor, action="rollout.create", target=rollout_id, remote=remote, now=now,
                     detail={"artifact": request.artifact, "name": artifact["name"], "version": artifact["version"],
                             "group": request.group, "devices": sum(len(w) for w in waves),
                             "waves": request.waves, "gates": gates.__dict__, "reason": request.reason,
                             "command": {"kind": "deploy", "artifact": request.artifact,
                                         "target": {"group": request.group} if request.group else
                                         {"devices": sum(len(w) for w in waves)},
                                         "force_downgrade": request.force_downgrade}})
    return rollout_id


ACTIONS = {"pause": "pause", "resume": "resume", "abort": "abort"}
PAST_TENSE = {"pause": "paused", "resume": "resumed", "abort": "aborted"}
"""The default reason of an action without one: ``aborted by admin`` (not ``abortd``)."""


def rollout_action(database: Database, rollout_id: str, action: str, *, actor: str, remote: str,
                   reason: str = "") -> None:
    """Pause, resume or abort through the state machine (409 for a transition it refuses).
    A driver that changed the rollout in between makes the write retry on the new revision."""
    if action not in ACTIONS:
        raise ApiError(404, "not_found", f"no rollout action {action!r} (pause, resume, abort)")
    for _ in range(20):
        now = time.time()
        with database.write() as connection:
            row = connection.execute(select(tables.rollouts).where(tables.rollouts.c.id == rollout_id)) \
                .mappings().first()
            if row is None:
                raise ApiError(404, "not_found", f"no rollout {rollout_id}")
            if action == "resume":
                bad_releases.refuse_resume(connection, row["artifact_sha256"])
            why = reason or f"{PAST_TENSE[action]} by {actor}"
            after = transition(rollout_of(row), ACTIONS[action], now, why)  # type: ignore[arg-type]
            if save_rollout(connection, row, after, now, event=ACTIONS[action], actor=actor, reason=why):
                audit.record(connection, actor=actor, action=f"rollout.{action}", target=rollout_id, remote=remote,
                             now=now, detail={"from": row["state"], "to": after.state, "wave": row["wave"] + 1,
                                              "wave_count": row["wave_count"], "reason": why})
                return
    raise ApiError(409, "conflict", f"rollout {rollout_id} kept changing; try again")


def _wave_docs(row: Any, devices: Sequence[Any]) -> list[dict[str, Any]]:
    shares = json.loads(row["waves"])
    docs = []
    for index in range(row["wave_count"]):
        members = [d for d in devices if d["wave"] == index]
        states = Counter("active" if d["state"] == "active" and d["final"] else
                         "failed" if d["final"] else "not_sent" if d["state"] == NOT_SENT else "in_progress"
                         for d in members)
        if index < row["wave"] or (index == row["wave"] and row["state"] == "succeeded"):
            phase = "passed"
        elif index > row["wave"]:
            phase = "waiting"
        elif row["state"] in ("failed", "aborted", "paused", "pending"):
            phase = row["state"]
        else:
            phase = "soaking" if row["soak_started_at"] is not None else "running"
        docs.append({"index": index, "number": index + 1, "percent": shares[index] if index < len(shares) else None,
                     "devices": len(members), "active": states["active"], "failed": states["failed"],
                     "in_progress": states["in_progress"], "not_sent": states["not_sent"], "state": phase})
    return docs


def _device_docs(devices: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"device": d["device"], "wave": d["wave"], "wave_number": d["wave"] + 1, "command_id": d["command_id"],
             "state": d["state"],
             "final": d["final"], "reason": d["reason"], "sent_at": d["sent_at"], "updated_at": d["updated_at"],
             "undo": None if d["undo_command_id"] is None else {
                 "kind": d["undo_kind"], "command_id": d["undo_command_id"], "state": d["undo_state"],
                 "reason": d["undo_reason"]}}
            for d in devices]


def rollout_summary(row: Any) -> dict[str, Any]:
    return {"id": row["id"], "state": row["state"], "wave": row["wave"], "wave_number": row["wave"] + 1,
            "wave_count": row["wave_count"],
            "artifact": {"sha256": row["artifact_sha256"], "name": row["name"], "version": row["version"]},
            "target": {"group": row["target_group"]} if row["target_group"] else {"devices": None},
            "reason": row["reason"], "created_at": row["created_at"], "created_by": row["created_by"],
            "updated_at": row["updated_at"], "started_at": row["started_at"], "finished_at": row["finished_at"]}


def get_rollout(database: Database, rollout_id: str) -> dict[str, Any]:
    """``GET /api/rollouts/{id}``: the rollout, its waves and every device's job."""
    rd = tables.rollout_devices
    with database.read() as connection:
        row = connection.execute(select(tables.rollouts).where(tables.rollouts.c.id == rollout_id)) \
            .mappings().first()
        if row is None:
            raise ApiError(404, "not_found", f"no rollout {rollout_id}")
        devices = connection.execute(select(rd).where(rd.c.rollout_id == rollout_id).order_by(rd.c.wave, rd.c.device)) \
            .mappings().all()
        transitions = rollout_transitions(connection, rollout_id)
    summary = rollout_summary(row)
    if not row["target_group"]:
        summary["target"] = {"devices": [d["device"] for d in devices]}
    counts = Counter("active" if d["state"] == "active" and d["final"] else
                     "failed" if d["final"] else "not_sent" if d["state"] == NOT_SENT else "in_progress"
                     for d in devices)
    return {**summary,
            "waves": _wave_docs(row, devices),
            "gates": {"min_success_share": row["min_success_share"], "soak_s": row["soak_s"],
                      "wave_timeout_s": row["wave_timeout_s"], "max_error_rate": row["max_error_rate"],
                      "rollback_on_failure": row["rollback_on_failure"]},
            "options": {"health_window_s": row["health_window_s"], "force_downgrade": row["force_downgrade"],
                        "allow_contract_change": row["allow_contract_change"]},
            "wave_started_at": row["wave_started_at"], "soak_started_at": row["soak_started_at"],
            "paused_at": row["paused_at"],
            "counts": {"devices": len(devices), "active": counts["active"], "failed": counts["failed"],
                       "in_progress": counts["in_progress"], "not_sent": counts["not_sent"]},
            "transitions": transitions,
            "devices": _device_docs(devices)}


MAX_TRANSITIONS = 1000
"""Transitions a rollout document lists at most (the newest; a rollout has a few per wave)."""


def rollout_transitions(connection: Connection, rollout_id: str) -> list[dict[str, Any]]:
    """Every transition of a rollout, oldest first (the newest :data:`MAX_TRANSITIONS`), waves 1-based."""
    table = tables.rollout_transitions
    rows = connection.execute(select(table).where(table.c.rollout_id == rollout_id).order_by(table.c.id.desc())
                              .limit(MAX_TRANSITIONS)).mappings().all()
    return [{"at": r["at"], "event": r["event"], "from": r["from_state"], "to": r["to_state"], "wave": r["wave"],
             "actor": r["actor"], "reason": r["reason"]} for r in reversed(rows)]


def list_rollouts(database: Database, *, state: str | None, limit: int) -> list[dict[str, Any]]:
    query = select(tables.rollouts).order_by(tables.rollouts.c.created_at.desc()).limit(limit)
    if state is not None:
        query = query.where(tables.rollouts.c.state == state)
    with database.read() as connection:
        return [rollout_summary(row) for row in connection.execute(query).mappings()]


def rollout_state_counts(database: Database) -> dict[str, int]:
    with database.read() as connection:
        return dict(connection.execute(select(tables.rollouts.c.state, func.count()).group_by(
            tables.rollouts.c.state)).all())
