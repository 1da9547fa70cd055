"""Task metrics: what a lossy (quantized or fp16) build is judged by. Pure numpy, no I/O.

One number over a whole tensor can be fooled: a YOLO-style head concatenates box coordinates
in pixels with sigmoid scores, so its cosine stays above 0.998 while every score collapsed; a
CTC recognizer's argmax over the flattened [T, classes] output agrees on one element of 40
steps. ``evaluate`` therefore judges each checked output by its task's metric: detection
recall/precision against the reference's detections, per-step sequence agreement (with CTC
strings), classifier top-1, or each raw output's cosine / max abs diff.

Every decoder is the device's own (:mod:`edgepack_core.postprocess`: detection candidates and
class-wise NMS, the CTC collapse, top-k ranking), so a build is judged on what its devices
answer. Lossless builds are checked by :mod:`sdk.packager.fidelity` instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from edgepack_core.postprocess import class_rows, ctc_collapse, top_k
from edgepack_core.postprocess_spec import PostprocessSpec
from sdk.packager.detection_match import (  # noqa: F401 - the task metrics' names, kept importable here
    DetectionAgreement,
    DetectionDecoder,
    Detections,
    decode_yolov8,
    detection_agreement,
    iou_matrix,
    match_detections,
    yolov8_decoder,
)
from sdk.packager.evidence import EvidenceCall, MetricEvidence, bootstrap, decide, paired_difference_interval, wilson
from sdk.packager.fidelity import cosine, json_number, top1

TASK_METRICS = ("top1", "agreement", "cosine", "max_abs", "detection", "sequence")
DEFAULT_MIN_RECALL = 0.95
DEFAULT_MIN_PRECISION = 0.95
# Matched boxes may keep their place while every score collapses onto one quantization step
# (a Concat of pixel boxes and sigmoid scores given one int8 scale: every score read 1.213 with
# recall and precision still 1.0). The mean shift of matched scores is judged too.
DEFAULT_MAX_SCORE_DIFF = 0.05
DEFAULT_MIN_AGREEMENT = 0.99


def ctc_labels(best: np.ndarray, blank: int) -> tuple[int, ...]:
    """The class indices greedy CTC decoding reads from per-step best classes ``best``
    (:func:`~edgepack_core.postprocess.ctc_collapse`: repeats collapsed, blanks dropped)."""
    best = np.asarray(best)
    return tuple(int(i) for i in best[ctc_collapse(best, blank)])


@dataclass(frozen=True)
class SequenceAgreement:
    steps: int  # time steps compared, over all samples and batch rows
    agreement: float  # share of steps whose argmax agrees
    sequences: int | None = None  # decoded sequences compared (ctc)
    string_match: float | None = None

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"steps": self.steps, "step_agreement": round(self.agreement, 6)}
        if self.sequences is not None:
            doc.update({"sequences": self.sequences, "string_match": round(self.string_match or 0.0, 6)})
        return doc


def _steps(value: np.ndarray) -> np.ndarray:
    """Per-step argmax of a ``[..., T, classes]`` output as ``[rows, T]`` (a 1-D output is one step)."""
    array = np.asarray(value)
    if array.ndim == 0 or array.size == 0:
        return np.zeros((1, 0), np.int64)
    top = np.argmax(array, axis=-1)
    return top.reshape(1, -1) if top.ndim <= 1 else top.reshape(-1, top.shape[-1])


def sequence_agreement(
    ref: Sequence[np.ndarray], cand: Sequence[np.ndarray], *, blank: int | None = None
) -> SequenceAgreement:
    """Per-step argmax agreement of ``[batch, T, classes]`` outputs (class axis last; every
    other position is a step), one array per sample. With ``blank`` (a CTC model) the greedy
    decoded sequences of each row are compared too. Pure."""
    if len(ref) != len(cand) or not ref:
        raise ValueError("need the same, non-zero number of samples from both models")
    total = agree = rows = same_strings = 0
    for a, b in zip(ref, cand, strict=True):
        if np.shape(a) != np.shape(b):
            raise ValueError(f"shape {list(np.shape(b))}, expected {list(np.shape(a))}")
        ta, tb = _steps(a), _steps(b)
        total += ta.size
        agree += int(np.sum(ta == tb))
        if blank is not None:
            for ra, rb in zip(ta, tb, strict=True):
                rows += 1
                same_strings += ctc_labels(ra, blank) == ctc_labels(rb, blank)
    return SequenceAgreement(
        total,
        agree / total if total else 1.0,
        rows if blank is not None else None,
        (same_strings / rows if rows else 1.0) if blank is not None else None,
    )


@dataclass(frozen=True)
class OutputScore:
    """One checked output under the task metric: the figure judged, its limit, met or not."""

    output: str
    metric: str
    met: bool
    value: float  # the judged figure (for detection, the worse of recall and precision)
    limit: float
    why: str  # one line: "output scores: detection recall 0.19 (required >= 0.95)"
    shortfall: float = 0.0  # how far past the limit a miss is
    figures: Mapping[str, Any] | None = None
    evidence: tuple[EvidenceCall, ...] = ()  # each gated figure's interval against its limit

    @property
    def decided(self) -> bool:
        """Whether every gated figure's 95% interval clears its limit (not only its point value)."""
        return all(call.decided for call in self.evidence)

    def to_json(self) -> dict[str, Any]:
        return {
            "evidence": [call.to_json() for call in self.evidence],
            "decided": self.decided,
            "output": self.output,
            "metric": self.metric,
            "met": self.met,
            "value": json_number(self.value),
            "limit": self.limit,
            "shortfall": json_number(self.shortfall),
            "why": self.why,
            **dict(self.figures or {}),
        }


