"""Desired state, pure: effective targets (device beats group beats fleet; conflicting groups
refused with the reason; the most cautious hold wins) and the reconciler's decision at each
boundary (converged, send, and every reason to wait)."""

from __future__ import annotations

import pytest

from sdk.fleet_server.targets import (
    ABSENT,
    MAX_ATTEMPTS,
    NO_TARGET,
    ArtifactInfo,
    LastCommand,
    Reported,
    Running,
    Target,
    Wanted,
    effective_target,
    reconcile,
    target_command_id,
)

V1, V2, V3 = "1" * 64, "2" * 64, "3" * 64
ARTIFACTS = {V1: ArtifactInfo(V1, "digits", "1.1.0", "a" * 64), V2: ArtifactInfo(V2, "digits", "2.0.0", "b" * 64),
             V3: ArtifactInfo(V3, "digits", "3.0.0")}
ON_V1 = Reported(online=True, models={"digits": Running("1.1.0", "a" * 64)}, heard_at=100.0)
ON_V2 = Reported(online=True, models={"digits": Running("2.0.0", "b" * 64)}, heard_at=100.0)


def _effective(fleet=NO_TARGET, groups=None, device=NO_TARGET):
    return effective_target(fleet, groups or {}, device)


def test_device_beats_group_beats_fleet():
    fleet, group, device = Target({"digits": V1}), Target({"digits": V2}), Target({"digits": V3})
    assert _effective(fleet).models["digits"] == Wanted(V1, "fleet")
    assert _effective(fleet, {"kitchen": group}).models["digits"] == Wanted(V2, "group:kitchen")
    assert _effective(fleet, {"kitchen": group}, device).models["digits"] == Wanted(V3, "device")


def test_groups_that_agree_give_the_model_and_groups_that_disagree_are_a_conflict_not_a_pick():
    agree = _effective(groups={"a": Target({"digits": V1}), "b": Target({"digits": V1})})
    assert agree.models["digits"] == Wanted(V1, "group:a+b") and not agree.conflicts
    clash = _effective(Target({"digits": V3}), {"a": Target({"digits": V1}), "b": Target({"digits": V2})})
    assert "digits" not in clash.models  # not even the fleet's: the groups said something, just not one thing
    assert clash.conflicts["digits"] == (("a", V1), ("b", V2))
    decision = reconcile("d", clash, ON_V2, ARTIFACTS, {}, now=200.0)
    assert decision.kind == "wait" and "groups disagree" in decision.reason and "device target" in decision.reason
    # a device target settles it
    settled = _effective(groups={"a": Target({"digits": V1}), "b": Target({"digits": V2})},
                         device=Target({"digits": V1}))
    assert reconcile("d", settled, ON_V2, ARTIFACTS, {}, now=200.0).kind == "send"


def test_any_scope_that_holds_holds_the_device_and_names_itself():
    assert _effective(Target(hold=True)).held_by == ("fleet",)
    held = _effective(Target({"digits": V1}), {"kitchen": Target(hold=True)}, Target(hold=True))
    assert held.held_by == ("device", "group:kitchen")
    decision = reconcile("d", held, ON_V2, ARTIFACTS, {}, now=200.0)
    assert decision.kind == "wait" and decision.reason == "held by device, group:kitchen"
    assert dict(decision.differences) == {"digits": "runs 2.0.0, target 1.1.0"}


def test_a_device_already_on_target_is_converged_even_held_offline_or_after_a_failed_job():
    effective = _effective(groups={"kitchen": Target({"digits": V1}, hold=True)})
    offline = Reported(online=False, models=ON_V1.models)
    failed = {"digits": LastCommand("tg-x", V1, "group:kitchen", 1, 1, 50.0, "failed", True, "boom", 60.0)}
    assert reconcile("d", effective, offline, ARTIFACTS, failed, now=200.0).kind == "converged"


def test_a_device_that_differs_gets_the_deploy_downgrade_included_with_a_derived_id():
    effective = _effective(groups={"kitchen": Target({"digits": V1})})
    decision = reconcile("cam-02", effective, ON_V2, ARTIFACTS, {}, now=200.0)
    assert (decision.kind, decision.model, decision.artifact, decision.attempt) == ("send", "digits", V1, 1)
    assert decision.command_id == target_command_id("cam-02", "digits", Wanted(V1, "group:kitchen"), 1)
    assert decision.command_id != target_command_id("cam-03", "digits", Wanted(V1, "group:kitchen"), 1)
    assert len(decision.command_id) <= 64


