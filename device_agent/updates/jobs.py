r"""The update job state machine. Pure: states, allowed transitions, and
what a restarted agent does with a job it finds half-way.

    queued -> downloading -> verifying -> staging -> testing -> active
       \-> rejected     \-> failed       \-> rejected/failed  \-> failed   \-> rolled_back
       \-> cancelled    \-> cancelled                        \-> cancelled

``active`` is reached at the hot-swap; the job stays open (``final`` false) through the
health window and closes either ``active`` (final) or ``rolled_back``. Every state change of
every job goes through :func:`advance`, including those a restart makes (a job cut short
before the switch goes back to ``queued``; one cut short in ``testing`` after the switch goes
to ``rolled_back``), a ``cancel`` command or a newer deploy (``cancelled``), and a rollback
command (``queued -> rolled_back`` when it worked, ``failed`` naming what serves when not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from edgepack_core.errors import InvalidTransition
from edgepack_core.protocol.messages import JobEvent

QUEUED, DOWNLOADING, VERIFYING, STAGING, TESTING, ACTIVE = "queued", "downloading", "verifying", "staging", \
    "testing", "active"
FAILED, REJECTED, ROLLED_BACK, DONE, CANCELLED = "failed", "rejected", "rolled_back", "done", "cancelled"

STATES = (QUEUED, DOWNLOADING, VERIFYING, STAGING, TESTING, ACTIVE, FAILED, REJECTED, ROLLED_BACK, DONE, CANCELLED)
TERMINAL = frozenset({FAILED, REJECTED, ROLLED_BACK, DONE, CANCELLED})

TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({QUEUED, DOWNLOADING, REJECTED, FAILED, DONE, CANCELLED, ROLLED_BACK}),
    DOWNLOADING: frozenset({DOWNLOADING, VERIFYING, FAILED, CANCELLED, QUEUED}),
    VERIFYING: frozenset({VERIFYING, STAGING, REJECTED, FAILED, CANCELLED, QUEUED}),
    STAGING: frozenset({TESTING, FAILED, CANCELLED, QUEUED}),
    TESTING: frozenset({ACTIVE, FAILED, CANCELLED, QUEUED, ROLLED_BACK}),
    ACTIVE: frozenset({ACTIVE, ROLLED_BACK, FAILED}),
    FAILED: frozenset(),
    REJECTED: frozenset(),
    ROLLED_BACK: frozenset(),
    DONE: frozenset(),
    CANCELLED: frozenset(),
}
CANCELLABLE = frozenset({QUEUED, DOWNLOADING, VERIFYING, STAGING, TESTING})
"""States a ``cancel`` (or a newer deploy) can end; past the switch only a rollback undoes a job."""


@dataclass(frozen=True)
class Job:
    """One command's job, as persisted and as published on ``dev/{d}/job``."""

    id: str
    type: str
    state: str = QUEUED
    reason: str = ""
    final: bool = False
    command: dict[str, Any] = field(default_factory=dict)
    detail: dict[str, Any] = field(default_factory=dict)
    history: tuple[tuple[str, float], ...] = ()

    def event(self, device: str, ts: float, *, duplicate: bool = False) -> JobEvent:
        """The job event ``device`` publishes at ``ts``: the protocol's own type, so the agent
        builds with the definition every host reader parses with."""
        version = self.command.get("version")
        return JobEvent(device=device, job=self.id, type=self.type, state=self.state, final=self.final,
                        ts=round(ts, 3), reason=self.reason, version=str(version) if version else None,
                        duplicate=duplicate, detail=dict(self.detail))

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": self.type, "state": self.state, "reason": self.reason, "final": self.final,
                "command": self.command, "detail": self.detail, "history": [list(h) for h in self.history]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Job:
        return cls(id=doc["id"], type=doc["type"], state=doc["state"], reason=doc.get("reason", ""),
                   final=bool(doc.get("final")), command=doc.get("command", {}), detail=doc.get("detail", {}),
                   history=tuple((s, t) for s, t in doc.get("history", [])))


def advance(job: Job, state: str, reason: str, now: float, *, final: bool | None = None,
            **detail: Any) -> Job:
    """The job after moving to ``state``; raises InvalidTransition for a move the table forbids."""
    if state not in TRANSITIONS[job.state]:
        raise InvalidTransition(f"job {job.id}: {job.state} -> {state} is not allowed", state=job.state, move=state)
    is_final = state in TERMINAL if final is None else final
    return replace(job, state=state, reason=reason, final=is_final, detail={**job.detail, **detail},
                   history=(*job.history, (state, round(now, 3))))


# What a restarted agent does with a job found in each state.
RESUME = "resume"        # start the pipeline again from the download (resumable, idempotent)
ROLL_BACK = "roll_back"  # the new model was active but not yet proven: it may be why we died
NOTHING = "nothing"      # the job had ended
FAIL = "fail"            # cut short and not to be re-run (non-deploy, expired, or it crashed us)

MAX_RESUMES = 3
"""A deploy resumed this many times without finishing is failed: each restart may be the job's
doing (out of memory on a hostile artifact), and a fleet must not crash-loop on one command."""


def resumes(job: Job) -> int:
    """How many times a restart sent this job back to ``queued`` (the first entry is its creation)."""
    return sum(1 for state, _ in job.history[1:] if state == QUEUED)


def on_restart(job: Job, *, active_is_job_version: bool, now: float | None = None) -> str:
    """Decide what to do with a persisted job after a crash or restart. Pure.

    ``active_is_job_version`` says whether the store's committed active model is the one
    this job installs (the switch is the store's commit point, so it can be ahead of the
    job's last saved state). A deploy is not resumed when its command has expired (the
    operator's order is stale), when it stopped the agent while verifying (``verify_started``
    set: a hostile archive that exhausts memory must not be verified again), or after
    :data:`MAX_RESUMES` restarts.
    """
    if job.final or job.state in TERMINAL:
        return NOTHING
    if job.state == ACTIVE or (job.state == TESTING and active_is_job_version):
        return ROLL_BACK
    if job.type != "deploy":
        return FAIL
    if job.state == VERIFYING and job.detail.get("verify_started"):
        return FAIL
    expires_at = job.command.get("expires_at")
    if now is not None and isinstance(expires_at, (int, float)) and (not math.isfinite(expires_at)
                                                                      or expires_at < now):
        return FAIL
    if resumes(job) >= MAX_RESUMES:
        return FAIL
    return RESUME


def restart_reason(job: Job, now: float) -> str:
    """The reason a restarted agent gives for failing ``job`` (after :func:`on_restart` said FAIL)."""
    if job.type != "deploy":
        return "the agent restarted before the command completed"
    if job.state == VERIFYING and job.detail.get("verify_started"):
        return "the agent stopped while verifying this artifact; it is not verified again"
    expires_at = job.command.get("expires_at")
    if isinstance(expires_at, (int, float)) and (not math.isfinite(expires_at) or expires_at < now):
        return "the command expired while the agent was down"
    return f"the agent restarted {resumes(job)} times during this job; not trying again"
