"""Pure tensor comparisons shared by the host's golden pass and the device's smoke test, so
both sides agree on what a declared non-finite answer is."""

from __future__ import annotations

import numpy as np


def same_non_finite(value: np.ndarray, want: np.ndarray) -> bool:
    """True when ``value`` is NaN exactly where ``want`` is, and infinite exactly where ``want``
    is infinite with the same sign. Pure. Why: a golden output may be non-finite only when the
    build's own test data declared it so (an IsNaN or Cast-of-inf model); anywhere else a NaN
    out is a broken model, and a NaN never equals itself under plain comparison."""
    value_bad, want_bad = ~np.isfinite(value), ~np.isfinite(want)
    if not np.array_equal(value_bad, want_bad):
        return False
    return bool(np.array_equal(value[want_bad], want[want_bad], equal_nan=True))
