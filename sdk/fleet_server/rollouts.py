r"""Server-side rollouts as pure decisions: the state machine and the next step. No I/O, no clock.

    pending -> running(wave 1) -> running(wave k) -> ... -> succeeded
                  |  ^                 |
          pause   v  | resume          +-> failed   (a wave missed its gates)
               paused                  +-> aborted  (the operator)
    pending | paused -> aborted;  pending -> paused;  pending -> failed (it cannot start)

Waves are 1-based wherever a person reads them (messages, the API's ``wave_number``, the audit,
the transitions); :attr:`Rollout.wave` is the 0-based index the tables keep.

Every change of a rollout's state goes through :func:`transition` (an invalid one raises
:class:`InvalidTransition`, which the API answers with 409); what the driver does next is
:func:`next_step` of the persisted rollout, its devices' job states, their health figures
and the time. So a server that restarts (or another server that takes over the lease)
continues from the database alone: nothing about a rollout lives only in memory.

A wave passes its gates when (1) enough of its devices ended their job ``active`` (the
devices' own health window passed; ``min_success_share``, 1.0 by default, judged by
:func:`sdk.deploy.policy.wave_verdict`, the same rule ``edgepack deploy --canary`` uses), then
(2) it soaked ``soak_s`` seconds during which enough of those devices stayed online and, with
``max_error_rate``, reported an error share of their inferences at most that high. Devices that
give no final answer within ``wave_timeout_s`` count as failed. Time spent paused does not
count towards either clock.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from edgepack_core.errors import InvalidTransition, SchemaError
from edgepack_core.golden_stream import GoldenCounts
from sdk.deploy.policy import ACTIVE, DeviceJob, required_successes, wave_verdict

PENDING, RUNNING, PAUSED, SUCCEEDED, FAILED, ABORTED = "pending", "running", "paused", "succeeded", "failed", \
    "aborted"
STATES = (PENDING, RUNNING, PAUSED, SUCCEEDED, FAILED, ABORTED)
TERMINAL = frozenset({SUCCEEDED, FAILED, ABORTED})

Event = Literal["start", "soak", "advance", "succeed", "fail", "pause", "resume", "abort"]
TRANSITIONS: dict[str, dict[str, str]] = {
    PENDING: {"start": RUNNING, "pause": PAUSED, "abort": ABORTED, "fail": FAILED},
    RUNNING: {"soak": RUNNING, "advance": RUNNING, "succeed": SUCCEEDED, "fail": FAILED, "pause": PAUSED,
              "abort": ABORTED},
    PAUSED: {"resume": RUNNING, "abort": ABORTED},
    SUCCEEDED: {},
    FAILED: {},
    ABORTED: {},
}

NOT_SENT, SENT = "not_sent", "sent"
"""A rollout device's state before its job's first event: not sent yet, or recorded and sent."""
MAX_REASON = 2000


def _refused(state: str, event: str) -> InvalidTransition:
    """The domain error for ``event`` in ``state`` (the fleet server's API answers it with 409)."""
    allowed = ", ".join(TRANSITIONS.get(state, {})) or "nothing"
    return InvalidTransition(f"cannot {event} a rollout that is {state} (allowed: {allowed})", state=state, move=event)


@dataclass(frozen=True)
class Gates:
    min_success_share: float = 1.0
    soak_s: float = 0.0
    wave_timeout_s: float = 1800.0
    max_error_rate: float | None = None
    rollback_on_failure: bool = False


@dataclass(frozen=True)
class Rollout:
    """The persisted fields the state machine reads and writes."""

    id: str
    state: str
    wave: int
    wave_count: int
    gates: Gates
    reason: str = ""
    started_at: float | None = None
    wave_started_at: float | None = None
    soak_started_at: float | None = None
    paused_at: float | None = None
    finished_at: float | None = None


def transition(rollout: Rollout, event: Event, now: float, reason: str = "") -> Rollout:
    """The one way a rollout changes state. Raises :class:`InvalidTransition`."""
    target = TRANSITIONS.get(rollout.state, {}).get(event)
    if target is None:
        raise _refused(rollout.state, event)
    reason = reason[:MAX_REASON]
    if event == "start":
        return replace(rollout, state=target, wave=0, started_at=now, wave_started_at=now, soak_started_at=None)
    if event == "soak":
        return replace(rollout, soak_started_at=now)
    if event == "advance":
        if rollout.wave + 1 >= rollout.wave_count:
            raise _refused(rollout.state, "advance past the last wave")
        return replace(rollout, wave=rollout.wave + 1, wave_started_at=now, soak_started_at=None)
    if event == "pause":
        return replace(rollout, state=target, paused_at=now, reason=reason or rollout.reason)
    if event == "resume":
        return _resumed(rollout, now, reason)
    # succeed, fail, abort: terminal
    return replace(rollout, state=target, reason=reason, finished_at=now, paused_at=None)


def _resumed(rollout: Rollout, now: float, reason: str) -> Rollout:
    """Back to running; the clocks of the wave and its soak skip the time spent paused. A
    rollout paused before it started starts now."""
    if rollout.started_at is None:
        return replace(rollout, state=RUNNING, wave=0, started_at=now, wave_started_at=now, soak_started_at=None,
                       paused_at=None, reason=reason)
    paused = max(0.0, now - (rollout.paused_at if rollout.paused_at is not None else now))

    def shifted(moment: float | None) -> float | None:
        return None if moment is None else moment + paused

    return replace(rollout, state=RUNNING, paused_at=None, reason=reason,
                   wave_started_at=shifted(rollout.wave_started_at), soak_started_at=shifted(rollout.soak_started_at))


# --------------------------------------------------------------------------- ids


def command_id(rollout_id: str, kind: str, wave: int, device: str) -> str:
    """The id of the command ``kind`` (deploy, rollback, cancel) a rollout sends ``device`` in
    ``wave``: derived, never random, so whoever computes it again (a restarted server, the
    other server) gets the same id, and the device's replay ledger refuses a second copy.
    ``<rollout>-<k><wave>-<16 hex of sha256(rollout|kind|wave|device)>``, within the id pattern."""
    digest = hashlib.sha256(f"{rollout_id}|{kind}|{wave}|{device}".encode()).hexdigest()[:16]
    return f"{rollout_id}-{kind[0]}{wave}-{digest}"


def new_rollout_id(entropy: bytes) -> str:
    """``ro-`` and 12 hex digits of ``entropy`` (the caller passes random bytes)."""
    return f"ro-{entropy.hex()[:12]}"


# --------------------------------------------------------------------------- the next step


@dataclass(frozen=True)
class DeviceStatus:
    """One device of a rollout as the driver read it: its wave, its job, its health figures
    since the current wave's soak began (``inferences``/``errors``), whether it is online, and
    the golden stream counts its job's detail carried (None: none)."""

    device: str
    wave: int
    state: str = NOT_SENT
    final: bool = False
    reason: str = ""
    online: bool = True
    inferences: int = 0
    errors: int = 0
    golden_stream: GoldenCounts | None = None


StepKind = Literal["wait", "start", "send", "soak", "advance", "succeed", "fail"]


@dataclass(frozen=True)
class Step:
    """What the driver does next. ``devices``: whom to send the wave's command (``send``);
    ``rollback``/``cancel``: whom to undo after a failure, when the rollout asks for it."""

    kind: StepKind
    devices: tuple[str, ...] = ()
    reason: str = ""
    rollback: tuple[str, ...] = ()
    cancel: tuple[str, ...] = ()


ALREADY_ACTIVE = "is already the active model"
"""The agent's answer to a deploy of the model it runs: that device is on the version, not failed."""


def ended_active(device: DeviceStatus) -> bool:
    """Whether a device's job counts as ended ``active`` for the gates: it did, or the device
    answered that it already runs the rollout's model (a fleet brought back to one version is
    not failed by the devices already on it). Never used to pick whom a failure rolls back."""
    return device.final and (device.state == ACTIVE or ALREADY_ACTIVE in device.reason)


def _jobs(devices: Sequence[DeviceStatus]) -> dict[str, DeviceJob]:
    return {d.device: DeviceJob(d.device, state=ACTIVE if ended_active(d) else d.state, reason=d.reason,
                                final=d.final) for d in devices}


def undo_targets(devices: Sequence[DeviceStatus]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Whom a failed rollout undoes: devices whose job reached ``active`` get a ``rollback``
    (final or still in their health window: a rollback ends the window too), devices still
    on their way (sent, no final answer) get a ``cancel`` of the deploy (a rollback would
    take them to the model before the one they run). Sorted."""
    rollback = sorted(d.device for d in devices if d.state == ACTIVE)
    cancel = sorted(d.device for d in devices if d.state != ACTIVE and d.state != NOT_SENT and not d.final)
    return tuple(rollback), tuple(cancel)


def failure(rollout: Rollout, devices: Sequence[DeviceStatus], reason: str) -> Step:
    """The ``fail`` step, with the devices to undo when the rollout asks for it."""
    if not rollout.gates.rollback_on_failure:
        return Step("fail", reason=reason)
    rollback, cancel = undo_targets(devices)
    return Step("fail", reason=reason, rollback=rollback, cancel=cancel)


def soak_verdict(wave: Sequence[DeviceStatus], gates: Gates) -> str:
    """Why the soaking wave fails its health gate, or "" while it holds: too few of its devices
    (those that ended active) are online and under ``max_error_rate``. Pure."""
    required = required_successes(len(wave), gates.min_success_share)
    unhealthy: list[str] = []
    healthy = 0
    for device in wave:
        if not ended_active(device):
            continue
        if not device.online:
            unhealthy.append(f"{device.device} offline")
        elif gates.max_error_rate is not None and device.inferences > 0 \
                and device.errors / device.inferences > gates.max_error_rate:
            unhealthy.append(f"{device.device} error rate {device.errors / device.inferences:.3f}")
        else:
            healthy += 1
    if healthy >= required:
        return ""
    return (f"soak: {', '.join(unhealthy[:10]) or 'no healthy device'}"
            f"{'...' if len(unhealthy) > 10 else ''}; {healthy} healthy, {required} of {len(wave)} required")


def golden_stream_note(wave: Sequence[DeviceStatus]) -> str:
    """The wave's golden stream event mismatches, counted from its failed devices' typed job
    counts (the agent refuses a candidate whose golden clip gives other events). Pure."""
    counts = [d.golden_stream.mismatches for d in wave
              if d.final and d.state != ACTIVE and d.golden_stream is not None]
    hit = [count for count in counts if count]
    return f"; golden stream: {sum(hit)} event mismatch(es) on {len(hit)} device(s)" if hit else ""


def next_step(rollout: Rollout, devices: Sequence[DeviceStatus], now: float) -> Step:
    """What a driver holding the lease does now with ``rollout``. Pure.

    ``pending`` starts; a running wave first gets its commands sent (devices not sent yet),
    then is judged by the job gate, then soaks, then the next wave starts or the rollout
    succeeds. ``paused`` and terminal rollouts wait (a failed one's undo commands were
    decided with its ``fail`` step)."""
    if rollout.state == PENDING:
        return Step("start")
    if rollout.state != RUNNING:
        return Step("wait")
    wave = [d for d in devices if d.wave == rollout.wave]
    if not wave:
        return failure(rollout, devices, f"wave {rollout.wave + 1} has no device (the plan is damaged)")
    unsent = tuple(sorted(d.device for d in wave if d.state == NOT_SENT))
    if unsent:
        return Step("send", devices=unsent)
    started = rollout.wave_started_at if rollout.wave_started_at is not None else now
    timed_out = now - started >= rollout.gates.wave_timeout_s
    verdict = wave_verdict(_jobs(wave), [d.device for d in wave], timed_out=timed_out,
                           min_success_share=rollout.gates.min_success_share)
    label = f"wave {rollout.wave + 1} of {rollout.wave_count}"
    if verdict.outcome == "failed":
        why = f"timed out after {rollout.gates.wave_timeout_s:g} s: " if verdict.timed_out else ""
        return failure(rollout, devices, f"{label} failed: {why}{verdict.reason}{golden_stream_note(wave)}")
    if verdict.outcome == "pending":
        return Step("wait")
    return _after_jobs(rollout, devices, wave, label, now)


def _after_jobs(rollout: Rollout, devices: Sequence[DeviceStatus], wave: Sequence[DeviceStatus], label: str,
                now: float) -> Step:
    """The step of a running wave whose jobs passed their gate: soak, then advance or succeed."""
    if rollout.soak_started_at is None:
        return Step("soak")
    unhealthy = soak_verdict(wave, rollout.gates)
    if unhealthy:
        return failure(rollout, devices, f"{label} failed its {unhealthy}")
    if now - rollout.soak_started_at < rollout.gates.soak_s:
        return Step("wait")
    if rollout.wave + 1 >= rollout.wave_count:
        return Step("succeed", reason=f"{rollout.wave_count} wave(s) passed")
    return Step("advance")


MAX_DRIVER_ERRORS = 3
"""Rounds in a row a rollout may raise an unexpected error in the driver before it is failed."""


def fails_after_error(consecutive: int, *, permanent: bool) -> bool:
    """Whether a rollout whose round in the driver raised (``consecutive`` rounds in a row,
    this one included) is failed now. An error no retry can cure (a parameter no device
    accepts: ``permanent``) fails it at once; any other after :data:`MAX_DRIVER_ERRORS`
    rounds, so a poisoned rollout is retried a bounded number of times, never forever, and
    never holds up the rollouts after it. Pure."""
    return permanent or consecutive >= MAX_DRIVER_ERRORS


def check_gates(gates: Gates) -> Gates:
    """Gates from an API request, bounded (:class:`SchemaError` naming the field: the API's 400)."""
    checks = (
        ("min_success_share", gates.min_success_share, 0.0, 1.0, False),
        ("soak_s", gates.soak_s, 0.0, 7 * 86400.0, True),
        ("wave_timeout_s", gates.wave_timeout_s, 1.0, 7 * 86400.0, True),
    )
    for name, value, low, high, closed_low in checks:
        if not math.isfinite(value) or value > high or value < low or (not closed_low and value <= low):
            raise SchemaError(name, f"{value!r} is outside {'[' if closed_low else '('}{low:g}, {high:g}]")
    if gates.max_error_rate is not None and not (math.isfinite(gates.max_error_rate)
                                                  and 0 <= gates.max_error_rate <= 1):
        raise SchemaError("max_error_rate", f"{gates.max_error_rate!r} is outside [0, 1]")
    return gates
