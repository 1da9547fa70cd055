"""The pure rollout policy of edgepack deploy (sdk/deploy/policy.py) and the artifact server's
Range parsing, at their boundaries."""

from __future__ import annotations

import json

import pytest

from edgepack_core.protocol.messages import JobEvent, parse_job_event
from sdk.deploy.policy import JobBoard, RolloutError, all_active, plan_waves, wave_verdict
from sdk.deploy.server import parse_range

DEVICES = [f"d{i}" for i in range(10)]


def _event(job: str = "c-1", state: object = "active", final: object = True, device: str = "a",
           **extra: object) -> JobEvent | str:
    """A job event as the device sends it, through the one parser every host reader uses."""
    doc = {"schema": "edgepack.job/1", "device": device, "ts": 1.0, "job": job, "type": "deploy", "state": state,
           "final": final, **extra}
    return parse_job_event(device, json.dumps({k: v for k, v in doc.items() if v is not None}).encode())


# ------------------------------------------------------------------ plan_waves


@pytest.mark.parametrize(("percent", "canaries"), [(10, 1), (10.1, 2), (1, 1), (20, 2), (99, 10), (100, 10)])
def test_canary_share_rounds_up_and_a_full_share_is_one_wave(percent, canaries):
    waves = plan_waves(DEVICES, percent)
    assert waves[0] == DEVICES[:canaries]
    assert [d for wave in waves for d in wave] == DEVICES
    assert len(waves) == (1 if canaries == len(DEVICES) else 2)


def test_no_canary_or_a_single_target_is_one_wave():
    assert plan_waves(DEVICES, None) == [DEVICES]
    assert plan_waves(["only"], 10) == [["only"]]


def test_duplicate_targets_are_planned_once_in_order():
    assert plan_waves(["b", "a", "b"], None) == [["b", "a"]]


@pytest.mark.parametrize("percent", [0, -5, 100.0001, float("nan"), float("inf")])
def test_canary_share_out_of_range_is_refused(percent):
    with pytest.raises(RolloutError, match="canary share"):
        plan_waves(DEVICES, percent)


def test_empty_target_list_is_refused():
    with pytest.raises(RolloutError) as caught:
        plan_waves([], None)
    assert str(caught.value) == "no target device to deploy to"


# ------------------------------------------------------------------ JobBoard


def test_board_folds_events_of_its_command_from_its_devices_only():
    board = JobBoard("c-1", ["a", "b"])
    assert board.fold(_event(state="downloading", final=False))
    assert not board.fold(_event(job="c-2"))                   # another command
    assert not board.fold(_event(device="stranger"))           # not in this rollout
    assert board.jobs["a"].state == "downloading" and not board.jobs["a"].final
    assert board.jobs["b"].state == "sent"


@pytest.mark.parametrize("change", [{"state": 7}, {"final": "yes"}, {"state": "x" * 33}, {"state": ""},
                                    {"final": None}, {"state": "Active"}, {"job": "../x"}])
def test_a_job_event_with_fields_of_the_wrong_type_is_refused_by_the_parser(change):
    assert _event(**change) == "bad_schema"


@pytest.mark.parametrize("state", ["x", "s" * 32])
def test_state_length_boundaries_are_accepted(state):
    board = JobBoard("c-1", ["a"])
    event = _event(state=state, final=False, reason="r")
    assert board.fold(event)
    assert (board.jobs["a"].state, board.jobs["a"].events) == (state, [event])


@pytest.mark.parametrize("reason", [None, 5, ["x"]])
def test_missing_or_non_text_reason_reads_as_empty(reason):
    board = JobBoard("c-1", ["a"])
    assert board.fold(_event(state="failed", reason=reason))
    assert board.jobs["a"].reason == ""


def test_a_final_state_is_kept_against_later_duplicates():
    board = JobBoard("c-1", ["a"])
    board.fold(_event(state="failed", reason="smoke test"))
    board.fold(_event(state="active", duplicate=True))
    assert (board.jobs["a"].state, board.jobs["a"].reason, board.jobs["a"].final) == ("failed", "smoke test", True)
    assert len(board.jobs["a"].events) == 2


