"""Report cards (issue 26 item 7): ``device_report_cards`` (device, model name) -> what the device
measured of that model at activation (latency p50/p99, time to first inference, peak RSS, the
share of nodes on an accelerated provider), with the version and model sha256 it was measured
on (sdk/fleet_server/report_cards.py).

Revision ID: 0018_report_cards
Revises: 0017_enroll
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0018_report_cards"
down_revision = "0017_enroll"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "device_report_cards",
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=128), nullable=True),
        sa.Column("model_sha256", sa.String(length=64), nullable=True),
        sa.Column("provider", sa.String(length=64), nullable=False),
        sa.Column("runs", sa.Integer(), nullable=False),
        sa.Column("p50_ms", sa.Float(), nullable=True),
        sa.Column("p99_ms", sa.Float(), nullable=True),
        sa.Column("first_inference_ms", sa.Float(), nullable=True),
        sa.Column("peak_rss_bytes", sa.BigInteger(), nullable=True),
        sa.Column("nodes", sa.Integer(), nullable=True),
        sa.Column("accelerated_nodes", sa.Integer(), nullable=True),
        sa.Column("accelerated_share", sa.Float(), nullable=True),
        sa.Column("budget_hit", sa.Boolean(), nullable=False),
        sa.Column("measured_at", sa.Float(), nullable=False),
        sa.Column("heard_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("device", "name", name=op.f("pk_device_report_cards")),
    )
    op.create_index(op.f("ix_device_report_cards_name_version"), "device_report_cards", ["name", "version"],
                    unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_device_report_cards_name_version"), table_name="device_report_cards")
    op.drop_table("device_report_cards")
