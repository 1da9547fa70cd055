"""Desired state: targets per fleet, group and device, holds, the reconciler's commands.

- ``target_entries``: (scope, name, model) -> artifact sha256 or "absent", with the revision,
  the operator's reason, who and when (sdk/fleet_server/targets.py).
- ``target_holds``: scopes whose devices get no reconciler command.
- ``target_commands``: the reconciler's deploys (derived ids); their signed bytes are rows of
  ``commands`` whose ``rollout_id`` is now NULL-able.
- ``artifacts.model_sha256``: the manifest's model file hash, what a device reports it runs.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "target_entries",
        sa.Column("scope", sa.String(length=8), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("artifact", sa.String(length=64), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("set_by", sa.String(length=64), nullable=False),
        sa.Column("set_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "name", "model", name=op.f("pk_target_entries")),
    )
    op.create_table(
        "target_holds",
        sa.Column("scope", sa.String(length=8), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("set_by", sa.String(length=64), nullable=False),
        sa.Column("set_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "name", name=op.f("pk_target_holds")),
    )
    op.create_table(
        "target_commands",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("artifact", sa.String(length=64), nullable=False),
        sa.Column("source", sa.String(length=200), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_target_commands")),
    )
    with op.batch_alter_table("target_commands", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_target_commands_device_model"), ["device", "model"], unique=False)
    with op.batch_alter_table("commands", schema=None) as batch_op:
        batch_op.alter_column("rollout_id", existing_type=sa.String(length=64), nullable=True)
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("model_sha256", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.drop_column("model_sha256")
    op.execute("DELETE FROM commands WHERE rollout_id IS NULL")
    with op.batch_alter_table("commands", schema=None) as batch_op:
        batch_op.alter_column("rollout_id", existing_type=sa.String(length=64), nullable=False)
    with op.batch_alter_table("target_commands", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_target_commands_device_model"))
    op.drop_table("target_commands")
    op.drop_table("target_holds")
    op.drop_table("target_entries")
