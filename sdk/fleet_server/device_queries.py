"""The API's reads and writes on the devices: the device list and documents (built by the
database itself as JSON), groups, decommissioning, dead letters and telemetry points.

Split out of :mod:`.queries` (which keeps the rollouts and artifacts, and re-exports these names
under their old import path). Each function takes plain values (already bounded by :mod:`.api`)
and returns the JSON documents the API sends; writes record their audit row in the same
transaction.
"""

from __future__ import annotations

import base64
import json
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text

from edgepack_core.protocol.ids import ID_PATTERN
from sdk.errors import ApiError
from sdk.fleet_server import audit, device_pipelines, log_tables, report_card_table, report_cards
from sdk.fleet_server import db as tables
from sdk.fleet_server.db import Database
from sdk.fleet_server.retention import Bucket, RetentionPolicy, check_step, effective_step, fold, rebucket

MAX_DEVICES_PAGE = 10_000

# --------------------------------------------------------------------------- devices


def is_online(status: str | None, last_seen: float | None, now: float, silence_s: float) -> bool:
    """Online: the device's last state said so and it was heard from within ``silence_s``."""
    return status == "online" and last_seen is not None and now - last_seen <= silence_s


# The device document is built by the database itself (SQLite's json_object, PostgreSQL's
# json_build_object): a fleet list of thousands of devices then costs the server one string
# from the database instead of a Python dict per device and a JSON encoding of them all, most
# of it outside the interpreter lock that ingest competes for. One template per dialect, the
# same keys in the same order (a test compares a device in the list with GET of that device).

_PLAIN = (("status", "status"), ("status_reason", "status_reason"))
_AFTER_MODEL = (("version", "model_version"), ("provider", "provider"), ("profile", "profile"))
_AFTER_GROUPS = (("last_seen", "last_seen"), ("first_seen", "first_seen"))
_AFTER_LATENCY = (("throughput_per_s", "throughput_per_s"), ("inferences_total", "inferences_total"),
                  ("errors_total", "errors_total"))
_LAST = (("cpu_percent", "cpu_percent"), ("memory_rss_bytes", "memory_rss_bytes"),
         ("temperature_c", "temperature_c"), ("telemetry_at", "telemetry_at"))
_ONLINE = "d.status = 'online' AND d.last_seen >= :cutoff"


def _pairs(fields: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"'{key}', d.{column}" for key, column in fields)


def _device_json_sql(dialect: str) -> str:
    """The SQL expression of one device's JSON document (``d`` is the devices row)."""
    latency = ", ".join(f"'{p}', d.latency_{p}" for p in ("p50", "p90", "p99", "mean"))
    model_fields = "'name', d.model_name, 'version', d.model_version, 'sha256', d.model_sha256"
    has_model = "d.model_name IS NOT NULL OR d.model_version IS NOT NULL"
    rate_guard = "d.inferences_interval > 0 AND d.errors_interval IS NOT NULL"
    unenrolled = ("FROM device_claimed_groups c WHERE c.device = d.id AND NOT EXISTS (SELECT 1 FROM device_groups g "
                  "WHERE g.device = d.id AND g.group_name = c.group_name)")
    update = ("(SELECT CASE WHEN NOT e.final THEN 'updating' WHEN e.state IN ('failed', 'rejected', 'rolled_back') "
              "THEN 'failed' ELSE 'ok' END FROM job_events e WHERE e.device = d.id AND e.type = 'deploy' "
              "ORDER BY e.id DESC LIMIT 1)")
    if dialect == "sqlite":
        obj, online = "json_object", f"json(CASE WHEN {_ONLINE} THEN 'true' ELSE 'false' END)"
        model = f"json(CASE WHEN {has_model} THEN json_object({model_fields}) END)"
        groups = ("json((SELECT json_group_array(group_name) FROM (SELECT g.group_name FROM device_groups g "
                  "WHERE g.device = d.id ORDER BY g.group_name)))")
        claimed = (f"json((SELECT json_group_array(group_name) FROM (SELECT c.group_name AS group_name {unenrolled} "
                   "ORDER BY c.group_name)))")
        rate = f"CASE WHEN {rate_guard} THEN round(CAST(d.errors_interval AS REAL) / d.inferences_interval, 6) END"
    else:
        obj, online = "json_build_object", f"({_ONLINE})"
        model = f"CASE WHEN {has_model} THEN json_build_object({model_fields}) END"
        groups = ("COALESCE((SELECT json_agg(g.group_name ORDER BY g.group_name) FROM device_groups g "
                  "WHERE g.device = d.id), '[]'::json)")
        claimed = f"COALESCE((SELECT json_agg(c.group_name ORDER BY c.group_name) {unenrolled}), '[]'::json)"
        rate = f"CASE WHEN {rate_guard} THEN round(d.errors_interval::numeric / d.inferences_interval, 6) END"
    return (f"{obj}('id', d.id, 'online', {online}, {_pairs(_PLAIN)}, 'update_status', {update}, 'model', {model}, "
            f"{_pairs(_AFTER_MODEL)}, "
            f"'groups', {groups}, 'unenrolled_groups', {claimed}, {_pairs(_AFTER_GROUPS)}, "
            f"'latency_ms', {obj}({latency}), "
            f"{_pairs(_AFTER_LATENCY)}, 'error_rate', {rate}, {_pairs(_LAST)})")