@dataclass(frozen=True)
class Evaluation:
    """Every checked output of a candidate against the reference: the build ships only when all met."""

    metric: str
    samples: int
    scores: list[OutputScore]

    @property
    def met(self) -> bool:
        return all(score.met for score in self.scores)

    @property
    def worst(self) -> OutputScore | None:
        return max(self.scores, key=lambda s: (not s.met, s.shortfall), default=None)

    @property
    def decided(self) -> bool:
        """Whether the validation data shows the budget met at 95% confidence, every output."""
        return self.met and all(score.decided for score in self.scores)

    def evidence_summary(self) -> str:
        """One line: the figures whose interval does not clear the budget and the data that
        would, else every gated figure's interval."""
        calls = [call for score in self.scores for call in score.evidence]
        undecided = [call for call in calls if not call.decided]
        return "; ".join(call.why for call in (undecided or calls)) or "no figure with an interval"

    def summary(self) -> str:
        """One line: the output that missed most and by how much, else every output's figure."""
        missed = [s for s in self.scores if not s.met]
        if missed:
            worst = self.worst
            assert worst is not None
            more = f" ({len(missed) - 1} more output(s) missed)" if len(missed) > 1 else ""
            return f"{worst.why}, short by {worst.shortfall:.4g}{more}"
        return "; ".join(s.why for s in self.scores) or "no outputs compared"

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "metric": self.metric,
            "samples": self.samples,
            "met": self.met,
            "outputs": [s.to_json() for s in self.scores],
            "worst_output": worst.output if worst else None,
            "summary": self.summary(),
            "decided": self.decided,
            "evidence": self.evidence_summary(),
        }


def _judged(
    name: str,
    metric: str,
    label: str,
    value: float,
    limit: float,
    figures: Mapping[str, Any],
    excess: float,
    bound: str,
) -> OutputScore:
    """A figure against its limit; ``excess`` is how far past it the figure is (<= 0: met)."""
    met = excess <= 1e-12
    return OutputScore(
        name,
        metric,
        met,
        value,
        limit,
        f"output {name}: {label} {value:.4g} ({bound} {limit:.4g})",
        0.0 if met else excess,
        figures,
    )


def _at_least(
    name: str, metric: str, label: str, value: float, limit: float, figures: Mapping[str, Any]
) -> OutputScore:
    return _judged(name, metric, label, value, limit, figures, limit - value, "required >=")


