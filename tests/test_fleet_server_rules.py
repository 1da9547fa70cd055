"""The fleet server's pure rules, as values: the rollout state machine and its next step, wave
plans and the success-share gate, telemetry folding and bounds, message records, tokens."""

from __future__ import annotations

import hmac
import json
import math
from pathlib import Path

import pytest

from edgepack_core.errors import SchemaError
from edgepack_core.protocol.bounds import MAX_MESSAGE_BYTES
from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.protocol.messages import (
    Decommissioned,
    DeviceState,
    JobEvent,
    parse_job_event,
    parse_state,
    parse_telemetry,
)
from sdk.deploy.policy import (
    DeviceJob,
    RolloutError,
    check_wave_shares,
    plan_wave_shares,
    planned_shares,
    required_successes,
    wave_verdict,
)
from sdk.errors import ApiError, ServerConfigError
from sdk.fleet_server import auth
from sdk.fleet_server.retention import (
    MAX_POINTS,
    Bucket,
    RetentionPolicy,
    bucket_of,
    check_step,
    effective_step,
    fold,
    parse_duration,
    rebucket,
)
from sdk.fleet_server.rollouts import (
    ABORTED,
    FAILED,
    NOT_SENT,
    PAUSED,
    PENDING,
    RUNNING,
    SENT,
    STATES,
    SUCCEEDED,
    TRANSITIONS,
    DeviceStatus,
    Gates,
    InvalidTransition,
    Rollout,
    check_gates,
    command_id,
    next_step,
    soak_verdict,
    transition,
    undo_targets,
)

EVENTS = ("start", "soak", "advance", "succeed", "fail", "pause", "resume", "abort")


def _rollout(state: str = RUNNING, wave: int = 0, waves: int = 3, **changes) -> Rollout:
    gates = changes.pop("gates", Gates(soak_s=10.0, wave_timeout_s=100.0))
    values = {"started_at": 0.0, "wave_started_at": 0.0} if state != PENDING else {}
    values.update(changes)
    return Rollout(id="ro-000000000001", state=state, wave=wave, wave_count=waves, gates=gates, **values)


# ------------------------------------------------------------------ the state machine


@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("event", EVENTS)
def test_every_transition_is_allowed_or_refused_as_the_table_says(state, event):
    rollout = _rollout(state, wave=0, waves=3)
    target = TRANSITIONS[state].get(event)
    if target is None:
        with pytest.raises(InvalidTransition) as refused:
            transition(rollout, event, 50.0)
        assert (refused.value.state, refused.value.move) == (state, event)  # the API answers it 409
        assert f"cannot {event} a rollout that is {state}" in str(refused.value)
    else:
        assert transition(rollout, event, 50.0).state == target


def test_terminal_states_allow_nothing():
    for state in (SUCCEEDED, FAILED, ABORTED):
        assert TRANSITIONS[state] == {}


def test_start_begins_wave_one_now():
    started = transition(_rollout(PENDING), "start", 7.0)
    assert (started.state, started.wave, started.started_at, started.wave_started_at) == (RUNNING, 0, 7.0, 7.0)


def test_advance_moves_to_the_next_wave_and_restarts_its_clocks():
    soaking = _rollout(RUNNING, wave=0, waves=2, soak_started_at=5.0)
    moved = transition(soaking, "advance", 9.0)
    assert (moved.wave, moved.wave_started_at, moved.soak_started_at) == (1, 9.0, None)
    with pytest.raises(InvalidTransition):
        transition(moved, "advance", 10.0)  # wave 2 of 2 is the last


def test_resume_skips_the_time_spent_paused():
    paused = transition(_rollout(RUNNING, wave_started_at=100.0, soak_started_at=150.0), "pause", 160.0)
    assert paused.paused_at == 160.0
    resumed = transition(paused, "resume", 200.0)
    assert (resumed.state, resumed.paused_at) == (RUNNING, None)
    assert (resumed.wave_started_at, resumed.soak_started_at) == (140.0, 190.0)


def test_resuming_a_rollout_paused_before_it_started_starts_it():
    resumed = transition(transition(_rollout(PENDING), "pause", 1.0), "resume", 5.0)
    assert (resumed.state, resumed.wave, resumed.started_at, resumed.wave_started_at) == (RUNNING, 0, 5.0, 5.0)


