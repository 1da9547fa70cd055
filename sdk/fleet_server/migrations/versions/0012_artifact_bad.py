"""Releases marked bad fleet-wide: ``artifact_bad`` (artifact sha256 -> who, when, why). The
reconciler never sends a marked artifact, new rollouts and targets naming it are refused and
running rollouts carrying it are paused (sdk/fleet_server/bad_releases.py).

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "artifact_bad",
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("sha256", name=op.f("pk_artifact_bad")),
    )


def downgrade() -> None:
    op.drop_table("artifact_bad")