def _device_array_sql(dialect: str, where: str) -> str:
    """A JSON array of the documents of the devices matching ``where``, sorted by id, one page."""
    page = (f"SELECT {_device_json_sql(dialect)} AS doc, d.id AS id FROM devices d WHERE {where} "
            "ORDER BY d.id LIMIT :limit OFFSET :offset")
    if dialect == "sqlite":
        return f"SELECT json_group_array(json(doc)) FROM ({page})"
    return f"SELECT COALESCE(json_agg(doc ORDER BY id), '[]'::json)::text FROM ({page}) AS page"


@dataclass(frozen=True)
class DeviceFilter:
    group: str | None = None
    online: bool | None = None
    version: str | None = None
    limit: int = 1000
    offset: int = 0

    def sql(self) -> str:
        """The WHERE clause (values go in as bound parameters, see :meth:`params`)."""
        clauses = ["1 = 1"]
        if self.group is not None:
            clauses.append("d.id IN (SELECT device FROM device_groups WHERE group_name = :group)")
        if self.version is not None:
            clauses.append("d.model_version = :version")
        if self.online is True:
            clauses.append(f"({_ONLINE})")
        elif self.online is False:
            clauses.append("NOT (d.status = 'online' AND d.last_seen >= :cutoff)")
        return " AND ".join(clauses)

    def params(self, cutoff: float) -> dict[str, Any]:
        return {"group": self.group, "version": self.version, "cutoff": cutoff, "limit": self.limit,
                "offset": self.offset}


def list_devices_json(database: Database, where: DeviceFilter, *, now: float, silence_s: float) -> str:
    """``GET /api/devices`` as JSON text: the page of devices, the total matching, and counts over
    every match (online, by version, by provider)."""
    params = where.params(now - silence_s)
    counts_sql = (f"SELECT d.model_version, d.provider, CASE WHEN {_ONLINE} THEN 1 ELSE 0 END AS up, count(*) "
                  f"FROM devices d WHERE {where.sql()} GROUP BY d.model_version, d.provider, up")
    with database.read() as connection:
        page = connection.execute(text(_device_array_sql(database.dialect, where.sql())), params).scalar()
        groups = connection.execute(text(counts_sql), params).all()
    by_version: Counter[str] = Counter()
    by_provider: Counter[str] = Counter()
    online = total = 0
    for version, provider, up, count in groups:
        by_version[version or "none"] += count
        by_provider[provider or "none"] += count
        online += count if up else 0
        total += count
    tail = json.dumps({"total": total, "limit": where.limit, "offset": where.offset,
                       "counts": {"online": online, "offline": total - online, "by_version": dict(by_version),
                                  "by_provider": dict(by_provider)}}, separators=(",", ":"))
    return f'{{"devices":{page or "[]"},{tail[1:]}'


def list_devices(database: Database, where: DeviceFilter, *, now: float, silence_s: float) -> dict[str, Any]:
    """:func:`list_devices_json`, decoded."""
    return json.loads(list_devices_json(database, where, now=now, silence_s=silence_s))