def _at_most(name: str, metric: str, label: str, value: float, limit: float, figures: Mapping[str, Any]) -> OutputScore:
    return _judged(name, metric, label, value, limit, figures, value - limit, "allowed <=")


def _rows_top(value: np.ndarray) -> np.ndarray:
    """Each row's best class, ranked as the device's topk ranks it."""
    return top_k(class_rows(np.atleast_1d(value)), 1)[:, 0]


def _score_top1(
    name: str, ref: list[np.ndarray], cand: list[np.ndarray], budget: Mapping[str, Any], labels: Sequence[int] | None
) -> OutputScore:
    limit = 0.01 if budget.get("max_drop") is None else float(budget["max_drop"])
    if labels is not None:
        ref_right = [top1(a) == labels[n] for n, a in enumerate(ref)]
        cand_right = [top1(b) == labels[n] for n, b in enumerate(cand)]
        ref_ok, cand_ok = sum(ref_right) / len(ref), sum(cand_right) / len(cand)
        drop = ref_ok - cand_ok
        score = _at_most(
            name,
            "top1",
            f"top-1 accuracy {cand_ok:.2%} vs {ref_ok:.2%}, drop",
            drop,
            limit,
            {"accuracy_reference": ref_ok, "accuracy_candidate": cand_ok, "accuracy_drop": drop},
        )
        return replace(score, evidence=(decide(_paired_drop(ref_right, cand_right), "at most", limit),))
    rows = agree = 0
    for a, b in zip(ref, cand, strict=True):
        ta, tb = _rows_top(a), _rows_top(b)
        rows += ta.size
        agree += int(np.sum(ta == tb))
    share = agree / rows if rows else 1.0
    score = _at_most(
        name,
        "top1",
        f"top-1 agreement {share:.2%}, disagreement",
        1 - share,
        limit,
        {"top1_agreement": share, "rows": rows},
    )
    shares = wilson("top-1 agreement", agree, rows, "samples" if rows == len(ref) else "rows")
    return replace(score, evidence=(decide(shares, "at least", 1 - limit),))


def _paired_drop(ref_right: Sequence[bool], cand_right: Sequence[bool]) -> MetricEvidence:
    """The labelled accuracy drop with Newcombe's paired interval (both models on the same samples)."""
    pairs = list(zip(ref_right, cand_right, strict=True))
    kinds = ((True, True), (True, False), (False, True), (False, False))
    counts = [sum(pair == kind for pair in pairs) for kind in kinds]
    low, high = paired_difference_interval(*counts)
    drop = (counts[1] - counts[2]) / len(pairs)
    return MetricEvidence("top-1 accuracy drop", drop, len(pairs), low, high, "newcombe", "labelled samples")


def _finite_pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    both = np.isfinite(a64) & np.isfinite(b64)
    return a64[both], b64[both]


def _score_cosine(name: str, ref: list[np.ndarray], cand: list[np.ndarray], budget: Mapping[str, Any]) -> OutputScore:
    if budget.get("min_cosine") is not None:
        limit = float(budget["min_cosine"])
    else:
        limit = 1 - (float(budget["max_drop"]) if budget.get("max_drop") else 0.01)
    cosines = [cosine(*_finite_pair(a, b)) for a, b in zip(ref, cand, strict=True)]
    worst = float(min(cosines))
    score = _at_least(
        name,
        "cosine",
        "cosine",
        float(np.mean(cosines)),
        limit,
        {"cosine": float(np.mean(cosines)), "worst_sample_cosine": worst},
    )
    return replace(score, evidence=(decide(bootstrap("cosine", cosines, "samples", (-1.0, 1.0)), "at least", limit),))


def _score_max_abs(name: str, ref: list[np.ndarray], cand: list[np.ndarray], budget: Mapping[str, Any]) -> OutputScore:
    limit = 1e-3 if budget.get("max_abs") is None else float(budget["max_abs"])
    diffs = [np.abs(x - y) for x, y in (_finite_pair(a, b) for a, b in zip(ref, cand, strict=True)) if x.size]
    largest = max((float(d.max()) for d in diffs), default=0.0)
    return _at_most(name, "max_abs", "max abs diff", largest, limit, {"max_abs_diff": largest})


