"""Device enrollment: one-time tokens, certificates for CSRs, broker passwords, rotation, revocation.

An admin asks for a token for a device id (``edgepack fleet enroll DEVICE_ID [--group G]
[--password]``); the server keeps only its SHA-256, with the device, the groups and an expiry.
On the device, ``edgepack-agent enroll`` makes a key, sends a CSR with the token
(``POST /api/enroll``, authenticated by nothing else) and gets back a certificate from the fleet
CA (:mod:`.ca`) whose CN is the device id, the CA bundle, the broker's address and the groups.
The token is claimed by one conditional UPDATE, so it works once even under two concurrent
requests; a CSR for another device id leaves it unused. With ``--password`` the server makes a
random password instead, delivered once, and keeps only mosquitto's hash of it for the generated
password file (:mod:`.broker_files`).

Rotation: once a certificate is past :data:`RENEW_AT` of its life, the leading server sends the
device a signed ``renew-certificate`` command carrying a fresh renewal token; the device makes a
new key and CSR and redeems it like an enrollment. The old certificate stays valid until it
expires (it is not revoked), so no reconnect fails in between. Revocation (``edgepack fleet
revoke``, and every decommission) marks the device's certificates revoked (the CRL lists them
until they expire) and removes its password entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import exists, or_, select, update
from sqlalchemy.engine import Connection

from edgepack_core.errors import SchemaError
from edgepack_core.fsutil import atomic_write
from edgepack_core.protocol.commands import build_command
from sdk.broker import parse_broker
from sdk.errors import ApiError, BrokerOptionError, ServerConfigError
from sdk.fleet_server import audit
from sdk.fleet_server import db as tables
from sdk.fleet_server.actions import CommandSink
from sdk.fleet_server.broker_files import SALT_BYTES, BrokerFiles, acl_text, password_entry, password_text
from sdk.fleet_server.ca import DEFAULT_VALIDITY_DAYS, FleetCA, Revoked, check_csr
from sdk.fleet_server.db import Database
from sdk.fleet_server.enrollment_tables import device_certificates, device_passwords, enrollment_tokens

CERTIFICATE, PASSWORD, RENEWAL = "certificate", "password", "renewal"
DEFAULT_TOKEN_TTL_S = 24 * 3600.0
MAX_TOKEN_TTL_S = 30 * 86400.0
MIN_TOKEN_TTL_S = 60.0
RENEW_AT = 2 / 3
"""A certificate past this share of its life gets a renew-certificate command."""
RENEWAL_TTL_S = 24 * 3600.0
"""A renewal command and its token live this long (less when the certificate expires sooner);
one that expired unused is sent again."""
MAX_RENEWALS_PER_ROUND = 500
RENEW_COMMAND_KIND = "renew-cert"  # the commands table's kind (16 characters at most)
USED = "this enrollment token was already used (a token works once: ask for a new one)"


def write_first_crl(ca: FleetCA, path: Path, now: float) -> bool:
    """An empty CRL at ``path`` unless a file is there (``edgepack fleet ca-init``: the broker
    needs its crlfile before the server that keeps it current can start). True if written."""
    try:
        atomic_write(path, ca.crl([], now, int(now) * 1000), mode=0o644, overwrite=False)
    except FileExistsError:
        return False
    return True


def new_token() -> str:
    """A one-time token: 256 random bits, URL-safe, after a prefix that names it (and keeps a
    leading ``-`` from reading as a command-line flag)."""
    return f"ept{secrets.token_urlsafe(32)}"


def token_digest(token: str) -> str:
    """What the database keeps of a token. A plain SHA-256 suffices: a token is 256 random bits."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def renewal_from(not_before: float, not_after: float) -> float:
    """When a certificate valid from ``not_before`` to ``not_after`` becomes due for rotation
    (:data:`RENEW_AT` of its life): one expression, so the renewal loop and the credentials
    document the dashboard warns from agree to the last bit. Pure."""
    return not_before + RENEW_AT * (not_after - not_before)


def renewal_due(not_before: float, not_after: float, now: float) -> bool:
    """Whether a certificate valid from ``not_before`` to ``not_after`` is due for rotation at
    ``now``: past :data:`RENEW_AT` of its life and not yet expired. Pure."""
    return renewal_from(not_before, not_after) <= now < not_after


