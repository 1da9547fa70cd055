"""Whose failure is a session run that raised: the client's input (a 400 naming the input, the
index, what was sent and what fits) or the model's (a 500 counted against it). Pure.

onnxruntime's text alone cannot tell a wrong-size input to a dynamic-dim model (a Reshape or
Concat that needs a width of 32k) from a model bug; the request's shapes can. A feed that breaks
the declared inputs (rank, a fixed dim) is the client's. A shape error inside the graph on a
feed whose dynamic dims differ from every golden sample's (the shapes the model is proven to
run) is the client's too. The model's: the same shapes the golden samples ran, an error that is
not about shapes, and onnxruntime's own input check refusing a feed the declared inputs admit
(the manifest and the graph disagree: a packaging fault, not the client's).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Shapes = Mapping[str, tuple[int, ...]]
Declared = Mapping[str, tuple[int | str, ...]]

MAX_DETAIL_CHARS = 300
"""onnxruntime's useful part is kept to this many characters (its source paths dropped)."""
MAX_REPORTED_DIMS = 4

_PREFIX = re.compile(r"^\s*\[ONNXRuntimeError\]\s*:\s*\d+\s*:\s*[A-Z_]+\s*:\s*")
_SOURCE = re.compile(r"Status Message: \S+:\d+ .*? was false\. ?")
_PLEASE = re.compile(r"\s*Please fix either the inputs(/outputs)? or the model\.?")
_INPUT = re.compile(r"for input: (\S+)")
_DIMS = re.compile(r"index: (\d+) Got: (\d+) Expected: (\d+)")
_RANK = re.compile(r"Invalid rank for input: (\S+) Got: (\d+) Expected: (\d+)")
_SHAPE_WORDS = ("shape", "dimension", "rank", "reshape", "broadcast", "concat", "size")


@dataclass(frozen=True)
class DimMismatch:
    """One dim of one input that does not fit: ``index`` None is the rank."""

    input: str
    index: int | None
    got: int
    fits: str

    def text(self) -> str:
        where = "its rank" if self.index is None else f"index {self.index}"
        return f"input {self.input}: {where} got {self.got}, expected {self.fits}"


@dataclass(frozen=True)
class Verdict:
    """``client``: a 400 (the request's fault); else a 500 counted against the model."""

    client: bool
    message: str


def ort_detail(text: str) -> str:
    """onnxruntime's message, its useful part on one bounded line: no status prefix, source
    path or function signature, no "Please fix" advice."""
    text = _PLEASE.sub("", _SOURCE.sub("", _PREFIX.sub("", str(text))))
    line = " ".join(text.split())
    return line if len(line) <= MAX_DETAIL_CHARS else line[: MAX_DETAIL_CHARS - 3] + "..."


def reported_mismatches(detail: str) -> list[DimMismatch]:
    """What onnxruntime's own input check names (``Got invalid dimensions for input`` or
    ``Invalid rank for input``): input, index, got, expected."""
    rank = _RANK.search(detail)
    if rank:
        return [DimMismatch(rank[1], None, int(rank[2]), rank[3])]
    named = _INPUT.search(detail)
    if not named or "invalid dimensions" not in detail:
        return []
    return [DimMismatch(named[1], int(i), int(got), want) for i, got, want in _DIMS.findall(detail)]


def declared_mismatches(shapes: Shapes, declared: Declared) -> list[DimMismatch]:
    """Dims of the request that break the declared inputs: a rank, or a fixed dim."""
    found = []
    for name, shape in shapes.items():
        want = declared.get(name)
        if want is None:
            continue
        if len(shape) != len(want):
            found.append(DimMismatch(name, None, len(shape), str(len(want))))
            continue
        found += [
            DimMismatch(name, i, got, str(d))
            for i, (got, d) in enumerate(zip(shape, want, strict=True))
            if isinstance(d, int) and got != d
        ]
    return found


def batch_symbols(inputs: Declared, outputs: Sequence[Sequence[int | str]]) -> frozenset[str]:
    """The symbols that lead an input and an output: the batch, which a model that declares it
    dynamic must run at any size (a failure at a new batch size is the model's)."""
    leading = {shape[0] for shape in outputs if shape and isinstance(shape[0], str)}
    return frozenset(s[0] for s in inputs.values() if s and isinstance(s[0], str) and s[0] in leading)


def unproven_dims(
    shapes: Shapes, declared: Declared, proven: Sequence[Shapes], batch: frozenset[str] = frozenset()
) -> list[DimMismatch]:
    """Dynamic dims of the request (not the batch) at sizes no golden sample ran, each with the
    sizes that did (or the symbolic name when there are no golden samples)."""
    found = []
    for name, shape in shapes.items():
        want = declared.get(name, ())
        for index, got in enumerate(shape):
            if index >= len(want) or isinstance(want[index], int) or want[index] in batch:
                continue
            ran = sorted({p[name][index] for p in proven if name in p and len(p[name]) == len(shape)})
            if got not in ran:
                fits = " or ".join(map(str, ran)) + " (as its golden samples)" if ran else f"{want[index]!r}"
                found.append(DimMismatch(name, index, got, fits))
    return found


def is_shape_error(detail: str) -> bool:
    lowered = detail.lower()
    return any(word in lowered for word in _SHAPE_WORDS)


def _said(mismatches: list[DimMismatch]) -> str:
    return "; ".join(m.text() for m in mismatches[:MAX_REPORTED_DIMS])


def judge_run_failure(
    error: str,
    shapes: Shapes,
    declared: Declared,
    proven: Sequence[Shapes],
    batch: frozenset[str] = frozenset(),
) -> Verdict:
    """The verdict on a failed run of a request with ``shapes`` on a model with ``declared``
    inputs (``batch``: their batch symbols) and golden-sample input shapes ``proven``; the
    message keeps onnxruntime's index, got and expected."""
    detail = ort_detail(error)
    known = declared_mismatches(shapes, declared)
    if known:
        return Verdict(True, f"{_said(known)} (onnxruntime: {detail})")
    ran_before = any(all(p.get(n) == s for n, s in shapes.items()) for p in proven)
    if reported_mismatches(detail) or ran_before or not is_shape_error(detail):
        return Verdict(False, f"inference failed: {detail}")
    unproven = unproven_dims(shapes, declared, proven, batch)
    if not unproven:
        return Verdict(False, f"inference failed: {detail}")
    return Verdict(True, f"the model cannot take this input: {_said(unproven)} (onnxruntime: {detail})")
