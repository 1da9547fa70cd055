"""The ``alerts`` table: one row per incident (fired, then resolved) and per rollout notice.

Why a table and not memory: an open incident's ``open_key`` (``KIND:SUBJECT``) is unique, so a
key fires once until it resolved even across a restart or a change of the leading server; a
notice's key names its transition, so it is sent once. Kept here, not in :mod:`.db` (which
imports this module so the table joins its metadata), to keep that module's size in bounds.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Column, Float, Index, String, Table, Text

from sdk.fleet_server.db import RowId, metadata

alerts = Table(  # one row per incident (fired, resolved) or rollout notice
    "alerts", metadata,
    Column("id", RowId, primary_key=True, autoincrement=True),
    Column("kind", String(32), nullable=False),  # offline | error_rate | failed_update | rollout
    Column("subject", String(128), nullable=False),  # the device or the rollout
    Column("state", String(16), nullable=False),  # open | resolved | notice
    Column("open_key", String(200), unique=True),  # kind:subject while open (one per key); a notice's own key
    Column("opened_at", Float, nullable=False),
    Column("resolved_at", Float),
    Column("summary", String(500), nullable=False),
    Column("detail", Text, nullable=False),  # JSON, bounded
    Column("source_id", BigInteger),  # a rollout notice's rollout_transitions id (where the next look starts)
    Index(None, "opened_at"),
)