def token_refusal(row: Any, device: str | None, now: float) -> str:
    """Why a token row cannot be redeemed now ("" when it can); ``device`` is the CSR's CN
    (None: a password enrollment, no CSR). Pure."""
    if row is None:
        return "not a valid enrollment token (ask an admin for one: edgepack fleet enroll DEVICE_ID)"
    if row.used_at is not None:
        return USED
    if row.expires_at <= now:
        return f"this enrollment token expired at {time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(row.expires_at))}"
    if row.kind != PASSWORD and device is None:
        return "this token is for a certificate: send a CSR (edgepack-agent enroll makes one)"
    if device is not None and device != row.device:
        return f"the CSR's CN {device[:64]!r} is not the device this token is for"
    return ""


def parse_enroll_broker(url: str) -> Broker:
    """``mqtts://HOST:PORT`` (TLS) or ``mqtt://HOST:PORT`` into a :class:`Broker`;
    :class:`ServerConfigError` otherwise. Pure."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in ("mqtt", "mqtts"):
        raise ServerConfigError(f"--enroll-broker must be mqtts://HOST:PORT or mqtt://HOST:PORT, got {url!r}")
    try:
        host, port = parse_broker(rest)
    except BrokerOptionError as err:
        raise ServerConfigError(f"--enroll-broker: {err}") from err
    return Broker(host, port, scheme == "mqtts")


@dataclass(frozen=True)
class EnrollConfig:
    """What ``fleet serve`` takes for enrollment (docs/enrollment.md lists each flag)."""

    ca_dir: Path = Path("fleet-ca")
    validity_days: int = DEFAULT_VALIDITY_DAYS
    broker: Broker | None = None  # None: the server's own broker address
    broker_ca: Path | None = None
    files: BrokerFiles = field(default_factory=BrokerFiles)
    files_interval_s: float = 10.0
    renew_interval_s: float = 60.0


@dataclass(frozen=True)
class Broker:
    """The broker address enrolled devices are given (``--enroll-broker``)."""

    host: str
    port: int
    tls: bool

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "tls": self.tls}


@dataclass
class Enrollment:
    """Enrollment on one fleet server: its CA, what devices are told, the broker files."""

    database: Database
    ca_dir: Path
    broker: Broker
    validity_days: int = DEFAULT_VALIDITY_DAYS
    extra_ca: str = ""  # the CA that signed the broker's server certificate, when not the fleet CA
    files: BrokerFiles = field(default_factory=BrokerFiles)
    crl_number: int = 0
    _ca: FleetCA | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def ca(self) -> FleetCA:
        """The fleet CA, made in ``ca_dir`` on first use."""
        with self._lock:
            if self._ca is None:
                self._ca = FleetCA.open(self.ca_dir, validity_days=self.validity_days, now=time.time())
            return self._ca

    @property
    def ca_bundle(self) -> str:
        return self.ca.pem + self.extra_ca

    # ---------------------------------------------------------------- tokens (admins)

    def create_token(
        self,
        device: str,
        groups: list[str],
        *,
        password: bool,
        ttl_s: float,
        actor: str,
        remote: str,
        now: float | None = None,
    ) -> dict[str, Any]:
        """A new one-time token for ``device`` (printed once; only its hash is kept), audited
        ``device.enroll_identity``."""
        now = time.time() if now is None else now
        if not MIN_TOKEN_TTL_S <= ttl_s <= MAX_TOKEN_TTL_S:
            raise SchemaError("expires_in_s", f"must be {MIN_TOKEN_TTL_S:.0f} to {MAX_TOKEN_TTL_S:.0f} seconds")
        token = new_token()
        kind = PASSWORD if password else CERTIFICATE
        row = {
            "token_sha256": token_digest(token),
            "device": device,
            "kind": kind,
            "groups": json.dumps(groups),
            "created_at": now,
            "created_by": actor[:128],
            "expires_at": now + ttl_s,
            "used_at": None,
        }
        with self.database.write() as connection:
            connection.execute(enrollment_tokens.insert(), row)
            audit.record(
                connection,
                actor=actor,
                action="device.enroll_identity",
                target=device,
                remote=remote,
                now=now,
                detail={"kind": kind, "groups": groups, "expires_at": now + ttl_s},
            )
        return {"device": device, "token": token, "kind": kind, "groups": groups, "expires_at": now + ttl_s}

    # ---------------------------------------------------------------- redeeming (devices)

    def redeem(self, token: str, csr_pem: str | None, *, remote: str, now: float | None = None) -> dict[str, Any]:
        """A device's enrollment or renewal: its certificate (or password) and what it needs to
        connect. 403 naming why for a token that cannot be used; 400 for a CSR that is not one."""
        now = time.time() if now is None else now
        try:
            parsed = check_csr(csr_pem) if csr_pem is not None else None
        except SchemaError as err:  # well-formed JSON, but not a CSR this CA signs
            raise ApiError(422, "invalid", str(err)) from err
        digest = token_digest(token)
        t = enrollment_tokens
        with self.database.write() as connection:
            row = connection.execute(select(t).where(t.c.token_sha256 == digest)).first()
            refusal = token_refusal(row, None if parsed is None else parsed[1], now)
            if refusal or row is None:
                raise ApiError(403, "forbidden", refusal)
            claimed = connection.execute(
                update(t).where(t.c.token_sha256 == digest, t.c.used_at.is_(None)).values(used_at=now)
            )
            if claimed.rowcount != 1:  # another request used it in between
                raise ApiError(403, "forbidden", USED)
            answer = self._issue(connection, row, parsed, now)
            audit.record(
                connection,
                actor=f"device:{row.device}",
                action=f"device.{row.kind}",
                target=row.device,
                remote=remote,
                now=now,
                detail={k: v for k, v in answer.items() if k in ("serial", "groups")},
            )
        self.refresh_files(now)
        return answer

    def _issue(self, connection: Connection, row: Any, parsed: Any, now: float) -> dict[str, Any]:
        device = row.device
        answer: dict[str, Any] = {"device": device, "broker": self.broker.to_json(), "ca": self.ca_bundle}
        if row.kind != RENEWAL:
            answer["groups"] = self._enroll_groups(connection, device, json.loads(row.groups), now)
        if row.kind == PASSWORD:  # a CSR sent with it (edgepack-agent enroll always sends one) is not signed
            password = secrets.token_urlsafe(32)
            entry = password_entry(password, os.urandom(SALT_BYTES))
            p = device_passwords
            connection.execute(p.delete().where(p.c.device == device))
            connection.execute(p.insert(), {"device": device, "entry": entry, "created_at": now})
            return {**answer, "username": device, "password": password}
        assert parsed is not None
        issued = self.ca.issue(parsed[0], device, now)
        connection.execute(
            device_certificates.insert(),
            {
                "serial": issued.serial,
                "device": device,
                "issued_at": now,
                "not_before": issued.not_before,
                "not_after": issued.not_after,
                "revoked_at": None,
                "renewal_command": None,
                "renewal_sent_at": None,
            },
        )
        return {**answer, "certificate": issued.pem, "serial": issued.serial, "not_after": issued.not_after}

    def _enroll_groups(self, connection: Connection, device: str, groups: list[str], now: float) -> list[str]:
        """The server holds the device's groups: exactly the token's; the device row is made
        when the server has not heard of it yet, and a decommission mark is lifted."""
        d, g = tables.devices, tables.device_groups
        if connection.execute(select(d.c.id).where(d.c.id == device)).first() is None:
            connection.execute(
                d.insert(),
                {"id": device, "status": "unknown", "status_reason": "enrolled", "first_seen": now, "last_seen": now},
            )
        connection.execute(d.update().where(d.c.id == device).values(groups_enrolled_at=now))
        connection.execute(g.delete().where(g.c.device == device))
        if groups:
            connection.execute(g.insert(), [{"device": device, "group_name": name} for name in groups])
        connection.execute(tables.decommissioned.delete().where(tables.decommissioned.c.device == device))
        return groups

    # ---------------------------------------------------------------- revocation

    def revoke(
        self, device: str, *, reason: str, actor: str, remote: str, now: float | None = None, must_exist: bool = True
    ) -> dict[str, Any]:
        """Revoke every unexpired certificate of ``device`` and remove its broker password; its
        unused tokens are voided. Audited ``device.revoke``; 404 for a device with neither
        (unless ``must_exist`` is off: a decommission revokes what there is)."""
        now = time.time() if now is None else now
        c, p, t = device_certificates, device_passwords, enrollment_tokens
        with self.database.write() as connection:
            serials = list(
                connection.execute(
                    select(c.c.serial).where(c.c.device == device, c.c.revoked_at.is_(None), c.c.not_after > now)
                ).scalars()
            )
            connection.execute(update(c).where(c.c.serial.in_(serials)).values(revoked_at=now))
            removed = connection.execute(p.delete().where(p.c.device == device)).rowcount > 0
            connection.execute(update(t).where(t.c.device == device, t.c.used_at.is_(None)).values(used_at=now))
            if not serials and not removed and must_exist:
                raise ApiError(404, "not_found", f"{device} holds no valid certificate or broker password")
            audit.record(
                connection,
                actor=actor,
                action="device.revoke",
                target=device,
                remote=remote,
                now=now,
                detail={"reason": reason, "serials": serials, "password_removed": removed},
            )
        self.refresh_files(now)
        return {"device": device, "revoked": serials, "password_removed": removed, "reason": reason}

    # ---------------------------------------------------------------- rotation (the leading server)

    def send_renewals(self, sink: CommandSink, now: float) -> int:
        """Send a signed renew-certificate command, with a fresh renewal token, for each
        certificate past :data:`RENEW_AT` of its life (and again for one whose token expired
        unused). Returns how many were sent."""
        c, newer = device_certificates, device_certificates.alias("newer")
        resend_before = now - RENEWAL_TTL_S
        superseded = exists().where(newer.c.device == c.c.device, newer.c.issued_at > c.c.issued_at,
                                    newer.c.revoked_at.is_(None))
        with self.database.read() as connection:
            rows = connection.execute(
                select(c)
                .where(
                    c.c.revoked_at.is_(None),
                    c.c.not_after > now,
                    c.c.not_before + (c.c.not_after - c.c.not_before) * RENEW_AT <= now,
                    or_(c.c.renewal_sent_at.is_(None), c.c.renewal_sent_at < resend_before),
                    ~superseded,  # only a device's newest certificate is rotated
                )
                .order_by(c.c.not_after)
                .limit(MAX_RENEWALS_PER_ROUND)
            ).all()
        due = [row for row in rows if renewal_due(row.not_before, row.not_after, now)]
        recorded = [command for row in due if (command := self._renew(sink, row, now)) is not None]
        if recorded:
            sink.publish(recorded, now)
        return len(recorded)

    def _renew(self, sink: CommandSink, row: Any, now: float) -> dict[str, Any] | None:
        c = device_certificates
        ttl = min(RENEWAL_TTL_S, row.not_after - now)
        token = new_token()
        command = build_command("renew-certificate", device=row.device, ttl_s=ttl, now=now, token=token)
        with self.database.write() as connection:
            unchanged = (
                c.c.renewal_sent_at.is_(None)
                if row.renewal_sent_at is None
                else c.c.renewal_sent_at == row.renewal_sent_at
            )
            claimed = connection.execute(
                update(c)
                .where(c.c.serial == row.serial, unchanged)
                .values(renewal_command=command["id"], renewal_sent_at=now)
            )
            if claimed.rowcount != 1:  # another server sent it
                return None
            connection.execute(
                enrollment_tokens.insert(),
                {
                    "token_sha256": token_digest(token),
                    "device": row.device,
                    "kind": RENEWAL,
                    "groups": "[]",
                    "created_at": now,
                    "created_by": "server",
                    "expires_at": now + ttl,
                    "used_at": None,
                },
            )
            return sink.record_command(connection, row.device, RENEW_COMMAND_KIND, command, now)

    # ---------------------------------------------------------------- broker files

    def revoked(self, now: float) -> list[Revoked]:
        c = device_certificates
        with self.database.read() as connection:
            return [
                Revoked(serial, at)
                for serial, at in connection.execute(
                    select(c.c.serial, c.c.revoked_at)
                    .where(c.c.revoked_at.is_not(None), c.c.not_after > now)
                    .order_by(c.c.serial)
                )
            ]

    def refresh_files(self, now: float | None = None) -> bool:
        """Rewrite the broker files that changed (ACL from the groups the server holds, CRL,
        password file) and reload the broker if any did. True when something was written."""
        now = time.time() if now is None else now
        files = self.files
        changed = False
        if files.acl is not None:
            text = acl_text(files.acl_base_lines(), self._groups(), files.root)
            changed |= files.write(files.acl, text.encode(), 0o644)
        if files.crl is not None:
            revoked = self.revoked(now)
            key = ",".join(r.serial for r in revoked)
            if files.crl not in files.written_for or files.written_for[files.crl] != key:
                self.crl_number += 1
                changed |= files.write(files.crl, self.ca.crl(revoked, now, int(now) * 1000 + self.crl_number), 0o644)
                files.written_for[files.crl] = key
        if files.passwords is not None:
            with self.database.read() as connection:
                entries = dict(connection.execute(select(device_passwords.c.device, device_passwords.c.entry)).all())
            changed |= files.write(files.passwords, password_text(files.base_passwords(), entries).encode(), 0o640)
        if changed:
            files.reload()
        return changed

    def _groups(self) -> dict[str, list[str]]:
        g = tables.device_groups
        groups: dict[str, list[str]] = {}
        with self.database.read() as connection:
            for device, group in connection.execute(select(g.c.device, g.c.group_name)):
                groups.setdefault(device, []).append(group)
        return groups
