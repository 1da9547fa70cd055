"""Which outputs of one answer hold NaN or infinity, and what that makes the answer. Pure.

A non-finite output is the model's failure unless its recipe declares the output
``allow_non_finite`` (``outputs.NAME.allow_non_finite`` in the manifest): then it is data (a
``-inf`` log-probability, a NaN meaning "no value") and the answer is served, flagged with the
outputs that hold it. Either way the answer is counted (``RequestStats.non_finite``), and the
health window judges it (``device_agent/updates/health.py``).

Cost on the hot path: one reduction per float output (no temporary array); only an output
whose sum is not finite (a NaN/inf in it, or a sum that overflowed) gets the exact per-value
count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


def non_finite_counts(outputs: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Output name -> how many NaN/inf values it holds, for the outputs that hold any."""
    found: dict[str, int] = {}
    for name, value in outputs.items():
        if value.dtype.kind not in "fc" or value.size == 0:
            continue
        with np.errstate(over="ignore", invalid="ignore"):  # a sum of large finite values may overflow
            total = value.sum(dtype=np.float64 if value.dtype.itemsize < 4 else None)
        if np.isfinite(total):
            continue
        bad = int(value.size - np.count_nonzero(np.isfinite(value)))
        if bad:
            found[name] = bad
    return found


@dataclass(frozen=True)
class Finiteness:
    """One answer's verdict: ``refused`` (output -> count) makes it a 500 ``non_finite_output``;
    ``flagged`` names the allowed outputs that hold NaN/inf (served, and said so)."""

    refused: Mapping[str, int]
    flagged: tuple[str, ...]

    @property
    def non_finite(self) -> bool:
        return bool(self.refused or self.flagged)


FINITE = Finiteness({}, ())


def judge_outputs(counts: Mapping[str, int], allowed: frozenset[str]) -> Finiteness:
    """Split the outputs holding NaN/inf into refused ones and allowed (flagged) ones."""
    if not counts:
        return FINITE
    return Finiteness(
        {name: n for name, n in counts.items() if name not in allowed},
        tuple(name for name in counts if name in allowed),
    )
