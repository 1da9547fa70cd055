"""The tables of device enrollment (sdk/fleet_server/enrollment.py), on the fleet's one
``metadata`` (migration 0017_enroll).

They live beside :mod:`.db` rather than in it so that module stays within its size; the Alembic
environment and :mod:`.enrollment` import this module, so the tables are known wherever the
metadata is used. :func:`device_credentials` is their one read for the API.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, Float, Index, String, Table, Text, select

from sdk.fleet_server.db import ID, Database, metadata

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


MAX_LISTED_CERTIFICATES = 5


def device_credentials(database: Database, device: str) -> dict[str, Any]:
    """``GET /api/devices/{id}/credentials``: the device's newest certificates (serial, validity,
    revocation; never the certificate itself) and whether it holds a broker password. Empty for
    a device never enrolled through the server: what ``edgepack device show`` reads for the
    certificate's expiry."""
    c = device_certificates
    with database.read() as connection:
        rows = (
            connection.execute(
                select(c.c.serial, c.c.issued_at, c.c.not_before, c.c.not_after, c.c.revoked_at)
                .where(c.c.device == device)
                .order_by(c.c.issued_at.desc(), c.c.serial)
                .limit(MAX_LISTED_CERTIFICATES)
            )
            .mappings()
            .all()
        )
        password = connection.execute(
            select(device_passwords.c.device).where(device_passwords.c.device == device)
        ).first()
    return {"device": device, "certificates": [dict(row) for row in rows], "password": password is not None}