def get_device(database: Database, device: str, *, now: float, silence_s: float) -> dict[str, Any]:
    """``GET /api/devices/{id}``: the same document as in the list, with the capabilities."""
    sql = _device_array_sql(database.dialect, "d.id = :device")
    with database.read() as connection:
        found = json.loads(connection.execute(text(sql), {"device": device, "cutoff": now - silence_s, "limit": 1,
                                                          "offset": 0}).scalar() or "[]")
        capabilities = connection.execute(select(tables.devices.c.capabilities).where(
            tables.devices.c.id == device)).scalar()
        cards = report_cards.of_device(connection, device)
        pipelines = device_pipelines.of_device(connection, device)
    if not found:
        raise ApiError(404, "not_found", f"no device {device}")
    return {**found[0], "capabilities": json.loads(capabilities) if capabilities else {}, "report_cards": cards,
            "pipelines": pipelines}


MAX_GROUPS = 64
GROUPS_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["groups"],
    "properties": {
        "groups": {"type": "array", "maxItems": MAX_GROUPS,
                   "items": {"type": "string", "pattern": ID_PATTERN, "maxLength": 64},
                   "description": "every group the device belongs to (replaces what was enrolled)"},
    },
}


def set_device_groups(database: Database, device: str, groups: Sequence[str], *, actor: str, remote: str,
                      now: float | None = None) -> None:
    """Enroll ``device`` in exactly ``groups`` (the server's word; what the device claims is
    kept apart and never used), audited as ``device.groups``."""
    now = time.time() if now is None else now
    table = tables.device_groups
    with database.write() as connection:
        if connection.execute(select(tables.devices.c.id).where(tables.devices.c.id == device)).first() is None:
            raise ApiError(404, "not_found", f"no device {device}")
        before = sorted(connection.execute(select(table.c.group_name).where(table.c.device == device)).scalars())
        connection.execute(table.delete().where(table.c.device == device))
        if groups:
            connection.execute(table.insert(), [{"device": device, "group_name": g} for g in groups])
        connection.execute(tables.devices.update().where(tables.devices.c.id == device)
                           .values(groups_enrolled_at=now))
        audit.record(connection, actor=actor, action="device.groups", target=device, remote=remote, now=now,
                     detail={"before": before, "after": sorted(groups)})


def decommission_device(database: Database, device: str, *, reason: str, actor: str, remote: str,
                        now: float | None = None) -> dict[str, Any]:
    """Remove ``device`` from the fleet: its rows, groups and fetched logs go, and it is marked decommissioned so
    its later messages are dropped until :func:`enroll_device`; audited ``device.decommission``
    with the operator's reason. 404 for a device the server never heard of (and not marked)."""
    now = time.time() if now is None else now
    table = tables.decommissioned
    with database.write() as connection:
        known = connection.execute(select(tables.devices.c.id).where(tables.devices.c.id == device)).first()
        marked = connection.execute(select(table.c.device).where(table.c.device == device)).first()
        if known is None and marked is None:
            raise ApiError(404, "not_found", f"no device {device}")
        for rows in (tables.device_groups, tables.device_claimed_groups, tables.device_rejected,
                     tables.device_models, report_card_table.device_report_cards,
                     log_tables.device_logs, log_tables.device_log_chunks, device_pipelines.device_pipelines):
            connection.execute(rows.delete().where(rows.c.device == device))
        for scoped in (tables.target_entries, tables.target_holds):  # its own target goes with it
            connection.execute(scoped.delete().where(scoped.c.scope == "device", scoped.c.name == device))
        connection.execute(tables.devices.delete().where(tables.devices.c.id == device))
        if marked is None:
            connection.execute(table.insert(), {"device": device, "at": now, "actor": actor, "reason": reason})
        audit.record(connection, actor=actor, action="device.decommission", target=device, remote=remote, now=now,
                     detail={"reason": reason, "again": marked is not None})
    return {"device": device, "decommissioned_at": now, "reason": reason}


