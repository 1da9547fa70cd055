"""Desired state on the database: targets read and written, and each device's decision.

The I/O around the pure :mod:`.targets`: :func:`load_plan` reads, in one snapshot, every
target and hold, the devices (their enrolled groups, reported model, liveness), the artifacts
targets name, the newest reconciler command per (device, model) with its job's newest state
(from ``job_events``) and the rollouts devices are in; then asks :func:`~.targets.reconcile`
about each device. The driver acts on it; ``GET /api/devices/{id}/target`` and ``GET
/api/targets/...`` show it. Writes (:func:`set_target`, :func:`set_hold`) record their audit
row, with the operator's reason, in the same transaction.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from edgepack_core.errors import SchemaError
from edgepack_core.protocol.ids import is_valid_id
from sdk.errors import ApiError
from sdk.fleet_server import audit
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database
from sdk.fleet_server.rollouts import TERMINAL
from sdk.fleet_server.targets import (
    ABSENT,
    DEVICE,
    FLEET,
    GROUP,
    NO_TARGET,
    ArtifactInfo,
    Decision,
    Effective,
    LastCommand,
    Rejection,
    Reported,
    Running,
    Target,
    effective_target,
    marked_bad,
    matches,
    reconcile,
)

CHUNK = 500  # ids per IN (...) clause
MAX_MODELS = 16  # entries one target request may set
MAX_REASON = 2000


@dataclass(frozen=True)
class Scopes:
    """Every target and hold in the database."""

    fleet: Target = NO_TARGET
    groups: Mapping[str, Target] = field(default_factory=dict)
    devices: Mapping[str, Target] = field(default_factory=dict)


@dataclass(frozen=True)
class View:
    """When, and by which rules, decisions are read: the time, how long a silent device
    stays online, a command's lifetime."""

    now: float
    silence_s: float = 60.0
    command_ttl_s: float = 24 * 3600.0


@dataclass(frozen=True)
class DevicePlan:
    """One device: its groups, effective target, reported state and the decision."""

    device: str
    groups: tuple[str, ...]
    effective: Effective
    reported: Reported
    decision: Decision


def _chunks(items: Sequence[str]) -> Iterable[list[str]]:
    for start in range(0, len(items), CHUNK):
        yield list(items[start:start + CHUNK])


def load_scopes(connection: Connection) -> Scopes:
    entries: dict[tuple[str, str], dict[str, str]] = {}
    revisions: dict[tuple[str, str], dict[str, int]] = {}
    set_at: dict[tuple[str, str], dict[str, float]] = {}
    for row in connection.execute(select(tables.target_entries)).mappings():
        key = (row["scope"], row["name"])
        entries.setdefault(key, {})[row["model"]] = row["artifact"]
        revisions.setdefault(key, {})[row["model"]] = row["revision"]
        set_at.setdefault(key, {})[row["model"]] = row["set_at"]
    held = {(row.scope, row.name) for row in connection.execute(select(tables.target_holds))}
    targets = {key: Target(entries.get(key, {}), key in held, revisions.get(key, {}), set_at.get(key, {}))
               for key in set(entries) | held}
    return Scopes(fleet=targets.get((FLEET, ""), NO_TARGET),
                  groups={name: t for (scope, name), t in targets.items() if scope == GROUP},
                  devices={name: t for (scope, name), t in targets.items() if scope == DEVICE})


def _select_for(connection: Connection, query: Any, column: Any, devices: Sequence[str] | None) -> Iterable[Any]:
    """The rows of ``query`` for ``devices`` (``column IN`` chunks), or for every device (None:
    one plain query, what the driver's round over the whole fleet asks)."""
    if devices is None:
        yield from connection.execute(query)
        return
    for part in _chunks(devices):
        yield from connection.execute(query.where(column.in_(part)))


def _artifacts(connection: Connection, shas: set[str]) -> dict[str, ArtifactInfo]:
    found: dict[str, ArtifactInfo] = {}
    a, bad = tables.artifacts, tables.artifact_bad
    for part in _chunks(sorted(shas - {ABSENT})):
        for row in connection.execute(select(a.c.sha256, a.c.name, a.c.version, a.c.model_sha256, bad.c.reason)
                                      .select_from(a.outerjoin(bad, bad.c.sha256 == a.c.sha256))
                                      .where(a.c.sha256.in_(part))):
            found[row.sha256] = ArtifactInfo(row.sha256, row.name, row.version, row.model_sha256, row.reason)
    return found


