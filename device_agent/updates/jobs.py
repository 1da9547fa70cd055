"""The update job state machine. Pure: states, allowed transitions, and
what a restarted agent does with a job it finds half-way.

    queued -> downloading -> verifying -> staging -> testing -> active
       \\-> rejected     \\-> failed       \\-> rejected/failed  \\-> failed   \\-> rolled_back

``active`` is reached at the hot-swap; the job stays open (``final`` false) through the
health window and closes either ``active`` (final) or ``rolled_back``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

QUEUED, DOWNLOADING, VERIFYING, STAGING, TESTING, ACTIVE = "queued", "downloading", "verifying", "staging", \
    "testing", "active"
FAILED, REJECTED, ROLLED_BACK, DONE = "failed", "rejected", "rolled_back", "done"

STATES = (QUEUED, DOWNLOADING, VERIFYING, STAGING, TESTING, ACTIVE, FAILED, REJECTED, ROLLED_BACK, DONE)
TERMINAL = frozenset({FAILED, REJECTED, ROLLED_BACK, DONE})

TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({DOWNLOADING, REJECTED, FAILED, DONE}),
    DOWNLOADING: frozenset({DOWNLOADING, VERIFYING, FAILED}),
    VERIFYING: frozenset({STAGING, REJECTED, FAILED}),
    STAGING: frozenset({TESTING, FAILED}),
    TESTING: frozenset({ACTIVE, FAILED}),
    ACTIVE: frozenset({ACTIVE, ROLLED_BACK}),
    FAILED: frozenset(),
    REJECTED: frozenset(),
    ROLLED_BACK: frozenset(),
    DONE: frozenset(),
}


class InvalidTransition(RuntimeError):
    """A programming error: the executor tried a transition the machine does not allow."""


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

    def event(self) -> dict[str, Any]:
        """The job event payload (the reporter adds schema, device and ts)."""
        doc: dict[str, Any] = {"job": self.id, "type": self.type, "state": self.state, "reason": self.reason,
                               "final": self.final}
        if self.command.get("version"):
            doc["version"] = self.command["version"]
        if self.detail:
            doc["detail"] = self.detail
        return doc

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
        raise InvalidTransition(f"job {job.id}: {job.state} -> {state} is not allowed")
    is_final = state in TERMINAL if final is None else final
    return replace(job, state=state, reason=reason, final=is_final, detail={**job.detail, **detail},
                   history=(*job.history, (state, round(now, 3))))


# What a restarted agent does with a job found in each state.
RESUME = "resume"        # start the pipeline again from the download (resumable, idempotent)
ROLL_BACK = "roll_back"  # the new model was active but not yet proven: it may be why we died
NOTHING = "nothing"      # the job had ended
FAIL = "fail"            # a non-deploy job cut short: close it with a reason, do not re-run it


def on_restart(job: Job, *, active_is_job_version: bool) -> str:
    """Decide what to do with a persisted job after a crash or restart. Pure.

    ``active_is_job_version`` says whether the store's committed active model is the one
    this job installs (the switch is the store's commit point, so it can be ahead of the
    job's last saved state).
    """
    if job.final or job.state in TERMINAL:
        return NOTHING
    if job.state == ACTIVE or (job.state == TESTING and active_is_job_version):
        return ROLL_BACK
    if job.type != "deploy":
        return FAIL
    return RESUME
