"""Error kinds in the telemetry history: ``telemetry_raw.error_kinds`` and
``telemetry_rollup.error_kinds`` (JSON ``{kind: count}``), so the device page charts errors by
kind (a model answering NaN shows as ``non_finite_output``, not as an anonymous count). Rows
stored before this revision have none (their errors still count, under no kind).

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for table in ("telemetry_raw", "telemetry_rollup"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.add_column(sa.Column("error_kinds", sa.Text(), nullable=True))


def downgrade() -> None:
    for table in ("telemetry_raw", "telemetry_rollup"):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column("error_kinds")
