"""Accuracy metrics comparing a packaged model with the original. Pure numpy, no I/O.

``compare`` takes the outputs of both models on the same samples (one dict per sample) and
returns every metric at once; ``budget_met`` applies the recipe's budget to them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Comparison:
    samples: int
    max_abs_diff: float
    mean_abs_diff: float
    cosine: float               # mean over samples of the flattened first output's cosine
    top1_agreement: float       # share of samples whose argmax agrees
    accuracy_reference: float | None = None
    accuracy_candidate: float | None = None

    @property
    def accuracy_drop(self) -> float | None:
        if self.accuracy_reference is None or self.accuracy_candidate is None:
            return None
        return self.accuracy_reference - self.accuracy_candidate

    def to_json(self) -> dict[str, Any]:
        doc = {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}
        if self.accuracy_drop is not None:
            doc["accuracy_drop"] = round(self.accuracy_drop, 6)
        return doc


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    denominator = np.linalg.norm(a) * np.linalg.norm(b)
    if denominator == 0:
        return 1.0 if np.array_equal(a, b) else 0.0
    return float(np.dot(a, b) / denominator)


def compare(reference: Sequence[Mapping[str, np.ndarray]], candidate: Sequence[Mapping[str, np.ndarray]],
            *, output: str | None = None, labels: Sequence[int] | None = None) -> Comparison:
    """Compare two models' outputs sample by sample (``output`` picks the classifier output)."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError("need the same, non-zero number of samples from both models")
    name = output or next(iter(reference[0]))
    max_abs, abs_sum, count, cosines, agree = 0.0, 0.0, 0, [], 0
    ref_correct = cand_correct = 0
    for index, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        for key, value in ref.items():
            diff = np.abs(value.astype(np.float64) - cand[key].astype(np.float64))
            if diff.size:
                max_abs = max(max_abs, float(diff.max()))
                abs_sum += float(diff.sum())
                count += diff.size
        a, b = ref[name], cand[name]
        cosines.append(_cosine(a, b))
        ref_top, cand_top = int(np.argmax(a.reshape(-1))), int(np.argmax(b.reshape(-1)))
        agree += ref_top == cand_top
        if labels is not None:
            ref_correct += ref_top == labels[index]
            cand_correct += cand_top == labels[index]
    n = len(reference)
    return Comparison(
        samples=n, max_abs_diff=max_abs, mean_abs_diff=abs_sum / max(count, 1), cosine=float(np.mean(cosines)),
        top1_agreement=agree / n,
        accuracy_reference=ref_correct / n if labels is not None else None,
        accuracy_candidate=cand_correct / n if labels is not None else None,
    )


@dataclass(frozen=True)
class Budget:
    """The recipe's accuracy budget: one metric and its limit."""

    metric: str = "cosine"   # top1 | agreement | cosine | max_abs
    max_drop: float | None = None
    min_cosine: float | None = None
    max_abs: float | None = None

    @classmethod
    def from_recipe(cls, section: Mapping[str, Any], has_labels: bool) -> Budget:
        metric = section.get("metric") or ("top1" if has_labels else "cosine")
        return cls(metric, section.get("max_drop"), section.get("min_cosine"), section.get("max_abs"))

    def check(self, result: Comparison) -> tuple[bool, str]:
        """(met, a one-line explanation)."""
        if self.metric == "top1":
            if result.accuracy_drop is None:
                return False, "metric top1 needs labelled validation data"
            limit = 0.01 if self.max_drop is None else self.max_drop
            return result.accuracy_drop <= limit + 1e-12, (
                f"top-1 accuracy {result.accuracy_candidate:.2%} vs {result.accuracy_reference:.2%} "
                f"(drop {result.accuracy_drop:.2%}, allowed {limit:.2%})")
        if self.metric == "agreement":
            limit = 0.01 if self.max_drop is None else self.max_drop
            return 1 - result.top1_agreement <= limit + 1e-12, (
                f"top-1 agreement {result.top1_agreement:.2%} (allowed disagreement {limit:.2%})")
        if self.metric == "max_abs":
            limit = 1e-3 if self.max_abs is None else self.max_abs
            return result.max_abs_diff <= limit, f"max abs diff {result.max_abs_diff:.3g} (allowed {limit:.3g})"
        limit = self.min_cosine if self.min_cosine is not None else 1 - (self.max_drop if self.max_drop else 0.01)
        return result.cosine >= limit, f"output cosine {result.cosine:.5f} (required >= {limit:.5f})"
