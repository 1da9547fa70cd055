"""The job state machine at its edges: every transition allowed and refused, what advance()
records, restart decisions and the reasons given, and the persisted/published forms."""

from __future__ import annotations

import json
import math

import pytest

from device_agent.updates import jobs as J
from device_agent.updates.jobs import InvalidTransition, Job, advance, on_restart, restart_reason, resumes

NOW = 1_000_000.0

# The allowed moves, written out independently of jobs.TRANSITIONS (the docstring's diagram plus
# the restart, cancel and rollback moves); every other pair must be refused.
ALLOWED = {
    J.QUEUED: {J.QUEUED, J.DOWNLOADING, J.REJECTED, J.FAILED, J.DONE, J.CANCELLED, J.ROLLED_BACK},
    J.DOWNLOADING: {J.DOWNLOADING, J.VERIFYING, J.FAILED, J.CANCELLED, J.QUEUED},
    J.VERIFYING: {J.VERIFYING, J.STAGING, J.REJECTED, J.FAILED, J.CANCELLED, J.QUEUED},
    J.STAGING: {J.TESTING, J.FAILED, J.CANCELLED, J.QUEUED},
    J.TESTING: {J.ACTIVE, J.FAILED, J.CANCELLED, J.QUEUED, J.ROLLED_BACK},
    J.ACTIVE: {J.ACTIVE, J.ROLLED_BACK, J.FAILED},
}
PAIRS = [(before, after) for before in J.STATES for after in J.STATES]


@pytest.mark.parametrize(("before", "after"), [p for p in PAIRS if p[1] in ALLOWED.get(p[0], ())])
def test_allowed_transition(before, after):
    job = advance(Job("j", "deploy", state=before), after, "why", NOW)
    assert job.state == after and job.reason == "why"
    assert job.final is (after in J.TERMINAL)


@pytest.mark.parametrize(("before", "after"), [p for p in PAIRS if p[1] not in ALLOWED.get(p[0], ())])
def test_refused_transition_names_the_job_and_the_move(before, after):
    job = Job("j-7", "deploy", state=before)
    with pytest.raises(InvalidTransition) as caught:
        advance(job, after, "why", NOW)
    assert str(caught.value) == f"job j-7: {before} -> {after} is not allowed"


def test_the_table_covers_every_state_and_terminal_states_are_exactly_the_ends():
    assert set(J.TRANSITIONS) == set(J.STATES)
    assert {J.FAILED, J.REJECTED, J.ROLLED_BACK, J.DONE, J.CANCELLED} == J.TERMINAL
    assert {state for state in J.STATES if J.CANCELLED in J.TRANSITIONS[state]} == J.CANCELLABLE


def test_advance_records_reason_detail_and_time_to_the_millisecond():
    job = Job("j", "deploy", detail={"kept": 1, "over": "old"}, history=((J.QUEUED, 1.0),))
    moved = advance(job, J.DOWNLOADING, "fetching", 1234.56789, over="new", bytes=10)
    assert moved.reason == "fetching"
    assert moved.detail == {"kept": 1, "over": "new", "bytes": 10}
    assert moved.history == ((J.QUEUED, 1.0), (J.DOWNLOADING, 1234.568))
    assert job.detail == {"kept": 1, "over": "old"}  # the old job is untouched


def test_advance_final_flag_defaults_to_terminal_and_can_be_set():
    assert advance(Job("j", "deploy", state=J.TESTING), J.ACTIVE, "", NOW).final is False
    assert advance(Job("j", "deploy", state=J.TESTING), J.ACTIVE, "", NOW, final=True).final is True
    assert advance(Job("j", "deploy", state=J.QUEUED), J.FAILED, "", NOW).final is True
    assert advance(Job("j", "deploy", state=J.QUEUED), J.FAILED, "", NOW, final=False).final is False


# ------------------------------------------------------------------ restarts


def _history(*states: str) -> tuple[tuple[str, float], ...]:
    return tuple((state, NOW) for state in states)


def test_resumes_counts_returns_to_queued_after_creation():
    assert resumes(Job("j", "deploy")) == 0
    assert resumes(Job("j", "deploy", history=_history(J.QUEUED))) == 0  # its creation
    assert resumes(Job("j", "deploy", history=_history(J.QUEUED, J.QUEUED))) == 1
    assert resumes(Job("j", "deploy", history=_history(J.QUEUED, J.DOWNLOADING, J.VERIFYING, J.QUEUED))) == 1


def test_a_job_resumed_max_resumes_times_is_failed_naming_the_count():
    history = _history(J.QUEUED, *([J.DOWNLOADING, J.QUEUED] * J.MAX_RESUMES))
    job = Job("j", "deploy", state=J.QUEUED, history=history)
    assert on_restart(job, active_is_job_version=False, now=NOW) == J.FAIL
    assert restart_reason(job, NOW) == f"the agent restarted {J.MAX_RESUMES} times during this job; not trying again"
    once_less = Job("j", "deploy", state=J.QUEUED, history=history[:-2])
    assert on_restart(once_less, active_is_job_version=False, now=NOW) == J.RESUME