def _score_detection(
    name: str,
    ref: Sequence[Mapping[str, np.ndarray]],
    cand: Sequence[Mapping[str, np.ndarray]],
    budget: Mapping[str, Any],
    decode: DetectionDecoder,
) -> OutputScore:
    found = detection_agreement([d for a in ref for d in decode(a)], [d for b in cand for d in decode(b)])
    min_recall = float(budget.get("min_recall", DEFAULT_MIN_RECALL))
    min_precision = float(budget.get("min_precision", DEFAULT_MIN_PRECISION))
    max_score_diff = float(budget.get("max_score_diff", DEFAULT_MAX_SCORE_DIFF))
    figures = found.to_json()
    recall = _at_least(name, "detection", "detection recall", found.recall, min_recall, figures)
    precision = _at_least(name, "detection", "detection precision", found.precision, min_precision, figures)
    checks = [recall, precision]
    if found.mean_score_diff is not None:  # no matched pair: recall/precision already say it
        checks.append(
            _at_most(
                name,
                "detection",
                "mean score shift of matched detections",
                found.mean_score_diff,
                max_score_diff,
                figures,
            )
        )
    evidence = _detection_evidence(found, min_recall, min_precision, max_score_diff)
    missed = [check for check in checks if not check.met]
    if missed:
        return replace(max(missed, key=lambda s: s.shortfall), evidence=evidence)
    score = recall if found.recall - min_recall <= found.precision - min_precision else precision
    shift = (
        ""
        if found.mean_score_diff is None
        else f", mean score shift {found.mean_score_diff:.3g} (allowed <= {max_score_diff:.3g})"
    )
    return replace(
        score,
        why=f"output {name}: detection recall {found.recall:.4g}, precision "
        f"{found.precision:.4g} (required >= {min_recall:.4g}, >= {min_precision:.4g}){shift}",
        evidence=evidence,
    )


def _detection_evidence(
    found: DetectionAgreement, min_recall: float, min_precision: float, max_score_diff: float
) -> tuple[EvidenceCall, ...]:
    """Recall over the reference's detections and precision over the candidate's (Wilson), and
    the matched pairs' mean score shift (bootstrap), each against its limit."""
    calls = [
        decide(wilson("recall", found.matched, found.reference, "reference detections"), "at least", min_recall),
        decide(wilson("precision", found.matched, found.candidate, "candidate detections"), "at least", min_precision),
    ]
    if found.score_diffs:
        shift = bootstrap("mean score shift", found.score_diffs, "matched detections", (0.0, 1.0))
        calls.append(decide(shift, "at most", max_score_diff))
    return tuple(calls)


def _score_sequence(
    name: str, ref: list[np.ndarray], cand: list[np.ndarray], budget: Mapping[str, Any], blank: int | None, layout: str
) -> OutputScore:
    if layout == "TNC":  # [T, batch, classes]: rows are the batch
        ref, cand = [np.swapaxes(a, 0, 1) for a in ref], [np.swapaxes(b, 0, 1) for b in cand]
    result = sequence_agreement(ref, cand, blank=blank)
    limit = float(budget.get("min_agreement", DEFAULT_MIN_AGREEMENT))
    figures = result.to_json()
    steps = wilson("per-step agreement", round(result.agreement * result.steps), result.steps, "time steps")
    calls = [decide(steps, "at least", limit)]
    score = _at_least(name, "sequence", "per-step agreement", result.agreement, limit, figures)
    if result.string_match is None:
        return replace(score, evidence=tuple(calls))
    strings = f"decoded strings equal {result.string_match:.2%}"
    if budget.get("min_string_match") is None:  # reported only
        return replace(score, why=f"{score.why}, {strings}", evidence=tuple(calls))
    string_limit = float(budget["min_string_match"])
    rows = result.sequences or 0
    matches = wilson("string match", round(result.string_match * rows), rows, "decoded strings")
    calls.append(decide(matches, "at least", string_limit))
    matched = _at_least(name, "sequence", "string match", result.string_match, string_limit, figures)
    missed = [check for check in (score, matched) if not check.met]
    if missed:
        worst = max(missed, key=lambda s: s.shortfall)
        worst = worst if worst is matched else replace(worst, why=f"{worst.why}, {strings}")
        return replace(worst, evidence=tuple(calls))
    return replace(
        score,
        why=f"{score.why}, string match {result.string_match:.4g} (required >= {matched.limit:.4g})",
        evidence=tuple(calls),
    )


