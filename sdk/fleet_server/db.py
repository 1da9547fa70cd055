"""The fleet server's tables (SQLAlchemy Core), its engines and its write transactions.

Why SQLAlchemy Core and not an ORM or hand-written SQL: one table definition serves SQLite
(the default, one file beside the operator) and PostgreSQL (several servers), with each
dialect's upsert (``INSERT ... ON CONFLICT``) and Alembic's autogenerate to prove that the
migrations build exactly these tables. The server runs few, simple statements, many of them
batched; an ORM's unit of work would add cost and hide the SQL.

SQLite runs in WAL mode (readers never block the writer), ``synchronous=NORMAL`` (a process
crash loses nothing committed), a busy timeout, and write transactions that start with
``BEGIN IMMEDIATE``: a deferred transaction that reads first and writes later can fail at
once with "database is locked" when another connection wrote in between, instead of waiting.

Times are unix seconds (floats) from the server's clock; ids follow the protocol's pattern.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    select,
)
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from sdk.errors import FleetServerError, ServerConfigError
from sdk.fleet_server.disk import private_database_file
from sdk.fleet_server.startup import new_fleet_refusal

log = logging.getLogger("edgepack.fleet_server.db")

ID = 64
"""Length of every protocol id (device, group, command, rollout): ``ID_PATTERN`` allows 64."""

metadata = MetaData(naming_convention={
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
})

# An autoincrementing 64-bit key on PostgreSQL; SQLite only autoincrements INTEGER PRIMARY KEY.
RowId = BigInteger().with_variant(Integer(), "sqlite")

devices = Table(
    "devices", metadata,
    Column("id", String(ID), primary_key=True),
    Column("status", String(16), nullable=False),  # online | offline | unknown
    Column("status_reason", String(300), nullable=False, default=""),
    Column("model_name", String(ID)),
    Column("model_version", String(128)),
    Column("model_sha256", String(64)),
    Column("provider", String(64)),
    Column("profile", String(64)),
    Column("capabilities", Text),  # JSON, bounded by edgepack_core.protocol.messages
    Column("first_seen", Float, nullable=False),
    Column("last_seen", Float, nullable=False),
    Column("state_ts", Float),  # the device's ts of the newest state applied, as the device reported it
    Column("state_heard", Float),  # when the server heard that state: what orders states (device clocks lie)
    Column("state_epoch", String(32)),  # the applied state's connection mark (liveness.py), None when unmarked
    Column("state_session", BigInteger),
    Column("groups_enrolled_at", Float),  # None: the device's groups were never enrolled (see device_groups)
    Column("telemetry_at", Float),
    Column("telemetry_seq", BigInteger),
    Column("latency_p50", Float),
    Column("latency_p90", Float),
    Column("latency_p99", Float),
    Column("latency_mean", Float),
    Column("throughput_per_s", Float),
    Column("inferences_total", BigInteger),
    Column("errors_total", BigInteger),
    Column("inferences_interval", BigInteger),
    Column("errors_interval", BigInteger),
    Column("cpu_percent", Float),
    Column("memory_rss_bytes", BigInteger),
    Column("temperature_c", Float),
    Index(None, "model_version"),
)

device_groups = Table(  # the groups the server holds for a device (enrolled): what rollouts target
    "device_groups", metadata,
    Column("device", String(ID), primary_key=True),
    Column("group_name", String(ID), primary_key=True),
    Index(None, "group_name"),
)

device_claimed_groups = Table(  # the groups a device's newest state claims: shown, never used
    "device_claimed_groups", metadata,
    Column("device", String(ID), primary_key=True),
    Column("group_name", String(ID), primary_key=True),
)

dead_letters = Table(  # device messages that parsed but could not be stored (bounded, newest kept)
    "dead_letters", metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("received_at", Float, nullable=False),
    Column("device", String(ID), nullable=False),
    Column("kind", String(16), nullable=False),  # state | job | telemetry
    Column("topic", String(300), nullable=False),
    Column("reason", String(500), nullable=False),  # ASCII: the error, its non-ASCII escaped
    Column("size", Integer, nullable=False),
    Column("payload_head", LargeBinary, nullable=False),  # the first bytes of the payload
    Index(None, "received_at"),
)

decommissioned = Table(  # devices removed from the fleet: their messages are dropped until enrolled again
    "decommissioned", metadata,
    Column("device", String(ID), primary_key=True),
    Column("at", Float, nullable=False),
    Column("actor", String(128), nullable=False),
    Column("reason", String(500), nullable=False),
)

telemetry_raw = Table(
    "telemetry_raw", metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("device", String(ID), nullable=False),
    Column("ts", Float, nullable=False),  # when the server received it (device clocks drift)
    Column("seq", BigInteger),
    Column("latency_p50", Float),
    Column("latency_p99", Float),
    Column("latency_mean", Float),
    Column("throughput_per_s", Float),
    Column("inferences", BigInteger),  # in the device's interval
    Column("errors", BigInteger),  # in the device's interval
    Column("cpu_percent", Float),
    Column("memory_rss_bytes", BigInteger),
    Column("error_kinds", Text),  # JSON {kind: count} of the interval's errors (None: none, or before 0006)
    Index(None, "device", "ts"),
    Index(None, "ts"),
)

telemetry_rollup = Table(
    "telemetry_rollup", metadata,
    Column("device", String(ID), primary_key=True),
    Column("bucket", BigInteger, primary_key=True),  # start of the bucket (unix seconds, a multiple of step)
    Column("step", Integer, nullable=False),
    Column("samples", Integer, nullable=False),
    Column("latency_p50_sum", Float, nullable=False),
    Column("latency_p50_samples", Integer, nullable=False),
    Column("latency_p99_max", Float),
    Column("throughput_sum", Float, nullable=False),
    Column("inferences", BigInteger, nullable=False),
    Column("errors", BigInteger, nullable=False),
    Column("error_kinds", Text),  # JSON {kind: count} summed over the bucket (None: none)
    Index(None, "bucket"),
)

job_events = Table(
    "job_events", metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("device", String(ID), nullable=False),
    Column("job", String(ID), nullable=False),
    Column("type", String(32), nullable=False),
    Column("state", String(32), nullable=False),
    Column("final", Boolean, nullable=False),
    Column("reason", String(500), nullable=False, default=""),
    Column("ts", Float, nullable=False),  # the device's ts: with the rest, what makes a redelivery a duplicate
    Column("received_at", Float, nullable=False),
    UniqueConstraint("device", "job", "state", "final", "ts"),
    Index(None, "job"),
    Index(None, "received_at"),
    Index(None, "device", "type", "id"),  # a device's newest deploy job: the device list's update_status
)

artifacts = Table(
    "artifacts", metadata,
    Column("sha256", String(64), primary_key=True),
    Column("name", String(ID), nullable=False),
    Column("version", String(128), nullable=False),
    Column("size", BigInteger, nullable=False),
    Column("key_id", String(32), nullable=False),
    Column("targets", Text, nullable=False),  # JSON list of target profiles
    Column("created_at", Float, nullable=False),
    Column("created_by", String(ID), nullable=False),
    Column("model_sha256", String(64)),  # the manifest's model file hash (what devices report); None: older rows
)

rollouts = Table(
    "rollouts", metadata,
    Column("id", String(ID), primary_key=True),
    Column("artifact_sha256", String(64), ForeignKey("artifacts.sha256"), nullable=False),
    Column("name", String(ID), nullable=False),
    Column("version", String(128), nullable=False),
    Column("target_group", String(ID)),  # None: an explicit device list
    Column("state", String(16), nullable=False),
    Column("wave", Integer, nullable=False),  # the current wave, 0-based in the table (the API adds wave_number)
    Column("waves", Text, nullable=False),  # JSON: the cumulative shares asked for
    Column("wave_count", Integer, nullable=False),  # waves actually planned (a share may add nobody)
    Column("min_success_share", Float, nullable=False),
    Column("soak_s", Float, nullable=False),
    Column("wave_timeout_s", Float, nullable=False),
    Column("max_error_rate", Float),
    Column("rollback_on_failure", Boolean, nullable=False),
    Column("health_window_s", Float),
    Column("force_downgrade", Boolean, nullable=False),
    Column("allow_contract_change", Boolean, nullable=False),
    Column("reason", Text, nullable=False, default=""),
    Column("created_at", Float, nullable=False),
    Column("created_by", String(ID), nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("started_at", Float),
    Column("wave_started_at", Float),
    Column("soak_started_at", Float),
    Column("paused_at", Float),
    Column("finished_at", Float),
    Column("revision", Integer, nullable=False),  # optimistic concurrency: every change bumps it
    Index(None, "state"),
)

rollout_devices = Table(
    "rollout_devices", metadata,
    Column("rollout_id", String(ID), ForeignKey("rollouts.id"), primary_key=True),
    Column("device", String(ID), primary_key=True),
    Column("wave", Integer, nullable=False),
    Column("command_id", String(ID), nullable=False, unique=True),  # derived from (rollout, wave, device)
    Column("state", String(32), nullable=False),  # not_sent | sent | the job's state
    Column("final", Boolean, nullable=False),
    Column("reason", String(500), nullable=False, default=""),
    Column("sent_at", Float),
    Column("job_ts", Float),  # the device's ts of the newest job event applied (a late redelivery loses)
    Column("updated_at", Float),
    Column("undo_command_id", String(ID), unique=True),  # a rollback or cancel after a failed wave
    Column("undo_kind", String(16)),
    Column("undo_state", String(32)),
    Column("undo_reason", String(500)),
)

commands = Table(
    "commands", metadata,
    Column("id", String(ID), primary_key=True),  # the command id: recorded once, by one server
    Column("rollout_id", String(ID), ForeignKey("rollouts.id")),  # None: the reconciler's (target_commands)
    Column("device", String(ID), nullable=False),
    Column("kind", String(16), nullable=False),  # deploy | rollback | cancel
    Column("topic", String(300), nullable=False),
    Column("payload", LargeBinary, nullable=False),  # the signed wire bytes, resent unchanged
    Column("created_at", Float, nullable=False),
    Column("created_by", String(128), nullable=False),  # the server that recorded it
    Column("published_at", Float),  # the broker's PUBACK; None: maybe sent (a crash in between)
    Column("attempts", Integer, nullable=False),
    Index(None, "published_at"),
    Index(None, "rollout_id"),
    Index(None, "device", "created_at"),  # a device's update history (sdk/fleet_server/history.py)
)

rollout_transitions = Table(  # every change of a rollout's state, wave or soak, with who and why (never updated)
    "rollout_transitions", metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("rollout_id", String(ID), ForeignKey("rollouts.id"), nullable=False),
    Column("at", Float, nullable=False),
    Column("event", String(16), nullable=False),  # start | soak | advance | succeed | fail | pause | resume | abort
    Column("from_state", String(16), nullable=False),
    Column("to_state", String(16), nullable=False),
    Column("wave", Integer, nullable=False),  # 1-based: the wave the rollout is in after the transition
    Column("actor", String(128), nullable=False),  # the operator's token name, or server:<id> for the driver
    Column("reason", Text, nullable=False, default=""),
    Index(None, "rollout_id", "id"),
)

target_entries = Table(  # desired state: one row per (scope, model) the operator set (sdk/fleet_server/targets.py)
    "target_entries", metadata,
    Column("scope", String(8), primary_key=True),  # fleet | group | device
    Column("name", String(ID), primary_key=True),  # the group or device ("" for the fleet)
    Column("model", String(ID), primary_key=True),
    Column("artifact", String(64), nullable=False),  # an artifact sha256, or "absent"
    Column("revision", Integer, nullable=False),  # times the operator set this entry: a new decision
    Column("reason", Text, nullable=False, default=""),
    Column("set_by", String(ID), nullable=False),
    Column("set_at", Float, nullable=False),
)

target_holds = Table(  # scopes whose devices get no reconciler command while held
    "target_holds", metadata,
    Column("scope", String(8), primary_key=True),
    Column("name", String(ID), primary_key=True),
    Column("reason", Text, nullable=False, default=""),
    Column("set_by", String(ID), nullable=False),
    Column("set_at", Float, nullable=False),
)

target_commands = Table(  # the reconciler's deploys (their signed bytes are in commands; job states in job_events)
    "target_commands", metadata,
    Column("id", String(ID), primary_key=True),  # derived: targets.target_command_id
    Column("device", String(ID), nullable=False),
    Column("model", String(ID), nullable=False),
    Column("artifact", String(64), nullable=False),
    Column("source", String(200), nullable=False),  # fleet | group:NAME[+NAME] | device
    Column("revision", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Index(None, "device", "model"),
)

target_staged = Table(  # a target change made in waves: applied when its rollout succeeds
    "target_staged", metadata,
    Column("rollout_id", String(ID), ForeignKey("rollouts.id"), primary_key=True),
    Column("scope", String(8), nullable=False),  # fleet | group
    Column("name", String(ID), nullable=False),
    Column("model", String(ID), nullable=False),
    Column("artifact", String(64), nullable=False),
    Column("reason", Text, nullable=False, default=""),
    Column("set_by", String(ID), nullable=False),
    Column("set_at", Float, nullable=False),
    Column("applied_at", Float),  # None: not (yet) applied
)

device_models = Table(  # every model a device's newest online state lists (an agent holding several named models)
    "device_models", metadata,
    Column("device", String(ID), primary_key=True),
    Column("name", String(ID), primary_key=True),
    Column("version", String(128)),
    Column("model_sha256", String(64)),
)

device_rejected = Table(  # what each device's newest online state lists as rejected (its own bounded ledger)
    "device_rejected", metadata,
    Column("device", String(ID), primary_key=True),
    Column("sha256", String(64), primary_key=True),  # the artifact's
    Column("name", String(ID), nullable=False),
    Column("version", String(128), nullable=False),
    Column("stage", String(16), nullable=False),  # admission | smoke_test | health_window
    Column("reason", String(500), nullable=False),
    Column("device_ts", Float, nullable=False),  # when the device recorded it (its clock)
    Column("heard_at", Float, nullable=False),  # when the server first heard of it (its clock: what targets compare)
)

artifact_bad = Table(  # releases the operator marked bad fleet-wide: never sent while marked (bad_releases.py)
    "artifact_bad", metadata,
    Column("sha256", String(64), primary_key=True),  # the artifact's
    Column("reason", String(500), nullable=False),
    Column("actor", String(128), nullable=False),
    Column("at", Float, nullable=False),
)

settings_entries = Table(  # desired agent settings: one row per (scope, key) the operator set (settings.py)
    "settings_entries", metadata,
    Column("scope", String(8), primary_key=True),  # fleet | group | device
    Column("name", String(ID), primary_key=True),  # "" for the fleet
    Column("key", String(64), primary_key=True),  # a dotted agent.yaml key (settings.py: SETTING_KEYS)
    Column("value", Text, nullable=False),  # JSON, validated when set
    Column("set_by", String(ID), nullable=False),
    Column("set_at", Float, nullable=False),
)

fleet_keys = Table(  # release and operator public keys the fleet's devices are told to hold (settings.py)
    "fleet_keys", metadata,
    Column("key_id", String(16), primary_key=True),
    Column("kind", String(16), nullable=False),  # release | operator
    Column("pem", Text, nullable=False),
    Column("added_by", String(ID), nullable=False),
    Column("added_at", Float, nullable=False),
    Column("retired_at", Float),  # None: in use
)

settings_sent = Table(  # each settings document the server signed for a device (generation: per device, rising)
    "settings_sent", metadata,
    Column("device", String(ID), primary_key=True),
    Column("generation", Integer, primary_key=True),
    Column("digest", String(64), nullable=False),  # sha256 of the document's canonical JSON
    Column("command_id", String(ID), nullable=False),
    Column("created_at", Float, nullable=False),
)

settings_reports = Table(  # what each device's newest online state says about its settings
    "settings_reports", metadata,
    Column("device", String(ID), primary_key=True),
    Column("generation", Integer, nullable=False),  # 0: none from the server applied
    Column("results", Text, nullable=False),  # JSON: key -> "applied" | "refused: reason"
    Column("release_keys", Text, nullable=False),  # JSON list of key ids
    Column("operator_keys", Text, nullable=False),  # JSON list of key ids
    Column("heard_at", Float, nullable=False),
)

leases = Table(
    "leases", metadata,
    Column("name", String(ID), primary_key=True),
    Column("holder", String(128), nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("acquired_at", Float, nullable=False),
)

audit_log = Table(
    "audit_log", metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("ts", Float, nullable=False),
    Column("actor", String(ID), nullable=False),  # the token's name, never the token
    Column("action", String(64), nullable=False),
    Column("target", String(128), nullable=False),
    Column("outcome", String(16), nullable=False),  # ok | refused
    Column("detail", Text, nullable=False),  # JSON, bounded
    Column("remote", String(64), nullable=False),
    Index(None, "ts"),
    Index(None, "action", "id"),  # a page of one action; the bound on command.external entries
)


# --------------------------------------------------------------------------- engines


def normalise_url(url: str) -> str:
    """The SQLAlchemy URL for what a user typed: ``postgresql://`` means psycopg 3 (SQLAlchemy
    would pick psycopg2, which the ``server`` extra does not install); SQLite and PostgreSQL
    only. :class:`ServerConfigError` for anything else."""
    try:
        parsed = make_url(url)
    except ArgumentError as err:
        raise ServerConfigError(f"--db {url!r} is not a database URL (sqlite:///fleet.db, "
                                "postgresql://user@host/db)") from err
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        if parsed.drivername in ("postgresql", "postgresql+psycopg"):
            return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
        raise ServerConfigError(f"--db: PostgreSQL through {parsed.drivername!r} is not supported; use postgresql://")
    if backend == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            raise ServerConfigError("--db: an in-memory SQLite database would lose everything; give a file")
        return url
    raise ServerConfigError(f"--db: {backend!r} is not supported (sqlite:///FILE or postgresql://...)")


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None  # transactions are begun explicitly (see _sqlite_begin)
    cursor = dbapi_connection.cursor()
    for pragma in ("journal_mode=WAL", "synchronous=NORMAL", "busy_timeout=10000", "foreign_keys=ON"):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def _sqlite_begin(connection: Connection) -> None:
    immediate = connection.get_execution_options().get("edgepack_write", False)
    connection.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


class Database:
    """An engine plus the two ways the server uses it: :meth:`read` and :meth:`write`."""

    def __init__(self, url: str, *, pool_size: int = 8) -> None:
        self.url = normalise_url(url)
        parsed = make_url(self.url)
        self.dialect = parsed.get_backend_name()
        if self.dialect == "sqlite":
            private_database_file(_database_file(parsed).resolve())  # 0600, or tightened to it
            self.engine: Engine = create_engine(self.url, connect_args={"check_same_thread": False, "timeout": 10},
                                                pool_size=pool_size, max_overflow=8)
            event.listen(self.engine, "connect", _sqlite_pragmas)
            event.listen(self.engine, "begin", _sqlite_begin)
        else:
            self.engine = create_engine(self.url, pool_size=pool_size, max_overflow=8, pool_pre_ping=True,
                                        connect_args={"connect_timeout": 10})

    @property
    def is_sqlite(self) -> bool:
        return self.dialect == "sqlite"

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """A connection in a transaction for reads (a consistent snapshot on both backends)."""
        with self.engine.connect() as connection, connection.begin():
            yield connection

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction: committed when the block ends, rolled back if it raises. On
        SQLite it takes the write lock at its start (``BEGIN IMMEDIATE``)."""
        with self.engine.connect() as connection:
            connection.execution_options(edgepack_write=True)
            with connection.begin():
                yield connection

    def insert(self, table: Table) -> Any:
        """The dialect's INSERT, which has ``on_conflict_do_nothing`` / ``on_conflict_do_update``."""
        from sqlalchemy.dialects import postgresql, sqlite

        return sqlite.insert(table) if self.is_sqlite else postgresql.insert(table)

    def insert_new(self, connection: Connection, table: Table, values: dict[str, Any]) -> bool:
        """Insert one row unless its key (or a unique constraint) exists; True if it was new.
        (``rowcount`` of an ``ON CONFLICT DO NOTHING`` is not reliable on psycopg, so
        PostgreSQL is asked to return the new row's key.)"""
        statement = self.insert(table).on_conflict_do_nothing()
        if self.is_sqlite:
            return connection.execute(statement, values).rowcount == 1
        key = next(iter(table.primary_key.columns))
        return connection.execute(statement.returning(key), values).first() is not None

    def newest_first(self, table: Table, *, limit: int, before: int | None, **equal: Any) -> list[Any]:
        """One page of ``table`` (a log with an increasing ``id``): newest first, at most
        ``limit`` rows with ids below ``before``, each column named in ``equal`` equal to its
        value (None: any)."""
        query = select(table).order_by(table.c.id.desc()).limit(max(limit, 1))
        if before is not None:
            query = query.where(table.c.id < before)
        for name, value in equal.items():
            if value is not None:
                query = query.where(table.c[name] == value)
        with self.read() as connection:
            return list(connection.execute(query).mappings().all())

    def dispose(self) -> None:
        self.engine.dispose()

    def close(self) -> None:
        """A clean stop: on SQLite, every pooled connection closed, then the WAL folded into the
        database file and truncated (``wal_checkpoint(TRUNCATE)``), so the file alone holds the
        fleet (a copy of it, a backup of it, is complete). Call it after every user stopped."""
        self.engine.dispose()
        if not self.is_sqlite:
            return
        with self.engine.connect() as connection:
            busy, _frames, _done = connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()
        self.engine.dispose()
        if busy:
            log.warning("the SQLite checkpoint at stop was blocked by another connection: the WAL keeps data")