def test_a_non_deploy_job_cut_short_is_failed_with_its_reason():
    job = Job("r", "rollback", state=J.QUEUED)
    assert on_restart(job, active_is_job_version=False, now=NOW) == J.FAIL
    assert restart_reason(job, NOW) == "the agent restarted before the command completed"


def test_verify_started_fails_only_a_job_that_was_verifying():
    verifying = Job("j", "deploy", state=J.VERIFYING, detail={"verify_started": True})
    assert on_restart(verifying, active_is_job_version=False, now=NOW) == J.FAIL
    assert restart_reason(verifying, NOW) == "the agent stopped while verifying this artifact; it is not verified again"
    # the flag left over from an earlier attempt does not matter once the job is downloading again
    downloading = Job("j", "deploy", state=J.DOWNLOADING, detail={"verify_started": True})
    assert on_restart(downloading, active_is_job_version=False, now=NOW) == J.RESUME
    expired = Job("j", "deploy", state=J.DOWNLOADING, detail={"verify_started": True},
                  command={"expires_at": NOW - 1})
    assert restart_reason(expired, NOW) == "the command expired while the agent was down"


@pytest.mark.parametrize(("expires_at", "expired"), [
    (NOW - 0.001, True), (NOW, False), (NOW + 1, False), (math.inf, True), (-math.inf, True), (math.nan, True),
    (None, False), ("soon", False),
])
def test_expiry_boundary_on_restart(expires_at, expired):
    job = Job("j", "deploy", state=J.DOWNLOADING, command={"expires_at": expires_at})
    assert on_restart(job, active_is_job_version=False, now=NOW) == (J.FAIL if expired else J.RESUME)
    many = Job("j", "deploy", state=J.DOWNLOADING, command={"expires_at": expires_at},
               history=_history(J.QUEUED, *([J.QUEUED] * J.MAX_RESUMES)))
    expected = "the command expired while the agent was down" if expired else \
        f"the agent restarted {J.MAX_RESUMES} times during this job; not trying again"
    assert restart_reason(many, NOW) == expected


def test_expiry_is_not_judged_without_a_clock():
    job = Job("j", "deploy", state=J.DOWNLOADING, command={"expires_at": NOW - 1})
    assert on_restart(job, active_is_job_version=False) == J.RESUME


def test_a_job_past_the_switch_is_rolled_back_before_any_other_rule():
    for job_type in ("deploy", "rollback"):
        active = Job("j", job_type, state=J.ACTIVE, command={"expires_at": NOW - 1},
                     history=_history(J.QUEUED, *([J.QUEUED] * J.MAX_RESUMES)))
        assert on_restart(active, active_is_job_version=False, now=NOW) == J.ROLL_BACK
    testing = Job("j", "rollback", state=J.TESTING)
    assert on_restart(testing, active_is_job_version=True, now=NOW) == J.ROLL_BACK
    assert on_restart(testing, active_is_job_version=False, now=NOW) == J.FAIL


def test_an_ended_job_needs_nothing_even_if_not_marked_final():
    for state in J.TERMINAL:
        assert on_restart(Job("j", "deploy", state=state), active_is_job_version=True, now=NOW) == J.NOTHING
    assert on_restart(Job("j", "deploy", state=J.ACTIVE, final=True), active_is_job_version=True) == J.NOTHING


# ------------------------------------------------------------------ persisted and published forms


def test_job_json_has_every_field_and_round_trips():
    job = Job("j", "deploy", state=J.TESTING, reason="smoke", final=False, command={"version": "1.2.0"},
              detail={"bytes": 3}, history=_history(J.QUEUED, J.TESTING))
    doc = job.to_json()
    assert doc == {"id": "j", "type": "deploy", "state": J.TESTING, "reason": "smoke", "final": False,
                   "command": {"version": "1.2.0"}, "detail": {"bytes": 3},
                   "history": [[J.QUEUED, NOW], [J.TESTING, NOW]]}
    assert Job.from_json(doc) == job


def test_job_json_without_optional_fields_reads_the_defaults():
    job = Job.from_json({"id": "j", "type": "ping", "state": J.QUEUED})
    assert job == Job("j", "ping", state=J.QUEUED)
    assert job.reason == "" and job.command == {} and job.detail == {} and job.history == () and job.final is False


def test_job_event_carries_version_and_detail_only_when_present():
    """The wire bytes are those the agent sent before the typed builder (key order included)."""
    head = {"schema": "edgepack.job/1", "device": "d", "ts": 1.234}
    bare = Job("j", "ping", state=J.DONE, reason="pong", final=True)
    assert bare.event("d", 1.2341).encode() == json.dumps(
        {**head, "job": "j", "type": "ping", "state": J.DONE, "reason": "pong", "final": True}).encode()
    full = Job("k", "deploy", state=J.DOWNLOADING, reason="fetching", command={"version": "1.2.0"},
               detail={"bytes": 3})
    assert full.event("d", 1.2341, duplicate=True).encode() == json.dumps(
        {**head, "job": "k", "type": "deploy", "state": J.DOWNLOADING, "reason": "fetching", "final": False,
         "version": "1.2.0", "detail": {"bytes": 3}, "duplicate": True}).encode()
    assert "version" not in Job("k", "deploy", command={"version": ""}).event("d", 1.0).to_json()