def _score_exact(name: str, ref: list[np.ndarray], cand: list[np.ndarray]) -> OutputScore:
    same = sum(bool(np.array_equal(a, b)) for a, b in zip(ref, cand, strict=True)) / len(ref)
    return _at_least(name, "exact", "samples exactly equal", same, 1.0, {"equal_samples": same})


def evaluate(
    reference: Sequence[Mapping[str, np.ndarray]],
    candidate: Sequence[Mapping[str, np.ndarray]],
    *,
    metric: str,
    outputs: Sequence[str],
    budget: Mapping[str, Any] | None = None,
    labels: Sequence[int] | None = None,
    decode: DetectionDecoder | None = None,
    blank: int | None = None,
    layout: str = "NTC",
) -> Evaluation:
    """Judge ``candidate`` against ``reference`` (one output dict per sample, same samples) by
    ``metric`` on each of ``outputs`` separately, against the recipe's ``budget`` keys
    (``max_drop``, ``min_cosine``, ``max_abs``, ``min_recall``, ``min_precision``,
    ``max_score_diff``, ``min_agreement``, ``min_string_match``). Outputs of non-float dtype
    must match exactly (their argmax or cosine means nothing). ``decode`` turns one sample's
    outputs into detections (default :func:`decode_yolov8` of the output); ``blank`` makes
    ``sequence`` compare CTC-decoded strings too, reported, and gated by ``min_string_match``
    when the budget sets it (``layout`` ``TNC`` for ``[T, batch, classes]`` outputs). Pure."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError("need the same, non-zero number of samples from both models")
    if metric not in TASK_METRICS:
        raise ValueError(f"unknown metric {metric!r}")
    budget = budget or {}
    scores = []
    for name in outputs:
        ref = [np.asarray(sample[name]) for sample in reference]
        cand = [np.asarray(sample[name]) if name in sample else None for sample in candidate]
        problem = next(
            (
                f"shape {list(b.shape)}, expected {list(a.shape)}" if b is not None else "missing"
                for a, b in zip(ref, cand, strict=True)
                if b is None or b.shape != a.shape
            ),
            None,
        )
        if problem is not None:
            scores.append(
                OutputScore(name, metric, False, float("nan"), 0.0, f"output {name}: {problem}", float("inf"))
            )
            continue
        got = [b for b in cand if b is not None]
        if ref[0].dtype.kind not in "fc" or (metric == "top1" and labels is None and ref[0].size == 0):
            scores.append(_score_exact(name, ref, got))
        elif metric in ("top1", "agreement"):
            scores.append(_score_top1(name, ref, got, budget, labels if metric == "top1" else None))
        elif metric == "max_abs":
            scores.append(_score_max_abs(name, ref, got, budget))
        elif metric == "detection":
            scores.append(_score_detection(name, reference, candidate, budget, decode or yolov8_decoder(name)))
        elif metric == "sequence":
            scores.append(_score_sequence(name, ref, got, budget, blank, layout))
        else:
            scores.append(_score_cosine(name, ref, got, budget))
    return Evaluation(metric, len(reference), scores)


def task_metric(named: str | None, postprocess: PostprocessSpec, has_labels: bool) -> str:
    """The metric a lossy build is judged by: the recipe's, else the task's: ``detection`` for a
    detection postprocess, ``sequence`` for ``ctc``, ``top1`` for classifiers (``topk``,
    ``softmax``), ``cosine`` per output for ``raw`` (``top1`` whenever the data has labels)."""
    if named:
        return named
    kind = postprocess.kind
    if kind == "detection":
        return "detection"
    if kind == "ctc":
        return "sequence"
    if kind in ("topk", "softmax") or has_labels:
        return "top1"
    return "cosine"