def test_the_same_version_with_another_model_file_is_not_on_target():
    effective = _effective(Target({"digits": V1}))
    rebuilt = Reported(online=True, models={"digits": Running("1.1.0", "c" * 64)}, heard_at=1.0)
    assert reconcile("d", effective, rebuilt, ARTIFACTS, {}, now=2.0).kind == "send"
    unknown_hash = Reported(online=True, models={"digits": Running("1.1.0", None)}, heard_at=1.0)
    assert reconcile("d", effective, unknown_hash, ARTIFACTS, {}, now=2.0).kind == "converged"


def _last(state="sent", final=False, reason="", sent_at=100.0, final_at=None, attempt=1, revision=1):
    return {"digits": LastCommand("tg-1", V1, "fleet", revision, attempt, sent_at, state, final, reason, final_at)}


@pytest.mark.parametrize("age, kind", [(3599.999, "wait"), (3600.0, "send")])
def test_a_command_in_flight_is_never_resent_until_its_lifetime_is_over(age, kind):
    effective = _effective(Target({"digits": V1}))
    decision = reconcile("d", effective, ON_V2, ARTIFACTS, _last("downloading"), now=100.0 + age,
                         command_ttl_s=3600.0)
    assert decision.kind == kind
    if kind == "wait":
        assert decision.reason == "digits: command tg-1 in flight (downloading)"
    else:
        assert decision.attempt == 2


def test_an_artifact_the_device_rejected_is_not_sent_again_until_the_operator_sets_the_target_again():
    rejected = _last("rolled_back", True, "unhealthy: 30 non-finite outputs", final_at=150.0)
    decision = reconcile("d", _effective(Target({"digits": V1})), ON_V2, ARTIFACTS, rejected, now=999.0)
    assert decision.kind == "wait" and "rejected on this device (rolled_back: unhealthy" in decision.reason
    again = _effective(Target({"digits": V1}, revisions={"digits": 2}))
    retried = reconcile("d", again, ON_V2, ARTIFACTS, rejected, now=999.0)
    assert retried.kind == "send" and retried.attempt == 1 and retried.revision == 2


@pytest.mark.parametrize("source_scope, set_at, kind", [
    ("fleet", 500.0, "wait"),  # a fleet or group target never overrides the device's own rejection
    ("group", 500.0, "wait"),
    ("device", 150.0, "wait"),  # a device target set when the rejection was heard, not after it
    ("device", 150.001, "send"),  # set after it: the operator's explicit retry
])
def test_an_artifact_the_device_reports_rejected_is_never_sent_by_a_fleet_or_group_target(source_scope, set_at,
                                                                                         kind):
    from sdk.fleet_server.targets import Rejection

    reported = Reported(online=True, models=ON_V2.models, heard_at=100.0,
                        rejected={V1: Rejection("health_window", "unhealthy: 30 non-finite outputs", 150.0)})
    target = Target({"digits": V1}, set_at={"digits": set_at})
    effective = {"fleet": lambda: _effective(target), "group": lambda: _effective(groups={"kitchen": target}),
                 "device": lambda: _effective(device=target)}[source_scope]()
    decision = reconcile("d", effective, reported, ARTIFACTS, {}, now=999.0)
    assert decision.kind == kind
    if kind == "wait":
        assert decision.reason == (f"digits: artifact {V1[:12]} rejected by this device (health_window: unhealthy: "
                                   "30 non-finite outputs); set a device target to retry")


def test_already_the_active_model_is_not_a_rejection():
    answer = _last("failed", True, "digits-1.1.0-abc is already the active model", final_at=150.0)
    effective = _effective(Target({"digits": V1}))
    stale = Reported(online=True, models=ON_V2.models, heard_at=150.0)
    assert reconcile("d", effective, stale, ARTIFACTS, answer, now=999.0).reason.endswith("waiting for the "
                                                                                          "device's state")
    assert reconcile("d", effective, ON_V1, ARTIFACTS, answer, now=999.0).kind == "converged"


@pytest.mark.parametrize("heard_at, kind", [(150.0, "wait"), (150.001, "send")])
def test_a_device_that_drifted_after_its_job_ended_active_gets_the_target_again(heard_at, kind):
    done = _last("active", True, final_at=150.0)
    drifted = Reported(online=True, models=ON_V2.models, heard_at=heard_at)
    decision = reconcile("d", _effective(Target({"digits": V1})), drifted, ARTIFACTS, done, now=999.0)
    assert decision.kind == kind


