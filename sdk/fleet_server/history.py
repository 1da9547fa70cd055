"""A device's update history: every command it was sent, every job it reported and every rollout
that planned it a wave it did not send, newest first.

Why built from the stored rows and not kept as a table of its own: the ``commands`` table holds
what the server sent (a rollout's waves and undos, the targets' reconciler), ``job_events``
what the device answered (also to commands the server did not send: ``edgepack deploy``, a
command over MQTT), ``rollout_devices``/``rollouts`` which rollout a job was part of. A job's
history is the join of the three; a copy would be one more thing to keep consistent.

:func:`outcome` is the pure part (a job's final answer as succeeded, failed, cancelled, in
progress, sent or unanswered); :func:`device_history` reads one bounded page.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.engine import Connection

from sdk.errors import ApiError
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database

MAX_PAGE = 200
DEFAULT_PAGE = 50
MAX_STATES = 50
"""States listed per job at most (the newest): a job has about ten; the ingest budget bounds a flood."""

FAILED_STATES = frozenset({"failed", "rejected"})
SUCCEEDED, FAILED, CANCELLED, IN_PROGRESS, SENT, UNANSWERED, NOT_SENT = (
    "succeeded",
    "failed",
    "cancelled",
    "in_progress",
    "sent",
    "unanswered",
    "not_sent",
)
OUTCOMES = (SUCCEEDED, FAILED, CANCELLED, IN_PROGRESS, SENT, UNANSWERED, NOT_SENT)
NOT_UPDATES = ("fetch-logs",)
"""Command types that are not part of the update history: a log fetch (the device page's live
tail sends one every few seconds) is read through the logs API (sdk/fleet_server/device_logs.py)."""


def not_sent_reason(wave: int, rollout_state: str) -> str:
    """Why a rollout's device has no command (``wave`` 0-based, shown 1-based). Pure."""
    if rollout_state in ("pending", "running", "paused"):
        return f"waiting for wave {wave + 1} (the rollout is {rollout_state})"
    return f"wave {wave + 1} was never sent: the rollout {rollout_state}"


def outcome(kind: str, state: str | None, final: bool, *, expires_at: float | None, now: float) -> str:
    """A job's outcome from its newest state. Pure.

    No answer yet: ``sent``, or ``unanswered`` once the command expired (the device will refuse
    it now). Not final: ``in_progress``. Final: ``cancelled``; ``failed`` or ``rejected`` are
    ``failed``; ``rolled_back`` ends a deploy ``failed`` (its health window undid it) but is what
    a rollback is for; anything else (``active``, ``done``) ``succeeded``."""
    if state is None:
        return UNANSWERED if expires_at is not None and now > expires_at else SENT
    if not final:
        return IN_PROGRESS
    if state == "cancelled":
        return CANCELLED
    if state in FAILED_STATES or (state == "rolled_back" and kind == "deploy"):
        return FAILED
    return SUCCEEDED


@dataclass(frozen=True)
class Page:
    """One page of a device's history: at most ``limit`` jobs started before ``before`` (None: now)."""

    limit: int = DEFAULT_PAGE
    before: float | None = None


def _sent(connection: Connection, device: str, page: Page) -> list[dict[str, Any]]:
    """The commands the server sent ``device`` (newest first, one page), with what their signed bytes name."""
    commands, targets = tables.commands, tables.target_commands
    query = (
        select(
            commands.c.id,
            commands.c.kind,
            commands.c.rollout_id,
            commands.c.created_at,
            commands.c.payload,
            targets.c.source,
        )
        .select_from(commands.outerjoin(targets, targets.c.id == commands.c.id))
        .where(commands.c.device == device, commands.c.kind.not_in(NOT_UPDATES))
    )
    if page.before is not None:
        query = query.where(commands.c.created_at < page.before)
    found = []
    for row in connection.execute(query.order_by(commands.c.created_at.desc()).limit(page.limit + 1)):
        body = json.loads(bytes(row.payload))  # the server's own signed bytes (<= 64 KiB)
        artifact = (
            {"sha256": body["sha256"], "name": body.get("name"), "version": body.get("version")}
            if body.get("sha256")
            else None
        )
        found.append(
            {
                "job": row.id,
                "kind": row.kind,
                "rollout": row.rollout_id,
                "target": row.source,
                "sent_by_server": True,
                "started_at": row.created_at,
                "artifact": artifact,
                "expires_at": body.get("expires_at"),
                "from_version": body.get("from_version"),
            }
        )
    return found


def _answered_only(connection: Connection, device: str, page: Page) -> list[dict[str, Any]]:
    """Jobs ``device`` reported for commands the server did not send (``edgepack deploy``, MQTT)."""
    events, commands = tables.job_events, tables.commands
    first = func.min(events.c.received_at)
    query = (
        select(events.c.job, func.max(events.c.type), first)
        .where(events.c.device == device, events.c.type.not_in(NOT_UPDATES),
               events.c.job.not_in(select(commands.c.id).where(commands.c.device == device)))
        .group_by(events.c.job)
    )
    if page.before is not None:
        query = query.having(first < page.before)
    return [
        {
            "job": job,
            "kind": kind,
            "rollout": None,
            "target": None,
            "sent_by_server": False,
            "started_at": started,
            "artifact": None,
            "expires_at": None,
            "from_version": None,
        }
        for job, kind, started in connection.execute(query.order_by(first.desc()).limit(page.limit + 1))
    ]