def test_terminal_transitions_record_the_end_and_the_reason():
    failed = transition(_rollout(RUNNING, paused_at=None), "fail", 12.0, "x" * 5000)
    assert (failed.state, failed.finished_at) == (FAILED, 12.0) and len(failed.reason) == 2000
    aborted = transition(transition(_rollout(RUNNING), "pause", 3.0), "abort", 4.0, "operator")
    assert (aborted.state, aborted.paused_at, aborted.reason) == (ABORTED, None, "operator")


# ------------------------------------------------------------------ the next step


def _devices(*rows: tuple) -> list[DeviceStatus]:
    return [DeviceStatus(*row) for row in rows]


def test_pending_starts_and_paused_or_finished_waits():
    assert next_step(_rollout(PENDING), [], 0.0).kind == "start"
    for state in (PAUSED, SUCCEEDED, FAILED, ABORTED):
        assert next_step(_rollout(state), _devices(("a", 0)), 0.0).kind == "wait"


def test_a_wave_is_sent_to_its_unsent_devices_only():
    devices = _devices(("b", 0), ("a", 0), ("c", 0, SENT), ("d", 1))
    step = next_step(_rollout(), devices, 1.0)
    assert (step.kind, step.devices) == ("send", ("a", "b"))


def test_a_wave_without_devices_fails_the_rollout():
    step = next_step(_rollout(wave=1), _devices(("a", 0, "active", True)), 1.0)
    assert step.kind == "fail" and "wave 2 has no device" in step.reason


def test_wave_waits_for_final_answers_until_the_timeout_exactly():
    devices = _devices(("a", 0, "active", True), ("b", 0, "downloading", False))
    assert next_step(_rollout(), devices, 99.999).kind == "wait"
    step = next_step(_rollout(), devices, 100.0)
    assert step.kind == "fail"
    assert step.reason == "wave 1 of 3 failed: timed out after 100 s: no final answer from b"


def test_one_failed_device_fails_the_wave_at_once_with_its_reason():
    devices = _devices(("a", 0, "rolled_back", True, "unhealthy"), ("b", 0, "downloading"))
    step = next_step(_rollout(), devices, 1.0)
    assert (step.kind, step.reason) == ("fail", "wave 1 of 3 failed: a: rolled_back (unhealthy)")
    assert step.rollback == () and step.cancel == ()  # undo only when asked


def test_failure_with_rollback_undoes_what_the_rollout_changed():
    gates = Gates(rollback_on_failure=True, wave_timeout_s=100.0)
    devices = _devices(("w0", 0, "active", True), ("a", 1, "failed", True, "smoke"), ("b", 1, "downloading"),
                       ("c", 1, "active", False), ("later", 2, NOT_SENT))
    step = next_step(_rollout(wave=1, gates=gates), devices, 1.0)
    assert step.kind == "fail"
    assert step.rollback == ("c", "w0") and step.cancel == ("b",)


def test_undo_targets_leave_out_unsent_and_finally_failed_devices():
    devices = _devices(("sent", 0, SENT), ("x", 0, NOT_SENT), ("f", 0, "failed", True), ("r", 0, "rejected", True),
                       ("ok", 0, "active", True), ("window", 0, "active", False))
    assert undo_targets(devices) == (("ok", "window"), ("sent",))


def test_a_passed_wave_soaks_then_the_next_starts_at_the_soak_boundary():
    devices = _devices(("a", 0, "active", True))
    assert next_step(_rollout(), devices, 1.0).kind == "soak"
    soaking = _rollout(soak_started_at=10.0)
    assert next_step(soaking, devices, 19.999).kind == "wait"
    assert next_step(soaking, devices, 20.0).kind == "advance"


def test_the_last_wave_succeeds_after_its_soak():
    devices = _devices(("a", 2, "active", True))
    step = next_step(_rollout(wave=2, soak_started_at=0.0), devices, 10.0)
    assert (step.kind, step.reason) == ("succeed", "3 wave(s) passed")


def test_zero_soak_moves_on_in_the_same_round_as_the_soak_starts():
    devices = _devices(("a", 0, "active", True))
    rollout = _rollout(gates=Gates(soak_s=0.0), soak_started_at=5.0)
    assert next_step(rollout, devices, 5.0).kind == "advance"


