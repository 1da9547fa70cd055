"""The rollout policy of ``edgepack deploy``, as pure functions: no MQTT, no clock.

- :func:`plan_waves` splits the targets into a canary wave and the rest;
- :class:`JobBoard` folds the devices' job events (``edgepack.job/1``) into one row per device;
- :func:`wave_verdict` says whether a wave passed, failed or is still running.

Why pure: these decide whether a fleet gets a model, so their boundaries (the canary share
rounding, a wave where one device failed, an event for another command) are tested as
values, and the orchestrator around them stays a short sequence of I/O steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from edgepack_core.errors import EdgepackError

ACTIVE = "active"
MAX_EVENTS_PER_DEVICE = 64
MAX_STATE_CHARS = 32
MAX_REASON_CHARS = 500


class RolloutError(EdgepackError):
    """A rollout that cannot be planned (an empty target list, a canary share out of range)."""


@dataclass
class DeviceJob:
    """What one device said about this rollout's command so far."""

    device: str
    state: str = "sent"
    reason: str = ""
    final: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)


def plan_waves(targets: Sequence[str], canary_percent: float | None) -> list[list[str]]:
    """The waves to send, in order: ``[canaries, rest]``, or one wave with everyone.

    The canary wave holds ``ceil(len * percent / 100)`` devices (at least one); with a single
    target, or a share that covers everyone, there is one wave. Duplicates are removed, order kept.
    """
    unique = list(dict.fromkeys(targets))
    if not unique:
        raise RolloutError("no target device to deploy to")
    if canary_percent is None:
        return [unique]
    if not (math.isfinite(canary_percent) and 0 < canary_percent <= 100):
        raise RolloutError(f"the canary share must be above 0 and at most 100 percent, got {canary_percent}")
    count = max(1, math.ceil(len(unique) * canary_percent / 100))
    if count >= len(unique):
        return [unique]
    return [unique[:count], unique[count:]]


class JobBoard:
    """Folds job events for one command id into a :class:`DeviceJob` per target device.

    Events come off the network: anything for another command, from a device outside the
    rollout, or with fields of the wrong type is ignored; a device's row stops changing once
    it has a final state (later duplicates only add to its bounded event list).
    """

    def __init__(self, command_id: str, devices: Sequence[str]) -> None:
        self.command_id = command_id
        self.jobs: dict[str, DeviceJob] = {device: DeviceJob(device) for device in devices}

    def fold(self, device: str | None, event: Any) -> bool:
        """Take one event from ``device``; True if it was for this rollout and was recorded.
        ``state`` (1 to 32 characters) and ``final`` (a boolean) are required, as in the job
        schema; a missing or non-text ``reason`` reads as empty."""
        job = self.jobs.get(device)  # type: ignore[arg-type]
        if job is None or not isinstance(event, Mapping) or event.get("job") != self.command_id:
            return False
        state, final, reason = event.get("state"), event.get("final"), event.get("reason")
        if not isinstance(state, str) or not 0 < len(state) <= MAX_STATE_CHARS or not isinstance(final, bool):
            return False
        if len(job.events) < MAX_EVENTS_PER_DEVICE:
            job.events.append(dict(event))
        if not job.final:
            job.state, job.final = state, final
            job.reason = reason[:MAX_REASON_CHARS] if isinstance(reason, str) else ""
        return True

    def finished(self, devices: Sequence[str]) -> bool:
        """Whether every device of ``devices`` has reached a final state."""
        return all(self.jobs[device].final for device in devices)

    def skip(self, devices: Sequence[str], reason: str) -> None:
        """Mark devices that were never sent the command (a canary failed first)."""
        for device in devices:
            self.jobs[device].state, self.jobs[device].reason = "skipped", reason


def all_active(jobs: Mapping[str, DeviceJob]) -> bool:
    """Every device (at least one) ended ``active`` and final."""
    return bool(jobs) and all(job.final and job.state == ACTIVE for job in jobs.values())


@dataclass(frozen=True)
class WaveVerdict:
    """``passed`` (all final and active), ``failed`` (one failed, or time ran out) or ``pending``."""

    outcome: Literal["passed", "failed", "pending"]
    failed: tuple[str, ...] = ()
    reason: str = ""
    timed_out: bool = False


def wave_verdict(board: JobBoard, wave: Sequence[str], *, timed_out: bool) -> WaveVerdict:
    """Judge one wave. A device that ended in anything but ``active`` fails the wave at once
    (no need to wait for the others); without failures, the wave passes when every device is
    final, and fails naming the silent devices when ``timed_out``."""
    jobs = [board.jobs[device] for device in wave]
    failed = [job for job in jobs if job.final and job.state != ACTIVE]
    if failed:
        first = failed[0]
        return WaveVerdict("failed", tuple(j.device for j in failed),
                           f"{', '.join(j.device for j in failed)}: {first.state} ({first.reason})")
    silent = [job.device for job in jobs if not job.final]
    if not silent:
        return WaveVerdict("passed")
    if timed_out:
        return WaveVerdict("failed", tuple(silent), f"no final answer from {', '.join(silent)}", timed_out=True)
    return WaveVerdict("pending")
