"""Remote logs: ``device_logs`` (records devices sent in answer to fetch-logs, unique by device,
ts and seq; the newest per device kept) and ``device_log_chunks`` (which chunks of which request
arrived). sdk/fleet_server/log_tables.py.

Revision ID: 0015
Revises: 0014
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "device_logs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("ts", sa.Float(), nullable=False),
        sa.Column("level", sa.String(length=16), nullable=False),
        sa.Column("logger", sa.String(length=128), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("request", sa.String(length=64), nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_device_logs")),
        sa.UniqueConstraint("device", "ts", "seq", name=op.f("uq_device_logs_device_ts_seq")),
    )
    op.create_index(op.f("ix_device_logs_device_ts"), "device_logs", ["device", "ts"], unique=False)
    op.create_table(
        "device_log_chunks",
        sa.Column("request", sa.String(length=64), nullable=False),
        sa.Column("chunk", sa.Integer(), nullable=False),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("records", sa.Integer(), nullable=False),
        sa.Column("last", sa.Boolean(), nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("request", "chunk", name=op.f("pk_device_log_chunks")),
    )
    op.create_index(op.f("ix_device_log_chunks_device_received_at"), "device_log_chunks", ["device", "received_at"],
                    unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_device_log_chunks_device_received_at"), table_name="device_log_chunks")
    op.drop_table("device_log_chunks")
    op.drop_index(op.f("ix_device_logs_device_ts"), table_name="device_logs")
    op.drop_table("device_logs")
