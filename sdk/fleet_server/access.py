"""Who a request is and whether its role may do what it asks: the API's guard calls these.

A token is looked for in the token file first (in memory, constant time over every token:
:mod:`.auth`), then among the tokens in force in the database (:mod:`.users`, one indexed read
in the thread pool, so a revocation anywhere refuses it at the next request). The role check is
the pure table of :mod:`.roles`.
"""

from __future__ import annotations

from typing import Any

from starlette.concurrency import run_in_threadpool

from sdk.errors import ForbiddenError
from sdk.fleet_server import roles, users
from sdk.fleet_server.auth import TokenCheck, presented
from sdk.fleet_server.db import Database


async def identify(tokens: TokenCheck, database: Database, header: str | None) -> roles.Identity | None:
    """The identity of ``Authorization: Bearer <token>``, or None (a 401)."""
    identity = tokens.who(header)
    token = presented(header) if identity is None else None
    if token is not None:
        identity = await run_in_threadpool(users.identify, database, token)
    return identity


def authorize(identity: roles.Identity, action: str) -> None:
    """:class:`ForbiddenError` (403, naming the least role allowed) unless the role may ``action``."""
    if not roles.allows(identity.role, action):
        raise ForbiddenError(roles.needed_role(action), roles.refusal(action, identity))


def refusal_target(params: dict[str, Any]) -> str:
    """What a refused write was aimed at, from its path."""
    return str(params.get("rollout_id") or params.get("sha256") or params.get("device_id") or params.get("group")
               or params.get("name") or "")