def sqlite_file(url: str) -> Path | None:
    """The file of a ``sqlite:///`` URL (None for other databases)."""
    parsed = make_url(normalise_url(url))
    return _database_file(parsed) if parsed.get_backend_name() == "sqlite" else None


def _database_file(parsed: URL) -> Path:
    """The file of a SQLite URL (:func:`normalise_url` refuses one without a file)."""
    if not parsed.database:
        raise ServerConfigError("--db: an in-memory SQLite database would lose everything; give a file")
    return Path(parsed.database).expanduser()


def has_fleet_schema(database: Database) -> bool:
    """Whether the database holds a fleet: Alembic's version table, or any of the fleet's tables."""
    from sqlalchemy import inspect

    names = set(inspect(database.engine).get_table_names())
    return "alembic_version" in names or bool(names & set(metadata.tables))


def open_database(url: str, *, migrate_schema: bool = True, stored_artifacts: int | None = None,
                  init: bool = False) -> Database:
    """Connect (one line naming the problem if that fails) and bring the schema to the newest
    migration. With ``stored_artifacts`` (the count in the artifact store beside it), a database
    that holds no fleet is refused unless ``init`` (:func:`new_fleet_refusal`).
    :class:`FleetServerError` when the database cannot be reached, upgraded or is refused."""
    file = sqlite_file(url)
    empty_file = file is not None and file.is_file() and file.stat().st_size == 0
    where = f"the database {file}" if file is not None else "the database"

    def refuse_unless_a_fleet(has_schema: bool) -> None:
        if stored_artifacts is None:
            return
        refusal = new_fleet_refusal(has_schema=has_schema, empty_file=empty_file, stored_artifacts=stored_artifacts,
                                    init=init, where=where)
        if refusal is not None:
            raise FleetServerError(refusal)

    if empty_file:
        refuse_unless_a_fleet(False)  # before a connection writes SQLite's header into it
    database = Database(url)
    try:
        with database.engine.connect():
            pass
        try:
            refuse_unless_a_fleet(has_fleet_schema(database))
        except FleetServerError:
            database.dispose()
            raise
        if migrate_schema:
            from sdk.fleet_server.schema_upgrade import migrate

            migrate(database)
    except SQLAlchemyError as err:
        database.dispose()
        reason = str(getattr(err, "orig", None) or err).strip().splitlines()[0][:300]
        raise FleetServerError(f"cannot use the database {make_url(database.url).render_as_string()}: "
                               f"{reason}") from err
    return database


from sdk.fleet_server import users as _users  # noqa: E402,F401  isort: skip  (its api_tokens table joins metadata)
from sdk.fleet_server import alert_table as _alert_table  # noqa: E402,F401  isort: skip  (the alerts table)
from sdk.fleet_server import device_pipelines, log_tables, report_card_table, rollout_golden  # noqa: E402,F401  tables
