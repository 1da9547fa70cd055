"""Alembic environment of the fleet server, run programmatically (:func:`sdk.fleet_server.schema_upgrade.migrate`).

The caller hands over an open connection (``config.attributes["connection"]``), so migrations
run inside the server's own engine settings (SQLite pragmas, the PostgreSQL advisory lock).
There is no alembic.ini: ``script_location`` is set in code.
"""

from __future__ import annotations

from alembic import context

from sdk.fleet_server import enrollment_tables  # noqa: F401  (its tables join the metadata)
from sdk.fleet_server.db import metadata

connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - only reachable by running the alembic CLI by hand
    raise RuntimeError("run migrations through sdk.fleet_server.schema_upgrade.migrate(), which passes a connection")

context.configure(connection=connection, target_metadata=metadata, render_as_batch=connection.dialect.name == "sqlite",
                  compare_type=True)
with context.begin_transaction():
    context.run_migrations()
