"""The tables of device enrollment (sdk/fleet_server/enrollment.py), on the fleet's one
``metadata`` (migration 0017_enroll).

They live beside :mod:`.db` rather than in it so that module stays within its size; the Alembic
environment and :mod:`.enrollment` import this module, so the tables are known wherever the
metadata is used.
"""

from __future__ import annotations

from sqlalchemy import Column, Float, Index, String, Table, Text

from sdk.fleet_server.db import ID, metadata

enrollment_tokens = Table(  # one-time tokens: only their sha256 is kept (the token is printed once)
    "enrollment_tokens",
    metadata,
    Column("token_sha256", String(64), primary_key=True),
    Column("device", String(ID), nullable=False),
    Column("kind", String(16), nullable=False),  # certificate | password | renewal
    Column("groups", Text, nullable=False),  # JSON list: the groups enrollment sets (renewal: none)
    Column("created_at", Float, nullable=False),
    Column("created_by", String(128), nullable=False),
    Column("expires_at", Float, nullable=False),
    Column("used_at", Float),  # None: not used yet; a token is used once
    Index(None, "device"),
)

device_certificates = Table(  # every certificate the fleet CA issued
    "device_certificates",
    metadata,
    Column("serial", String(40), primary_key=True),  # hex
    Column("device", String(ID), nullable=False),
    Column("issued_at", Float, nullable=False),
    Column("not_before", Float, nullable=False),
    Column("not_after", Float, nullable=False),
    Column("revoked_at", Float),  # None: not revoked; listed in the CRL until it expires
    Column("renewal_command", String(ID)),  # the renew-certificate command sent for it (None: not yet)
    Column("renewal_sent_at", Float),  # when; sent again once its token expired unused
    Index(None, "device"),
    Index(None, "not_after"),
)

device_passwords = Table(  # devices enrolled with a broker password (--password): the mosquitto entry
    "device_passwords",
    metadata,
    Column("device", String(ID), primary_key=True),
    Column("entry", String(300), nullable=False),  # mosquitto's $7$ PBKDF2-SHA512 hash (never the password)
    Column("created_at", Float, nullable=False),
)
