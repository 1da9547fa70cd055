"""The API's reads and writes on the tables: devices, telemetry, artifacts, rollouts.

Each function takes plain values (already bounded by :mod:`.api`) and returns the JSON
documents the API sends, so their shapes are defined in one place (and described in
:mod:`.openapi`). Writes record their audit row in the same transaction.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.engine import Connection

from edgepack_core.protocol.commands import field_schema
from edgepack_core.protocol.ids import ID_PATTERN
from sdk.deploy.policy import RolloutError, plan_wave_shares, planned_shares
from sdk.errors import ApiError
from sdk.fleet_server import audit, bad_releases, report_card_table, report_cards
from sdk.fleet_server import db as tables
from sdk.fleet_server.artifacts import StoredArtifact
from sdk.fleet_server.db import Database
from sdk.fleet_server.driver import rollout_of, save_rollout
from sdk.fleet_server.retention import Bucket, RetentionPolicy, check_step, effective_step, fold, rebucket
from sdk.fleet_server.rollouts import (
    NOT_SENT,
    PENDING,
    Gates,
    check_gates,
    command_id,
    new_rollout_id,
    transition,
)

MAX_DEVICES_PAGE = 10_000
MAX_ROLLOUT_DEVICES = 100_000
SHA256_PATTERN = "^[0-9a-f]{64}$"
MAX_GATE_S = 7 * 86400  # soak_s and wave_timeout_s (rollouts.check_gates)


def _signed_field(name: str, description: str) -> dict[str, Any]:
    """A rollout option signed into every deploy command: the deploy command schema's own bounds
    (what a device accepts), null allowed (the device's default). A value a device would refuse
    is refused when the rollout is created, naming the bound, not when its commands are built."""
    device_rule = field_schema("deploy", name)
    kinds = device_rule.pop("type")
    return {**device_rule, "type": [*([kinds] if isinstance(kinds, str) else kinds), "null"],
            "description": description}


ROLLOUT_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["artifact", "waves"],
    "properties": {
        "artifact": {"type": "string", "pattern": SHA256_PATTERN, "description": "sha256 of an uploaded artifact"},
        "group": {"type": "string", "pattern": ID_PATTERN, "maxLength": 64,
                  "description": "every device of this group that is online now (or give devices)"},
        "devices": {"type": "array", "minItems": 1, "maxItems": MAX_ROLLOUT_DEVICES,
                    "items": {"type": "string", "pattern": ID_PATTERN, "maxLength": 64}},
        "waves": {"type": "array", "minItems": 1, "maxItems": 20,
                  "items": {"type": "number", "exclusiveMinimum": 0, "maximum": 100},
                  "description": "cumulative percentages of the targets, the last 100 (e.g. [5, 25, 100])"},
        "soak_s": {"type": "number", "minimum": 0, "maximum": MAX_GATE_S,
                   "description": "seconds a passed wave is watched before the next"},
        "min_success_share": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                              "description": "share of a wave that must end active (default 1)"},
        "wave_timeout_s": {"type": "number", "minimum": 1, "maximum": MAX_GATE_S,
                           "description": "a device without a final answer after this long counts as failed"},
        "max_error_rate": {"type": ["number", "null"], "minimum": 0, "maximum": 1,
                           "description": "during the soak, the largest error share of a device's inferences"},
        "rollback_on_failure": {"type": "boolean",
                                "description": "a failed wave rolls back (or cancels) what the rollout updated"},
        "health_window_s": _signed_field("health_window_s", "the devices' health window in seconds (signed into "
                                                            "the command; the deploy command's bounds)"),
        "force_downgrade": {"type": "boolean"},
        "allow_contract_change": {"type": "boolean"},
        "exclude_offline": {"type": "boolean",
                            "description": "with devices: leave out those offline now (a group takes only online "
                                           "devices anyway)"},
        "reason": {"type": "string", "maxLength": 500,
                   "description": "why (kept in the rollout's transitions and the audit)"},
    },
}


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
    if not found:
        raise ApiError(404, "not_found", f"no device {device}")
    return {**found[0], "capabilities": json.loads(capabilities) if capabilities else {}, "report_cards": cards}


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
    """Remove ``device`` from the fleet: its rows and groups go, and it is marked decommissioned so
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
                     tables.device_models, report_card_table.device_report_cards):
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


