"""Several named models per device: ``device_models`` (device, model name) -> version and model
file sha256, kept in step with each device's newest online state (its ``models`` list), which the
reconciler compares with targets (sdk/fleet_server/desired.py).

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "device_models",
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("version", sa.String(length=128), nullable=True),
        sa.Column("model_sha256", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("device", "name", name=op.f("pk_device_models")),
    )


def downgrade() -> None:
    op.drop_table("device_models")
