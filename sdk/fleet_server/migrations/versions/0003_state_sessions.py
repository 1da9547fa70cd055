"""States carry the connection they belong to: ``devices.state_epoch`` and ``state_session``.

A birth and the last will of one MQTT connection carry the same mark, so the ingest orders a
device's states by connection (``sdk/fleet_server/liveness.py``) instead of by when it heard them:
a will heard late, as a retained message, still beats the birth it follows.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("devices", schema=None) as batch_op:
        batch_op.add_column(sa.Column("state_epoch", sa.String(length=32), nullable=True))
        batch_op.add_column(sa.Column("state_session", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("devices", schema=None) as batch_op:
        batch_op.drop_column("state_session")
        batch_op.drop_column("state_epoch")
