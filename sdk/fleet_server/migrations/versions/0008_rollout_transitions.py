"""Rollout transitions and a device index on commands (issue 24 items 6 and 8).

``rollout_transitions`` keeps every change of a rollout (event, from, to, 1-based wave, actor,
reason, time): the rollout row's ``reason`` is only the latest. ``ix_commands_device_created_at``
serves a device's update history (``GET /api/devices/{id}/history``); ``ix_audit_log_action_id``
one action's page and the bound on ``command.external`` entries.

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "rollout_transitions",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("rollout_id", sa.String(length=64), nullable=False),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("event", sa.String(length=16), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=False),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("wave", sa.Integer(), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["rollout_id"], ["rollouts.id"], name=op.f("fk_rollout_transitions_rollout_id_rollouts")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_rollout_transitions")),
    )
    op.create_index(op.f("ix_rollout_transitions_rollout_id_id"), "rollout_transitions", ["rollout_id", "id"])
    op.create_index(op.f("ix_commands_device_created_at"), "commands", ["device", "created_at"])
    op.create_index(op.f("ix_audit_log_action_id"), "audit_log", ["action", "id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_audit_log_action_id"), table_name="audit_log")
    op.drop_index(op.f("ix_commands_device_created_at"), table_name="commands")
    op.drop_index(op.f("ix_rollout_transitions_rollout_id_id"), table_name="rollout_transitions")
    op.drop_table("rollout_transitions")
