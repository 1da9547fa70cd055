"""Ingest guards: dead letters, states ordered by when the server heard them, enrolled groups.

- ``dead_letters``: device messages that parsed but could not be stored (bounded by the ingest).
- ``devices.state_heard``: the server's receipt time of the state applied (ordering; a device's
  own ts is kept as reported in ``state_ts``).
- ``devices.groups_enrolled_at`` and ``device_claimed_groups``: ``device_groups`` now holds the
  groups the server enrolled; what a device claims is kept apart. Groups stored before this
  revision were taken from the devices' claims: they stay enrolled (and are the claims too).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "dead_letters",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("received_at", sa.Float(), nullable=False),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("topic", sa.String(length=300), nullable=False),
        sa.Column("reason", sa.String(length=500), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("payload_head", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_dead_letters")),
    )
    with op.batch_alter_table("dead_letters", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_dead_letters_received_at"), ["received_at"], unique=False)

    op.create_table(
        "device_claimed_groups",
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("group_name", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("device", "group_name", name=op.f("pk_device_claimed_groups")),
    )
    with op.batch_alter_table("devices", schema=None) as batch_op:
        batch_op.add_column(sa.Column("state_heard", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("groups_enrolled_at", sa.Float(), nullable=True))
    op.execute("INSERT INTO device_claimed_groups (device, group_name) SELECT device, group_name FROM device_groups")
    op.execute("UPDATE devices SET groups_enrolled_at = first_seen WHERE id IN (SELECT device FROM device_groups)")


def downgrade() -> None:
    with op.batch_alter_table("devices", schema=None) as batch_op:
        batch_op.drop_column("groups_enrolled_at")
        batch_op.drop_column("state_heard")
    op.drop_table("device_claimed_groups")
    with op.batch_alter_table("dead_letters", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_dead_letters_received_at"))
    op.drop_table("dead_letters")