@pytest.mark.parametrize("attempt, kind", [(MAX_ATTEMPTS - 1, "send"), (MAX_ATTEMPTS, "wait")])
def test_resends_of_one_target_are_bounded(attempt, kind):
    done = _last("active", True, final_at=150.0, attempt=attempt)
    drifted = Reported(online=True, models=ON_V2.models, heard_at=151.0)
    assert reconcile("d", _effective(Target({"digits": V1})), drifted, ARTIFACTS, done, now=999.0).kind == kind


def test_the_reasons_to_wait_before_anything_is_sent():
    effective = _effective(Target({"digits": V1}))
    offline = Reported(online=False, models=ON_V2.models, status_reason="connection lost (last will)")
    assert reconcile("d", effective, offline, ARTIFACTS, {}, now=1.0).reason == \
        "offline: connection lost (last will)"
    assert reconcile("d", effective, ON_V2, ARTIFACTS, {}, now=1.0, busy="rollout ro-1").reason == "in rollout ro-1"
    missing = reconcile("d", _effective(Target({"digits": "9" * 64})), ON_V2, ARTIFACTS, {}, now=1.0)
    assert missing.kind == "wait" and "not in the server's store" in missing.reason
    two = _effective(Target({"digits": V1, "kws": V3}))
    assert "names 2 models" in reconcile("d", two, ON_V2, ARTIFACTS, {}, now=1.0).reason


def test_absent_models_are_on_target_when_missing_and_replaced_by_the_wanted_one():
    assert reconcile("d", _effective(Target({"kws": ABSENT})), ON_V2, ARTIFACTS, {}, now=1.0).kind == "converged"
    effective = _effective(Target({"digits": ABSENT}))
    decision = reconcile("d", effective, ON_V2, ARTIFACTS, {}, now=1.0)
    assert decision.kind == "wait" and "removing a model is not supported" in decision.reason
    swap = _effective(Target({"digits": ABSENT, "kws": V3}))
    assert reconcile("d", swap, ON_V2, ARTIFACTS, {}, now=1.0).model == "kws"


def test_no_target_is_converged():
    assert reconcile("d", _effective(), ON_V2, ARTIFACTS, {}, now=1.0).kind == "converged"


def test_targets_are_frozen():
    target = Target({"digits": V1})
    with pytest.raises(TypeError):
        target.models["digits"] = V2  # type: ignore[index]


def test_a_rollout_to_the_version_a_device_already_runs_counts_it_active_and_never_rolls_it_back():
    """The incident: `rollout create 1.1.0 --group kitchen --force-downgrade` failed its wave because
    cam-01 answered `... is already the active model`. That answer passes the gate; a failure of
    another device does not roll cam-01 back (it was not moved)."""
    from sdk.fleet_server.rollouts import DeviceStatus, Gates, Rollout, next_step

    running = Rollout("ro-1", "running", 0, 1, Gates(rollback_on_failure=True), started_at=0.0,
                      wave_started_at=0.0)
    already = DeviceStatus("cam-01", 0, "failed", True, "scale-1.1.0-abc is already the active model")
    moved = DeviceStatus("cam-02", 0, "active", True)
    assert next_step(running, [already, moved], now=1.0).kind == "soak"
    broken = DeviceStatus("cam-02", 0, "failed", True, "download failed")
    failed = next_step(running, [already, broken], now=1.0)
    assert failed.kind == "fail" and "cam-02" in failed.reason and "cam-01" not in failed.reason
    assert failed.rollback == () and failed.cancel == ()


def test_a_device_holding_several_models_gets_each_targeted_model_and_one_holding_one_never_a_second():
    kws = "4" * 64
    artifacts = {**ARTIFACTS, kws: ArtifactInfo(kws, "kws", "1.0.0", "k" * 64)}
    effective = _effective(Target({"digits": V1, "kws": kws}))
    both = Reported(online=True, heard_at=1.0, several=True,
                    models={"digits": Running("1.1.0", "a" * 64), "kws": Running("0.9.0", "j" * 64)})
    decision = reconcile("d", effective, both, artifacts, {}, now=2.0)
    assert (decision.kind, decision.model, decision.artifact) == ("send", "kws", kws)
    assert dict(decision.differences) == {"kws": "runs 0.9.0, target 1.0.0"}
    on_both = Reported(online=True, heard_at=1.0, several=True,
                       models={"digits": Running("1.1.0", "a" * 64), "kws": Running("1.0.0", "k" * 64)})
    assert reconcile("d", effective, on_both, artifacts, {}, now=2.0).kind == "converged"
    single = reconcile("d", effective, ON_V1, artifacts, {}, now=2.0)
    assert single.kind == "wait" and "this device runs one" in single.reason