def test_soak_fails_when_a_device_goes_offline():
    devices = [DeviceStatus("a", 0, "active", True, online=False), DeviceStatus("b", 0, "active", True)]
    step = next_step(_rollout(soak_started_at=0.0), devices, 1.0)
    assert step.kind == "fail" and "a offline" in step.reason and "1 healthy, 2 of 2 required" in step.reason


def test_soak_error_rate_gate_holds_at_the_limit_and_fails_one_over():
    gates = Gates(max_error_rate=0.1, soak_s=10.0)
    at_limit = [DeviceStatus("a", 0, "active", True, inferences=100, errors=10)]
    over = [DeviceStatus("a", 0, "active", True, inferences=100, errors=11)]
    assert soak_verdict(at_limit, gates) == ""
    assert "a error rate 0.110" in soak_verdict(over, gates)
    assert next_step(_rollout(gates=gates, soak_started_at=0.0), over, 1.0).kind == "fail"
    silent = [DeviceStatus("a", 0, "active", True, inferences=0, errors=0)]
    assert soak_verdict(silent, gates) == ""  # no inference, no rate: the job gate already judged it


def test_success_share_tolerates_failures_down_to_the_share():
    gates = Gates(min_success_share=0.8, wave_timeout_s=100.0)
    devices = _devices(*[(f"d{i}", 0, "active", True) for i in range(4)], ("bad", 0, "failed", True, "smoke"))
    assert next_step(_rollout(gates=gates), devices, 1.0).kind == "soak"
    two_bad = [*devices[:3], DeviceStatus("bad2", 0, "failed", True), devices[4]]
    assert next_step(_rollout(gates=gates), two_bad, 1.0).kind == "fail"


def test_command_ids_are_derived_distinct_and_within_the_id_pattern():
    longest = "d" * 64
    first = command_id("ro-0123456789ab", "deploy", 19, longest)
    assert first == command_id("ro-0123456789ab", "deploy", 19, longest)
    assert is_valid_id(first) and len(first) <= 64
    others = {command_id("ro-0123456789ab", kind, wave, device) for kind in ("deploy", "rollback", "cancel")
              for wave in (0, 1) for device in ("a", "b")}
    assert len(others) == 12


@pytest.mark.parametrize(("field", "value"), [("min_success_share", 0.0), ("min_success_share", 1.01),
                                              ("soak_s", -1.0), ("soak_s", math.inf), ("wave_timeout_s", 0.5),
                                              ("max_error_rate", 1.5), ("max_error_rate", math.nan)])
def test_gates_out_of_range_are_refused_naming_the_field(field, value):
    with pytest.raises(SchemaError) as refused:  # a domain error: the API answers it 400 "invalid"
        check_gates(Gates(**{field: value}))
    assert refused.value.path == field and str(refused.value).startswith(f"{field}: ")


def test_gates_at_their_bounds_are_accepted():
    assert check_gates(Gates(min_success_share=1.0, soak_s=0.0, wave_timeout_s=1.0, max_error_rate=0.0))
    assert check_gates(Gates(min_success_share=0.01, soak_s=7 * 86400, wave_timeout_s=7 * 86400, max_error_rate=1.0))


# ------------------------------------------------------------------ wave plans and the share gate


def test_plan_wave_shares_gives_cumulative_waves():
    devices = [f"d{i:02d}" for i in range(20)]
    waves = plan_wave_shares(devices, [5, 25, 100])
    assert [len(w) for w in waves] == [1, 4, 15] and [d for wave in waves for d in wave] == devices


def test_plan_wave_shares_drops_a_share_that_adds_nobody_and_duplicates():
    assert plan_wave_shares(["a", "b", "a", "c", "d", "e"], [10, 11, 100]) == [["a"], ["b", "c", "d", "e"]]
    assert planned_shares(5, [10, 11, 100]) == [11.0, 100.0]  # the share each planned wave completes
    assert plan_wave_shares(["only"], [5, 25, 100]) == [["only"]]
    assert planned_shares(1, [5, 25, 100]) == [100.0]
    assert planned_shares(20, [5, 25, 100]) == [5.0, 25.0, 100.0]


@pytest.mark.parametrize("shares", [[], list(range(1, 22)), [50, 50, 100], [60, 40, 100], [5, 25], [0, 100],
                                    [100.5], [math.nan, 100], [True, 100]])