def _last_commands(connection: Connection, devices: Sequence[str] | None) -> dict[str, dict[str, LastCommand]]:
    """Device -> model -> the newest reconciler command, with its job's newest state."""
    tc, events = tables.target_commands, tables.job_events
    newest: dict[tuple[str, str], Any] = {}
    for found in _select_for(connection, select(tc), tc.c.device, devices):
        row = found._mapping
        key = (row["device"], row["model"])
        if key not in newest or (row["created_at"], row["attempt"]) > (newest[key]["created_at"],
                                                                       newest[key]["attempt"]):
            newest[key] = row
    states: dict[str, Any] = {}
    event: Any
    ids = sorted(row["id"] for row in newest.values())
    for part in _chunks(ids):
        for event in connection.execute(select(events).where(events.c.job.in_(part))).mappings():
            seen = states.get(event["job"])
            if seen is None or (event["final"], event["ts"]) > (seen["final"], seen["ts"]):
                states[event["job"]] = event
    out: dict[str, dict[str, LastCommand]] = {}
    for (device, model), row in newest.items():
        event = states.get(row["id"])
        out.setdefault(device, {})[model] = LastCommand(
            row["id"], row["artifact"], row["source"], row["revision"], row["attempt"], row["created_at"],
            state=event["state"] if event is not None else "sent", final=bool(event and event["final"]),
            reason=event["reason"] if event is not None else "",
            final_at=event["received_at"] if event is not None and event["final"] else None)
    return out


def _busy(connection: Connection, devices: Sequence[str] | None) -> dict[str, str]:
    """Device -> the unfinished rollout it is in (its job not final yet)."""
    rd, ro = tables.rollout_devices, tables.rollouts
    query = select(rd.c.device, rd.c.rollout_id).select_from(rd.join(ro, ro.c.id == rd.c.rollout_id)) \
        .where(ro.c.state.not_in(sorted(TERMINAL)), rd.c.final.is_(False))
    return {device: f"rollout {rollout}" for device, rollout in _select_for(connection, query, rd.c.device, devices)}


def _devices(connection: Connection, only: str | None, group: str | None) -> list[Any]:
    d, dg = tables.devices, tables.device_groups
    query = select(d.c.id, d.c.status, d.c.status_reason, d.c.last_seen, d.c.state_heard, d.c.model_name,
                   d.c.model_version, d.c.model_sha256).order_by(d.c.id)
    if only is not None:
        query = query.where(d.c.id == only)
    if group is not None:
        query = query.where(d.c.id.in_(select(dg.c.device).where(dg.c.group_name == group)))
    return list(connection.execute(query))


def _groups_of(connection: Connection, devices: Sequence[str] | None) -> dict[str, tuple[str, ...]]:
    dg = tables.device_groups
    out: dict[str, list[str]] = {}
    for device, group in _select_for(connection, select(dg.c.device, dg.c.group_name), dg.c.device, devices):
        out.setdefault(device, []).append(group)
    return {device: tuple(sorted(groups)) for device, groups in out.items()}


def _rejections(connection: Connection, devices: Sequence[str] | None) -> dict[str, dict[str, Rejection]]:
    """Device -> artifact sha256 -> the device's reported rejection of it."""
    table = tables.device_rejected
    out: dict[str, dict[str, Rejection]] = {}
    for row in _select_for(connection, select(table), table.c.device, devices):
        out.setdefault(row.device, {})[row.sha256] = Rejection(row.stage, row.reason, row.heard_at)
    return out


def _models_of(connection: Connection, devices: Sequence[str] | None) -> dict[str, dict[str, Running]]:
    """Device -> model name -> what it runs, for devices that listed their models."""
    table = tables.device_models
    out: dict[str, dict[str, Running]] = {}
    for row in _select_for(connection, select(table), table.c.device, devices):
        out.setdefault(row.device, {})[row.name] = Running(row.version, row.model_sha256)
    return out


