"""Rejected versions as the devices report them: ``device_rejected`` (device, artifact sha256),
kept in step with each device's newest online state, so the reconciler never re-sends an
artifact a device refused (sdk/fleet_server/targets.py: device_rejected).

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "device_rejected",
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=128), nullable=False),
        sa.Column("stage", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("device_ts", sa.Float(), nullable=False),
        sa.Column("heard_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("device", "sha256", name=op.f("pk_device_rejected")),
    )


def downgrade() -> None:
    op.drop_table("device_rejected")
