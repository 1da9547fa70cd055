"""Golden stream counts of a rollout device's job: ``rollout_devices.golden_events`` and
``golden_mismatches``, stored from the job's typed detail (sdk/fleet_server/rollout_golden.py)
so a failed wave counts mismatches without parsing the job's reason. Rows stored before this
revision have none.

Revision ID: 0020_rollout_golden
Revises: 0019_device_pipelines
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0020_rollout_golden"
down_revision = "0019_device_pipelines"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("rollout_devices", schema=None) as batch_op:
        batch_op.add_column(sa.Column("golden_events", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("golden_mismatches", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("rollout_devices", schema=None) as batch_op:
        batch_op.drop_column("golden_mismatches")
        batch_op.drop_column("golden_events")