def enroll_device(database: Database, device: str, *, reason: str, actor: str, remote: str,
                  now: float | None = None) -> dict[str, Any]:
    """Take a decommissioned device back: its next state enrols it as a new device would.
    404 when it is not decommissioned (a device the fleet knows is enrolled already)."""
    now = time.time() if now is None else now
    table = tables.decommissioned
    with database.write() as connection:
        if connection.execute(table.delete().where(table.c.device == device)).rowcount == 0:
            raise ApiError(404, "not_found", f"device {device} is not decommissioned")
        audit.record(connection, actor=actor, action="device.enroll", target=device, remote=remote, now=now,
                     detail={"reason": reason})
    return {"device": device, "enrolled_at": now, "reason": reason}


def decommissioned_devices(database: Database) -> list[dict[str, Any]]:
    """``GET /api/decommissioned``: every decommissioned device, newest first."""
    table = tables.decommissioned
    with database.read() as connection:
        rows = connection.execute(select(table).order_by(table.c.at.desc(), table.c.device)).mappings().all()
    return [dict(row) for row in rows]


MAX_DEAD_LETTER_PAGE = 1000
MAX_ROW_ID = 10**18 - 1  # the largest ``before`` a page takes (18 digits, what Params.integer reads)


def dead_letters(database: Database, *, limit: int, before: int | None, device: str | None) -> list[dict[str, Any]]:
    """``GET /api/dead-letters``: device messages that could not be stored, newest first."""
    rows = database.newest_first(tables.dead_letters, limit=min(limit, MAX_DEAD_LETTER_PAGE), before=before,
                                 device=device)
    return [{"id": row["id"], "received_at": row["received_at"], "device": row["device"], "kind": row["kind"],
             "topic": row["topic"], "reason": row["reason"], "size": row["size"],
             "payload_head": base64.b64encode(row["payload_head"]).decode("ascii")} for row in rows]


def telemetry(database: Database, device: str, *, since: float, until: float, step: int,
              policy: RetentionPolicy, now: float) -> dict[str, Any]:
    """``GET /api/devices/{id}/telemetry``: points of ``step`` seconds from ``since`` to ``until``,
    from raw samples inside the raw window and from rollups before it."""
    try:
        check_step(since, until, step)
    except ValueError as err:  # how since, until and step relate: beyond what a schema can say
        raise ApiError(422, "invalid", str(err)) from err
    raw_cutoff = now - policy.raw_s
    step = effective_step(step, since, raw_cutoff, policy.step_s)
    raw, rollup = tables.telemetry_raw, tables.telemetry_rollup
    with database.read() as connection:
        if connection.execute(select(tables.devices.c.id).where(tables.devices.c.id == device)).first() is None:
            raise ApiError(404, "not_found", f"no device {device}")
        samples = connection.execute(
            select(raw.c.device, raw.c.ts, raw.c.latency_p50, raw.c.latency_p99, raw.c.throughput_per_s,
                   raw.c.inferences, raw.c.errors, raw.c.error_kinds)
            .where(raw.c.device == device, raw.c.ts >= since, raw.c.ts < until).order_by(raw.c.ts)).all()
        rolled = connection.execute(select(rollup).where(
            rollup.c.device == device, rollup.c.bucket >= since - policy.step_s, rollup.c.bucket < until)
        ).mappings().all()
    buckets = fold((tuple(sample) for sample in samples), step)
    older = [Bucket.from_row(row) for row in rolled]
    merged = rebucket([*older, *buckets], step) if older and step % policy.step_s == 0 else buckets
    return {"device": device, "since": since, "until": until, "step": step,
            "points": [bucket.point() for bucket in merged if since - step < bucket.bucket < until]}


def devices_online_by(database: Database, *, now: float, silence_s: float) -> list[tuple[str, str, int]]:
    """(version, provider, count) of online devices, for ``/metrics``."""
    devices = tables.devices
    with database.read() as connection:
        rows = connection.execute(
            select(devices.c.model_version, devices.c.provider, func.count())
            .where(devices.c.status == "online", devices.c.last_seen >= now - silence_s)
            .group_by(devices.c.model_version, devices.c.provider)).all()
    return [(version or "none", provider or "none", count) for version, provider, count in rows]