# --------------------------------------------------------------------------- artifacts


def artifact_doc(row: Any, url: str) -> dict[str, Any]:
    bad = None if row.get("bad_at") is None else {"at": row["bad_at"], "actor": row["bad_actor"],
                                                  "reason": row["bad_reason"]}
    return {"sha256": row["sha256"], "name": row["name"], "version": row["version"], "size": row["size"],
            "key_id": row["key_id"], "targets": json.loads(row["targets"]), "created_at": row["created_at"],
            "created_by": row["created_by"], "url": url, "bad": bad}


def _artifact_rows() -> Any:
    """Artifacts with their bad mark (``bad_*`` columns, None when not marked)."""
    a, bad = tables.artifacts, tables.artifact_bad
    return select(a, bad.c.at.label("bad_at"), bad.c.actor.label("bad_actor"), bad.c.reason.label("bad_reason")) \
        .select_from(a.outerjoin(bad, bad.c.sha256 == a.c.sha256))


def save_artifact(database: Database, stored: StoredArtifact, *, actor: str, remote: str) -> bool:
    """Record an uploaded artifact (and the upload in the audit table); False if it was known."""
    with database.write() as connection:
        created = database.insert_new(connection, tables.artifacts, stored.to_row(actor=actor, now=time.time()))
        audit.record(connection, actor=actor, action="artifact.upload", target=stored.sha256, remote=remote,
                     detail={"name": stored.name, "version": stored.version, "size": stored.size,
                             "new": created})
    return created


def list_artifacts(database: Database) -> list[Any]:
    with database.read() as connection:
        return list(connection.execute(_artifact_rows().order_by(tables.artifacts.c.created_at.desc()))
                    .mappings().all())


def get_artifact(database: Database, sha256: str) -> Any:
    with database.read() as connection:
        row = connection.execute(_artifact_rows().where(tables.artifacts.c.sha256 == sha256)).mappings().first()
    if row is None:
        raise ApiError(404, "not_found", f"no artifact {sha256}")
    return row


# --------------------------------------------------------------------------- rollouts


@dataclass(frozen=True)
class RolloutRequest:
    artifact: str
    waves: list[float]
    group: str | None
    devices: list[str] | None
    gates: Gates
    health_window_s: float | None
    force_downgrade: bool
    allow_contract_change: bool
    reason: str = ""
    exclude_offline: bool = False

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RolloutRequest:
        """After schema validation: one of group/devices, gates bounded."""
        if ("group" in body) == ("devices" in body):
            raise ApiError(400, "invalid", "give exactly one of group or devices")
        gates = check_gates(Gates(
            min_success_share=float(body.get("min_success_share", 1.0)), soak_s=float(body.get("soak_s", 0.0)),
            wave_timeout_s=float(body.get("wave_timeout_s", 1800.0)),
            max_error_rate=None if body.get("max_error_rate") is None else float(body["max_error_rate"]),
            rollback_on_failure=bool(body.get("rollback_on_failure", False))))
        window = body.get("health_window_s")
        return cls(artifact=body["artifact"], waves=[float(w) for w in body["waves"]], group=body.get("group"),
                   devices=list(dict.fromkeys(body["devices"])) if "devices" in body else None, gates=gates,
                   health_window_s=None if window is None else float(window),
                   force_downgrade=bool(body.get("force_downgrade", False)),
                   allow_contract_change=bool(body.get("allow_contract_change", False)),
                   reason=str(body.get("reason", "")), exclude_offline=bool(body.get("exclude_offline", False)))