def _reported(row: Any, view: View, rejected: Mapping[str, Rejection],
              listed: Mapping[str, Running] | None = None) -> Reported:
    online = row.status == "online" and row.last_seen is not None and view.now - row.last_seen <= view.silence_s
    reason = row.status_reason or ("" if online or row.status != "online"
                                   else f"silent for over {view.silence_s:g} s")
    models = dict(listed) if listed else \
        ({row.model_name: Running(row.model_version, row.model_sha256)} if row.model_name else {})
    return Reported(online=online, models=models, status_reason=reason, heard_at=row.state_heard, rejected=rejected,
                    several=len(models) > 1, lists_models=listed is not None)


def load_plan(connection: Connection, view: View, *, device: str | None = None, group: str | None = None,
              available: Mapping[str, bool] | None = None) -> list[DevicePlan]:
    """Every (or one, or one group's) known device's decision, from one snapshot.
    ``available``: artifact sha256 -> whether this server can serve it (the driver's check)."""
    scopes = load_scopes(connection)
    rows = _devices(connection, device, group)
    ids: list[str] | None = None if device is None and group is None else [row.id for row in rows]
    groups = _groups_of(connection, ids)
    named = {t for target in (scopes.fleet, *scopes.groups.values(), *scopes.devices.values())
             for t in target.models.values()}
    artifacts = _artifacts(connection, named)
    if available is not None:
        artifacts = {sha: info for sha, info in artifacts.items() if available.get(sha, True)}
    last = _last_commands(connection, ids)
    busy = {**_staging(connection, ids), **_busy(connection, ids)}
    rejections = _rejections(connection, ids)
    listed = _models_of(connection, ids)
    plans = []
    shared: dict[tuple[str, ...], Effective] = {}  # devices without their own target share their groups' one
    for row in rows:
        mine = groups.get(row.id, ())
        own = scopes.devices.get(row.id)
        effective = shared.get(mine) if own is None else None
        if effective is None:
            effective = effective_target(scopes.fleet, {g: scopes.groups[g] for g in mine if g in scopes.groups},
                                         own or NO_TARGET)
            if own is None:
                shared[mine] = effective
        reported = _reported(row, view, rejections.get(row.id, {}), listed.get(row.id))
        decision = reconcile(row.id, effective, reported, artifacts, last.get(row.id, {}), now=view.now,
                             busy=busy.get(row.id, ""), command_ttl_s=view.command_ttl_s)
        plans.append(DevicePlan(row.id, mine, effective, reported, decision))
    return plans


# --------------------------------------------------------------------------- documents


def target_doc(target: Target) -> dict[str, Any]:
    return {"models": dict(target.models), "hold": target.hold}


def plan_doc(plan: DevicePlan) -> dict[str, Any]:
    """``GET /api/devices/{id}/target``: effective target, reported state, difference and why."""
    effective = plan.effective
    decision = plan.decision
    return {
        "device": plan.device,
        "groups": list(plan.groups),
        "effective": {"models": {m: {"artifact": w.artifact, "source": w.source, "revision": w.revision}
                                 for m, w in effective.models.items()},
                      "hold": effective.hold, "held_by": list(effective.held_by),
                      "conflicts": {m: [{"group": g, "artifact": a} for g, a in pairs]
                                    for m, pairs in effective.conflicts.items()}},
        "reported": {"online": plan.reported.online, "status_reason": plan.reported.status_reason,
                     "models": {m: {"version": r.version, "sha256": r.model_sha256}
                                for m, r in plan.reported.models.items()},
                     "rejected": {sha: {"stage": r.stage, "reason": r.reason, "heard_at": r.heard_at}
                                  for sha, r in plan.reported.rejected.items()}},
        "difference": dict(decision.differences),
        "state": decision.kind,  # converged | send (a command goes out at the next round) | wait
        "reason": decision.reason,
    }


def device_target(database: Database, device: str, view: View) -> dict[str, Any]:
    with database.read() as connection:
        plans = load_plan(connection, view, device=device)
    if not plans:
        raise ApiError(404, "not_found", f"no device {device}")
    return plan_doc(plans[0])