def test_bad_wave_shares_are_refused(shares):
    with pytest.raises(RolloutError):
        check_wave_shares(shares)


def test_twenty_waves_are_allowed_and_an_empty_target_list_is_not():
    assert len(check_wave_shares([5 * i for i in range(1, 21)])) == 20
    with pytest.raises(RolloutError, match="no target"):
        plan_wave_shares([], [100])


def test_required_successes_rounds_up_and_needs_one():
    assert required_successes(5, 0.8) == 4
    assert required_successes(5, 0.81) == 5
    assert required_successes(5, 0.01) == 1
    assert required_successes(3, 1.0) == 3
    for share in (0.0, 1.01, math.nan):
        with pytest.raises(RolloutError):
            required_successes(5, share)


def test_share_verdict_reasons():
    jobs = {"a": DeviceJob("a", "active", final=True), "b": DeviceJob("b", "failed", "smoke", final=True),
            "c": DeviceJob("c", "downloading")}
    pending = wave_verdict(jobs, ["a", "b", "c"], timed_out=False, min_success_share=0.5)
    assert pending.outcome == "pending"
    late = wave_verdict(jobs, ["a", "b", "c"], timed_out=True, min_success_share=0.5)
    assert (late.outcome, late.reason) == ("failed", "no final answer from c; 1 of 2 required ended active")
    enough = wave_verdict(jobs, ["a", "b", "c"], timed_out=True, min_success_share=0.3)
    assert (enough.outcome, enough.reason) == ("passed", "tolerated: b")
    jobs["c"] = DeviceJob("c", "rejected", "signature", final=True)
    lost = wave_verdict(jobs, ["a", "b", "c"], timed_out=False, min_success_share=0.5)
    assert (lost.outcome, lost.reason) == ("failed", "b, c: failed (smoke); 2 of 3 must end active")


# ------------------------------------------------------------------ telemetry folding


def test_bucket_boundaries():
    assert bucket_of(59.999, 60) == 0 and bucket_of(60.0, 60) == 60 and bucket_of(119.9, 60) == 60


def test_fold_keeps_sums_and_the_largest_p99():
    buckets = fold([("a", 0.5, 1.0, 4.0, 10.0, 10, 1), ("a", 59.0, 3.0, 9.0, 20.0, 30, 0),
                    ("a", 60.0, None, None, None, None, None), ("b", 1.0, 2.0, 2.0, 5.0, 5, 5)], 60)
    assert [(b.device, b.bucket, b.samples) for b in buckets] == [("a", 0, 2), ("a", 60, 1), ("b", 0, 1)]
    point = buckets[0].point()
    assert point == {"ts": 0, "samples": 2, "latency_p50_ms": 2.0, "latency_p99_ms": 9.0, "throughput_per_s": 15.0,
                     "inferences": 40, "errors": 1, "error_kinds": {}, "error_rate": 0.025}
    assert buckets[1].point()["latency_p50_ms"] is None and buckets[1].point()["error_rate"] is None


def test_rebucket_and_merge_add_up_like_one_fold():
    samples = [("a", float(t), float(t), float(t), 1.0, 1, t % 2) for t in range(0, 300, 7)]
    fine = fold(samples, 60)
    coarse = rebucket(fine, 300)
    whole = fold(samples, 300)
    assert [b.row() for b in coarse] == [b.row() for b in whole]
    twice = Bucket("a", 0, 60)
    twice.merge(fine[0])
    twice.merge(Bucket("a", 0, 60))
    assert twice.row() == fine[0].row()


def test_chart_requests_are_bounded_at_the_point_limit():
    check_step(0.0, MAX_POINTS * 10.0, 10)
    with pytest.raises(ValueError, match="at most"):
        check_step(0.0, MAX_POINTS * 10.0 + 10.0, 10)
    for since, until, step in ((10.0, 10.0, 1), (10.0, 5.0, 1), (0.0, 10.0, 0)):
        with pytest.raises(ValueError):
            check_step(since, until, step)


def test_effective_step_rises_to_the_rollup_step_before_the_raw_window():
    assert effective_step(5, since=1000.0, raw_cutoff=900.0, rollup_step=60) == 5
    assert effective_step(5, since=800.0, raw_cutoff=900.0, rollup_step=60) == 60
    assert effective_step(90, since=800.0, raw_cutoff=900.0, rollup_step=60) == 120
    assert effective_step(120, since=800.0, raw_cutoff=900.0, rollup_step=60) == 120


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("1h", 3600), ("2d", 172800),
                                               ("0.5s", 0.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "x", "0", "-1s", "inf", "nan", "1w"])
