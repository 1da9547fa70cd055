"""Device enrollment: one-time tokens, the certificates the fleet CA issued, broker passwords.

``enrollment_tokens`` (sha256 of the token -> device, kind, groups, expiry, use),
``device_certificates`` (serial -> device, validity, revocation, the renewal sent) and
``device_passwords`` (device -> its mosquitto password-file hash) (sdk/fleet_server/enrollment.py).

Revision ID: 0017_enroll
Revises: 0016_alerts
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017_enroll"
down_revision = "0016_alerts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "enrollment_tokens",
        sa.Column("token_sha256", sa.String(length=64), nullable=False),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("kind", sa.String(length=16), nullable=False),
        sa.Column("groups", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.Column("used_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("token_sha256", name=op.f("pk_enrollment_tokens")),
    )
    op.create_index(op.f("ix_enrollment_tokens_device"), "enrollment_tokens", ["device"])
    op.create_table(
        "device_certificates",
        sa.Column("serial", sa.String(length=40), nullable=False),
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("issued_at", sa.Float(), nullable=False),
        sa.Column("not_before", sa.Float(), nullable=False),
        sa.Column("not_after", sa.Float(), nullable=False),
        sa.Column("revoked_at", sa.Float(), nullable=True),
        sa.Column("renewal_command", sa.String(length=64), nullable=True),
        sa.Column("renewal_sent_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("serial", name=op.f("pk_device_certificates")),
    )
    op.create_index(op.f("ix_device_certificates_device"), "device_certificates", ["device"])
    op.create_index(op.f("ix_device_certificates_not_after"), "device_certificates", ["not_after"])
    op.create_table(
        "device_passwords",
        sa.Column("device", sa.String(length=64), nullable=False),
        sa.Column("entry", sa.String(length=300), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("device", name=op.f("pk_device_passwords")),
    )


def downgrade() -> None:
    op.drop_table("device_passwords")
    op.drop_index(op.f("ix_device_certificates_not_after"), table_name="device_certificates")
    op.drop_index(op.f("ix_device_certificates_device"), table_name="device_certificates")
    op.drop_table("device_certificates")
    op.drop_index(op.f("ix_enrollment_tokens_device"), table_name="enrollment_tokens")
    op.drop_table("enrollment_tokens")
