"""Accuracy metrics comparing a packaged model with the original. Pure numpy, no I/O.

``check_fidelity`` is the check of every lossless build: each output on its own, floats
within rtol/atol by dtype, integers, bools and strings exactly, naming the worst element.
``evaluate`` judges a lossy (quantized, fp16) build by its task's metric on each checked
output: detection recall/precision against the reference's detections, per-step sequence
agreement (with CTC strings), classifier top-1, or each raw output's cosine / max abs diff.
``compare`` gives summary figures of the first output for the report, never the judgement.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
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


def _numeric(value: np.ndarray) -> bool:
    return value.dtype.kind in "biufc"


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
            if not _numeric(value) or value.shape != cand[key].shape:
                continue
            # Summary figures over the finite places only: non-finite answers are judged by the
            # per-output fidelity check, which knows where they were expected.
            ref64, cand64 = value.astype(np.float64), cand[key].astype(np.float64)
            both = np.isfinite(ref64) & np.isfinite(cand64)
            diff = np.abs(ref64[both] - cand64[both])
            if diff.size:
                max_abs = max(max_abs, float(diff.max()))
                abs_sum += float(diff.sum())
                count += diff.size
        a, b = ref[name], cand[name]
        if not (_numeric(a) and a.size and a.shape == b.shape):  # nothing to rank: agree only if equal
            same = bool(np.array_equal(a, b))
            cosines.append(1.0 if same else 0.0)
            agree += same
            continue
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


# Default tolerances of the lossless check, by output dtype: (rtol, atol). float32 follows the
# 1e-5 absolute rule of the ONNX export guides with a 1e-3 relative term, so large values are
# judged by their leading digits; float16 and bfloat16 keep 11 and 8 significant bits.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-3, 1e-5),
    "float32": (1e-3, 1e-5),
    "float16": (1e-2, 1e-3),
    "bfloat16": (2e-2, 1e-2),
}


def tolerance(dtype: np.dtype, rtol: float | None = None, atol: float | None = None) -> tuple[float, float] | None:
    """(rtol, atol) for an output of ``dtype``, or None when it must match exactly."""
    if dtype.kind not in "fc":
        return None
    name = "bfloat16" if dtype.name == "bfloat16" else ("float64" if dtype.itemsize >= 8 else dtype.name)
    default_rtol, default_atol = DEFAULT_TOLERANCES.get(name, DEFAULT_TOLERANCES["float32"])
    return (default_rtol if rtol is None else rtol, default_atol if atol is None else atol)


@dataclass(frozen=True)
class OutputFidelity:
    """One output over all samples: within tolerance or not, and its worst element."""

    output: str
    dtype: str
    rtol: float | None          # None: compared exactly
    atol: float | None
    ok: bool
    ratio: float                # worst |diff| / (atol + rtol*|expected|); 0 exact match, inf mismatch
    max_abs_diff: float
    sample: int | None = None   # where the worst element is
    index: tuple[int, ...] | None = None
    got: Any = None
    expected: Any = None
    problem: str | None = None  # a missing output, a shape or dtype mismatch

    def describe(self, sample_name: str) -> str:
        if self.problem:
            return f"output {self.output} ({sample_name}): {self.problem}"
        where = f"output {self.output} element {list(self.index or ())} of {sample_name}"
        if self.rtol is None:
            return f"{where}: got {self.got!r}, expected {self.expected!r} ({self.dtype} must match exactly)"
        return (f"{where}: got {self.got!r}, expected {self.expected!r} (|diff| {self.max_abs_diff:.3g}; "
                f"{self.ratio:.3g}x the tolerance atol {self.atol:g} + rtol {self.rtol:g} * |expected|)")

    def to_json(self) -> dict[str, Any]:
        return {"output": self.output, "dtype": self.dtype, "ok": self.ok, "rtol": self.rtol, "atol": self.atol,
                "ratio": _finite_or_str(self.ratio), "max_abs_diff": _finite_or_str(self.max_abs_diff),
                "sample": self.sample, "index": list(self.index) if self.index is not None else None,
                "got": _plain(self.got), "expected": _plain(self.expected), "problem": self.problem}


def _finite_or_str(value: float) -> float | str:
    return round(value, 6) if np.isfinite(value) else str(value)


def _scalar(value: Any) -> Any:
    return value.item() if isinstance(value, np.generic) else value


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


@dataclass(frozen=True)
class Fidelity:
    """Every output of a lossless build against its reference."""

    samples: int
    outputs: list[OutputFidelity]
    sample_names: list[str]

    @property
    def ok(self) -> bool:
        return all(o.ok for o in self.outputs)

    @property
    def worst(self) -> OutputFidelity | None:
        return max(self.outputs, key=lambda o: (not o.ok, o.problem is not None, o.ratio), default=None)

    def summary(self) -> str:
        worst = self.worst
        if worst is None:
            return "no outputs compared"
        name = self.sample_names[worst.sample] if worst.sample is not None and worst.sample < len(
            self.sample_names) else f"sample {worst.sample}"
        if not self.ok:
            return f"{worst.describe(name)}"
        return (f"{len(self.outputs)} output(s) within tolerance on {self.samples} sample(s); worst "
                f"{worst.output} at {worst.ratio:.3g}x its tolerance")

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {"samples": self.samples, "ok": self.ok, "outputs": [o.to_json() for o in self.outputs],
                "worst_output": worst.output if worst else None, "summary": self.summary()}


def _element_check(want: np.ndarray, got: np.ndarray, rtol: float | None, atol: float | None
                   ) -> tuple[float, float, tuple[int, ...] | None]:
    """(worst ratio, max abs diff, index of the worst element) for two same-shape arrays."""
    if not want.size:
        return 0.0, 0.0, None
    if rtol is None or atol is None:
        differs = want != got
        if not np.any(differs):
            return 0.0, 0.0, None
        index = tuple(int(i) for i in np.argwhere(differs)[0])
        diff = float(abs(float(got[index]) - float(want[index]))) if _numeric(want) else float("inf")
        return float("inf"), diff, index
    a, b = want.astype(np.float64), got.astype(np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))  # equal infinities and NaN where NaN was expected
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        diff = np.where(same, 0.0, np.abs(b - a))
        diff = np.where(np.isnan(diff), np.inf, diff)
        allowed = atol + rtol * np.abs(np.where(np.isfinite(a), a, 0.0))
        ratio = np.where(diff == 0, 0.0, np.where(allowed > 0, diff / allowed, np.inf))
    flat = int(np.argmax(ratio))
    index = tuple(int(i) for i in np.unravel_index(flat, ratio.shape))
    return float(ratio.reshape(-1)[flat]), float(diff.max()), index


def _family(dtype: np.dtype) -> str:
    return {"f": "float", "c": "float", "b": "bool", "i": "int", "u": "int"}.get(dtype.kind, "string")


def _check_output(name: str, reference: Sequence[Mapping[str, np.ndarray]],
                  candidate: Sequence[Mapping[str, np.ndarray]], rtol: float | None, atol: float | None
                  ) -> OutputFidelity:
    first = reference[0][name]
    tol = tolerance(first.dtype, rtol, atol)
    r, a = tol if tol is not None else (None, None)
    worst: OutputFidelity | None = None
    largest = 0.0
    for n, (ref, cand) in enumerate(zip(reference, candidate, strict=True)):
        want, got = ref[name], cand.get(name)
        problem = None
        if got is None:
            problem = "missing from the packaged model's outputs"
        elif got.shape != want.shape:
            problem = f"shape {list(got.shape)}, expected {list(want.shape)}"
        elif _family(got.dtype) != _family(want.dtype):
            problem = f"dtype {got.dtype.name}, expected {want.dtype.name}"
        if problem is not None or got is None:
            return OutputFidelity(name, first.dtype.name, r, a, False, float("inf"), float("inf"), n, problem=problem)
        ratio, max_abs, index = _element_check(want, got, r, a)
        largest = max(largest, max_abs)
        if index is not None and (worst is None or ratio > worst.ratio):
            worst = OutputFidelity(name, first.dtype.name, r, a, ratio <= 1.0, ratio, max_abs, n, index,
                                   _scalar(got[index]), _scalar(want[index]))
    if worst is None:
        return OutputFidelity(name, first.dtype.name, r, a, True, 0.0, 0.0)
    return OutputFidelity(**{**worst.__dict__, "max_abs_diff": largest})


def check_fidelity(reference: Sequence[Mapping[str, np.ndarray]], candidate: Sequence[Mapping[str, np.ndarray]], *,
                   rtol: float | None = None, atol: float | None = None, sample_names: Sequence[str] = ()
                   ) -> Fidelity:
    """Compare every output of ``candidate`` with ``reference``, sample by sample. Pure.

    Floats pass when |got - expected| <= atol + rtol * |expected| element-wise (NaN only where
    NaN was expected, equal infinities); other dtypes must be equal. ``rtol``/``atol`` replace
    the defaults of :data:`DEFAULT_TOLERANCES` for float outputs."""
    if len(reference) != len(candidate) or not reference:
        raise ValueError("need the same, non-zero number of samples from both models")
    names = list(reference[0])
    outputs = [_check_output(name, reference, candidate, rtol, atol) for name in names]
    return Fidelity(len(reference), outputs, list(sample_names) or [f"sample {n}" for n in range(len(reference))])


# --- Task metrics: what a lossy (quantized or fp16) build is judged by -------------------------
#
# One number over a whole tensor can be fooled: a YOLO-style head concatenates box coordinates
# in pixels with sigmoid scores, so its cosine stays above 0.998 while every score collapsed; a
# CTC recognizer's argmax over the flattened [T, classes] output agrees on one element of 40
# steps. Each task therefore gets its own metric, computed per output and per sample.

TASK_METRICS = ("top1", "agreement", "cosine", "max_abs", "detection", "sequence")
DEFAULT_MIN_RECALL = 0.95
DEFAULT_MIN_PRECISION = 0.95
# Matched boxes may keep their place while every score collapses onto one quantization step
# (a Concat of pixel boxes and sigmoid scores given one int8 scale: every score read 1.213 with
# recall and precision still 1.0). The mean shift of matched scores is judged too.
DEFAULT_MAX_SCORE_DIFF = 0.05
DEFAULT_MIN_AGREEMENT = 0.99
_IOU_EPSILON = 1e-9  # an IoU of exactly the threshold counts despite float rounding


@dataclass(frozen=True)
class Detections:
    """One image's detections: boxes ``[n, 4]`` as x1, y1, x2, y2, scores ``[n]``, classes ``[n]``."""

    boxes: np.ndarray
    scores: np.ndarray
    classes: np.ndarray

    @classmethod
    def of(cls, boxes: Any, scores: Any, classes: Any) -> Detections:
        box = np.asarray(boxes, np.float64).reshape(-1, 4)
        return cls(box, np.asarray(scores, np.float64).reshape(-1), np.asarray(classes, np.int64).reshape(-1))

    def __len__(self) -> int:
        return int(self.scores.shape[0])


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection over union of every box of ``a`` ``[n, 4]`` with every box of ``b`` ``[m, 4]``."""
    a, b = np.asarray(a, np.float64).reshape(-1, 4), np.asarray(b, np.float64).reshape(-1, 4)
    x1 = np.maximum(a[:, None, 0], b[None, :, 0])
    y1 = np.maximum(a[:, None, 1], b[None, :, 1])
    x2 = np.minimum(a[:, None, 2], b[None, :, 2])
    y2 = np.minimum(a[:, None, 3], b[None, :, 3])
    inter = np.clip(x2 - x1, 0, None) * np.clip(y2 - y1, 0, None)
    area_a = np.clip(a[:, 2] - a[:, 0], 0, None) * np.clip(a[:, 3] - a[:, 1], 0, None)
    area_b = np.clip(b[:, 2] - b[:, 0], 0, None) * np.clip(b[:, 3] - b[:, 1], 0, None)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)


def match_detections(ref: Detections, cand: Detections, iou: float = 0.5) -> list[tuple[int, int]]:
    """Greedy one-to-one matching: pairs of the same class with IoU >= ``iou``, highest IoU
    first (ties: lower reference index, then lower candidate index). A box of another class
    never matches, however well it overlaps: a detector that renames what it sees has missed it."""
    if not len(ref) or not len(cand):
        return []
    overlap = iou_matrix(ref.boxes, cand.boxes)
    same = ref.classes[:, None] == cand.classes[None, :]
    rows, cols = np.nonzero(same & (overlap >= iou - _IOU_EPSILON))
    order = sorted(zip(rows.tolist(), cols.tolist(), strict=True), key=lambda rc: (-overlap[rc], rc[0], rc[1]))
    used_ref: set[int] = set()
    used_cand: set[int] = set()
    pairs = []
    for r, c in order:
        if r not in used_ref and c not in used_cand:
            used_ref.add(r)
            used_cand.add(c)
            pairs.append((r, c))
    return pairs


@dataclass(frozen=True)
class DetectionAgreement:
    """The candidate's detections against the reference model's, taken as ground truth."""

    reference: int          # detections of the reference model, all images
    candidate: int
    matched: int
    mean_score_diff: float | None   # mean |score_ref - score_cand| over matched pairs

    @property
    def recall(self) -> float:
        return self.matched / self.reference if self.reference else 1.0

    @property
    def precision(self) -> float:
        return self.matched / self.candidate if self.candidate else (1.0 if not self.reference else 0.0)

    def to_json(self) -> dict[str, Any]:
        return {"reference_detections": self.reference, "candidate_detections": self.candidate,
                "matched": self.matched, "recall": round(self.recall, 6), "precision": round(self.precision, 6),
                "mean_score_diff": None if self.mean_score_diff is None else round(self.mean_score_diff, 6)}


def detection_agreement(ref: Sequence[Detections], cand: Sequence[Detections], iou: float = 0.5
                        ) -> DetectionAgreement:
    """Recall and precision of ``cand`` against ``ref`` (one :class:`Detections` per image) at
    ``iou``, with the mean score difference of matched boxes. Pure. No reference detection at
    all is recall 1; no candidate detection is precision 1 only when none were expected."""
    if len(ref) != len(cand):
        raise ValueError("need detections of the same images from both models")
    matched, diffs = 0, []
    for r, c in zip(ref, cand, strict=True):
        for i, j in match_detections(r, c, iou):
            matched += 1
            diffs.append(abs(float(r.scores[i]) - float(c.scores[j])))
    return DetectionAgreement(sum(len(r) for r in ref), sum(len(c) for c in cand), matched,
                              float(np.mean(diffs)) if diffs else None)


class MetricInputError(ValueError):
    """An output the metric cannot read (a detection metric on something that is no detection head)."""


def nms(boxes: np.ndarray, scores: np.ndarray, iou: float) -> list[int]:
    """Indices kept by greedy non-maximum suppression, best score first."""
    order = np.argsort(-scores, kind="stable")
    keep: list[int] = []
    while order.size:
        best = int(order[0])
        keep.append(best)
        rest = order[1:]
        order = rest[iou_matrix(boxes[best:best + 1], boxes[rest])[0] <= iou]
    return keep


def decode_yolov8(output: np.ndarray, *, score_threshold: float = 0.25, iou_threshold: float = 0.45,
                  max_detections: int = 300) -> list[Detections]:
    """Detections of a YOLOv8-style head ``[batch, 4 + classes, anchors]`` (cx, cy, w, h then
    per-class scores), class-wise NMS, in the model's input pixels. The validation metric's own
    decoder for recipes whose postprocess is not ``kind: detection``; a recipe that declares
    one is decoded by the shared postprocessor instead."""
    array = np.asarray(output, np.float64)
    if array.ndim == 2:
        array = array[None]
    if array.ndim != 3 or array.shape[1] < 5:
        raise MetricInputError(f"a yolov8 head is [batch, 4 + classes, anchors], got {list(np.shape(output))}")
    images = []
    for row in array:
        cx, cy, w, h = row[:4]
        scores_all = row[4:]
        classes = np.argmax(scores_all, axis=0)
        scores = scores_all[classes, np.arange(scores_all.shape[1])]
        keep = scores >= score_threshold
        boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)[keep]
        scores, classes = scores[keep], classes[keep]
        kept: list[int] = []
        for cls in np.unique(classes):
            index = np.nonzero(classes == cls)[0]
            kept.extend(int(index[k]) for k in nms(boxes[index], scores[index], iou_threshold))
        kept = sorted(kept, key=lambda k: (-scores[k], k))[:max_detections]
        images.append(Detections.of(boxes[kept], scores[kept], classes[kept]))
    return images


def ctc_greedy(steps: np.ndarray, blank: int) -> tuple[int, ...]:
    """Greedy CTC decoding of one sequence of per-step class indices: repeats collapsed, blanks dropped."""
    out: list[int] = []
    previous = None
    for index in steps.tolist():
        if index != previous and index != blank:
            out.append(int(index))
        previous = index
    return tuple(out)


@dataclass(frozen=True)
class SequenceAgreement:
    steps: int                      # time steps compared, over all samples and batch rows
    agreement: float                # share of steps whose argmax agrees
    sequences: int | None = None    # decoded sequences compared (ctc)
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


def sequence_agreement(ref: Sequence[np.ndarray], cand: Sequence[np.ndarray], *, blank: int | None = None
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
                same_strings += ctc_greedy(ra, blank) == ctc_greedy(rb, blank)
    return SequenceAgreement(total, agree / total if total else 1.0,
                             rows if blank is not None else None,
                             (same_strings / rows if rows else 1.0) if blank is not None else None)


@dataclass(frozen=True)
class OutputScore:
    """One checked output under the task metric: the figure judged, its limit, met or not."""

    output: str
    metric: str
    met: bool
    value: float            # the judged figure (for detection, the worse of recall and precision)
    limit: float
    why: str                # one line: "output scores: detection recall 0.19 (required >= 0.95)"
    shortfall: float = 0.0  # how far past the limit a miss is
    figures: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"output": self.output, "metric": self.metric, "met": self.met, "value": _finite_or_str(self.value),
                "limit": self.limit, "shortfall": _finite_or_str(self.shortfall), "why": self.why,
                **dict(self.figures or {})}


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
        return {"metric": self.metric, "samples": self.samples, "met": self.met,
                "outputs": [s.to_json() for s in self.scores], "worst_output": worst.output if worst else None,
                "summary": self.summary()}


# One sample's outputs (by name) -> its detections, one entry per image of the batch.
DetectionDecoder = Callable[[Mapping[str, np.ndarray]], list[Detections]]


def _at_least(name: str, metric: str, label: str, value: float, limit: float, figures: Mapping[str, Any]
              ) -> OutputScore:
    met = value >= limit - 1e-12
    return OutputScore(name, metric, met, value, limit, f"output {name}: {label} {value:.4g} (required >= {limit:.4g})",
                       0.0 if met else limit - value, figures)


def _at_most(name: str, metric: str, label: str, value: float, limit: float, figures: Mapping[str, Any]
             ) -> OutputScore:
    met = value <= limit + 1e-12
    return OutputScore(name, metric, met, value, limit, f"output {name}: {label} {value:.4g} (allowed <= {limit:.4g})",
                       0.0 if met else value - limit, figures)


def _rows_top(value: np.ndarray) -> np.ndarray:
    array = np.asarray(value)
    return np.argmax(array.reshape(1, -1) if array.ndim <= 1 else array.reshape(array.shape[0], -1), axis=1)


def _score_top1(name: str, ref: list[np.ndarray], cand: list[np.ndarray], budget: Mapping[str, Any],
                labels: Sequence[int] | None) -> OutputScore:
    limit = 0.01 if budget.get("max_drop") is None else float(budget["max_drop"])
    if labels is not None:
        ref_ok = sum(int(np.argmax(a.reshape(-1))) == labels[n] for n, a in enumerate(ref)) / len(ref)
        cand_ok = sum(int(np.argmax(b.reshape(-1))) == labels[n] for n, b in enumerate(cand)) / len(cand)
        drop = ref_ok - cand_ok
        score = _at_most(name, "top1", f"top-1 accuracy {cand_ok:.2%} vs {ref_ok:.2%}, drop", drop, limit,
                         {"accuracy_reference": ref_ok, "accuracy_candidate": cand_ok, "accuracy_drop": drop})
        return score
    rows = agree = 0
    for a, b in zip(ref, cand, strict=True):
        ta, tb = _rows_top(a), _rows_top(b)
        rows += ta.size
        agree += int(np.sum(ta == tb))
    share = agree / rows if rows else 1.0
    return _at_most(name, "top1", f"top-1 agreement {share:.2%}, disagreement", 1 - share, limit,
                    {"top1_agreement": share, "rows": rows})


def _finite_pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    both = np.isfinite(a64) & np.isfinite(b64)
    return a64[both], b64[both]


def _score_cosine(name: str, ref: list[np.ndarray], cand: list[np.ndarray], budget: Mapping[str, Any]
                  ) -> OutputScore:
    if budget.get("min_cosine") is not None:
        limit = float(budget["min_cosine"])
    else:
        limit = 1 - (float(budget["max_drop"]) if budget.get("max_drop") else 0.01)
    cosines = [_cosine(*_finite_pair(a, b)) for a, b in zip(ref, cand, strict=True)]
    worst = float(min(cosines))
    return _at_least(name, "cosine", "cosine", float(np.mean(cosines)), limit,
                     {"cosine": float(np.mean(cosines)), "worst_sample_cosine": worst})


def _score_max_abs(name: str, ref: list[np.ndarray], cand: list[np.ndarray], budget: Mapping[str, Any]
                   ) -> OutputScore:
    limit = 1e-3 if budget.get("max_abs") is None else float(budget["max_abs"])
    diffs = [np.abs(x - y) for x, y in (_finite_pair(a, b) for a, b in zip(ref, cand, strict=True)) if x.size]
    largest = max((float(d.max()) for d in diffs), default=0.0)
    return _at_most(name, "max_abs", "max abs diff", largest, limit, {"max_abs_diff": largest})


def _score_detection(name: str, ref: Sequence[Mapping[str, np.ndarray]], cand: Sequence[Mapping[str, np.ndarray]],
                     budget: Mapping[str, Any], decode: DetectionDecoder) -> OutputScore:
    found = detection_agreement([d for a in ref for d in decode(a)], [d for b in cand for d in decode(b)])
    min_recall = float(budget.get("min_recall", DEFAULT_MIN_RECALL))
    min_precision = float(budget.get("min_precision", DEFAULT_MIN_PRECISION))
    max_score_diff = float(budget.get("max_score_diff", DEFAULT_MAX_SCORE_DIFF))
    figures = found.to_json()
    recall = _at_least(name, "detection", "detection recall", found.recall, min_recall, figures)
    precision = _at_least(name, "detection", "detection precision", found.precision, min_precision, figures)
    checks = [recall, precision]
    if found.mean_score_diff is not None:  # no matched pair: recall/precision already say it
        checks.append(_at_most(name, "detection", "mean score shift of matched detections",
                               found.mean_score_diff, max_score_diff, figures))
    missed = [check for check in checks if not check.met]
    if missed:
        return max(missed, key=lambda s: s.shortfall)
    score = recall if found.recall - min_recall <= found.precision - min_precision else precision
    shift = "" if found.mean_score_diff is None else \
        f", mean score shift {found.mean_score_diff:.3g} (allowed <= {max_score_diff:.3g})"
    return replace(score, why=f"output {name}: detection recall {found.recall:.4g}, precision "
                   f"{found.precision:.4g} (required >= {min_recall:.4g}, >= {min_precision:.4g}){shift}")


def _score_sequence(name: str, ref: list[np.ndarray], cand: list[np.ndarray], budget: Mapping[str, Any],
                    blank: int | None, layout: str) -> OutputScore:
    if layout == "TNC":  # [T, batch, classes]: rows are the batch
        ref, cand = [np.swapaxes(a, 0, 1) for a in ref], [np.swapaxes(b, 0, 1) for b in cand]
    result = sequence_agreement(ref, cand, blank=blank)
    limit = float(budget.get("min_agreement", DEFAULT_MIN_AGREEMENT))
    figures = result.to_json()
    score = _at_least(name, "sequence", "per-step agreement", result.agreement, limit, figures)
    if result.string_match is None:
        return score
    strings = f"decoded strings equal {result.string_match:.2%}"
    if budget.get("min_string_match") is None:  # reported only
        return replace(score, why=f"{score.why}, {strings}")
    matched = _at_least(name, "sequence", "string match", result.string_match, float(budget["min_string_match"]),
                        figures)
    missed = [check for check in (score, matched) if not check.met]
    if missed:
        worst = max(missed, key=lambda s: s.shortfall)
        return worst if worst is matched else replace(worst, why=f"{worst.why}, {strings}")
    return replace(score, why=f"{score.why}, string match {result.string_match:.4g} "
                   f"(required >= {matched.limit:.4g})")


def _score_exact(name: str, ref: list[np.ndarray], cand: list[np.ndarray]) -> OutputScore:
    same = sum(bool(np.array_equal(a, b)) for a, b in zip(ref, cand, strict=True)) / len(ref)
    return _at_least(name, "exact", "samples exactly equal", same, 1.0, {"equal_samples": same})


def evaluate(reference: Sequence[Mapping[str, np.ndarray]], candidate: Sequence[Mapping[str, np.ndarray]], *,
             metric: str, outputs: Sequence[str], budget: Mapping[str, Any] | None = None,
             labels: Sequence[int] | None = None, decode: DetectionDecoder | None = None,
             blank: int | None = None, layout: str = "NTC") -> Evaluation:
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
        problem = next((f"shape {list(b.shape)}, expected {list(a.shape)}" if b is not None else "missing"
                        for a, b in zip(ref, cand, strict=True) if b is None or b.shape != a.shape), None)
        if problem is not None:
            scores.append(OutputScore(name, metric, False, float("nan"), 0.0, f"output {name}: {problem}",
                                      float("inf")))
            continue
        got = [b for b in cand if b is not None]
        if ref[0].dtype.kind not in "fc" or (metric == "top1" and labels is None and ref[0].size == 0):
            scores.append(_score_exact(name, ref, got))
        elif metric in ("top1", "agreement"):
            scores.append(_score_top1(name, ref, got, budget, labels if metric == "top1" else None))
        elif metric == "max_abs":
            scores.append(_score_max_abs(name, ref, got, budget))
        elif metric == "detection":
            scores.append(_score_detection(name, reference, candidate, budget,
                                           decode or (lambda sample, key=name: decode_yolov8(sample[key]))))
        elif metric == "sequence":
            scores.append(_score_sequence(name, ref, got, budget, blank, layout))
        else:
            scores.append(_score_cosine(name, ref, got, budget))
    return Evaluation(metric, len(reference), scores)


def task_metric(named: str | None, postprocess: Mapping[str, Any], has_labels: bool) -> str:
    """The metric a lossy build is judged by: the recipe's, else the task's: ``detection`` for a
    detection postprocess, ``sequence`` for ``ctc``, ``top1`` for classifiers (``topk``,
    ``softmax``), ``cosine`` per output for ``raw`` (``top1`` whenever the data has labels)."""
    if named:
        return named
    kind = postprocess.get("kind", "raw")
    if kind == "detection":
        return "detection"
    if kind == "ctc":
        return "sequence"
    if kind in ("topk", "softmax") or has_labels:
        return "top1"
    return "cosine"
