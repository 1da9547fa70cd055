"""Per-device actions (``POST /api/devices/{id}/actions/{action}``): rollback to the last good
model, re-run the target, ping, hold, release.

Each action is one operator decision, audited as ``device.<action>`` with the operator's reason
and what it did (the command id it sent, the target revision it set). The commands (rollback,
ping) are built, signed with the server's operator key and recorded in the ``commands`` table
by the driver's own code (:meth:`~.driver.Driver.record_command`), so they are published,
acknowledged and, after a crash before the broker's PUBACK, resent exactly like a rollout's;
the device's job events come back through the normal ingest (``GET /api/devices/{id}/history``).
Hold, release and re-run go through the targets code (:func:`.desired.set_target`): the
reconciler, not this module, sends what a target change implies.

A rollback of a model the device's effective target names also holds the device (its own
target's hold): otherwise the reconciler would send the target's artifact, the one just rolled
back, again at its next round. Release the hold once the target names a good artifact.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import select
from sqlalchemy.engine import Connection

from edgepack_core import faults
from edgepack_core.errors import SchemaError
from edgepack_core.protocol.commands import build_command
from edgepack_core.protocol.ids import ID_PATTERN, is_valid_id
from sdk.errors import ApiError
from sdk.fleet_server import audit, desired
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database
from sdk.fleet_server.targets import ABSENT, DEVICE

ACTIONS = ("rollback", "rerun", "ping", "hold", "release")
MAX_REASON = 500

ACTION_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "reason": {"type": "string", "maxLength": MAX_REASON, "description": "why (kept in the audit)"},
        "model": {
            "type": "string",
            "maxLength": 64,
            "pattern": ID_PATTERN,
            "description": "rollback only: the model to roll back (default: the one the device serves)",
        },
    },
}


class CommandSink(Protocol):
    """What sends a command: the driver (signs, records in ``commands``, publishes)."""

    def record_command(
        self, connection: Connection, device: str, kind: str, command: dict[str, Any], now: float
    ) -> dict[str, Any] | None: ...

    def publish(self, commands: list[dict[str, Any]], now: float) -> None: ...


@dataclass(frozen=True)
class ActionRequest:
    """One parsed action: which, why, and (rollback) the model named."""

    action: str
    reason: str = ""
    model: str | None = None


def parse_action(action: str, body: Mapping[str, Any]) -> ActionRequest:
    """The action and its body (already validated against :data:`ACTION_REQUEST_SCHEMA`);
    :class:`SchemaError` naming the field for what the schema cannot say. Pure."""
    if action not in ACTIONS:
        raise SchemaError("action", f"{action[:64]!r} is not one of {', '.join(ACTIONS)}")
    model = body.get("model")
    if model is not None and action != "rollback":  # well-formed, but not for this action: a 422
        raise ApiError(422, "invalid", f"model: only a rollback names a model, not {action}")
    if model is not None and not is_valid_id(model):
        raise SchemaError("model", f"{model[:64]!r} is not a model name")
    return ActionRequest(action, body.get("reason", ""), model)


@dataclass(frozen=True)
class Caller:
    """Who asks, from where, and the server's rules for reading targets."""

    actor: str
    remote: str
    view: desired.View


def _device_row(connection: Connection, device: str) -> Any:
    d = tables.devices
    row = connection.execute(select(d.c.id, d.c.model_name, d.c.model_version).where(d.c.id == device)).first()
    if row is None:
        raise ApiError(404, "not_found", f"no device {device}")
    return row


def _plan(database: Database, device: str, view: desired.View) -> desired.DevicePlan:
    with database.read() as connection:
        plans = desired.load_plan(connection, view, device=device)
    if not plans:
        raise ApiError(404, "not_found", f"no device {device}")
    return plans[0]


def _served(connection: Connection, row: Any) -> dict[str, str]:
    """Model name -> version the device's newest state lists (every model of an agent holding
    several; else the one model of its state)."""
    m = tables.device_models
    listed = {
        name: version
        for name, version in connection.execute(select(m.c.name, m.c.version).where(m.c.device == row.id))
        if version
    }
    if listed:
        return listed
    return {row.model_name: row.model_version} if row.model_name and row.model_version else {}


def _from_version(connection: Connection, row: Any, model: str | None) -> dict[str, str]:
    """What a rollback undoes: the model the device reports serving, the one named when it
    serves several (409 when it serves none, not the one named, or several and none named)."""
    served = _served(connection, row)
    if not served:
        raise ApiError(409, "conflict", f"{row.id} reports no model it serves: nothing to roll back")
    if model is None and len(served) > 1:
        raise ApiError(409, "conflict", f"model: {row.id} serves {', '.join(sorted(served))}; name the model")
    name = model if model is not None else next(iter(served))
    if name not in served:
        raise ApiError(409, "conflict", f"model: {row.id} serves {', '.join(sorted(served))}, not {name}")
    return {"name": name, "version": served[name]}