def test_bad_durations(text):
    with pytest.raises(ServerConfigError):
        parse_duration(text)


def test_retention_policy_bounds():
    RetentionPolicy(raw_s=60, rollup_s=60, step_s=60)
    for kwargs in ({"raw_s": 59, "step_s": 60}, {"raw_s": 120, "rollup_s": 60}, {"step_s": 0}, {"step_s": 1.5},
                   {"interval_s": 0}, {"raw_s": math.nan}):
        with pytest.raises(ServerConfigError):
            RetentionPolicy(**kwargs)


# ------------------------------------------------------------------ message records


def _state(**changes) -> bytes:
    doc = {"schema": "edgepack.state/1", "device": "pi-1", "status": "online", "ts": 10.0, "groups": ["g", "bad/one"],
           "model": {"name": "scale", "version": "1.0.0", "sha256": "a" * 64}, "provider": "CPUExecutionProvider",
           "capabilities": {"profile": "rpi"}}
    doc.update(changes)
    return json.dumps(doc).encode()


def test_state_records_keep_only_safe_names():
    record = parse_state("pi-1", _state())
    assert isinstance(record, DeviceState)
    assert record.groups == ("g",) and record.profile == "rpi" and record.model.version == "1.0.0"
    assert parse_state("pi-1", b"") == Decommissioned("pi-1")
    assert parse_state("pi-1", _state(groups="g")).groups is None


@pytest.mark.parametrize(("payload", "reason"), [
    (b"{not json", "not_json"), (b"[1]", "bad_schema"), (b'{"schema": "x"}', "bad_schema"),
])
def test_broken_states_are_dropped_by_reason(payload, reason):
    assert parse_state("pi-1", payload) == reason


def test_a_state_for_another_device_is_refused():
    assert parse_state("pi-2", _state()) == "device_mismatch"
    assert parse_state("pi-1", _state(status="sleeping")) == "bad_schema"
    assert parse_state("pi-1", _state(ts=-1)) == "bad_schema"


def test_message_size_limit_at_the_boundary():
    base = _state(reason="")
    padded = base[:-1] + b', "pad": "' + b"x" * (MAX_MESSAGE_BYTES - len(base) - 11) + b'"}'
    assert len(padded) == MAX_MESSAGE_BYTES and isinstance(parse_state("pi-1", padded), DeviceState)
    over = padded[:-2] + b'x"}'
    assert len(over) == MAX_MESSAGE_BYTES + 1 and parse_state("pi-1", over) == "too_large"


def test_oversized_capabilities_are_dropped_not_stored():
    record = parse_state("pi-1", _state(capabilities={"profile": "x86", "blob": "x" * 9000}))
    assert record.capabilities is None and record.profile == "x86"


def test_telemetry_figures_are_typed_and_finite():
    doc = {"schema": "edgepack.telemetry/1", "device": "pi-1", "seq": 3, "latency_ms": {"p50": 1.5, "p99": True},
           "inferences": {"interval": 10, "total": -1}, "errors": {"a": 2, "b": "x"}, "errors_interval": {"a": 1},
           "throughput_per_s": 1e300, "cpu_percent": 5}
    record = parse_telemetry("pi-1", json.dumps(doc).encode())
    assert record.latency_p50 == 1.5 and record.latency_p99 is None
    assert record.inferences_total is None and record.errors_total == 2 and record.errors_interval == 1
    assert record.throughput_per_s is None and record.cpu_percent == 5.0
    nan = b'{"schema": "edgepack.telemetry/1", "device": "pi-1", "latency_ms": {"p50": NaN}}'
    assert parse_telemetry("pi-1", nan).latency_p50 is None
    assert parse_telemetry("pi-2", json.dumps(doc).encode()) == "device_mismatch"


