"""Named API tokens held in the database: made, listed and revoked over the API, no restart.

Only a token's sha256 is stored (never the token, which its creator sees once). A request's
token is looked up by its digest on every request, so a revocation (on any server sharing the
database) refuses the token at the next request; the stored digest is compared with
:func:`hmac.compare_digest` all the same. ``last_used_at`` is written at most once a
:data:`TOUCH_S` per token, so reads do not become writes.

A name is unique among the tokens in force (a revoked token's row stays, for the audit, and its
name may be given again); it may not be a token file's name. Revoking the last admin (the file's
admins counted) is refused: the fleet would have no one left to make tokens.
"""

from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Float, Index, LargeBinary, String, Table, func, select
from sqlalchemy.exc import IntegrityError

from edgepack_core.protocol.ids import is_valid_id
from sdk.errors import ApiError
from sdk.fleet_server import audit
from sdk.fleet_server.auth import digest_of, is_token_text
from sdk.fleet_server.db import ID, Database, RowId, metadata
from sdk.fleet_server.roles import ROLES, Identity

TOUCH_S = 60.0
"""``last_used_at`` is written when it is older than this (one write a minute per busy token)."""
MAX_TOKENS = 10_000
"""Tokens in force at most (a bound on the table a list returns whole)."""
RESERVED = frozenset({"mqtt"})
"""Names the server records as actors itself (``mqtt``: commands seen on the broker)."""

api_tokens = Table(  # named tokens with a role (fleet token create): only the sha256 is kept
    "api_tokens", metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("name", String(ID), nullable=False),
    Column("role", String(16), nullable=False),
    Column("digest", LargeBinary(32), nullable=False),  # sha256 of the token
    Column("created_at", Float, nullable=False),
    Column("created_by", String(ID), nullable=False),
    Column("revoked_at", Float, nullable=True),
    Column("revoked_by", String(ID), nullable=True),
    Column("last_used_at", Float, nullable=True),
    Index(None, "digest", unique=True),
)
Index("ix_api_tokens_name_in_force", api_tokens.c.name, unique=True,  # two creates of one name: one wins
      sqlite_where=api_tokens.c.revoked_at.is_(None), postgresql_where=api_tokens.c.revoked_at.is_(None))


@dataclass(frozen=True)
class Caller:
    """Who asks (the audit's actor and remote address) and the token file's names and admins."""

    actor: str
    remote: str
    file_names: frozenset[str]
    file_admins: int


def check_new(name: object, role: object, file_names: frozenset[str]) -> tuple[str, str]:
    """A new token's name and role, or the 400/409 naming what to fix. Pure."""
    if not is_valid_id(name):
        raise ApiError(400, "invalid", "name: 1 to 64 letters, digits, '.', '_' or '-'")
    assert isinstance(name, str)
    if role not in ROLES:
        raise ApiError(400, "invalid", f"role: one of {', '.join(ROLES)}")
    assert isinstance(role, str)
    if name in RESERVED:
        raise ApiError(409, "conflict", f"the name {name!r} is the server's own; choose another")
    if name in file_names:
        raise ApiError(409, "conflict", f"a token named {name!r} is in the token file")
    return name, role


def _in_force(connection: Any, name: str) -> Any:
    table = api_tokens
    return connection.execute(select(table).where(table.c.name == name, table.c.revoked_at.is_(None))
                              .with_for_update()).mappings().first()