def _targets(connection: Connection, request: RolloutRequest, now: float, silence_s: float) -> list[str]:
    devices = tables.devices
    if request.group is not None:
        rows = connection.execute(
            select(devices.c.id, devices.c.status, devices.c.last_seen)
            .where(devices.c.id.in_(select(tables.device_groups.c.device)
                                    .where(tables.device_groups.c.group_name == request.group)))
            .order_by(devices.c.id)).all()
        targets = [r.id for r in rows if is_online(r.status, r.last_seen, now, silence_s)]
        if not targets:
            raise ApiError(422, "invalid", f"group {request.group}: no online device")
        return targets
    wanted = request.devices or []
    known: set[str] = set()
    for start in range(0, len(wanted), 500):
        known.update(connection.execute(select(devices.c.id).where(devices.c.id.in_(wanted[start:start + 500])))
                     .scalars())
    unknown = [d for d in wanted if d not in known]
    if unknown:
        raise ApiError(422, "invalid", f"unknown device(s): {', '.join(unknown[:5])}"
                                       f"{f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''}")
    return _online_only(connection, wanted, now, silence_s) if request.exclude_offline else wanted


def _online_only(connection: Connection, wanted: list[str], now: float, silence_s: float) -> list[str]:
    """``exclude_offline``: the listed devices online now, in order (422 when none is)."""
    devices = tables.devices
    online: set[str] = set()
    for start in range(0, len(wanted), 500):
        online.update(r.id for r in connection.execute(
            select(devices.c.id, devices.c.status, devices.c.last_seen)
            .where(devices.c.id.in_(wanted[start:start + 500])))
            if is_online(r.status, r.last_seen, now, silence_s))
    kept = [d for d in wanted if d in online]
    if not kept:
        raise ApiError(422, "invalid", "exclude_offline: every listed device is offline")
    return kept


def create_rollout(database: Database, request: RolloutRequest, *, actor: str, remote: str, silence_s: float,
                   now: float | None = None, also: Callable[[Connection, str], None] | None = None) -> str:
    """Plan and store a rollout (``pending``: the driver starts it); returns its id. ``also``
    writes what the rollout carries in its transaction (a staged target change)."""
    now = time.time() if now is None else now
    rollout_id = new_rollout_id(os.urandom(8))
    with database.write() as connection:
        artifact = connection.execute(select(tables.artifacts).where(
            tables.artifacts.c.sha256 == request.artifact)).mappings().first()
        if artifact is None:
            raise ApiError(404, "not_found", f"no artifact {request.artifact} (upload it first)")
        bad_releases.refuse_if_bad(connection, request.artifact, "artifact")
        try:
            waves = plan_wave_shares(_targets(connection, request, now, silence_s), request.waves)
        except RolloutError as err:  # the shares' order: beyond what a schema can say
            raise ApiError(422, "invalid", str(err)) from err
        gates = request.gates
        connection.execute(tables.rollouts.insert().values(
            id=rollout_id, artifact_sha256=request.artifact, name=artifact["name"], version=artifact["version"],
            target_group=request.group, state=PENDING, wave=0,
            waves=json.dumps(planned_shares(sum(len(w) for w in waves), request.waves)),
            wave_count=len(waves), min_success_share=gates.min_success_share, soak_s=gates.soak_s,
            wave_timeout_s=gates.wave_timeout_s, max_error_rate=gates.max_error_rate,
            rollback_on_failure=gates.rollback_on_failure, health_window_s=request.health_window_s,
            force_downgrade=request.force_downgrade, allow_contract_change=request.allow_contract_change,
            reason=request.reason, created_at=now, created_by=actor, updated_at=now, revision=0))
        connection.execute(tables.rollout_transitions.insert().values(
            rollout_id=rollout_id, at=now, event="create", from_state="", to_state=PENDING, wave=1, actor=actor,
            reason=request.reason))
        connection.execute(tables.rollout_devices.insert(), [
            {"rollout_id": rollout_id, "device": device, "wave": index, "state": NOT_SENT, "final": False,
             "reason": "", "command_id": command_id(rollout_id, "deploy", index, device)}
            for index, wave in enumerate(waves) for device in wave])
        if also is not None:
            also(connection, rollout_id)
        audit.record(connection, actor=actor, action="rollout.create", target=rollout_id, remote=remote, now=now,
                     detail={"artifact": request.artifact, "name": artifact["name"], "version": artifact["version"],
                             "group": request.group, "devices": sum(len(w) for w in waves),
                             "waves": request.waves, "gates": gates.__dict__, "reason": request.reason,
                             "command": {"kind": "deploy", "artifact": request.artifact,
                                         "target": {"group": request.group} if request.group else
                                         {"devices": sum(len(w) for w in waves)},
                                         "force_downgrade": request.force_downgrade}})
    return rollout_id


