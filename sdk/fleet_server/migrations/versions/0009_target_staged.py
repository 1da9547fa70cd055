"""Staged target changes: ``target_staged`` (a target change made in waves by a rollout, applied
to ``target_entries`` when the rollout succeeds; sdk/fleet_server/desired.py).

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "target_staged",
        sa.Column("rollout_id", sa.String(length=64), nullable=False),
        sa.Column("scope", sa.String(length=8), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("artifact", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("set_by", sa.String(length=64), nullable=False),
        sa.Column("set_at", sa.Float(), nullable=False),
        sa.Column("applied_at", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"], name=op.f("fk_target_staged_rollout_id_rollouts")),
        sa.PrimaryKeyConstraint("rollout_id", name=op.f("pk_target_staged")),
    )


def downgrade() -> None:
    op.drop_table("target_staged")
