"""The table of report cards (issue 26 item 7), on :data:`.db.metadata` (db.py imports this
module, so Alembic's comparison and every reader see it).

``device_report_cards``: per (device, model name), the card the device's newest online state
carries for the model it serves (``sdk/fleet_server/report_cards.py`` keeps it in step), with
the model version and file sha256 it was measured on, so cards aggregate per model version.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Boolean, Column, Float, Index, Integer, String, Table

from sdk.fleet_server.db import ID, metadata

device_report_cards = Table(
    "device_report_cards", metadata,
    Column("device", String(ID), primary_key=True),
    Column("name", String(ID), primary_key=True),  # the model's name
    Column("version", String(128)),
    Column("model_sha256", String(64)),
    Column("provider", String(64), nullable=False),
    Column("runs", Integer, nullable=False),
    Column("p50_ms", Float),
    Column("p99_ms", Float),
    Column("first_inference_ms", Float),
    Column("peak_rss_bytes", BigInteger),
    Column("nodes", Integer),
    Column("accelerated_nodes", Integer),
    Column("accelerated_share", Float),
    Column("budget_hit", Boolean, nullable=False),
    Column("measured_at", Float, nullable=False),  # the device's clock
    Column("heard_at", Float, nullable=False),  # when the server heard the state that carried it
    Index(None, "name", "version"),
)
