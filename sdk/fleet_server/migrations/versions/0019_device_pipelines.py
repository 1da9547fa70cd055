"""Pipelines on the fleet server (issue 26): ``device_pipelines`` (device) -> the ``pipelines``
section of the device's newest telemetry with each pipeline's frames per second
(sdk/fleet_server/device_pipelines.py).

Revision ID: 0019_device_pipelines
Revises: 0018_report_cards
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0019_device_pipelines"
down_revision = "0018_report_cards"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "device_pipelines",
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=True),
        sa.Column("clock", sa.Float(), nullable=False),
        sa.Column("heard_at", sa.Float(), nullable=False),
        sa.Column("figures", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("device", name=op.f("pk_device_pipelines")),
    )


def downgrade() -> None:
    op.drop_table("device_pipelines")
