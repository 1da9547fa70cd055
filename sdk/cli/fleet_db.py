"""``edgepack fleet migrate-db`` and the database password every fleet database command takes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sdk.cli.fleet import fleet
from sdk.cli.terminal import echo
from sdk.errors import CommandFailed, ServerConfigError

_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)


def db_password_option(func: Callable[..., Any]) -> Callable[..., Any]:
    """``--db-password-file F`` (or ``EDGEPACK_DB_PASSWORD``): the PostgreSQL password, never in the URL."""
    return click.option(
        "--db-password-file",
        type=_FILE,
        help="File whose first line is the database password (mode 600), so the --db URL need "
        "not hold it (or EDGEPACK_DB_PASSWORD).",
    )(func)


def database_url(url: str, password_file: Path | None, *, flag: str = "--db") -> str:
    """``url`` with the password from ``--db-password-file`` or the environment added; a password
    in the URL itself still works, with one line saying ``ps`` shows it."""
    from sdk.fleet_server.disk import resolve_password, url_with_password, warn_password_in_url

    password = resolve_password(password_file)
    if password is None:
        warn_password_in_url(url)
    return url_with_password(url, password, flag=flag)


@fleet.command("migrate-db")
@click.option("--from", "source", required=True, help="The database to copy, e.g. sqlite:///fleet.db.")
@click.option(
    "--to",
    "target",
    required=True,
    help="The database to copy into, e.g. postgresql://edgepack@db/fleet "
    "(its password from --db-password-file or EDGEPACK_DB_PASSWORD).",
)
@db_password_option
@click.option("--from-password-file", type=_FILE, help="File holding the password of a PostgreSQL --from database.")
@click.option("--force", is_flag=True, help="Replace whatever the target already holds (refused otherwise).")
def migrate_db(
    source: str, target: str, db_password_file: Path | None, from_password_file: Path | None, force: bool
) -> None:
    """Copy a fleet's database (devices, history, rollouts, targets, the audit: every table) into another one.

    Stop the servers first. Both schemas are brought to this release's; the copy is one
    transaction on the target; each table's row counts are compared after (one line per table
    that differs, exit 1)."""
    try:
        from sdk.fleet_server.disk import url_with_password
        from sdk.fleet_server.migrate_db import migrate_db as run
    except ImportError as err:
        raise ServerConfigError(
            f"edgepack fleet migrate-db needs the server extra (pip install 'edgepack[server]'): {err}"
        ) from err
    source_url = source
    if from_password_file is not None:
        from sdk.fleet_server.disk import read_db_password

        source_url = url_with_password(source, read_db_password(from_password_file), flag="--from")
    done = run(source_url, database_url(target, db_password_file, flag="--to"), force=force)
    for count in done.counts:
        click.echo(f"{count.table}: {count.target} row(s)")
    echo(*(f"edgepack: migrate-db: {problem}" for problem in done.problems), err=True)  # rows' text in them
    if done.problems:
        raise CommandFailed(f"migrate-db: {len(done.problems)} problem(s); the target is not a complete copy")