def test_a_release_marked_bad_fleet_wide_is_never_sent_and_the_device_waits_with_the_reason():
    """The operator marked 2.0.0 bad: a device whose target names it waits, the reason named."""
    from dataclasses import replace

    bad = {**ARTIFACTS, V2: replace(ARTIFACTS[V2], bad="NaN outputs on cam-02")}
    for scope in (Target({"digits": V2}), NO_TARGET):
        device = scope if scope.models else Target({"digits": V2})
        decision = reconcile("d", _effective(device=device), ON_V1, bad, {}, now=200.0)
        assert decision.kind == "wait", decision
        assert decision.reason == f"digits: artifact {V2[:12]} marked bad: NaN outputs on cam-02"
    # a device already on the bad release is not "converged away": nothing is sent either way
    assert reconcile("d", _effective(Target({"digits": V2})), ON_V2, bad, {}, now=200.0).kind == "converged"
    # boundary: the mark cleared, the same target is sent again
    cleared = reconcile("d", _effective(Target({"digits": V2})), ON_V1, ARTIFACTS, {}, now=200.0)
    assert (cleared.kind, cleared.artifact) == ("send", V2)


def test_a_bad_release_does_not_stop_another_model_of_the_device():
    from dataclasses import replace

    kws = "k" * 64
    artifacts = {**ARTIFACTS, V2: replace(ARTIFACTS[V2], bad="broken"), kws: ArtifactInfo(kws, "kws", "1.0.0")}
    several = Reported(online=True, models={"digits": Running("1.1.0", "a" * 64), "kws": Running("0.9.0")},
                       heard_at=100.0, several=True)
    decision = reconcile("d", _effective(Target({"digits": V2, "kws": kws})), several, artifacts, {}, now=200.0)
    assert (decision.kind, decision.model, decision.artifact) == ("send", "kws", kws)


LISTING = Reported(online=True, models={"digits": Running("2.0.0", "b" * 64), "kws": Running("1.0.0", None)},
                   heard_at=100.0, several=True, lists_models=True)


def test_an_absent_target_sends_the_signed_remove_to_an_agent_that_lists_its_models():
    """Issue 24 items 1 and 2: a target's "absent" is carried out (the agent's remove command),
    not left waiting, on an agent that lists its models; an older agent still waits, saying why."""
    effective = _effective(Target({"kws": ABSENT}))
    decision = reconcile("d", effective, LISTING, ARTIFACTS, {}, now=1.0)
    assert (decision.kind, decision.model, decision.artifact) == ("send", "kws", ABSENT)
    assert decision.reason == "kws: remove" and decision.command_id.startswith("tg-")
    old = Reported(online=True, models=dict(LISTING.models), heard_at=100.0, several=True)
    assert "removing a model is not supported" in reconcile("d", effective, old, ARTIFACTS, {}, now=1.0).reason
    gone = Reported(online=True, models={"digits": Running("2.0.0", "b" * 64)}, heard_at=200.0, lists_models=True)
    assert reconcile("d", effective, gone, ARTIFACTS, {}, now=1.0).kind == "converged"


@pytest.mark.parametrize("state, final, kind", [("queued", False, "wait"), ("done", True, "wait"),
                                                ("failed", True, "wait")])
def test_a_remove_in_flight_or_ended_is_not_sent_again_until_the_device_reports(state, final, kind):
    effective = _effective(Target({"kws": ABSENT}))
    last = {"kws": LastCommand("tg-9", ABSENT, "fleet", 1, 1, 100.0, state, final, "", 150.0 if final else None)}
    decision = reconcile("d", effective, LISTING, ARTIFACTS, last, now=120.0)
    assert decision.kind == kind
    if state == "done":  # ended done: the device's next state (heard after 150) settles it
        assert "waiting for the device's state" in decision.reason
    if state == "failed":
        assert decision.reason.startswith("kws: the remove of kws failed on this device (failed")
