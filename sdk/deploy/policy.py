"""The rollout policy of ``edgepack deploy``, as pure functions: no MQTT, no clock.

- :func:`plan_waves` splits the targets into a canary wave and the rest;
  :func:`plan_wave_shares` into any number of waves by cumulative percentages (5, 25, 100),
  the fleet server's plans;
- :class:`JobBoard` folds the devices' job events (``edgepack.job/1``) into one row per device;
- :func:`wave_verdict` says whether a wave passed, failed or is still running, optionally
  tolerating failures down to a minimum success share (the fleet server's gate).

Why pure: these decide whether a fleet gets a model, so their boundaries (the canary share
rounding, a wave where one device failed, an event for another command) are tested as
values, and the orchestrator around them stays a short sequence of I/O steps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from edgepack_core.protocol.messages import JobEvent
from sdk.errors import RolloutError

ACTIVE = "active"
MAX_EVENTS_PER_DEVICE = 64
MAX_WAVES = 20


@dataclass
class DeviceJob:
    """What one device said about this rollout's command so far."""

    device: str
    state: str = "sent"
    reason: str = ""
    final: bool = False
    events: list[JobEvent] = field(default_factory=list)


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


def check_wave_shares(percents: Sequence[float]) -> list[float]:
    """Cumulative wave shares as given: 1 to :data:`MAX_WAVES` finite numbers, each above 0,
    strictly increasing, the last exactly 100 (every target is reached at the end)."""
    shares = list(percents)
    if not 0 < len(shares) <= MAX_WAVES:
        raise RolloutError(f"a rollout has 1 to {MAX_WAVES} waves, got {len(shares)}")
    for index, share in enumerate(shares):
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share) \
                or not 0 < share <= 100:
            raise RolloutError(f"wave {index + 1}: {share!r} is not a share above 0 and at most 100 percent")
        if index and share <= shares[index - 1]:
            raise RolloutError(f"wave {index + 1}: {share:g}% does not grow past wave {index}'s {shares[index - 1]:g}%"
                               " (shares are cumulative)")
    if shares[-1] != 100:
        raise RolloutError(f"the last wave must reach 100% of the targets, not {shares[-1]:g}%")
    return [float(share) for share in shares]


def plan_wave_shares(targets: Sequence[str], percents: Sequence[float]) -> list[list[str]]:
    """The waves of a rollout by cumulative shares: wave ``i`` brings the devices reached up to
    ``ceil(len * percents[i] / 100)`` (so 5, 25, 100 over 20 devices gives 1, 4, 15). A share
    that adds no device (it rounds to the previous count) gives no wave. Duplicates are
    removed, order kept."""
    unique = list(dict.fromkeys(targets))
    if not unique:
        raise RolloutError("no target device to deploy to")
    waves: list[list[str]] = []
    reached = 0
    for count in _reach(len(unique), percents):
        waves.append(unique[reached:count])
        reached = count
    return waves


def planned_shares(size: int, percents: Sequence[float]) -> list[float]:
    """The share each wave of :func:`plan_wave_shares` over ``size`` targets completes, in order:
    the largest share asked for that reaches the same number of targets (5, 25, 100 over one
    device is one wave, and it completes 100)."""
    shares = check_wave_shares(percents)
    wanted = [max(1, math.ceil(size * share / 100)) for share in shares]
    return [max(share for share, count in zip(shares, wanted, strict=True) if count == reached)
            for reached in _reach(size, shares)]


def _reach(size: int, percents: Sequence[float]) -> list[int]:
    """How many targets each wave reaches, cumulatively; a share that adds nobody is skipped."""
    reached: list[int] = []
    for share in check_wave_shares(percents):
        count = max(1, math.ceil(size * share / 100))
        if count > (reached[-1] if reached else 0):
            reached.append(count)
    return reached


class JobBoard:
    """Folds job events for one command id into a :class:`DeviceJob` per target device.

    Events come parsed and bounded (:func:`~edgepack_core.protocol.messages.parse_job_event`);
    one for another command or from a device outside the rollout is ignored; a device's row
    stops changing once it has a final state (later duplicates only add to its bounded event
    list).
    """

    def __init__(self, command_id: str, devices: Sequence[str]) -> None:
        self.command_id = command_id
        self.jobs: dict[str, DeviceJob] = {device: DeviceJob(device) for device in devices}

    def fold(self, event: JobEvent) -> bool:
        """Take one event; True if it was for this rollout and was recorded."""
        job = self.jobs.get(event.device)
        if job is None or event.job != self.command_id:
            return False
        if len(job.events) < MAX_EVENTS_PER_DEVICE:
            job.events.append(event)
        if not job.final:
            job.state, job.final, job.reason = event.state, event.final, event.reason
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


def required_successes(size: int, min_success_share: float) -> int:
    """How many devices of a wave of ``size`` must end active: ``ceil(size * share)``, at least
    one for a non-empty wave (a wave where nothing succeeded never passes). Pure."""
    if not (math.isfinite(min_success_share) and 0 < min_success_share <= 1):
        raise RolloutError(f"the success share must be above 0 and at most 1, got {min_success_share}")
    return min(size, max(1, math.ceil(size * min_success_share - 1e-9)))


def wave_verdict(board: JobBoard | Mapping[str, DeviceJob], wave: Sequence[str], *, timed_out: bool,
                 min_success_share: float = 1.0) -> WaveVerdict:
    """Judge one wave. A device that ended in anything but ``active`` fails the wave at once
    (no need to wait for the others); without failures, the wave passes when every device is
    final, and fails naming the silent devices when ``timed_out``.

    With ``min_success_share`` below 1 (the fleet server's gate), failures are tolerated as
    long as :func:`required_successes` can still be met: the wave fails once too many devices
    failed, passes when every device is final (or time ran out) with enough of them active."""
    jobs_by_device = board.jobs if isinstance(board, JobBoard) else board
    jobs = [jobs_by_device[device] for device in wave]
    if min_success_share < 1:
        return _share_verdict(jobs, required_successes(len(jobs), min_success_share), timed_out)
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


def _share_verdict(jobs: Sequence[DeviceJob], required: int, timed_out: bool) -> WaveVerdict:
    failed = [job for job in jobs if job.final and job.state != ACTIVE]
    succeeded = sum(1 for job in jobs if job.final and job.state == ACTIVE)
    silent = [job.device for job in jobs if not job.final]
    names = ", ".join(job.device for job in failed)
    if len(jobs) - len(failed) < required:
        first = failed[0]
        return WaveVerdict("failed", tuple(job.device for job in failed),
                           f"{names}: {first.state} ({first.reason}); {required} of {len(jobs)} must end active")
    if not silent or (timed_out and succeeded >= required):
        return WaveVerdict("passed", tuple(job.device for job in failed), names and f"tolerated: {names}")
    if timed_out:
        return WaveVerdict("failed", tuple(silent), f"no final answer from {', '.join(silent)}; {succeeded} of "
                                                    f"{required} required ended active", timed_out=True)
    return WaveVerdict("pending")