def test_job_records():
    event = {"schema": "edgepack.job/1", "device": "pi-1", "ts": 5.0, "job": "ro-1-d0-ab", "type": "deploy",
             "state": "rolled_back", "final": True, "reason": "r" * 900}
    record = parse_job_event("pi-1", json.dumps(event).encode())
    assert isinstance(record, JobEvent) and len(record.reason) == 500 and record.final is True
    for change in ({"job": "../x"}, {"state": "Active"}, {"state": ""}, {"final": "yes"}, {"ts": None},
                   {"schema": "edgepack.job/2"}):
        assert parse_job_event("pi-1", json.dumps({**event, **change}).encode()) == "bad_schema", change


# ------------------------------------------------------------------ tokens


GOOD = "0123456789abcdef"


def test_token_file_lines():
    tokens = auth.parse_tokens(f"# comment\n\nadmin:{GOOD}\n{GOOD}x\n")
    assert tokens[0].name == "admin" and tokens[1].name.startswith("token-")
    with pytest.raises(ServerConfigError, match="line 1"):
        auth.parse_tokens(f"admin:{GOOD[:-1]}")  # 15 characters: one short
    with pytest.raises(ServerConfigError, match="line 2"):
        auth.parse_tokens(f"a:{GOOD}\nbad name:{GOOD}")
    with pytest.raises(ServerConfigError, match="same name"):
        auth.parse_tokens(f"a:{GOOD}\na:{GOOD}1")
    with pytest.raises(ServerConfigError, match="no token"):
        auth.parse_tokens("# nothing\n")


def test_identify_names_the_token_and_refuses_everything_else():
    check = auth.TokenCheck(auth.parse_tokens(f"admin:{GOOD}\nci:{GOOD}-ci"))
    assert check.identify(f"Bearer {GOOD}") == "admin"
    assert check.identify(f"bearer {GOOD}-ci") == "ci"
    for header in (None, "", f"Basic {GOOD}", "Bearer ", f"Bearer {GOOD}0", f"Bearer {GOOD[:-1]}",
                   "Bearer " + "x" * 600):
        assert check.identify(header) is None, header


def test_token_comparison_is_constant_time_and_never_stops_early(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    check = auth.TokenCheck(auth.parse_tokens(f"a:{GOOD}\nb:{GOOD}b\nc:{GOOD}c"))
    assert check.identify(f"Bearer {GOOD}") == "a"
    assert calls == [(32, 32)] * 3  # digests of equal length, every token compared
    calls.clear()
    assert check.identify("Bearer a-much-longer-wrong-token-of-any-length") is None
    assert calls == [(32, 32)] * 3


def test_token_file_readable_by_others_is_refused(tmp_path: Path):
    path = tmp_path / "tokens"
    path.write_text(f"admin:{GOOD}\n")
    path.chmod(0o644)
    with pytest.raises(ServerConfigError, match="readable by others"):
        auth.read_token_file(path)
    path.chmod(0o600)
    assert auth.read_token_file(path)[0].name == "admin"
    assert auth.client_token(path) == GOOD


def test_a_rollout_the_driver_cannot_drive_fails_at_once_or_after_the_bounded_retries():
    from sdk.fleet_server.rollouts import MAX_DRIVER_ERRORS, fails_after_error

    assert fails_after_error(1, permanent=True)
    assert not fails_after_error(MAX_DRIVER_ERRORS - 1, permanent=False)
    assert fails_after_error(MAX_DRIVER_ERRORS, permanent=False)
    failed = transition(_rollout(PENDING, started_at=None), "fail", 5.0, "cannot start")
    assert failed.state == "failed" and failed.finished_at == 5.0 and failed.reason == "cannot start"


def test_the_api_answers_the_pure_modules_domain_errors_by_class():
    """The rollout machine and the gate check raise domain errors, never HTTP ones; the API
    layer alone turns them into a status (409 conflict, 400 invalid), the message kept."""
    from sdk.fleet_server.api import as_api_error

    refused = InvalidTransition("cannot resume a rollout that is aborted", state="aborted", move="resume")
    conflict = as_api_error(refused)
    assert (conflict.status, conflict.code, conflict.message) == (409, "conflict", str(refused))
    invalid = as_api_error(SchemaError("soak_s", "-1.0 is outside [0, 604800]"))
    assert (invalid.status, invalid.code, invalid.message) == (400, "invalid", "soak_s: -1.0 is outside [0, 604800]")
    refusal = ApiError(404, "not_found", "no rollout")
    assert as_api_error(refusal) is refusal
    assert not issubclass(InvalidTransition, ApiError) and not issubclass(SchemaError, ApiError)
