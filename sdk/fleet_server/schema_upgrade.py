"""Bringing a fleet database's schema to this release's: Alembic, run at every start, quietly.

Kept apart from :mod:`.db` (the tables) so that importing the tables never imports Alembic,
whose import writes a "setup plugin" INFO line per plugin: :func:`quiet_alembic` sets its
logger before that import, so a start shows none of them unless ``edgepack -v``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from sdk.errors import FleetServerError

if TYPE_CHECKING:
    from sdk.fleet_server.db import Database

MIGRATION_LOCK = 0x6564_6765_7061_636B  # "edgepack": the PostgreSQL advisory lock held while migrating


def quiet_alembic(verbose: bool = False) -> None:
    """Alembic's INFO lines (a "setup plugin" line per plugin when it is imported, one per
    migration) at WARNING unless ``verbose`` (``edgepack -v``) or already set: they are noise at
    every start. Set before alembic is imported, which is when the plugin lines are written."""
    logger = logging.getLogger("alembic")
    if verbose:
        logger.setLevel(logging.INFO)
    elif logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def migrate(database: Database) -> None:
    """Upgrade the schema to the newest Alembic revision (programmatically, at start). Two
    servers starting together on PostgreSQL take turns through an advisory lock."""
    quiet_alembic()
    from alembic import command
    from alembic.config import Config
    from alembic.util.exc import CommandError

    config = Config()
    config.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    with database.engine.connect() as connection:
        if not database.is_sqlite:
            connection.exec_driver_sql(f"SELECT pg_advisory_lock({MIGRATION_LOCK})")
            connection.commit()
        try:
            config.attributes["connection"] = connection
            try:
                command.upgrade(config, "head")
            except CommandError as err:  # a revision this release does not know: a newer one migrated it
                raise FleetServerError(
                    f"the database's schema is from a newer Edgepack release ({err}): run the "
                    "release that migrated it, or restore a backup taken before"
                ) from err
            connection.commit()
        finally:
            if not database.is_sqlite:
                connection.exec_driver_sql(f"SELECT pg_advisory_unlock({MIGRATION_LOCK})")
                connection.commit()