def test_event_list_and_reason_are_bounded():
    board = JobBoard("c-1", ["a"])
    for _ in range(200):
        board.fold(_event(state="downloading", final=False, reason="r" * 10_000))
    assert len(board.jobs["a"].events) == 64
    assert len(board.jobs["a"].reason) == 500


def test_finished_and_all_active():
    board = JobBoard("c-1", ["a", "b"])
    board.fold(_event())
    assert board.finished(["a"]) and not board.finished(["a", "b"])
    assert not all_active(board.jobs)
    board.fold(_event(device="b"))
    assert all_active(board.jobs)
    assert not all_active({})
    failed = JobBoard("c-1", ["a"])
    failed.fold(_event(state="failed"))
    assert not all_active(failed.jobs)


# ------------------------------------------------------------------ wave_verdict


def test_wave_passes_only_when_every_device_is_final_and_active():
    board = JobBoard("c-1", ["a", "b"])
    board.fold(_event())
    assert wave_verdict(board, ["a", "b"], timed_out=False).outcome == "pending"
    board.fold(_event(device="b", state="active", final=False))   # swapped, health window still open
    assert wave_verdict(board, ["a", "b"], timed_out=False).outcome == "pending"
    board.fold(_event(device="b"))
    assert wave_verdict(board, ["a", "b"], timed_out=False).outcome == "passed"


def test_one_failure_fails_the_wave_without_waiting_for_the_others():
    board = JobBoard("c-1", ["a", "b", "c"])
    board.fold(_event(device="b", state="rolled_back", reason="error rate"))
    verdict = wave_verdict(board, ["a", "b", "c"], timed_out=False)
    assert (verdict.outcome, verdict.failed, verdict.timed_out) == ("failed", ("b",), False)
    assert verdict.reason == "b: rolled_back (error rate)"
    board.fold(_event(device="c", state="failed", reason="smoke"))
    assert wave_verdict(board, ["a", "b", "c"], timed_out=False).reason == "b, c: rolled_back (error rate)"


def test_timeout_fails_the_wave_naming_the_silent_devices():
    board = JobBoard("c-1", ["a", "b"])
    board.fold(_event())
    verdict = wave_verdict(board, ["a", "b"], timed_out=True)
    assert (verdict.outcome, verdict.failed, verdict.timed_out) == ("failed", ("b",), True)
    assert verdict.reason == "no final answer from b"
    three = JobBoard("c-1", ["a", "b", "c"])
    assert wave_verdict(three, ["a", "b", "c"], timed_out=True).reason == "no final answer from a, b, c"
    board.fold(_event(device="b"))
    assert wave_verdict(board, ["a", "b"], timed_out=True).outcome == "passed"  # all in: time does not matter


def test_skipped_devices_are_marked():
    board = JobBoard("c-1", ["a", "b"])
    board.skip(["b"], "canary failed")
    assert (board.jobs["b"].state, board.jobs["b"].reason, board.jobs["b"].final) == ("skipped", "canary failed",
                                                                                      False)


# ------------------------------------------------------------------ Range


@pytest.mark.parametrize(("header", "expected"), [
    ("", None), ("bytes=0-", (0, 9)), ("bytes=5-9", (5, 9)), ("bytes=9-9", (9, 9)), ("bytes=0-100", (0, 9)),
    ("bytes=-3", (7, 9)), ("bytes=-100", (0, 9)), ("bytes=10-", "unsatisfiable"), ("bytes=9-5", "unsatisfiable"),
    ("bytes=-0", "unsatisfiable"), ("bytes=-", None), ("bytes=1-2,4-5", None), ("items=0-1", None),
    ("bytes=" + "9" * 19 + "-", None), ("bytes=x-1", None),
])
def test_range_header_boundaries(header, expected):
    assert parse_range(header, 10) == expected


def test_range_on_tiny_files_and_header_length_boundary():
    assert parse_range("bytes=-5", 0) == "unsatisfiable"
    assert parse_range("bytes=-5", 1) == (0, 0)
    assert parse_range("bytes=0-", 1) == (0, 0)
    padded = "bytes=2-" + " " * 192
    assert len(padded) == 200 and parse_range(padded, 10) == (2, 9)
    assert parse_range(padded + " ", 10) is None