def targets_doc(database: Database, view: View, *, group: str | None = None) -> dict[str, Any]:
    """``GET /api/targets`` (every scope, each device's state) or one group's."""
    with database.read() as connection:
        scopes = load_scopes(connection)
        plans = load_plan(connection, view, group=group)
    states = {kind: sum(p.decision.kind == kind for p in plans) for kind in ("converged", "send", "wait")}
    doc: dict[str, Any] = {"fleet": target_doc(scopes.fleet),
                           "groups": {g: target_doc(t) for g, t in sorted(scopes.groups.items())
                                      if group is None or g == group},
                           "devices": {d: target_doc(t) for d, t in sorted(scopes.devices.items())
                                       if group is None or d in {p.device for p in plans}},
                           "summary": states,
                           "states": [{"device": p.device, "state": p.decision.kind, "reason": p.decision.reason,
                                       "difference": dict(p.decision.differences)} for p in plans]}
    return doc


# --------------------------------------------------------------------------- writes


@dataclass(frozen=True)
class TargetChange:
    """A parsed ``PUT /api/targets/...`` body: entries to set (model -> sha256 or "absent"),
    entries to clear (the scope below decides again), the hold when given, the reason."""

    set: Mapping[str, str]
    clear: tuple[str, ...]
    hold: bool | None
    reason: str
    staged: Staged | None = None


@dataclass(frozen=True)
class Staged:
    """A target change made in waves (a rollout's gates; applied when the rollout succeeds)."""

    waves: tuple[float, ...]
    soak_s: float = 0.0
    wave_timeout_s: float = 1800.0
    min_success_share: float = 1.0
    max_error_rate: float | None = None


STAGE_KEYS = ("waves", "soak_s", "wave_timeout_s", "min_success_share", "max_error_rate")


def _staged(body: Mapping[str, Any], change: TargetChange, scope: str) -> Staged | None:
    """The waves of a staged change, or None; 422 when the change cannot be staged."""
    if "waves" not in body:
        if any(key in body for key in STAGE_KEYS):
            raise ApiError(422, "invalid", "waves: gates without waves (give waves to stage the change)")
        return None
    if scope == DEVICE:
        raise ApiError(422, "invalid", "waves: a device target is not staged (give it without waves)")
    if len(change.set) != 1 or change.clear or change.hold is not None or ABSENT in change.set.values():
        raise ApiError(422, "invalid", "waves: a staged change sets exactly one model to an artifact, nothing else")
    return Staged(tuple(float(w) for w in body["waves"]), float(body.get("soak_s", 0.0)),
                  float(body.get("wave_timeout_s", 1800.0)), float(body.get("min_success_share", 1.0)),
                  None if body.get("max_error_rate") is None else float(body["max_error_rate"]))


def parse_change(body: Mapping[str, Any], scope: str = GROUP) -> TargetChange:
    """The body, already validated against :data:`TARGET_REQUEST_SCHEMA`, as a change
    (:class:`SchemaError` naming the field for what the schema cannot say: the API's 400)."""
    models = body.get("models", {})
    if len(models) > MAX_MODELS:
        raise SchemaError("models", f"{len(models)} entries; at most {MAX_MODELS}")
    for model in models:
        if not is_valid_id(model):
            raise SchemaError(f"models.{model[:64]}", "is not a model name (letters, digits, '.', '_', '-'; "
                                                      "at most 64)")
    if not models and "hold" not in body:
        raise ApiError(422, "invalid", "models: nothing to change: give models or hold")
    change = TargetChange(set={m: a for m, a in models.items() if a is not None},
                          clear=tuple(sorted(m for m, a in models.items() if a is None)),
                          hold=body.get("hold"), reason=body.get("reason", ""))
    return replace(change, staged=_staged(body, change, scope))


TARGET_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "models": {"type": "object",
                   "additionalProperties": {"type": ["string", "null"], "pattern": "^([0-9a-f]{64}|absent)$"},
                   "description": "model name -> artifact sha256, \"absent\", or null to clear this scope's entry"},
        "hold": {"type": "boolean", "description": "stop (true) or allow (false) commands to these devices"},
        "reason": {"type": "string", "maxLength": MAX_REASON, "description": "why (kept in the audit)"},
        "waves": {"type": "array", "minItems": 1, "maxItems": 20,
                  "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                  "description": "stage the change: cumulative percentages of the devices that need it, the last "
                                 "100; a rollout moves them and the target changes when it succeeds"},
        "soak_s": {"type": "number", "minimum": 0, "maximum": 7 * 86400},
        "wave_timeout_s": {"type": "number", "minimum": 1, "maximum": 7 * 86400},
        "min_success_share": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "max_error_rate": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    },
}


