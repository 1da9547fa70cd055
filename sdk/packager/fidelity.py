"""Tensor fidelity: a packaged model's outputs against the original's. Pure numpy, no I/O.

``check_fidelity`` is the check of every lossless build: each output on its own, floats
within rtol/atol by dtype, integers, bools and strings exactly, naming the worst element.
``compare`` gives summary figures of the first output for the report, never the judgement.
A lossy build is judged by its task instead (:mod:`sdk.packager.task_metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from edgepack_core.postprocess import top_k


@dataclass(frozen=True)
class Comparison:
    samples: int
    max_abs_diff: float
    mean_abs_diff: float
    cosine: float  # mean over samples of the flattened first output's cosine
    top1_agreement: float  # share of samples whose argmax agrees
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


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine of two flattened arrays; two zero arrays agree, one zero array does not."""
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    denominator = np.linalg.norm(a) * np.linalg.norm(b)
    if denominator == 0:
        return 1.0 if np.array_equal(a, b) else 0.0
    return float(np.dot(a, b) / denominator)


def top1(value: np.ndarray) -> int:
    """The best class of one sample's whole output (flattened), as the device's topk ranks it."""
    return int(top_k(np.asarray(value).reshape(1, -1), 1)[0, 0])


def compare(
    reference: Sequence[Mapping[str, np.ndarray]],
    candidate: Sequence[Mapping[str, np.ndarray]],
    *,
    output: str | None = None,
    labels: Sequence[int] | None = None,
) -> Comparison:
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
        cosines.append(cosine(a, b))
        ref_top, cand_top = top1(a), top1(b)
        agree += ref_top == cand_top
        if labels is not None:
            ref_correct += ref_top == labels[index]
            cand_correct += cand_top == labels[index]
    n = len(reference)
    return Comparison(
        samples=n,
        max_abs_diff=max_abs,
        mean_abs_diff=abs_sum / max(count, 1),
        cosine=float(np.mean(cosines)),
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
    rtol: float | None  # None: compared exactly
    atol: float | None
    ok: bool
    ratio: float  # worst |diff| / (atol + rtol*|expected|); 0 exact match, inf mismatch
    max_abs_diff: float
    sample: int | None = None  # where the worst element is
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
        return (
            f"{where}: got {self.got!r}, expected {self.expected!r} (|diff| {self.max_abs_diff:.3g}; "
            f"{self.ratio:.3g}x the tolerance atol {self.atol:g} + rtol {self.rtol:g} * |expected|)"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "output": self.output,
            "dtype": self.dtype,
            "ok": self.ok,
            "rtol": self.rtol,
            "atol": self.atol,
            "ratio": json_number(self.ratio),
            "max_abs_diff": json_number(self.max_abs_diff),
            "sample": self.sample,
            "index": list(self.index) if self.index is not None else None,
            "got": _plain(self.got),
            "expected": _plain(self.expected),
            "problem": self.problem,
        }


def json_number(value: float) -> float | str:
    """A float for a JSON report: rounded, or its name when not finite ("inf", "nan")."""
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
        name = (
            self.sample_names[worst.sample]
            if worst.sample is not None and worst.sample < len(self.sample_names)
            else f"sample {worst.sample}"
        )
        if not self.ok:
            return f"{worst.describe(name)}"
        return (
            f"{len(self.outputs)} output(s) within tolerance on {self.samples} sample(s); worst "
            f"{worst.output} at {worst.ratio:.3g}x its tolerance"
        )

    def to_json(self) -> dict[str, Any]:
        worst = self.worst
        return {
            "samples": self.samples,
            "ok": self.ok,
            "outputs": [o.to_json() for o in self.outputs],
            "worst_output": worst.output if worst else None,
            "summary": self.summary(),
        }


def _element_check(
    want: np.ndarray, got: np.ndarray, rtol: float | None, atol: float | None
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
        diffs = np.where(same, 0.0, np.abs(b - a))
        diffs = np.where(np.isnan(diffs), np.inf, diffs)
        allowed = atol + rtol * np.abs(np.where(np.isfinite(a), a, 0.0))
        ratio = np.where(diffs == 0, 0.0, np.where(allowed > 0, diffs / allowed, np.inf))
    flat = int(np.argmax(ratio))
    index = tuple(int(i) for i in np.unravel_index(flat, ratio.shape))
    return float(ratio.reshape(-1)[flat]), float(diffs.max()), index


def _family(dtype: np.dtype) -> str:
    return {"f": "float", "c": "float", "b": "bool", "i": "int", "u": "int"}.get(dtype.kind, "string")


def _check_output(
    name: str,
    reference: Sequence[Mapping[str, np.ndarray]],
    candidate: Sequence[Mapping[str, np.ndarray]],
    rtol: float | None,
    atol: float | None,
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
            worst = OutputFidelity(
                name,
                first.dtype.name,
                r,
                a,
                ratio <= 1.0,
                ratio,
                max_abs,
                n,
                index,
                _scalar(got[index]),
                _scalar(want[index]),
            )
    if worst is None:
        return OutputFidelity(name, first.dtype.name, r, a, True, 0.0, 0.0)
    return OutputFidelity(**{**worst.__dict__, "max_abs_diff": largest})


def check_fidelity(
    reference: Sequence[Mapping[str, np.ndarray]],
    candidate: Sequence[Mapping[str, np.ndarray]],
    *,
    rtol: float | None = None,
    atol: float | None = None,
    sample_names: Sequence[str] = (),
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