ACTIONS = {"pause": "pause", "resume": "resume", "abort": "abort"}
PAST_TENSE = {"pause": "paused", "resume": "resumed", "abort": "aborted"}
"""The default reason of an action without one: ``aborted by admin`` (not ``abortd``)."""


def rollout_action(database: Database, rollout_id: str, action: str, *, actor: str, remote: str,
                   reason: str = "") -> None:
    """Pause, resume or abort through the state machine (409 for a transition it refuses).
    A driver that changed the rollout in between makes the write retry on the new revision."""
    if action not in ACTIONS:
        raise ApiError(404, "not_found", f"no rollout action {action!r} (pause, resume, abort)")
    for _ in range(20):
        now = time.time()
        with database.write() as connection:
            row = connection.execute(select(tables.rollouts).where(tables.rollouts.c.id == rollout_id)) \
                .mappings().first()
            if row is None:
                raise ApiError(404, "not_found", f"no rollout {rollout_id}")
            if action == "resume":
                bad_releases.refuse_resume(connection, row["artifact_sha256"])
            why = reason or f"{PAST_TENSE[action]} by {actor}"
            after = transition(rollout_of(row), ACTIONS[action], now, why)  # type: ignore[arg-type]
            if save_rollout(connection, row, after, now, event=ACTIONS[action], actor=actor, reason=why):
                audit.record(connection, actor=actor, action=f"rollout.{action}", target=rollout_id, remote=remote,
                             now=now, detail={"from": row["state"], "to": after.state, "wave": row["wave"] + 1,
                                              "wave_count": row["wave_count"], "reason": why})
                return
    raise ApiError(409, "conflict", f"rollout {rollout_id} kept changing; try again")


def _wave_docs(row: Any, devices: Sequence[Any]) -> list[dict[str, Any]]:
    shares = json.loads(row["waves"])
    docs = []
    for index in range(row["wave_count"]):
        members = [d for d in devices if d["wave"] == index]
        states = Counter("active" if d["state"] == "active" and d["final"] else
                         "failed" if d["final"] else "not_sent" if d["state"] == NOT_SENT else "in_progress"
                         for d in members)
        if index < row["wave"] or (index == row["wave"] and row["state"] == "succeeded"):
            phase = "passed"
        elif index > row["wave"]:
            phase = "waiting"
        elif row["state"] in ("failed", "aborted", "paused", "pending"):
            phase = row["state"]
        else:
            phase = "soaking" if row["soak_started_at"] is not None else "running"
        docs.append({"index": index, "number": index + 1, "percent": shares[index] if index < len(shares) else None,
                     "devices": len(members), "active": states["active"], "failed": states["failed"],
                     "in_progress": states["in_progress"], "not_sent": states["not_sent"], "state": phase})
    return docs


def _device_docs(devices: Sequence[Any]) -> list[dict[str, Any]]:
    return [{"device": d["device"], "wave": d["wave"], "wave_number": d["wave"] + 1, "command_id": d["command_id"],
             "state": d["state"],
             "final": d["final"], "reason": d["reason"], "sent_at": d["sent_at"], "updated_at": d["updated_at"],
             "undo": None if d["undo_command_id"] is None else {
                 "kind": d["undo_kind"], "command_id": d["undo_command_id"], "state": d["undo_state"],
                 "reason": d["undo_reason"]}}
            for d in devices]


def rollout_summary(row: Any) -> dict[str, Any]:
    return {"id": row["id"], "state": row["state"], "wave": row["wave"], "wave_number": row["wave"] + 1,
            "wave_count": row["wave_count"],
            "artifact": {"sha256": row["artifact_sha256"], "name": row["name"], "version": row["version"]},
            "target": {"group": row["target_group"]} if row["target_group"] else {"devices": None},
            "reason": row["reason"], "created_at": row["created_at"], "created_by": row["created_by"],
            "updated_at": row["updated_at"], "started_at": row["started_at"], "finished_at": row["finished_at"]}