def _check_artifacts(connection: Connection, change: TargetChange) -> None:
    """Each artifact named must be stored, and be a build of the model it is set for (422)."""
    known = _artifacts(connection, set(change.set.values()))
    for model, sha in sorted(change.set.items()):
        if sha == ABSENT:
            continue
        info = known.get(sha)
        if info is None:
            raise ApiError(422, "invalid", f"models.{model}: no artifact {sha} on this server (upload it first)")
        if info.name != model:
            raise ApiError(422, "invalid", f"models.{model}: artifact {sha[:12]} is model {info.name!r}, "
                                           f"not {model!r}")
        if info.bad is not None:
            raise ApiError(422, "invalid", f"models.{model}: {marked_bad(sha, info.bad)}; clear the mark first: "
                                           f"edgepack artifact good {sha}")


def _scope_exists(connection: Connection, scope: str, name: str) -> None:
    if scope == DEVICE and connection.execute(select(tables.devices.c.id).where(
            tables.devices.c.id == name)).first() is None:
        raise ApiError(404, "not_found", f"no device {name}")


def _write_entry(connection: Connection, key: tuple[str, str, str], artifact: str, revision: int, reason: str,
                 actor: str, now: float) -> None:
    entries = tables.target_entries
    scope, name, model = key
    connection.execute(entries.delete().where(entries.c.scope == scope, entries.c.name == name,
                                              entries.c.model == model))
    connection.execute(entries.insert().values(scope=scope, name=name, model=model, artifact=artifact,
                                               revision=revision, reason=reason, set_by=actor, set_at=now))


# --------------------------------------------------------------------------- staged changes


def staged_devices(database: Database, scope: str, name: str, change: TargetChange) -> list[str]:
    """The devices a staged change must move: those the scope covers (a group's members, or
    the fleet) that do not run the artifact already (they count converged, never failed)."""
    model, sha = next(iter(change.set.items()))
    with database.read() as connection:
        _check_artifacts(connection, change)
        info = _artifacts(connection, {sha})[sha]
        rows = _devices(connection, None, name if scope == GROUP else None)
    return [row.id for row in rows if not (row.model_name == model
                                           and matches(Running(row.model_version, row.model_sha256), info))]


def record_staged(connection: Connection, rollout_id: str, scope: str, name: str, change: TargetChange, *,
                  actor: str, remote: str, now: float) -> None:
    """Inside the rollout's own transaction: the change it carries, audited ``target.stage``."""
    model, sha = next(iter(change.set.items()))
    connection.execute(tables.target_staged.insert().values(
        rollout_id=rollout_id, scope=scope, name=name, model=model, artifact=sha, reason=change.reason,
        set_by=actor, set_at=now, applied_at=None))
    audit.record(connection, actor=actor, action="target.stage", target=f"{scope}:{name}" if name else scope,
                 remote=remote, now=now, detail={"reason": change.reason, "rollout": rollout_id, "set": {model: sha}})


def apply_staged(connection: Connection, rollout_id: str, now: float) -> bool:
    """Its rollout succeeded: write the staged change into the target (a new revision), audited
    ``target.set`` as the operator who staged it. False when the rollout carried none."""
    staged, entries = tables.target_staged, tables.target_entries
    row = connection.execute(select(staged).where(staged.c.rollout_id == rollout_id,
                                                  staged.c.applied_at.is_(None))).mappings().first()
    if row is None:
        return False
    revision = connection.execute(select(entries.c.revision).where(
        entries.c.scope == row["scope"], entries.c.name == row["name"], entries.c.model == row["model"])).scalar()
    _write_entry(connection, (row["scope"], row["name"], row["model"]), row["artifact"], (revision or 0) + 1,
                 row["reason"], row["set_by"], now)
    connection.execute(staged.update().where(staged.c.rollout_id == rollout_id).values(applied_at=now))
    audit.record(connection, actor=row["set_by"], action="target.set", now=now,
                 target=f"{row['scope']}:{row['name']}" if row["name"] else row["scope"],
                 detail={"reason": row["reason"], "set": {row["model"]: row["artifact"]}, "rollout": rollout_id})
    return True


