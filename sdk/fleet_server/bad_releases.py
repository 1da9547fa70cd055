"""Releases marked bad fleet-wide: the operator's stop for one artifact, everywhere.

``POST /api/artifacts/{sha256}/bad`` with a reason marks an artifact bad (``artifact_bad``),
``DELETE`` clears the mark; both are audited (``artifact.bad``, ``artifact.good``) with the
reason. While an artifact is marked:

- the reconciler never sends it: a device whose effective target names it waits with the
  reason ``artifact ... marked bad: <reason>`` (:func:`~.targets.reconcile`, from
  :attr:`~.targets.ArtifactInfo.bad`);
- a new rollout or target naming it is refused 422 naming it (:func:`refuse_if_bad`);
- the driver pauses, never fails, every pending or running rollout carrying it, with that
  reason, and a resume is refused until the mark is cleared.

The answer to a mark lists what still names the artifact (targets of the fleet, groups and
devices; rollouts in progress), so the operator knows what to set back.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Connection

from sdk.errors import ApiError
from sdk.fleet_server import audit
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database
from sdk.fleet_server.rollouts import TERMINAL
from sdk.fleet_server.targets import marked_bad

MAX_REASON = 500
CHUNK = 500

REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["reason"],
    "properties": {
        "reason": {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_REASON,
            "description": "why the release is bad (kept in the audit and shown to operators)",
        }
    },
}


@dataclass(frozen=True)
class BadMark:
    """An artifact marked bad: when, by whom, why."""

    at: float
    actor: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"at": self.at, "actor": self.actor, "reason": self.reason}


def marks(connection: Connection, shas: Iterable[str]) -> dict[str, BadMark]:
    """Artifact sha256 -> its mark, for those of ``shas`` marked bad."""
    table = tables.artifact_bad
    wanted = sorted(set(shas))
    found: dict[str, BadMark] = {}
    for start in range(0, len(wanted), CHUNK):
        for row in connection.execute(select(table).where(table.c.sha256.in_(wanted[start : start + CHUNK]))):
            found[row.sha256] = BadMark(row.at, row.actor, row.reason)
    return found


def refuse_if_bad(connection: Connection, sha256: str, field: str) -> None:
    """422 naming ``field`` and the mark when ``sha256`` is marked bad (a new rollout or target)."""
    _refuse(connection, sha256, 422, "invalid", f"{field}: ", "")


def refuse_resume(connection: Connection, sha256: str) -> None:
    """409 for resuming a rollout whose artifact is marked bad (the driver would pause it again)."""
    _refuse(connection, sha256, 409, "conflict", "", " or abort the rollout")


def _refuse(connection: Connection, sha256: str, status: int, code: str, prefix: str, suffix: str) -> None:
    mark = marks(connection, [sha256]).get(sha256)
    if mark is not None:
        raise ApiError(
            status,
            code,
            f"{prefix}{marked_bad(sha256, mark.reason)} (by {mark.actor}); clear the mark first "
            f"(edgepack artifact good {sha256}){suffix}",
        )


def named_by(connection: Connection, sha256: str) -> dict[str, list[dict[str, Any]]]:
    """What names the artifact now: target entries (fleet, groups, devices) and rollouts in progress."""
    entries, ro = tables.target_entries, tables.rollouts
    targets = [
        {"scope": row.scope, "name": row.name or None, "model": row.model}
        for row in connection.execute(
            select(entries.c.scope, entries.c.name, entries.c.model)
            .where(entries.c.artifact == sha256)
            .order_by(entries.c.scope, entries.c.name, entries.c.model)
        )
    ]
    rollouts = [
        {"id": row.id, "state": row.state, "target_group": row.target_group}
        for row in connection.execute(
            select(ro.c.id, ro.c.state, ro.c.target_group)
            .where(ro.c.artifact_sha256 == sha256, ro.c.state.not_in(sorted(TERMINAL)))
            .order_by(ro.c.created_at)
        )
    ]
    return {"targets": targets, "rollouts": rollouts}


def _known(connection: Connection, sha256: str) -> None:
    if connection.execute(select(tables.artifacts.c.sha256).where(tables.artifacts.c.sha256 == sha256)).first() is None:
        raise ApiError(404, "not_found", f"no artifact {sha256}")


def mark_bad(
    database: Database, sha256: str, reason: str, *, actor: str, remote: str, now: float | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Mark (or mark again, with the new reason) ``sha256`` bad; audited ``artifact.bad`` with
    the reason and what names it. Returns what names it."""
    now = time.time() if now is None else now
    table = tables.artifact_bad
    with database.write() as connection:
        _known(connection, sha256)
        connection.execute(table.delete().where(table.c.sha256 == sha256))
        connection.execute(table.insert().values(sha256=sha256, reason=reason, actor=actor[:128], at=now))
        named = named_by(connection, sha256)
        audit.record(
            connection,
            actor=actor,
            action="artifact.bad",
            target=sha256,
            remote=remote,
            now=now,
            detail={"reason": reason, **named},
        )
    return named


def clear_bad(
    database: Database, sha256: str, *, actor: str, remote: str, now: float | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Clear the mark (nothing to clear is no error); audited ``artifact.good`` with the mark it
    cleared. Returns what names the artifact (the reconciler sends it again)."""
    now = time.time() if now is None else now
    table = tables.artifact_bad
    with database.write() as connection:
        _known(connection, sha256)
        was = marks(connection, [sha256]).get(sha256)
        connection.execute(table.delete().where(table.c.sha256 == sha256))
        named = named_by(connection, sha256)
        audit.record(
            connection,
            actor=actor,
            action="artifact.good",
            target=sha256,
            remote=remote,
            now=now,
            detail={"cleared": None if was is None else was.to_json(), **named},
        )
    return named
