"""The alert rules, pure: what is wrong now, and which alerts that fires or resolves.

Three rules are *conditions* judged on every round from what the database holds: a device
silent longer than ``offline.after_s``, a device whose errors per inference over a window are
above a share, a device whose newest final update job failed. Each condition has a key (its
kind and subject, e.g. ``offline:cam-7``): :func:`plan` fires the keys that are true and not
open, and resolves the open keys that are no longer true, so an incident fires once and again
only after it resolved (a resolve notice is sent too). Rollout state changes are *notices*, one
per transition, keyed by the transition (sent once, nothing to resolve).

The I/O around these (reading the database, recording, sending) is :mod:`.alert_runner`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sdk.fleet_server.alert_config import ErrorRateRule, FailedUpdateRule, OfflineRule, RolloutRule
from sdk.fleet_server.history import FAILED, outcome

SCHEMA = "edgepack/alert/1"
MAX_DETAIL_BYTES = 2048
OFFLINE, ERROR_RATE, FAILED_UPDATE, ROLLOUT = "offline", "error_rate", "failed_update", "rollout"
KINDS = (OFFLINE, ERROR_RATE, FAILED_UPDATE, ROLLOUT)


@dataclass(frozen=True)
class Seen:
    """When the server last heard from a device."""

    device: str
    last_seen: float


@dataclass(frozen=True)
class Errors:
    """A device's inferences and errors summed over the error-rate window."""

    device: str
    inferences: int
    errors: int


@dataclass(frozen=True)
class FinalJob:
    """A device's newest final job of an update type."""

    device: str
    job: str
    type: str
    state: str
    reason: str


@dataclass(frozen=True)
class Change:
    """One row of ``rollout_transitions`` (with its rollout's artifact)."""

    id: int
    rollout: str
    event: str
    from_state: str
    to_state: str
    wave: int
    reason: str
    at: float
    artifact: str = ""


@dataclass(frozen=True)
class Condition:
    """Something wrong now, keyed by kind and subject."""

    kind: str
    subject: str
    summary: str
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.subject}"


@dataclass(frozen=True)
class Notice:
    """A rollout state change, sent once (``key`` names the transition)."""

    key: str
    subject: str
    summary: str
    source_id: int
    detail: Mapping[str, Any] = field(default_factory=dict)
    kind: str = ROLLOUT


@dataclass(frozen=True)
class Plan:
    """What a round changes: conditions that fire (not open yet), keys that resolve."""

    fire: tuple[Condition, ...]
    resolve: tuple[str, ...]


def offline(rule: OfflineRule | None, seen: Iterable[Seen], now: float) -> list[Condition]:
    """Devices silent for longer than ``after_s`` (exactly ``after_s`` is not yet an alert)."""
    if rule is None:
        return []
    return [
        Condition(
            OFFLINE,
            item.device,
            f"{item.device} not heard from for {now - item.last_seen:.0f} s (over {rule.after_s:g} s)",
            {"last_seen": item.last_seen, "silent_s": round(now - item.last_seen, 3), "after_s": rule.after_s},
        )
        for item in seen
        if now - item.last_seen > rule.after_s
    ]


def error_rate(rule: ErrorRateRule | None, figures: Iterable[Errors]) -> list[Condition]:
    """Devices with at least ``min_inferences`` in the window and a share of errors above ``above``."""
    if rule is None:
        return []
    found = []
    for item in figures:
        if item.inferences < rule.min_inferences or item.inferences <= 0:
            continue
        share = item.errors / item.inferences
        if share > rule.above:
            found.append(
                Condition(
                    ERROR_RATE,
                    item.device,
                    f"{item.device}: {share:.1%} of {item.inferences} inferences failed in the last "
                    f"{rule.window_s:g} s (over {rule.above:.1%})",
                    {
                        "errors": item.errors,
                        "inferences": item.inferences,
                        "rate": round(share, 6),
                        "above": rule.above,
                        "window_s": rule.window_s,
                    },
                )
            )
    return found


def failed_update(rule: FailedUpdateRule | None, jobs: Iterable[FinalJob]) -> list[Condition]:
    """Devices whose newest final update job failed (a deploy rolled back by its health window too)."""
    if rule is None:
        return []
    return [
        Condition(
            FAILED_UPDATE,
            job.device,
            f"{job.device}: {job.type} job {job.job} ended {job.state}{': ' + job.reason if job.reason else ''}",
            {"job": job.job, "type": job.type, "state": job.state, "reason": job.reason[:300]},
        )
        for job in jobs
        if job.type in rule.job_types and outcome(job.type, job.state, True, expires_at=None, now=0.0) == FAILED
    ]


def rollout_notices(rule: RolloutRule | None, changes: Iterable[Change]) -> list[Notice]:
    """A notice per transition into one of the rule's states (a wave's advance is no state change)."""
    if rule is None:
        return []
    return [
        Notice(
            f"{ROLLOUT}:{change.rollout}:{change.id}",
            change.rollout,
            f"rollout {change.rollout} {change.from_state} -> {change.to_state} (wave {change.wave})"
            f"{': ' + change.reason if change.reason else ''}",
            change.id,
            {
                "event": change.event,
                "from": change.from_state,
                "to": change.to_state,
                "wave": change.wave,
                "reason": change.reason[:300],
                "at": change.at,
                "artifact": change.artifact,
            },
        )
        for change in changes
        if change.to_state != change.from_state and change.to_state in rule.states
    ]


def plan(open_keys: Iterable[str], conditions: Iterable[Condition]) -> Plan:
    """Fire what is true and not open; resolve what is open and no longer true (also a rule
    turned off). One condition per key (the first)."""
    opened = set(open_keys)
    now_true: dict[str, Condition] = {}
    for condition in conditions:
        now_true.setdefault(condition.key, condition)
    return Plan(
        fire=tuple(c for key, c in now_true.items() if key not in opened), resolve=tuple(sorted(opened - set(now_true)))
    )


def detail_text(detail: Mapping[str, Any]) -> str:
    """A detail as the bounded JSON the table keeps."""
    text = json.dumps(dict(detail), separators=(",", ":"), sort_keys=True, default=str)
    return text if len(text) <= MAX_DETAIL_BYTES else json.dumps({"truncated": text[: MAX_DETAIL_BYTES - 64]})


def message(
    *,
    alert_id: int,
    event: str,
    kind: str,
    subject: str,
    key: str,
    summary: str,
    detail: Mapping[str, Any],
    opened_at: float,
    resolved_at: float | None,
    server: str,
    now: float,
) -> bytes:
    """The JSON body every sink sends (webhook body, MQTT payload)."""
    return json.dumps(
        {
            "schema": SCHEMA,
            "id": alert_id,
            "event": event,
            "kind": kind,
            "subject": subject,
            "key": key,
            "summary": summary,
            "detail": dict(detail),
            "opened_at": opened_at,
            "resolved_at": resolved_at,
            "server": server,
            "ts": now,
        },
        separators=(",", ":"),
        sort_keys=True,
        default=str,
    ).encode()
