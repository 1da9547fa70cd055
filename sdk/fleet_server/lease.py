"""The driver's lease: one server at a time advances rollouts and reconciles targets and settings
(:mod:`.driver`); the others take over when it expires."""

from __future__ import annotations

from typing import Any

from sqlalchemy import case, select, update

from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database

LEASE_NAME = "driver"


class Lease:
    """A named lease in the database: one holder at a time, until ``expires_at``.

    Taking it is one conditional UPDATE (``holder = me OR expires_at < now``), atomic on both
    backends; the row is created on first use. Servers compare their own clocks with the
    stored expiry, so their clocks must agree to well within the TTL (NTP)."""

    def __init__(self, database: Database, holder: str, ttl_s: float, name: str = LEASE_NAME) -> None:
        self.database, self.holder, self.ttl_s, self.name = database, holder, ttl_s, name

    def hold(self, now: float) -> bool:
        """Take or renew the lease; True while this holder has it."""
        leases = tables.leases
        with self.database.write() as connection:
            connection.execute(
                self.database.insert(leases).on_conflict_do_nothing(),
                {"name": self.name, "holder": self.holder, "expires_at": now + self.ttl_s, "acquired_at": now},
            )
            result = connection.execute(
                update(leases)
                .where(leases.c.name == self.name, (leases.c.holder == self.holder) | (leases.c.expires_at < now))
                .values(
                    holder=self.holder,
                    expires_at=now + self.ttl_s,
                    acquired_at=case((leases.c.holder == self.holder, leases.c.acquired_at), else_=now),
                )
            )
        return bool(result.rowcount)

    def release(self) -> None:
        """Give the lease up now (a clean stop), so another server need not wait for the expiry."""
        leases = tables.leases
        with self.database.write() as connection:
            connection.execute(
                update(leases).where(leases.c.name == self.name, leases.c.holder == self.holder).values(expires_at=0.0)
            )

    def current(self) -> dict[str, Any] | None:
        with self.database.read() as connection:
            row = connection.execute(select(tables.leases).where(tables.leases.c.name == self.name)).mappings().first()
        return None if row is None else dict(row)
