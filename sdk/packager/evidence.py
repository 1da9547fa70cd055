"""Evidence behind a task metric: its sample size, a 95% interval, and whether that interval
decides the budget. Pure: no onnx, no onnxruntime, no files.

A figure measured on a handful of samples says little: "recall 1" on 4 reference detections is
compatible with a true recall near 0.5. Each figure a lossy build is judged by therefore carries
a :class:`MetricEvidence`: a share of successes (recall, precision, top-1 agreement, per-step
agreement, string match) gets the Wilson score interval; the labelled top-1 accuracy drop, a
difference of two proportions on the same samples, gets Newcombe's paired interval (his method
10, built from Wilson intervals); a mean with no closed form (cosine, the mean score shift of
matched detections) gets a percentile bootstrap with a fixed seed, so two builds on the same
data report the same interval and take the same decision.

:func:`decide` says whether the interval's bound clears the budget (the lower bound for an
"at least" budget, the upper one for "at most"), and when it does not, how much data would
decide it (:func:`samples_needed`), in one line for the report:
``4 reference detections: recall cannot be judged >= 0.95; about 73 are needed``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Z95 = 1.959963984540054  # the two-sided 95% normal quantile, 1.96
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 20231129  # fixed: the same data gives the same interval in every build
MAX_BOOTSTRAP_VALUES = 100_000  # a longer series is resampled through its first values only
Method = Literal["wilson", "newcombe", "bootstrap"]
Side = Literal["at least", "at most"]


@dataclass(frozen=True)
class MetricEvidence:
    """One judged figure: ``value`` measured on ``n`` ``unit`` (e.g. 4 reference detections),
    with its 95% interval ``low``..``high`` by ``method``."""

    name: str
    value: float
    n: int
    low: float
    high: float
    method: Method
    unit: str = "samples"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "value": round(self.value, 6),
            "n": self.n,
            "unit": self.unit,
            "interval": [round(self.low, 6), round(self.high, 6)],
            "confidence": 0.95,
            "method": self.method,
        }


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of ``successes`` out of ``n``; (0, 1) when ``n`` is 0."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At 0 or n successes the bound sits on 0 or 1 exactly; rounding must not move it off.
    return (0.0 if successes == 0 else max(0.0, centre - half)), (1.0 if successes == n else min(1.0, centre + half))


def wilson(name: str, successes: int, n: int, unit: str) -> MetricEvidence:
    """A share of successes with its Wilson interval (an empty share counts as 1: nothing missed)."""
    low, high = wilson_interval(successes, n)
    return MetricEvidence(name, successes / n if n else 1.0, n, low, high, "wilson", unit)


def paired_difference_interval(
    both: int, first_only: int, second_only: int, neither: int, z: float = Z95
) -> tuple[float, float]:
    """Newcombe's (1998, method 10) interval of p1 - p2 for two proportions measured on the same
    samples: ``first_only`` samples the first got right and the second wrong, and so on. Built
    from each proportion's Wilson interval and their correlation, so it stays inside [-1, 1] and
    does not collapse to a point when the two agree on every sample, as a bootstrap would."""
    n = both + first_only + second_only + neither
    if min(both, first_only, second_only, neither) < 0:
        raise ValueError("counts cannot be negative")
    if n == 0:
        return -1.0, 1.0
    p1, p2 = (both + first_only) / n, (both + second_only) / n
    l1, u1 = wilson_interval(both + first_only, n, z)
    l2, u2 = wilson_interval(both + second_only, n, z)
    phi = _paired_correlation(both, first_only, second_only, neither)
    delta = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    epsilon = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    diff = p1 - p2
    return max(-1.0, diff - delta), min(1.0, diff + epsilon)


def _paired_correlation(both: int, first_only: int, second_only: int, neither: int) -> float:
    """Newcombe's continuity-corrected correlation of the two proportions: 0 when a margin is
    empty or the cross product ``both * neither - first_only * second_only`` lies in [0, n/2]."""
    n = both + first_only + second_only + neither
    margins = (both + first_only) * (second_only + neither) * (both + second_only) * (first_only + neither)
    if not margins:
        return 0.0
    cross = both * neither - first_only * second_only
    if cross > n / 2:
        return (cross - n / 2) / math.sqrt(margins)
    return 0.0 if cross >= 0 else cross / math.sqrt(margins)


def bootstrap_mean_interval(
    values: Sequence[float],
    bounds: tuple[float, float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the mean of ``values`` resampled with replacement,
    from a fixed seed (reproducible). Fewer than 2 values have no spread to resample: the whole
    ``bounds`` of the figure. A percentile bootstrap is optimistic on few values; the rates that
    decide most builds have closed forms instead."""
    data = np.asarray(values, np.float64).reshape(-1)[:MAX_BOOTSTRAP_VALUES]
    if data.size < 2:
        return bounds
    rng = np.random.default_rng(seed)
    means = np.empty(resamples, np.float64)
    chunk = max(1, 2_000_000 // data.size)  # bounded memory: chunk x n indices at a time
    for start in range(0, resamples, chunk):
        stop = min(resamples, start + chunk)
        means[start:stop] = data[rng.integers(0, data.size, size=(stop - start, data.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return max(bounds[0], float(low)), min(bounds[1], float(high))


def bootstrap(name: str, values: Sequence[float], unit: str, bounds: tuple[float, float]) -> MetricEvidence:
    """The mean of ``values`` with its seeded bootstrap interval."""
    low, high = bootstrap_mean_interval(values, bounds)
    mean = float(np.mean(values)) if len(values) else 0.0
    return MetricEvidence(name, mean, len(values), low, high, "bootstrap", unit)


def samples_needed(observed: float, budget: float, z: float = Z95) -> int | None:
    """The smallest n at which the Wilson lower bound of a share ``observed`` meets ``budget``,
    assuming the observed share holds on the larger sample (more data may of course move it).
    None when no n does: the share is not above the budget. From the interval's definition, the
    lower bound is >= b exactly when n * (observed - b)**2 >= z**2 * b * (1 - b)."""
    if observed <= budget:
        return None
    if budget <= 0:
        return 1
    exact = z * z * budget * (1 - budget) / (observed - budget) ** 2
    n = max(1, math.ceil(exact - 1e-9))
    while n > 1 and wilson_lower(observed, n - 1, z) >= budget:  # the closed form's rounding, checked
        n -= 1
    while wilson_lower(observed, n, z) < budget:
        n += 1
    return n


def wilson_lower(share: float, n: int, z: float = Z95) -> float:
    """The Wilson lower bound of a share ``share`` observed on ``n`` (not necessarily a whole
    number of successes): :func:`samples_needed`'s assumption that the observed share holds."""
    z2 = z * z
    return ((share + z2 / (2 * n)) - z * math.sqrt(share * (1 - share) / n + z2 / (4 * n * n))) / (1 + z2 / n)


@dataclass(frozen=True)
class EvidenceCall:
    """Whether ``evidence`` decides its budget: ``decided`` when the interval's bound on the
    budget's side clears it; ``needed`` how many ``evidence.unit`` would (None: none would at the
    observed figure); ``why`` one line for the report."""

    evidence: MetricEvidence
    side: Side
    budget: float
    decided: bool
    needed: int | None
    why: str

    def to_json(self) -> dict[str, Any]:
        return {
            **self.evidence.to_json(),
            "budget": f"{'>=' if self.side == 'at least' else '<='} {self.budget:g}",
            "decided": self.decided,
            "needed": self.needed,
            "why": self.why,
        }


def _needed(evidence: MetricEvidence, side: Side, budget: float) -> int | None:
    """How many ``unit`` would decide it, the observed figure holding. Wilson shares exactly;
    Newcombe's drop as the share of samples the second got wrong (the drop's worst case, the
    same n when both agree everywhere); a bootstrap mean by its interval narrowing as 1/sqrt(n)."""
    value = evidence.value
    if evidence.method == "wilson":
        return samples_needed(value, budget) if side == "at least" else samples_needed(1 - value, 1 - budget)
    if evidence.method == "newcombe":
        return samples_needed(1 - max(value, 0.0), 1 - budget)
    gap = value - budget if side == "at least" else budget - value
    half = value - evidence.low if side == "at least" else evidence.high - value
    if gap <= 0:
        return None
    if evidence.n < 2 or half <= 0:
        return max(2, evidence.n + 1)
    return max(evidence.n + 1, math.ceil(evidence.n * (half / gap) ** 2))


def decide(evidence: MetricEvidence, side: Side, budget: float) -> EvidenceCall:
    """Whether the 95% interval of ``evidence`` shows the budget met: its lower bound >= an
    "at least" budget, its upper bound <= an "at most" one (the bound exactly at the budget meets it)."""
    sign = ">=" if side == "at least" else "<="
    bound = evidence.low if side == "at least" else evidence.high
    decided = bound >= budget if side == "at least" else bound <= budget
    head = f"{evidence.n} {evidence.unit}: {evidence.name}"
    interval = f"95% interval {evidence.low:.4g}..{evidence.high:.4g}, {evidence.method}"
    if decided:
        return EvidenceCall(evidence, side, budget, True, None, f"{head} {sign} {budget:g} ({interval})")
    needed = _needed(evidence, side, budget)
    more = (
        f"about {needed} are needed" if needed is not None else f"no amount would at the observed {evidence.value:.4g}"
    )
    return EvidenceCall(
        evidence, side, budget, False, needed, f"{head} cannot be judged {sign} {budget:g} ({interval}); {more}"
    )
