"""Which outputs of one answer hold NaN or infinity, and what that makes the answer. Pure.

A non-finite output is the model's failure unless its recipe declares the output
``allow_non_finite`` (``outputs.NAME.allow_non_finite`` in the manifest): then it is data (a
``-inf`` log-probability, a NaN meaning "no value") and the answer is served, flagged with the
outputs that hold it. Either way the answer is counted (``RequestStats.non_finite``), and the
health window judges it (``device_agent/updates/health.py``).

Cost on the hot path: one ``isfinite().all()`` pass per float output (about 4-8 µs for a 1x4
output, 0.2 ms for a detector's 1x84x8400 head on the 2-core development machine; a sum, a
min/max pair or ``x * 0`` measured no faster); only an output holding a NaN/inf gets its exact
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
        finite = np.isfinite(value)
        if not finite.all():
            found[name] = int(value.size - np.count_nonzero(finite))
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