def create(database: Database, name: object, role: object, caller: Caller,
           now: float | None = None) -> tuple[dict[str, Any], str]:
    """Make a token: (its document, the token itself, shown once). Audited as token.create."""
    name, role = check_new(name, role, caller.file_names)
    now = time.time() if now is None else now
    secret = secrets.token_hex(32)
    values = {"name": name, "role": role, "digest": digest_of(secret), "created_at": now,
              "created_by": caller.actor}
    taken = ApiError(409, "conflict", f"a token named {name!r} exists; revoke it first or choose another name")
    try:
        with database.write() as connection:
            if _in_force(connection, name) is not None:
                raise taken
            count = connection.execute(select(func.count()).select_from(api_tokens)
                                       .where(api_tokens.c.revoked_at.is_(None))).scalar_one()
            if count >= MAX_TOKENS:
                raise ApiError(409, "conflict", f"{MAX_TOKENS} tokens are in force; revoke some first")
            connection.execute(api_tokens.insert().values(**values))
            audit.record(connection, actor=caller.actor, action="token.create", target=name, detail={"role": role},
                         remote=caller.remote, now=now)
    except IntegrityError as err:  # another server made one of that name between the check and the insert
        raise taken from err
    return document({**values, "revoked_at": None, "revoked_by": None, "last_used_at": None}), secret


def revoke(database: Database, name: str, caller: Caller, now: float | None = None) -> dict[str, Any]:
    """Revoke the token in force named ``name``; refused for the last admin. Audited as token.revoke."""
    if name in caller.file_names:
        raise ApiError(409, "conflict", f"the token {name!r} is in the token file: remove its line there and "
                                        "restart the server")
    now = time.time() if now is None else now
    table = api_tokens
    with database.write() as connection:
        row = _in_force(connection, name)
        if row is None:
            raise ApiError(404, "not_found", f"no token {name!r} in force")
        if row["role"] == "admin":
            admins = connection.execute(select(table.c.id).where(table.c.role == "admin",
                                                                 table.c.revoked_at.is_(None))
                                        .with_for_update()).all()
            if len(admins) + caller.file_admins <= 1:
                raise ApiError(409, "conflict", f"{name!r} is the last admin token; create another admin first")
        connection.execute(table.update().where(table.c.id == row["id"]).values(revoked_at=now,
                                                                                revoked_by=caller.actor))
        audit.record(connection, actor=caller.actor, action="token.revoke", target=name,
                     detail={"role": row["role"]}, remote=caller.remote, now=now)
    return document({**row, "revoked_at": now, "revoked_by": caller.actor})


def listing(database: Database) -> list[dict[str, Any]]:
    """Every token, in force first (by name), then the revoked ones, newest revocation first;
    at most :data:`MAX_TOKENS` revoked ones."""
    table = api_tokens
    with database.read() as connection:
        live = connection.execute(select(table).where(table.c.revoked_at.is_(None)).order_by(table.c.name)
                                  .limit(MAX_TOKENS)).mappings().all()
        gone = connection.execute(select(table).where(table.c.revoked_at.is_not(None))
                                  .order_by(table.c.revoked_at.desc()).limit(MAX_TOKENS)).mappings().all()
    return [document(row) for row in (*live, *gone)]


def document(row: Any) -> dict[str, Any]:
    """A token's public document: never its digest."""
    return {"name": row["name"], "role": row["role"], "source": "database", "created_at": row["created_at"],
            "created_by": row["created_by"], "revoked_at": row["revoked_at"], "revoked_by": row["revoked_by"],
            "last_used_at": row["last_used_at"]}


def identify(database: Database, token: str | None, now: float | None = None) -> Identity | None:
    """The token in force whose digest is ``token``'s, or None; its ``last_used_at`` written
    when older than :data:`TOUCH_S`."""
    if token is None or not is_token_text(token):
        return None
    digest = digest_of(token)
    table = api_tokens
    with database.read() as connection:
        row = connection.execute(select(table.c.id, table.c.name, table.c.role, table.c.digest, table.c.last_used_at)
                                 .where(table.c.digest == digest, table.c.revoked_at.is_(None))).first()
    if row is None or not hmac.compare_digest(bytes(row.digest), digest):
        return None
    now = time.time() if now is None else now
    if row.last_used_at is None or now - row.last_used_at >= TOUCH_S:
        with database.write() as connection:
            connection.execute(table.update().where(table.c.id == row.id).values(last_used_at=now))
    return Identity(row.name, row.role, "database")
