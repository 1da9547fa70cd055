"""The audit table: every write the API accepts or refuses, with who, what, when and how it ended.

Why in the same transaction as the write: an accepted change without its audit row (or an
audit row for a change that was rolled back) would make the table lie. A refused write (a
bad signature on an upload, an invalid transition) is recorded in its own transaction, with
``outcome`` ``refused`` and the reason. Requests without a valid token are not recorded (an
anonymous flood would otherwise fill the table); they are counted in ``/metrics``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.engine import Connection

from edgepack_core.protocol.commands import MAX_COMMAND_BYTES, Command, parse_command
from edgepack_core.protocol.ids import is_valid_id
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database

MAX_DETAIL_BYTES = 4096
MAX_PAGE = 1000


def _detail(detail: dict[str, Any] | None) -> str:
    text = json.dumps(detail or {}, separators=(",", ":"), sort_keys=True, default=str)
    if len(text) > MAX_DETAIL_BYTES:
        text = json.dumps({"truncated": text[: MAX_DETAIL_BYTES - 64]})
    return text


def record(connection: Connection, *, actor: str, action: str, target: str, outcome: str = "ok",
           detail: dict[str, Any] | None = None, remote: str = "", now: float | None = None) -> None:
    """Add one audit row inside the caller's transaction."""
    connection.execute(tables.audit_log.insert().values(
        ts=time.time() if now is None else now, actor=actor[:64], action=action[:64], target=target[:128],
        outcome=outcome[:16], detail=_detail(detail), remote=remote[:64]))


def record_refusal(database: Database, *, actor: str, action: str, target: str, reason: str,
                   remote: str = "", detail: dict[str, Any] | None = None) -> None:
    """A refused write, in a transaction of its own."""
    with database.write() as connection:
        record(connection, actor=actor, action=action, target=target, outcome="refused",
               detail={**(detail or {}), "reason": reason[:500]}, remote=remote)


def _entry(row: Any) -> dict[str, Any]:
    return {"id": row["id"], "ts": row["ts"], "actor": row["actor"], "action": row["action"],
            "target": row["target"], "outcome": row["outcome"], "detail": json.loads(row["detail"]),
            "remote": row["remote"]}


@dataclass(frozen=True)
class AuditQuery:
    """Which entries: ids below ``before``, of one ``action``, from ``since`` (unix seconds) on."""

    before: int | None = None
    action: str | None = None
    since: float | None = None

    def where(self, query: Any) -> Any:
        log = tables.audit_log
        if self.before is not None:
            query = query.where(log.c.id < self.before)
        if self.action is not None:
            query = query.where(log.c.action == self.action)
        if self.since is not None:
            query = query.where(log.c.ts >= self.since)
        return query


def entries(database: Database, *, limit: int = 100, before: int | None = None, action: str | None = None,
            since: float | None = None) -> list[dict[str, Any]]:
    """The newest entries first; ``before`` (an entry id) pages back."""
    log = tables.audit_log
    query = AuditQuery(before, action, since).where(select(log).order_by(log.c.id.desc())
                                                     .limit(max(1, min(limit, MAX_PAGE))))
    with database.read() as connection:
        return [_entry(row) for row in connection.execute(query).mappings()]


EXPORT_BATCH = 1000


def export_lines(database: Database, which: AuditQuery, limit: int | None = None) -> Iterator[bytes]:
    """The entries ``which`` selects, oldest first (at most ``limit``), as JSON lines: the same
    documents as :func:`entries`, read :data:`EXPORT_BATCH` at a time, so an export of a year
    holds one batch in memory. It ends at the newest entry there was when it began."""
    log = tables.audit_log
    with database.read() as connection:
        last = connection.execute(select(func.max(log.c.id))).scalar()
    after, left = 0, limit
    while last is not None and after < last and (left is None or left > 0):
        batch = EXPORT_BATCH if left is None else min(EXPORT_BATCH, left)
        query = which.where(select(log).where(log.c.id > after, log.c.id <= last).order_by(log.c.id).limit(batch))
        with database.read() as connection:
            rows = connection.execute(query).mappings().all()
        if not rows:
            return
        yield "".join(json.dumps(_entry(row), separators=(",", ":")) + "\n" for row in rows).encode()
        after = rows[-1]["id"]
        left = None if left is None else left - len(rows)


