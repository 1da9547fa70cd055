"""Named API tokens with a role (``edgepack fleet token create``): only each token's sha256 is
kept; a name is unique among the tokens in force (sdk/fleet_server/users.py).

Revision ID: 0013
Revises: 0012
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("digest", sa.LargeBinary(length=32), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("created_by", sa.String(length=64), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.Column("revoked_by", sa.String(length=64), nullable=True),
        sa.Column("last_used_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_tokens")),
    )
    op.create_index(op.f("ix_api_tokens_digest"), "api_tokens", ["digest"], unique=True)
    op.create_index("ix_api_tokens_name_in_force", "api_tokens", ["name"], unique=True,
                    sqlite_where=sa.text("revoked_at IS NULL"), postgresql_where=sa.text("revoked_at IS NULL"))


def downgrade() -> None:
    op.drop_index("ix_api_tokens_name_in_force", table_name="api_tokens")
    op.drop_index(op.f("ix_api_tokens_digest"), table_name="api_tokens")
    op.drop_table("api_tokens")
