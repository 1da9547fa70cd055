"""Decommissioned devices: ``decommissioned`` (device, when, who, why).

A decommissioned device is removed from the fleet's tables and its retained state cleared; its
later messages are dropped until an operator enrolls it again (docs/fleet-server.md, "Devices").

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "decommissioned",
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.PrimaryKeyConstraint("device", name=op.f("pk_decommissioned")),
    )


def downgrade() -> None:
    op.drop_table("decommissioned")