def _staging(connection: Connection, devices: Sequence[str] | None) -> dict[str, str]:
    """Device -> the staged change (its rollout not ended) whose scope covers it: the reconciler
    leaves those devices to the rollout, whatever the old target says."""
    staged, ro, dg = tables.target_staged, tables.rollouts, tables.device_groups
    pending = connection.execute(select(staged.c.rollout_id, staged.c.scope, staged.c.name)
                                 .select_from(staged.join(ro, ro.c.id == staged.c.rollout_id))
                                 .where(staged.c.applied_at.is_(None), ro.c.state.not_in(sorted(TERMINAL)))).all()
    out: dict[str, str] = {}
    for rollout_id, scope, name in pending:
        query = select(dg.c.device).where(dg.c.group_name == name) if scope == GROUP else select(tables.devices.c.id)
        column = dg.c.device if scope == GROUP else tables.devices.c.id
        for (device,) in _select_for(connection, query, column, devices):
            out.setdefault(device, f"staged change (rollout {rollout_id})")
    return out


def set_target(database: Database, scope: str, name: str, change: TargetChange, *, actor: str, remote: str,
               now: float | None = None) -> None:
    """Apply ``change`` to one scope (a set entry's revision goes up by one: a new operator
    decision), audited as ``target.set`` with before, after and the reason."""
    now = time.time() if now is None else now
    entries, holds = tables.target_entries, tables.target_holds
    with database.write() as connection:
        _scope_exists(connection, scope, name)
        _check_artifacts(connection, change)
        mine = (entries.c.scope == scope) & (entries.c.name == name)
        before = {row.model: (row.artifact, row.revision) for row in connection.execute(
            select(entries.c.model, entries.c.artifact, entries.c.revision).where(mine))}
        for model in change.clear:
            connection.execute(entries.delete().where(mine, entries.c.model == model))
        for model, artifact in sorted(change.set.items()):
            _write_entry(connection, (scope, name, model), artifact, before.get(model, ("", 0))[1] + 1,
                         change.reason, actor, now)
        count = connection.execute(select(func.count()).select_from(entries).where(mine)).scalar_one()
        if count > MAX_MODELS:
            raise ApiError(422, "invalid", f"models: the {scope} would hold {count} models; at most {MAX_MODELS}")
        held = (holds.c.scope == scope) & (holds.c.name == name)
        was_held = connection.execute(select(holds.c.scope).where(held)).first() is not None
        if change.hold is not None and change.hold != was_held:
            connection.execute(holds.delete().where(held))
            if change.hold:
                connection.execute(holds.insert().values(scope=scope, name=name, reason=change.reason,
                                                         set_by=actor, set_at=now))
        audit.record(connection, actor=actor, action="target.set", target=f"{scope}:{name}" if name else scope,
                     remote=remote, now=now,
                     detail={"reason": change.reason, "before": {m: a for m, (a, _r) in before.items()},
                             "set": dict(change.set), "clear": list(change.clear), "hold": change.hold,
                             "was_held": was_held})


def scope_doc(database: Database, scope: str, name: str) -> dict[str, Any]:
    """One scope's target as stored, each entry with who set it, when and why."""
    entries, holds = tables.target_entries, tables.target_holds
    with database.read() as connection:
        rows = connection.execute(select(entries).where(entries.c.scope == scope, entries.c.name == name)
                                  .order_by(entries.c.model)).mappings().all()
        hold = connection.execute(select(holds).where(holds.c.scope == scope, holds.c.name == name)) \
            .mappings().first()
        staged = connection.execute(select(tables.target_staged).where(
            tables.target_staged.c.scope == scope, tables.target_staged.c.name == name,
            tables.target_staged.c.applied_at.is_(None)).order_by(tables.target_staged.c.set_at)).mappings().all()
    return {"scope": scope, "name": name or None,
            "models": {r["model"]: {"artifact": r["artifact"], "revision": r["revision"], "reason": r["reason"],
                                    "set_by": r["set_by"], "set_at": r["set_at"]} for r in rows},
            "hold": None if hold is None else {"reason": hold["reason"], "set_by": hold["set_by"],
                                               "set_at": hold["set_at"]},
            "staged": [{"rollout": r["rollout_id"], "model": r["model"], "artifact": r["artifact"],
                        "reason": r["reason"], "set_by": r["set_by"], "set_at": r["set_at"]} for r in staged]}
