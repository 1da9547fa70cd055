"""The tables of remote logs (issue 25 item 5), on :data:`.db.metadata` (db.py imports this
module, so Alembic's comparison and every reader see them).

``device_logs``: the records devices sent in answer to ``fetch-logs`` commands, unique by
(device, ts, seq) so a record fetched twice is stored once; the newest
:data:`~.log_ingest.MAX_RECORDS_PER_DEVICE` per device are kept. ``device_log_chunks``: which
chunks of which request arrived (the CLI waits for an answer to be complete); the newest
:data:`~.log_ingest.MAX_CHUNKS_PER_DEVICE` per device are kept.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Column, Float, Index, Integer, String, Table, Text, UniqueConstraint

from sdk.fleet_server.db import ID, RowId, metadata

device_logs = Table(
    "device_logs", metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("device", String(ID), nullable=False),
    Column("seq", BigInteger, nullable=False),  # the record's number in the device's ring
    Column("ts", Float, nullable=False),  # when the device logged it (its clock)
    Column("level", String(16), nullable=False),
    Column("logger", String(128), nullable=False),
    Column("message", Text, nullable=False),  # at most 4096 characters, redacted on the device
    Column("request", String(ID), nullable=False),  # the fetch-logs command that brought it
    Column("received_at", Float, nullable=False),
    UniqueConstraint("device", "ts", "seq"),
    Index(None, "device", "ts"),
)

device_log_chunks = Table(
    "device_log_chunks", metadata,
    Column("request", String(ID), primary_key=True),
    Column("chunk", Integer, primary_key=True),
    Column("device", String(ID), nullable=False),
    Column("records", Integer, nullable=False),
    Column("last", Boolean, nullable=False),
    Column("received_at", Float, nullable=False),
    Index(None, "device", "received_at"),
)