def get_rollout(database: Database, rollout_id: str) -> dict[str, Any]:
    """``GET /api/rollouts/{id}``: the rollout, its waves and every device's job."""
    rd = tables.rollout_devices
    with database.read() as connection:
        row = connection.execute(select(tables.rollouts).where(tables.rollouts.c.id == rollout_id)) \
            .mappings().first()
        if row is None:
            raise ApiError(404, "not_found", f"no rollout {rollout_id}")
        devices = connection.execute(select(rd).where(rd.c.rollout_id == rollout_id).order_by(rd.c.wave, rd.c.device)) \
            .mappings().all()
        transitions = rollout_transitions(connection, rollout_id)
    summary = rollout_summary(row)
    if not row["target_group"]:
        summary["target"] = {"devices": [d["device"] for d in devices]}
    counts = Counter("active" if d["state"] == "active" and d["final"] else
                     "failed" if d["final"] else "not_sent" if d["state"] == NOT_SENT else "in_progress"
                     for d in devices)
    return {**summary,
            "waves": _wave_docs(row, devices),
            "gates": {"min_success_share": row["min_success_share"], "soak_s": row["soak_s"],
                      "wave_timeout_s": row["wave_timeout_s"], "max_error_rate": row["max_error_rate"],
                      "rollback_on_failure": row["rollback_on_failure"]},
            "options": {"health_window_s": row["health_window_s"], "force_downgrade": row["force_downgrade"],
                        "allow_contract_change": row["allow_contract_change"]},
            "wave_started_at": row["wave_started_at"], "soak_started_at": row["soak_started_at"],
            "paused_at": row["paused_at"],
            "counts": {"devices": len(devices), "active": counts["active"], "failed": counts["failed"],
                       "in_progress": counts["in_progress"], "not_sent": counts["not_sent"]},
            "transitions": transitions,
            "devices": _device_docs(devices)}


MAX_TRANSITIONS = 1000
"""Transitions a rollout document lists at most (the newest; a rollout has a few per wave)."""


def rollout_transitions(connection: Connection, rollout_id: str) -> list[dict[str, Any]]:
    """Every transition of a rollout, oldest first (the newest :data:`MAX_TRANSITIONS`), waves 1-based."""
    table = tables.rollout_transitions
    rows = connection.execute(select(table).where(table.c.rollout_id == rollout_id).order_by(table.c.id.desc())
                              .limit(MAX_TRANSITIONS)).mappings().all()
    return [{"at": r["at"], "event": r["event"], "from": r["from_state"], "to": r["to_state"], "wave": r["wave"],
             "actor": r["actor"], "reason": r["reason"]} for r in reversed(rows)]


def list_rollouts(database: Database, *, state: str | None, limit: int) -> list[dict[str, Any]]:
    query = select(tables.rollouts).order_by(tables.rollouts.c.created_at.desc()).limit(limit)
    if state is not None:
        query = query.where(tables.rollouts.c.state == state)
    with database.read() as connection:
        return [rollout_summary(row) for row in connection.execute(query).mappings()]


def rollout_state_counts(database: Database) -> dict[str, int]:
    with database.read() as connection:
        return dict(connection.execute(select(tables.rollouts.c.state, func.count()).group_by(
            tables.rollouts.c.state)).all())


def devices_online_by(database: Database, *, now: float, silence_s: float) -> list[tuple[str, str, int]]:
    """(version, provider, count) of online devices, for ``/metrics``."""
    devices = tables.devices
    with database.read() as connection:
        rows = connection.execute(
            select(devices.c.model_version, devices.c.provider, func.count())
            .where(devices.c.status == "online", devices.c.last_seen >= now - silence_s)
            .group_by(devices.c.model_version, devices.c.provider)).all()
    return [(version or "none", provider or "none", count) for version, provider, count in rows]