def _planned(connection: Connection, device: str, page: Page) -> list[dict[str, Any]]:
    """Rollouts that include ``device`` in a wave they have not sent (or never will)."""
    rd, rollouts = tables.rollout_devices, tables.rollouts
    query = (
        select(rd.c.command_id, rd.c.rollout_id, rd.c.wave, rollouts.c.created_at, rollouts.c.state)
        .select_from(rd.join(rollouts, rollouts.c.id == rd.c.rollout_id))
        .where(rd.c.device == device, rd.c.state == "not_sent")
    )
    if page.before is not None:
        query = query.where(rollouts.c.created_at < page.before)
    return [
        {
            "job": row.command_id,
            "kind": "deploy",
            "rollout": row.rollout_id,
            "target": None,
            "sent_by_server": True,
            "started_at": row.created_at,
            "artifact": None,
            "expires_at": None,
            "from_version": None,
            "not_sent": not_sent_reason(row.wave, row.state),
        }
        for row in connection.execute(query.order_by(rollouts.c.created_at.desc()).limit(page.limit + 1))
    ]


def _states(connection: Connection, device: str, jobs: list[str]) -> dict[str, list[dict[str, Any]]]:
    events = tables.job_events
    states: dict[str, list[dict[str, Any]]] = {job: [] for job in jobs}
    if not jobs:
        return states
    rows = connection.execute(
        select(events)
        .where(events.c.device == device, events.c.job.in_(jobs))
        .order_by(events.c.received_at, events.c.id)
    ).mappings()
    for row in rows:
        states[row["job"]].append(
            {
                "state": row["state"],
                "final": bool(row["final"]),
                "reason": row["reason"],
                "ts": row["ts"],
                "received_at": row["received_at"],
            }
        )
    return {job: listed[-MAX_STATES:] for job, listed in states.items()}


def _rollouts(connection: Connection, ids: set[str]) -> dict[str, dict[str, Any]]:
    if not ids:
        return {}
    r = tables.rollouts
    return {
        row.id: {
            "id": row.id,
            "state": row.state,
            "artifact": {"sha256": row.artifact_sha256, "name": row.name, "version": row.version},
        }
        for row in connection.execute(
            select(r.c.id, r.c.state, r.c.artifact_sha256, r.c.name, r.c.version).where(r.c.id.in_(sorted(ids)))
        )
    }


def _entry(
    item: dict[str, Any], states: list[dict[str, Any]], rollouts: dict[str, dict[str, Any]], now: float
) -> dict[str, Any]:
    last = states[-1] if states else None
    final = next((s for s in reversed(states) if s["final"]), None)
    shown = final or last
    rollout = rollouts.get(item["rollout"] or "")
    artifact = item["artifact"] or (rollout["artifact"] if rollout and item["kind"] == "deploy" else None)
    return {
        "job": item["job"],
        "kind": item["kind"],
        "sent_by_server": item["sent_by_server"],
        "rollout": None if rollout is None else {"id": rollout["id"], "state": rollout["state"]},
        "target": item["target"],
        "artifact": artifact,
        "from_version": item["from_version"],
        "started_at": item["started_at"],
        "updated_at": last["received_at"] if last else item["started_at"],
        "states": states,
        "state": shown["state"] if shown else None,
        "outcome": NOT_SENT
        if item.get("not_sent")
        else outcome(
            item["kind"], shown["state"] if shown else None, final is not None, expires_at=item["expires_at"], now=now
        ),
        "reason": shown["reason"] if shown else item.get("not_sent", ""),
    }


def device_history(database: Database, device: str, page: Page, *, now: float) -> dict[str, Any]:
    """``GET /api/devices/{id}/history``: the device's jobs, newest first, one page, each with its
    rollout, artifact, states with times, outcome and reason; ``next_before`` pages back (None
    on the last page). 404 for a device the server has no record of at all."""
    with database.read() as connection:
        merged = sorted(
            [
                *_sent(connection, device, page),
                *_answered_only(connection, device, page),
                *_planned(connection, device, page),
            ],
            key=lambda item: (item["started_at"], item["job"]),
            reverse=True,
        )[: page.limit + 1]
        if (
            not merged
            and connection.execute(select(tables.devices.c.id).where(tables.devices.c.id == device)).first() is None
        ):
            raise ApiError(404, "not_found", f"no device {device}")
        more, merged = len(merged) > page.limit, merged[: page.limit]  # one more read: is there a next page
        states = _states(connection, device, [item["job"] for item in merged])
        rollouts = _rollouts(connection, {item["rollout"] for item in merged if item["rollout"]})
    entries = [_entry(item, states[item["job"]], rollouts, now) for item in merged]
    return {
        "device": device,
        "entries": entries,
        "limit": page.limit,
        "next_before": merged[-1]["started_at"] if more else None,
    }
