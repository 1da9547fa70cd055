"""The shared rule for declared non-finite answers, and the device smoke test built on it."""

from __future__ import annotations

import numpy as np

from device_agent.smoke import compare_outputs
from edgepack_core.manifest import TensorSpec
from edgepack_core.tensor_compare import same_non_finite

NAN, INF = np.nan, np.inf


def test_same_non_finite_needs_the_same_places_and_the_same_kind():
    want = np.array([1.0, NAN, INF, -INF])
    assert same_non_finite(np.array([1.5, NAN, INF, -INF]), want)  # finite parts are not judged here
    assert not same_non_finite(np.array([1.0, 2.0, INF, -INF]), want)  # NaN expected, finite got
    assert not same_non_finite(np.array([1.0, NAN, -INF, -INF]), want)  # inf of the other sign
    assert not same_non_finite(np.array([1.0, INF, NAN, -INF]), want)  # NaN and inf swapped
    assert not same_non_finite(np.array([NAN, NAN, INF, -INF]), want)  # one more NaN than declared
    assert same_non_finite(np.zeros(0), np.zeros(0))


def _compare(got, want):
    spec = [TensorSpec("y", "float32", (len(want),))]
    return compare_outputs({"y": np.asarray(got, np.float32)}, {"y": np.asarray(want, np.float32)}, spec,
                           rtol=1e-3, atol=1e-4)


def test_smoke_accepts_golden_nan_and_inf_at_the_same_places():
    problem, diff = _compare([0.0, NAN, -INF], [0.0, NAN, -INF])
    assert problem is None and diff == 0.0


def test_smoke_refuses_nan_where_the_golden_output_is_finite():
    problem, _ = _compare([0.0, NAN, 1.0], [0.0, 2.0, 1.0])
    assert problem is not None and "non-finite" in problem


def test_smoke_still_judges_the_finite_part_beside_declared_nan():
    problem, diff = _compare([0.0, NAN, 1.5], [0.0, NAN, 1.0])
    assert problem is not None and "differs" in problem and abs(diff - 0.5) < 1e-6
    assert _compare([0.0, NAN, 1.0 + 5e-5], [0.0, NAN, 1.0])[0] is None  # inside atol 1e-4
