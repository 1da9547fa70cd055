"""The quantize pass's speed gate (issue 23 item 10): paired interleaved rounds, an interval, and
a fixed tie rule, so one recipe on one machine makes the same int8/fp32 choice in every build
even when its speed gain sits near ``quantize.min_speedup``."""

from __future__ import annotations

import numpy as np
import pytest

from sdk.packager import quant_search as plan
from sdk.packager.passes.quantize import LATENCY_ROUNDS


def _call(ratios: list[float], line: float) -> plan.SpeedCall:
    return plan.speed_call([1.0] * len(ratios), [1.0 / r for r in ratios], line)


@pytest.mark.parametrize(
    ("ratios", "line", "call"),
    [
        ([1.21, 1.3, 1.25], 1.2, "faster"),  # the lowest round clears the line
        ([1.2, 1.3, 1.25], 1.2, "undecided"),  # lowest round on the line: not above it
        ([1.19, 1.3, 1.25], 1.2, "undecided"),  # interval straddles the line
        ([1.1, 1.2, 1.15], 1.2, "slower"),  # highest round on the line: not above it
        ([1.1, 1.21, 1.15], 1.2, "undecided"),  # highest round just above it
        ([0.4, 0.5, 0.6], 0.0, "faster"),  # min_speedup 0 lets any speed through
    ],
)
def test_the_speed_call_decides_only_when_the_interval_clears_the_line(ratios, line, call):
    speed = _call(ratios, line)
    assert speed.call == call
    assert speed.faster is (call == "faster")
    assert speed.low == min(ratios) and speed.high == max(ratios)


def test_the_speedup_is_the_median_round_ratio():
    assert _call([1.0, 3.0, 2.0], 1.0).speedup == 2.0
    assert _call([1.0, 2.0, 3.0, 4.0], 1.0).speedup == 2.5


def test_a_single_timing_per_model_is_the_float_rule_of_before():
    assert plan.speed_call([2.0], [1.0], 1.99).call == "faster"
    assert plan.speed_call([2.0], [1.0], 2.0).call == "slower"
    assert plan.speed_call([1.0], [0.0], 0.0).call == "slower"  # no time measured: never faster
    assert plan.speed_call([], [], 0.0).call == "slower"


def test_an_undecided_int8_candidate_keeps_the_float_form():
    undecided = _call([0.9, 1.1], 1.0)
    assert plan.verdict("int8", True, undecided) == plan.Verdict(
        False, True, "meets the budget but is not clearly faster than fp32"
    )
    assert plan.verdict("int8", True, _call([0.8, 0.9], 1.0)).word == "meets the budget but is not faster than fp32"
    assert plan.verdict("int8", True, _call([1.1, 1.2], 1.0)).ships
    assert plan.verdict("fp16", True, undecided).ships  # fp16 is judged on accuracy alone
    assert not plan.verdict("int8", False, _call([2.0], 1.0)).ships


def _busy_build(rng: np.random.Generator, gain: float, rounds: int = LATENCY_ROUNDS) -> tuple[list[float], list[float]]:
    """One build's rounds on a busy machine: each model's block jitters (4%) and half the blocks
    are slowed by a load spike of up to 30%; the candidate is truly ``gain`` times faster."""

    def spike() -> float:
        return (1.0 + (rng.uniform(0, 0.3) if rng.random() < 0.5 else 0.0)) * rng.lognormal(0, 0.04)

    return [spike() for _ in range(rounds)], [spike() / gain for _ in range(rounds)]


def test_a_gain_near_the_line_on_a_busy_machine_does_not_flip_between_builds():
    """The symptom: one recipe shipped fp32 in one build and int8 in the next. With the old rule
    (each model's fastest block, then ratio > line) builds of a 1% gain flip; the interval's call
    keeps the float form in (nearly) every one of them."""
    rng = np.random.default_rng(23)
    builds = [_busy_build(rng, gain=1.01) for _ in range(200)]
    old = sum(min(f) / min(c) > 1.0 for f, c in builds)
    new = sum(plan.speed_call(f, c, 1.0).faster for f, c in builds)
    assert 60 <= old <= 160  # the old rule is a coin toss here
    assert new <= 4  # the new one says "not clearly faster" in at least 98% of builds
    clear = [_busy_build(rng, gain=1.6) for _ in range(200)]
    assert all(plan.speed_call(f, c, 1.0).faster for f, c in clear)  # a clear gain still ships