# --------------------------------------------------------------------------- commands the server did not send

EXTERNAL = "command.external"
MAX_EXTERNAL = 10_000
"""``command.external`` entries kept at most (the newest): a flood of commands on cmd topics,
already limited per topic by the ingest's budget, cannot fill the audit table."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class SeenCommand:
    """A message seen on a ``cmd`` topic, as far as it could be read (bounded, never trusted).
    ``id`` is None when it had no valid id; ``problem`` why a device would refuse it ("" when
    it passed the command schema and expiry; the signature is the device's to check)."""

    topic: str
    target: str  # the topic's device, or group:NAME
    size: int
    id: str | None
    summary: dict[str, Any]
    problem: str


def _text(value: Any, limit: int = 128) -> str | None:
    return value if isinstance(value, str) and len(value) <= limit and value.isprintable() else None


def _summary(document: dict[str, Any]) -> dict[str, Any]:
    """What the audit keeps of a command someone else sent: kind, target, what it names; never
    its signature, each value bounded or left out."""
    target = document.get("target")
    summary = {"type": _text(document.get("type"), 32), "name": _text(document.get("name")),
               "version": _text(document.get("version")),
               "sha256": document["sha256"] if isinstance(document.get("sha256"), str)
               and _SHA256.fullmatch(document["sha256"]) else None,
               "target": {key: value for key, value in target.items() if key in ("device", "group")
                          and is_valid_id(value)} if isinstance(target, dict) else None,
               "expires_at": document.get("expires_at") if isinstance(document.get("expires_at"), (int, float))
               else None}
    return {key: value for key, value in summary.items() if value}


def seen_command(topic: str, target: str, payload: bytes, now: float) -> SeenCommand:
    """Read a message seen on a cmd topic, bounded before it is parsed. Pure, never raises."""
    parsed = parse_command(payload, now)
    problem = "" if isinstance(parsed, Command) else parsed.reason
    document: Any = None
    if len(payload) <= MAX_COMMAND_BYTES:
        try:
            document = json.loads(payload)
        except (UnicodeDecodeError, ValueError, RecursionError):
            document = None
    raw_id = document.get("id") if isinstance(document, dict) else None
    return SeenCommand(topic=topic[:300], target=target, size=len(payload),
                       id=raw_id if is_valid_id(raw_id) else None,
                       summary=_summary(document) if isinstance(document, dict) else {}, problem=problem[:300])


def record_external(connection: Connection, seen: list[tuple[SeenCommand, float]]) -> int:
    """Audit the commands in ``seen`` whose id the server did not record (it knows every command it
    sent: the ``commands`` table), as ``command.external`` by ``mqtt`` (MQTT does not say who
    published); then keep the newest :data:`MAX_EXTERNAL` of them. Returns how many were audited."""
    ids = sorted({item.id for item, _ in seen if item.id is not None})
    ours: set[str] = set()
    for start in range(0, len(ids), 500):
        ours.update(connection.execute(select(tables.commands.c.id).where(
            tables.commands.c.id.in_(ids[start:start + 500]))).scalars())
    external = [(item, at) for item, at in seen if item.id is None or item.id not in ours]
    for item, at in external:
        record(connection, actor="mqtt", action=EXTERNAL, target=item.target, now=at,
               detail={"topic": item.topic, "id": item.id, "size": item.size, "command": item.summary,
                       "refused_by_schema": item.problem or None})
    if external:
        log = tables.audit_log
        oldest_kept = connection.execute(select(log.c.id).where(log.c.action == EXTERNAL).order_by(log.c.id.desc())
                                         .offset(MAX_EXTERNAL - 1).limit(1)).scalar()
        if oldest_kept is not None:
            connection.execute(delete(log).where(log.c.action == EXTERNAL, log.c.id < oldest_kept))
    return len(external)
