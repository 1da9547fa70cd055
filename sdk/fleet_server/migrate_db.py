"""``edgepack fleet migrate-db``: copy a fleet from one database to another (SQLite to PostgreSQL).

Why walk the SQLAlchemy metadata and not a list of tables: every table the fleet server has
(devices, history, rollouts, the audit, and whatever a later release adds) is declared on
:data:`~sdk.fleet_server.db.metadata`, and ``sorted_tables`` orders them so a row is copied
after the rows it refers to. Both databases are first brought to the newest schema by the same
migrations the server runs at start; the copy is one transaction on the target (all or
nothing), read from one snapshot of the source; the row counts of every table are compared
after it. A target that already holds rows is refused unless ``force`` (its rows are replaced):
copying onto a live fleet would mix two fleets.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import Table, delete, func, inspect, select, text
from sqlalchemy.engine import Connection

from sdk.errors import FleetServerError
from sdk.fleet_server.db import Database, metadata, open_database

BATCH = 2000
"""Rows read and inserted at a time: bounded memory whatever the fleet's size."""
NOT_COPIED = frozenset({"alembic_version"})
"""Tables the migrations write themselves (both sides are at the same revision)."""


@dataclass(frozen=True)
class TableCount:
    """One table's rows in the source and, after the copy, in the target."""

    table: str
    source: int
    target: int

    @property
    def problem(self) -> str:
        """One line when the counts differ, else "". Pure."""
        if self.source == self.target:
            return ""
        return f"{self.table}: {self.source} row(s) in the source, {self.target} in the target"


def occupied(counts: dict[str, int]) -> str:
    """Why a target with these row counts must not be copied onto, or "" (it is empty). Pure."""
    full = [f"{name} ({count})" for name, count in counts.items() if count]
    if not full:
        return ""
    return (
        f"the target database already holds rows in {', '.join(full[:8])}{' ...' if len(full) > 8 else ''}: "
        "give --force to replace them (everything in it is deleted first)"
    )


def _count(connection: Connection, table: Table) -> int:
    return int(connection.execute(select(func.count()).select_from(table)).scalar_one())


def _rows(connection: Connection, table: Table) -> Iterator[list[dict[str, object]]]:
    """The table's rows in primary-key order, :data:`BATCH` at a time."""
    result = connection.execute(select(table).order_by(*table.primary_key.columns)).mappings()
    while True:
        batch = result.fetchmany(BATCH)
        if not batch:
            return
        yield [dict(row) for row in batch]


def _reset_sequences(connection: Connection, table: Table) -> None:
    """On PostgreSQL, move an autoincrementing key's sequence past the copied ids (explicit ids
    do not advance it: the server's next insert would collide with a copied row)."""
    column = table.autoincrement_column
    if column is None or connection.dialect.name != "postgresql":
        return
    connection.execute(
        text(
            f"SELECT setval(pg_get_serial_sequence(:table, :column), COALESCE(MAX({column.name}), 1), "
            f"MAX({column.name}) IS NOT NULL) FROM {table.name}"
        ),
        {"table": table.name, "column": column.name},
    )


def unknown_tables(database: Database) -> list[str]:
    """Tables in ``database`` that this release does not declare (they would not be copied)."""
    names = set(inspect(database.engine).get_table_names())
    return sorted(names - set(metadata.tables) - NOT_COPIED)


def copy_tables(source: Database, target: Database, *, force: bool = False) -> list[TableCount]:
    """Copy every declared table of ``source`` into ``target`` (both at the newest schema);
    the per-table counts after. :class:`FleetServerError` when the target holds rows and not
    ``force``."""
    tables = [table for table in metadata.sorted_tables if table.name not in NOT_COPIED]
    with source.read() as reading:
        source_counts = {table.name: _count(reading, table) for table in tables}
        with target.write() as writing:
            refusal = occupied({table.name: _count(writing, table) for table in tables})
            if refusal and not force:
                raise FleetServerError(refusal)
            for table in reversed(tables):
                writing.execute(delete(table))
            for table in tables:
                for batch in _rows(reading, table):
                    writing.execute(table.insert(), batch)
                _reset_sequences(writing, table)
    with target.read() as connection:
        return [TableCount(table.name, source_counts[table.name], _count(connection, table)) for table in tables]


@dataclass(frozen=True)
class Migration:
    """What a copy did: each table's counts, and one line per problem (none: complete)."""

    counts: tuple[TableCount, ...]
    problems: tuple[str, ...]


def migrate_db(source_url: str, target_url: str, *, force: bool = False) -> Migration:
    """Open both databases (migrating their schemas), copy, compare the counts."""
    if source_url == target_url:
        raise FleetServerError("--from and --to are the same database")
    source = open_database(source_url)
    try:
        target = open_database(target_url)
        try:
            problems = [
                f"the source has the table {name}, which this release does not know: not copied"
                for name in unknown_tables(source)
            ]
            counts = copy_tables(source, target, force=force)
        finally:
            target.close()
    finally:
        source.close()
    problems += [count.problem for count in counts if count.problem]
    return Migration(tuple(counts), tuple(problems))
