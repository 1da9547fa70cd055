"""Desired agent settings and fleet keys on the database, and their reconciler round.

The I/O around the pure :mod:`.settings`: entries set per scope and keys added or retired (each
write audited with the operator in the same transaction), the devices' reports stored by the
ingest, and :func:`reconcile`, which the driver runs in its round: every device whose effective
document changed, or whose newest document it does not hold after a while, gets the next
generation as a signed ``apply-settings`` (recorded in ``settings_sent`` and ``commands`` before
it is published, so a second server cannot send the same generation).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.engine import Connection

from edgepack_core.errors import KeyFileError, SchemaError
from edgepack_core.protocol.commands import build_command, new_command_id
from edgepack_core.protocol.messages import DeviceState
from edgepack_core.settings_doc import KEY_KINDS_OF, check_value, parse_keys, schema_of
from edgepack_core.signing import (
    KEY_KINDS,
    OPERATOR,
    check_kind,
    file_kind,
    key_id,
    public_key_from_pem,
    public_key_pem,
)
from sdk.errors import ApiError
from sdk.fleet_server import audit
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database
from sdk.fleet_server.settings import (
    DEVICE,
    FLEET,
    GROUP,
    KEY_SETTING,
    Decision,
    Effective,
    FleetKey,
    Sent,
    SettingsScopes,
    decide,
    effective,
)

MAX_ENTRIES = 64  # keys one scope may hold
MAX_FLEET_KEYS = 64  # keys of all kinds ever added (retired included)
RETRY_S = 3600.0  # a document the device does not hold after this long is sent again (a new generation)


# ---------------------------------------------------------------- reading


def load_scopes(connection: Connection) -> SettingsScopes:
    fleet: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    devices: dict[str, dict[str, Any]] = {}
    for row in connection.execute(select(tables.settings_entries)).mappings():
        value = json.loads(row["value"])
        if row["scope"] == FLEET:
            fleet[row["key"]] = value
        else:
            (groups if row["scope"] == GROUP else devices).setdefault(row["name"], {})[row["key"]] = value
    return SettingsScopes(fleet, groups, devices)


def load_keys(connection: Connection) -> list[FleetKey]:
    rows = connection.execute(select(tables.fleet_keys).order_by(tables.fleet_keys.c.added_at)).mappings()
    return [FleetKey(r["key_id"], r["kind"], r["pem"], r["added_at"], r["retired_at"]) for r in rows]


def _groups_of(connection: Connection) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for device, group in connection.execute(select(tables.device_groups.c.device, tables.device_groups.c.group_name)):
        out.setdefault(device, []).append(group)
    return out


def sent_documents(connection: Connection, device: str | None = None) -> dict[str, Sent]:
    table = tables.settings_sent
    query = select(table) if device is None else select(table).where(table.c.device == device)
    newest: dict[str, Sent] = {}
    for row in connection.execute(query).mappings():
        seen = newest.get(row["device"])
        if seen is None or row["generation"] > seen.generation:
            newest[row["device"]] = Sent(row["generation"], row["digest"], row["command_id"], row["created_at"])
    return newest


def device_reports(connection: Connection, device: str | None = None) -> dict[str, Any]:
    table = tables.settings_reports
    query = select(table) if device is None else select(table).where(table.c.device == device)
    return {row["device"]: row for row in connection.execute(query).mappings()}


def held_operator_keys(connection: Connection, device: str) -> tuple[str, ...]:
    """The operator key ids ``device`` last reported holding (() when it reported none)."""
    row = connection.execute(
        select(tables.settings_reports.c.operator_keys).where(tables.settings_reports.c.device == device)
    ).first()
    return () if row is None else tuple(json.loads(row[0]))


def plans(
    connection: Connection, now: float, devices: Sequence[str] | None = None
) -> list[tuple[str, Effective, Decision]]:
    """Each device's effective document and the reconciler's decision."""
    scopes, keys, groups = load_scopes(connection), load_keys(connection), _groups_of(connection)
    d = tables.devices
    query = select(d.c.id, d.c.status).order_by(d.c.id)
    if devices is not None:
        query = query.where(d.c.id.in_(list(devices)))
    rows = connection.execute(query).all()
    one = rows[0].id if devices is not None and len(rows) == 1 else None
    sent, reported = sent_documents(connection, one), device_reports(connection, one)
    out = []
    for device, status in rows:
        document = effective(scopes, keys, device, groups.get(device, ()))
        report = reported.get(device)
        decision = decide(
            document,
            sent.get(device),
            None if report is None else report["generation"],
            online=status == "online",
            now=now,
            retry_s=RETRY_S,
        )
        out.append((device, document, decision))
    return out


# ---------------------------------------------------------------- the reconciler's round


def reconcile(driver: Any, now: float) -> int:
    """Send every device that needs one its next settings document (signed by the driver's
    :meth:`record_command`). Returns how many were sent."""
    with driver.database.read() as connection:
        if (
            connection.execute(select(tables.settings_entries.c.key).limit(1)).first() is None
            and connection.execute(select(tables.fleet_keys.c.key_id).limit(1)).first() is None
        ):
            return 0
        sends = [(device, doc, decision) for device, doc, decision in plans(connection, now) if decision.kind == "send"]
    to_publish: list[dict[str, Any]] = []
    with driver.database.write() as connection:
        for device, document, decision in sends:
            command_id = new_command_id("settings", str(decision.generation))
            if not driver.database.insert_new(
                connection,
                tables.settings_sent,
                {
                    "device": device,
                    "generation": decision.generation,
                    "digest": document.digest,
                    "command_id": command_id,
                    "created_at": now,
                },
            ):
                continue  # another server made this generation
            command = build_command(
                "apply-settings",
                device=device,
                command_id=command_id,
                ttl_s=driver.config.command_ttl_s,
                now=now,
                generation=decision.generation,
                settings=dict(document.settings),
            )
            recorded = driver.record_command(connection, device, "apply-settings", command, now)
            if recorded is not None:
                to_publish.append(recorded)
    driver.publish(to_publish, now)
    return len(to_publish)


# ---------------------------------------------------------------- writes


def set_entries(
    database: Database,
    scope: str,
    name: str,
    values: dict[str, Any],
    unset: Iterable[str],
    *,
    actor: str,
    remote: str,
    reason: str = "",
    now: float | None = None,
) -> None:
    """Set and unset keys of one scope, each value checked as the device checks it (400 naming
    the key), audited ``settings.set`` with before and after."""
    now = time.time() if now is None else now
    values = dict(values)
    for key, value in list(values.items()):
        _settable(key)
        values[key] = check_value(key, value)
    for key in unset:
        _settable(key)
    entries = tables.settings_entries
    with database.write() as connection:
        if (
            scope == DEVICE
            and connection.execute(select(tables.devices.c.id).where(tables.devices.c.id == name)).first() is None
        ):
            raise ApiError(404, "not_found", f"no device {name}")
        mine = (entries.c.scope == scope) & (entries.c.name == name)
        before = {
            row.key: json.loads(row.value)
            for row in connection.execute(select(entries.c.key, entries.c.value).where(mine))
        }
        for key in [*unset, *values]:
            connection.execute(delete(entries).where(mine, entries.c.key == key))
        if values:
            connection.execute(
                entries.insert(),
                [
                    {
                        "scope": scope,
                        "name": name,
                        "key": key,
                        "value": json.dumps(value, allow_nan=False),
                        "set_by": actor,
                        "set_at": now,
                    }
                    for key, value in sorted(values.items())
                ],
            )
        if len(set(before) - set(unset) | set(values)) > MAX_ENTRIES:
            raise ApiError(422, "invalid", f"the {scope} would hold more than {MAX_ENTRIES} settings")
        audit.record(
            connection,
            actor=actor,
            action="settings.set",
            target=f"{scope}:{name}" if name else scope,
            remote=remote,
            now=now,
            detail={"reason": reason, "before": before, "set": values, "unset": sorted(unset)},
        )


def _settable(key: str) -> None:
    """Refuse a key the operator cannot set on a scope (400 naming it)."""
    if key in KEY_KINDS_OF:
        raise SchemaError(key, "is held by the fleet's keys: edgepack fleet keys add|retire")
    if schema_of(key) is None:
        check_value(key, None)  # raises, naming an unknown or a local-only key as the device would


def add_key(database: Database, kind: str, pem: str, *, actor: str, remote: str, now: float | None = None) -> FleetKey:
    """Add a public key of ``kind`` (a file labelled with the other kind is refused); adding a
    key in use again changes nothing; a retired key is not taken back (409). The key is kept,
    and sent to devices, in ``edgepack keygen``'s PEM form (its header line kept or left out as
    given), whatever spelling came in: devices read that form without cryptography."""
    now = time.time() if now is None else now
    if kind not in KEY_KINDS:
        raise ApiError(400, "invalid", f"kind must be one of {', '.join(KEY_KINDS)}")
    data = pem.encode("utf-8")
    try:
        check_kind(data, "key", kind)
        public = public_key_from_pem(data, "key")
        parse_keys(KEY_SETTING[kind], [pem])
    except (KeyFileError, SchemaError) as err:
        raise ApiError(422, "invalid", str(err)) from err
    pem = public_key_pem(public, file_kind(data, "key")).decode("ascii")
    kid = key_id(public)
    with database.write() as connection:
        existing = {k.key_id: k for k in load_keys(connection)}
        found = existing.get(kid)
        if found is not None:
            if not found.in_use or found.kind != kind:
                raise ApiError(
                    409,
                    "conflict",
                    f"key {kid} was added before as a {found.kind} key"
                    f"{'' if found.in_use else ' and retired'}: make a new key",
                )
            return found
        if len(existing) >= MAX_FLEET_KEYS:
            raise ApiError(422, "invalid", f"the fleet holds {MAX_FLEET_KEYS} keys already")
        connection.execute(
            tables.fleet_keys.insert().values(key_id=kid, kind=kind, pem=pem, added_by=actor, added_at=now)
        )
        audit.record(
            connection, actor=actor, action="keys.add", target=kid, remote=remote, now=now, detail={"kind": kind}
        )
    return FleetKey(kid, kind, pem, now)


def retire_key(
    database: Database, kid: str, signers: Sequence[str], *, actor: str, remote: str, now: float | None = None
) -> FleetKey:
    """Retire a key: the next documents leave it out. Refused (409) for the last key of its kind
    in use, and for an operator key whose retirement would leave no key in use that this server
    signs with (``signers``): the devices would refuse every command after it."""
    now = time.time() if now is None else now
    with database.write() as connection:
        keys = load_keys(connection)
        found = next((k for k in keys if k.key_id == kid), None)
        if found is None:
            raise ApiError(404, "not_found", f"no key {kid}")
        if not found.in_use:
            return found
        left = [k for k in keys if k.kind == found.kind and k.in_use and k.key_id != kid]
        if not left:
            raise ApiError(409, "conflict", f"{kid} is the last {found.kind} key in use: add the new key first")
        if found.kind == OPERATOR and not any(k.key_id in signers for k in left):
            raise ApiError(
                409,
                "conflict",
                f"retiring {kid} leaves no operator key this server signs with: start "
                "the server with the new key's --operator-key first",
            )
        connection.execute(tables.fleet_keys.update().where(tables.fleet_keys.c.key_id == kid).values(retired_at=now))
        audit.record(
            connection,
            actor=actor,
            action="keys.retire",
            target=kid,
            remote=remote,
            now=now,
            detail={"kind": found.kind},
        )
    return FleetKey(found.key_id, found.kind, found.pem, found.added_at, now)


def save_reports(database: Database, connection: Connection, records: Sequence[tuple[DeviceState, float]]) -> None:
    """Keep ``settings_reports`` equal to each device's newest online report (ingest)."""
    rows = [
        {
            "device": r.device,
            "generation": r.settings.generation,
            "results": json.dumps(dict(r.settings.results)),
            "release_keys": json.dumps(r.settings.release_keys),
            "operator_keys": json.dumps(r.settings.operator_keys),
            "heard_at": heard,
        }
        for r, heard in records
        if r.settings is not None
    ]
    if not rows:
        return
    statement = database.insert(tables.settings_reports)
    connection.execute(
        statement.on_conflict_do_update(
            index_elements=["device"],
            set_={
                name: statement.excluded[name]
                for name in ("generation", "results", "release_keys", "operator_keys", "heard_at")
            },
        ),
        rows,
    )