def _send(
    database: Database, sink: CommandSink, device: str, request: ActionRequest, caller: Caller, ttl_s: float, now: float
) -> dict[str, Any]:
    """Build, sign, record and publish one command, with its ``device.<action>`` audit row in
    the same transaction."""
    with database.write() as connection:
        row = _device_row(connection, device)
        fields: dict[str, Any] = (
            {"from_version": _from_version(connection, row, request.model)} if request.action == "rollback" else {}
        )
        command = build_command(request.action, device=device, ttl_s=ttl_s, now=now, **fields)
        recorded = sink.record_command(connection, device, request.action, command, now)
        _audit_in(connection, device, request, caller, now, {"command": command["id"], **fields})
    faults.point("fleet-recorded-action")  # a crash here: the leader resends it (the driver's resend)
    if recorded is not None:
        sink.publish([recorded], now)
    return {"device": device, "action": request.action, "command": command["id"], "reason": request.reason, **fields}


def _set_hold(database: Database, device: str, hold: bool, reason: str, caller: Caller, now: float) -> None:
    desired.set_target(
        database,
        DEVICE,
        device,
        desired.TargetChange(set={}, clear=(), hold=hold, reason=reason),
        actor=caller.actor,
        remote=caller.remote,
        now=now,
    )


def _audit_in(
    connection: Connection, device: str, request: ActionRequest, caller: Caller, now: float, detail: Mapping[str, Any]
) -> None:
    """The action's ``device.<action>`` row, with the operator's reason, in the caller's transaction."""
    audit.record(
        connection,
        actor=caller.actor,
        action=f"device.{request.action}",
        target=device,
        remote=caller.remote,
        now=now,
        detail={"reason": request.reason, **detail},
    )


def _audit(
    database: Database, device: str, request: ActionRequest, caller: Caller, now: float, detail: Mapping[str, Any]
) -> None:
    with database.write() as connection:
        _audit_in(connection, device, request, caller, now, detail)


def _rollback(
    database: Database, sink: CommandSink, device: str, request: ActionRequest, caller: Caller, ttl_s: float, now: float
) -> dict[str, Any]:
    plan = _plan(database, device, caller.view)
    done = _send(database, sink, device, request, caller, ttl_s, now)
    wanted = plan.effective.models.get(done["from_version"]["name"])
    hold = wanted is not None and wanted.artifact != ABSENT and DEVICE not in plan.effective.held_by
    if hold:
        _set_hold(database, device, True, f"rolled back by {caller.actor}: {request.reason}"[:MAX_REASON], caller, now)
    return {**done, "held": hold or DEVICE in plan.effective.held_by}


def _rerun(database: Database, device: str, request: ActionRequest, caller: Caller, now: float) -> dict[str, Any]:
    """Set the device's own target to its effective one again: a new revision, which the
    reconciler sends (once more, even an artifact the device rejected before)."""
    plan = _plan(database, device, caller.view)
    models = {m: w.artifact for m, w in plan.effective.models.items()}
    if not models:
        raise ApiError(409, "conflict", f"{device} has no target to run again (set one: PUT /api/targets/...)")
    desired.set_target(
        database,
        DEVICE,
        device,
        desired.TargetChange(set=models, clear=(), hold=None, reason=request.reason),
        actor=caller.actor,
        remote=caller.remote,
        now=now,
    )
    after = _plan(database, device, desired.View(now, caller.view.silence_s, caller.view.command_ttl_s))
    decision = after.decision
    detail = {
        "models": models,
        "revisions": {m: after.effective.models[m].revision for m in models},
        "command": decision.command_id or None,
        "state": decision.kind,
        "why": decision.reason,
    }
    _audit(database, device, request, caller, now, detail)
    return {"device": device, "action": "rerun", "reason": request.reason, **detail}


def _hold(database: Database, device: str, request: ActionRequest, caller: Caller, now: float) -> dict[str, Any]:
    with database.read() as connection:
        _device_row(connection, device)
    _set_hold(database, device, request.action == "hold", request.reason, caller, now)
    held_by = list(_plan(database, device, caller.view).effective.held_by)
    _audit(database, device, request, caller, now, {"held_by": held_by})
    return {"device": device, "action": request.action, "reason": request.reason, "held_by": held_by}


def perform(
    database: Database,
    sink: CommandSink | None,
    device: str,
    request: ActionRequest,
    caller: Caller,
    *,
    command_ttl_s: float,
    now: float | None = None,
) -> dict[str, Any]:
    """Do one action (see the module docstring); the answer names what was sent or set."""
    now = time.time() if now is None else now
    if request.action in ("hold", "release"):
        return _hold(database, device, request, caller, now)
    if request.action == "rerun":
        return _rerun(database, device, request, caller, now)
    if sink is None:
        raise ApiError(503, "unavailable", "this server sends no commands (no broker connection)")
    if request.action == "rollback":
        return _rollback(database, sink, device, request, caller, command_ttl_s, now)
    return _send(database, sink, device, request, caller, min(command_ttl_s, 600.0), now)
