"""The audit table: every write the API accepts or refuses, with who, what, when and how it ended.

Why in the same transaction as the write: an accepted change without its audit row (or an
audit row for a change that was rolled back) would make the table lie. A refused write (a
bad signature on an upload, an invalid transition) is recorded in its own transaction, with
``outcome`` ``refused`` and the reason. Requests without a valid token are not recorded (an
anonymous flood would otherwise fill the table); they are counted in ``/metrics``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from sqlalchemy.engine import Connection

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


def entries(database: Database, *, limit: int = 100, before: int | None = None,
            action: str | None = None) -> list[dict[str, Any]]:
    """The newest entries first; ``before`` (an entry id) pages back."""
    rows = database.newest_first(tables.audit_log, limit=min(limit, MAX_PAGE), before=before, action=action)
    return [{"id": row["id"], "ts": row["ts"], "actor": row["actor"], "action": row["action"],
             "target": row["target"], "outcome": row["outcome"], "detail": json.loads(row["detail"]),
             "remote": row["remote"]} for row in rows]
