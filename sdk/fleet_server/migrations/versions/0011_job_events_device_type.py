"""An index on job events by device, type and id: the device list's ``update_status`` (the newest
deploy job of each device) becomes one index seek per device instead of a scan of its events
(10,000 devices with 90,000 events: 0.12 s without, 0.065 s with, on SQLite).

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(op.f("ix_job_events_device_type_id"), "job_events", ["device", "type", "id"])


def downgrade() -> None:
    op.drop_index(op.f("ix_job_events_device_type_id"), table_name="job_events")
