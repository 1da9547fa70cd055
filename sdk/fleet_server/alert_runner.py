"""Alerts, the I/O: read what the rules judge, record what fires and resolves, hand it to the sinks.

It runs on the driver's rounds while this server leads (one server judges a fleet), every
``evaluate_every_s``. The ``alerts`` table is the memory: an open incident's ``open_key`` is
unique, so a key fires once until it resolved even across a restart or a change of leader, and
a rollout notice's key names its transition (the newest one noted is where the next look
starts). What fires, resolves or is noticed is recorded in one transaction, then sent; every
alert sent or given up by a sink is audited (``alert.sent``, ``alert.given_up``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.engine import Connection

from edgepack_core.mqtt_transport import MqttTransport
from sdk.fleet_server import alert_table, audit
from sdk.fleet_server import alerts as rules
from sdk.fleet_server import db as tables
from sdk.fleet_server.alert_config import AlertsConfig
from sdk.fleet_server.alert_sinks import MqttOutlet, Outgoing, Sink, WebhookOutlet
from sdk.fleet_server.db import Database

log = logging.getLogger("edgepack.fleet_server.alerts")

MAX_PAGE = 500
MAX_CHANGES = 1000  # rollout transitions read per round at most (the rest next round)


def _seen(connection: Connection) -> list[rules.Seen]:
    devices = tables.devices
    return [rules.Seen(row.id, row.last_seen) for row in connection.execute(select(devices.c.id, devices.c.last_seen))]


def _errors(connection: Connection, since: float) -> list[rules.Errors]:
    raw = tables.telemetry_raw
    query = (
        select(raw.c.device, func.coalesce(func.sum(raw.c.inferences), 0), func.coalesce(func.sum(raw.c.errors), 0))
        .where(raw.c.ts >= since)
        .group_by(raw.c.device)
    )
    return [
        rules.Errors(device, int(inferences), int(errors)) for device, inferences, errors in connection.execute(query)
    ]


def _final_jobs(connection: Connection, types: Sequence[str]) -> list[rules.FinalJob]:
    events = tables.job_events
    newest = (
        select(func.max(events.c.id).label("id"))
        .where(events.c.final.is_(True), events.c.type.in_(types))
        .group_by(events.c.device)
        .subquery()
    )
    query = select(events.c.device, events.c.job, events.c.type, events.c.state, events.c.reason).join(
        newest, newest.c.id == events.c.id
    )
    return [
        rules.FinalJob(row.device, row.job, row.type, row.state, row.reason or "") for row in connection.execute(query)
    ]


def _changes(connection: Connection, after: int) -> list[rules.Change]:
    moves, rollouts = tables.rollout_transitions, tables.rollouts
    query = (
        select(moves, rollouts.c.name, rollouts.c.version)
        .join(rollouts, rollouts.c.id == moves.c.rollout_id)
        .where(moves.c.id > after)
        .order_by(moves.c.id)
        .limit(MAX_CHANGES)
    )
    return [
        rules.Change(
            row.id,
            row.rollout_id,
            row.event,
            row.from_state,
            row.to_state,
            row.wave,
            row.reason or "",
            row.at,
            f"{row.name}@{row.version}",
        )
        for row in connection.execute(query)
    ]


def newest_noted(connection: Connection) -> int | None:
    """The newest rollout transition a notice was recorded for (None: none ever)."""
    found = connection.execute(
        select(func.max(alert_table.alerts.c.source_id)).where(alert_table.alerts.c.kind == rules.ROLLOUT)
    ).scalar()
    return None if found is None else int(found)


def newest_transition(connection: Connection) -> int:
    return int(connection.execute(select(func.coalesce(func.max(tables.rollout_transitions.c.id), 0))).scalar_one())


class AlertRunner:
    """Judges the rules (:meth:`maybe_run` from the driver's rounds) and feeds the sinks."""

    def __init__(self, database: Database, config: AlertsConfig, sinks: Sequence[Sink], *, server_id: str) -> None:
        self.database = database
        self.config = config
        self.sinks = list(sinks)
        self.server_id = server_id
        self.actor = f"server:{server_id}"
        self.rounds = 0
        self._next = 0.0
        self._cursor: int | None = None  # the newest rollout transition looked at

    def maybe_run(self, now: float) -> None:
        if now >= self._next:
            self._next = now + self.config.evaluate_every_s
            self.run_once(now)

    def run_once(self, now: float) -> list[Outgoing]:
        """One round: judge, record, send. Returns what was handed to the sinks."""
        self.rounds += 1
        config = self.config
        with self.database.read() as connection:
            if self._cursor is None:  # first round: from the newest notice, or from now on a fleet that never had one
                self._cursor = newest_noted(connection)
                if self._cursor is None:
                    self._cursor = newest_transition(connection)
            conditions = [
                *rules.offline(config.offline, _seen(connection) if config.offline else [], now),
                *rules.error_rate(
                    config.error_rate,
                    _errors(connection, now - config.error_rate.window_s) if config.error_rate else [],
                ),
                *rules.failed_update(
                    config.failed_update,
                    _final_jobs(connection, config.failed_update.job_types) if config.failed_update else [],
                ),
            ]
            changes = _changes(connection, self._cursor) if config.rollout else []
        notices = rules.rollout_notices(config.rollout, changes)
        with self.database.write() as connection:
            opened = {
                row.open_key: row
                for row in connection.execute(select(alert_table.alerts).where(alert_table.alerts.c.state == "open"))
            }
            decided = rules.plan(opened, conditions)
            outgoing = [
                *self._fire(connection, decided.fire, now),
                *self._resolve(connection, decided.resolve, now),
                *self._notice(connection, notices, now),
            ]
        if changes:  # only once recorded: a round whose write failed looks at the same transitions again
            self._cursor = changes[-1].id
        for item in outgoing:
            for sink in self.sinks:
                sink.enqueue(item)
        if outgoing:
            log.info("alerts: %s", ", ".join(f"{item.event} {item.key}" for item in outgoing[:10]))
        return outgoing

    def _outgoing(self, event: str, now: float, **fields: Any) -> Outgoing:
        """An alert's message; ``fields`` are :func:`~.alerts.message`'s (alert_id, kind, subject, key, ...)."""
        return Outgoing(fields["key"], event, rules.message(event=event, server=self.server_id, now=now, **fields))

    def _open(self, connection: Connection, item: rules.Condition | rules.Notice, now: float) -> Outgoing | None:
        """Record a condition that fires (``open``) or a rollout notice; its message, or None when
        its key is already recorded (open, or noticed by another server first)."""
        notice = isinstance(item, rules.Notice)
        values = {
            "kind": item.kind,
            "subject": item.subject[:128],
            "state": "notice" if notice else "open",
            "open_key": item.key[:200],
            "opened_at": now,
            "resolved_at": now if notice else None,
            "summary": item.summary[:500],
            "detail": rules.detail_text(item.detail),
            "source_id": item.source_id if isinstance(item, rules.Notice) else None,
        }
        table = alert_table.alerts
        row = connection.execute(
            self.database.insert(table).on_conflict_do_nothing().returning(table.c.id), values
        ).first()
        if row is None:
            return None
        return self._outgoing(
            "notice" if notice else "fired",
            now,
            alert_id=int(row[0]),
            kind=item.kind,
            subject=item.subject,
            key=item.key,
            summary=item.summary,
            detail=item.detail,
            opened_at=now,
            resolved_at=values["resolved_at"],
        )

    def _fire(self, connection: Connection, fired: Sequence[rules.Condition], now: float) -> list[Outgoing]:
        return [out for condition in fired if (out := self._open(connection, condition, now)) is not None]

    def _notice(self, connection: Connection, notices: Sequence[rules.Notice], now: float) -> list[Outgoing]:
        return [out for notice in notices if (out := self._open(connection, notice, now)) is not None]

    def _resolve(self, connection: Connection, keys: Sequence[str], now: float) -> list[Outgoing]:
        out = []
        alerts = alert_table.alerts
        for key in keys:
            row = connection.execute(select(alerts).where(alerts.c.open_key == key)).first()
            if row is None:
                continue
            connection.execute(
                update(alerts)
                .where(and_(alerts.c.id == row.id, alerts.c.state == "open"))
                .values(state="resolved", open_key=None, resolved_at=now)
            )
            out.append(
                self._outgoing(
                    "resolved",
                    now,
                    alert_id=row.id,
                    kind=row.kind,
                    subject=row.subject,
                    key=key,
                    summary=row.summary,
                    detail=json.loads(row.detail),
                    opened_at=row.opened_at,
                    resolved_at=now,
                )
            )
        return out

    def record_outcome(self, sink: str, item: Outgoing, sent: bool, attempts: int, reason: str) -> None:
        """A sink's report: ``alert.sent`` or ``alert.given_up`` in the audit (the actor is this server)."""
        with self.database.write() as connection:
            audit.record(
                connection,
                actor=self.actor,
                action="alert.sent" if sent else "alert.given_up",
                target=item.key,
                outcome="ok" if sent else "refused",
                detail={
                    "sink": sink,
                    "event": item.event,
                    "attempts": attempts,
                    **({"reason": reason[:300]} if reason else {}),
                },
            )

    def to_json(self) -> dict[str, Any]:
        """What ``/api/status`` shows: rounds judged, and each sink's queue and counts."""
        return {
            "rounds": self.rounds,
            "sinks": [
                {"name": sink.name, "queued": sink.depth, "sent": sink.sent, "given_up": sink.given_up}
                for sink in self.sinks
            ],
        }

    def stop(self) -> None:
        for sink in self.sinks:
            sink.stop()


def listing(database: Database, *, limit: int = 100, state: str | None = None) -> dict[str, Any]:
    """``GET /api/alerts``: every open alert, and the newest ``limit`` alerts (any state, or ``state``)."""
    alerts = alert_table.alerts

    def doc(row: Any) -> dict[str, Any]:
        return {
            "id": row.id,
            "kind": row.kind,
            "subject": row.subject,
            "state": row.state,
            "key": row.open_key or f"{row.kind}:{row.subject}",
            "summary": row.summary,
            "detail": json.loads(row.detail),
            "opened_at": row.opened_at,
            "resolved_at": row.resolved_at,
        }

    recent = select(alerts).order_by(alerts.c.id.desc()).limit(min(max(limit, 1), MAX_PAGE))
    if state is not None:
        recent = recent.where(alerts.c.state == state)
    with database.read() as connection:
        open_rows = connection.execute(
            select(alerts).where(alerts.c.state == "open").order_by(alerts.c.id.desc()).limit(MAX_PAGE)
        ).all()
        recent_rows = connection.execute(recent).all()
    return {"open": [doc(row) for row in open_rows], "recent": [doc(row) for row in recent_rows]}


def start_alerts(
    database: Database, config: AlertsConfig, transport: MqttTransport | None, *, server_id: str
) -> AlertRunner:
    """The runner with a started sink per webhook and for the MQTT topic (on ``transport``, the
    server's own broker connection)."""
    runner = AlertRunner(database, config, [], server_id=server_id)
    delivery = config.delivery
    for hook, secret in zip(config.webhooks, config.secrets, strict=True):
        runner.sinks.append(
            Sink(
                WebhookOutlet(hook.url, secret=secret, timeout_s=delivery.timeout_s, name=hook.name),
                delivery,
                runner.record_outcome,
            )
        )
    if config.mqtt is not None and transport is not None:
        runner.sinks.append(
            Sink(
                MqttOutlet(transport, config.mqtt.topic, timeout_s=delivery.timeout_s), delivery, runner.record_outcome
            )
        )
    return runner
