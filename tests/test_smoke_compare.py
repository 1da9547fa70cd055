"""The smoke test's pure comparison at its edges: shape rules, every refusal's exact text,
the tolerance boundaries and the worst difference it reports."""

from __future__ import annotations

import numpy as np
import pytest

from device_agent.smoke import compare_outputs, shape_matches
from edgepack_core.manifest import TensorSpec

NAN = np.nan


def spec(name: str = "y", shape: tuple = ("N",), dtype: str = "float32") -> TensorSpec:
    return TensorSpec(name, dtype, shape)


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def compare(got, expected, declared=None, *, rtol=1e-3, atol=1e-4):
    return compare_outputs(got, expected, declared or [spec()], rtol=rtol, atol=atol)


@pytest.mark.parametrize(("shape", "declared", "matches"), [
    ((), (), True),
    ((2, 3), (2, 3), True),
    ((2, 3), ("N", 3), True),
    ((2, 3), ("N", "M"), True),
    ((2, 3), (2, 4), False),
    ((2, 3), (3, 3), False),
    ((2, 3), ("N", 4), False),
    ((2, 3), ("N",), False),  # rank differs though the first dim matches
    ((2,), ("N", 3), False),
    ((2, 3), (2, 3, 1), False),
])
def test_shape_rule(shape, declared, matches):
    assert shape_matches(shape, declared) is matches


def test_missing_output_is_named():
    assert compare({}, {"y": f32(1)}) == ("output y is missing", 0.0)


def test_output_off_its_declared_shape_is_named_with_both_shapes():
    assert compare({"y": f32(1, 2)}, {"y": f32(1, 2)}, [spec(shape=(3,))]) == \
        ("output y has shape [2], declared [3]", 0.0)


def test_golden_data_without_the_output_is_named():
    assert compare({"y": f32(1)}, {"z": f32(1)}) == ("golden outputs lack y", 0.0)


def test_output_off_the_golden_shape_is_named_with_both_shapes():
    assert compare({"y": f32(1, 2)}, {"y": f32(1, 2, 3)}) == ("output y has shape [2], golden [3]", 0.0)


def test_non_finite_output_where_golden_is_finite_is_named():
    assert compare({"y": f32(1, NAN)}, {"y": f32(1, 2)}) == \
        ("output y holds non-finite values where golden has other values", 0.0)


def test_difference_is_reported_with_the_tolerances():
    assert compare({"y": f32(0, 1.5)}, {"y": f32(0, 1)}) == \
        ("output y differs from golden by up to 0.5 (rtol 0.001, atol 0.0001)", 0.5)


def test_float_output_within_tolerance_but_not_equal_passes():
    problem, diff = compare({"y": f32(1.00005)}, {"y": f32(1)})
    assert problem is None and 0 < diff < 1e-4


def test_all_non_finite_output_matching_golden_passes_with_no_difference():
    assert compare({"y": f32(NAN, np.inf)}, {"y": f32(NAN, np.inf)}) == (None, 0.0)


@pytest.mark.parametrize(("got", "passes"), [(3.0, True), (1.0, True), (3.0078125, False), (0.9921875, False)])
def test_relative_tolerance_boundary(got, passes):
    # |got - 2| <= 0 + 0.5 * |2| = 1, exactly representable in float32
    problem, _ = compare({"y": f32(got)}, {"y": f32(2)}, rtol=0.5, atol=0.0)
    assert (problem is None) is passes


@pytest.mark.parametrize(("got", "passes"), [(2.5, True), (1.5, True), (2.5078125, False), (1.4921875, False)])
def test_absolute_tolerance_boundary(got, passes):
    problem, _ = compare({"y": f32(got)}, {"y": f32(2)}, rtol=0.0, atol=0.5)
    assert (problem is None) is passes


def test_integer_outputs_must_be_equal():
    ints = [spec(dtype="int64")]
    assert compare({"y": np.array([1, 2])}, {"y": np.array([1, 2])}, ints) == (None, 0.0)
    assert compare({"y": np.array([1, 3])}, {"y": np.array([1, 2])}, ints, rtol=1.0, atol=5.0) == \
        ("output y differs from golden", 0.0)


def test_worst_difference_is_the_largest_over_all_outputs():
    declared = [spec("a"), spec("b")]
    got = {"a": f32(1.25), "b": f32(1.125)}
    want = {"a": f32(1.0), "b": f32(1.0)}
    assert compare(got, want, declared, atol=0.5) == (None, 0.25)
    assert compare(got, want, declared[::-1], atol=0.5) == (None, 0.25)
    # a refusal still reports the worst difference seen before it
    assert compare({"a": f32(1.25)}, want, declared, atol=0.5) == ("output b is missing", 0.25)
