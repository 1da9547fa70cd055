"""Remote agent settings and fleet keys (issue 25 items 3-4): ``settings_entries`` (what the
operator set per fleet, group or device), ``fleet_keys`` (release and operator public keys the
devices are told to hold), ``settings_sent`` (each signed document, by device and generation)
and ``settings_reports`` (what each device says it holds). sdk/fleet_server/settings.py.

Revision ID: 0014
Revises: 0013
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "settings_entries",
        sa.Column("scope", sa.String(length=8), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("set_by", sa.String(length=64), nullable=False),
        sa.Column("set_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("scope", "name", "key", name=op.f("pk_settings_entries")),
    )
    op.create_table(
        "fleet_keys",
        sa.Column("key_id", sa.String(length=16), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("pem", sa.Text(), nullable=False),
        sa.Column("added_by", sa.String(length=64), nullable=False),
        sa.Column("added_at", sa.Float(), nullable=False),
        sa.Column("retired_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("key_id", name=op.f("pk_fleet_keys")),
    )
    op.create_table(
        "settings_sent",
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(length=64), nullable=False),
        sa.Column("command_id", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("device", "generation", name=op.f("pk_settings_sent")),
    )
    op.create_table(
        "settings_reports",
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("generation", sa.Integer(), nullable=False),
        sa.Column("results", sa.Text(), nullable=False),
        sa.Column("release_keys", sa.Text(), nullable=False),
        sa.Column("operator_keys", sa.Text(), nullable=False),
        sa.Column("heard_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("device", name=op.f("pk_settings_reports")),
    )


def downgrade() -> None:
    for table in ("settings_reports", "settings_sent", "fleet_keys", "settings_entries"):
        op.drop_table(table)
