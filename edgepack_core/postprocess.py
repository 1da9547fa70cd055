"""The declarative postprocessing spec: what ``predict`` reports as ``result`` next to the raw outputs.

Runs identically on the host (validation, ``inspect``) and on a device, with numpy only.

Kinds (one model output is read: ``output``, or the model's first output):

- ``raw``: no interpretation; the result is ``None`` and callers show the raw outputs.
- ``softmax``: class probabilities, ``list[float]`` for one sample, ``list[list[float]]``
  for a batch of several.
- ``topk``: the ``k`` best classes as ``[{"index", "label", "score"}]`` for one sample (a
  list of such lists for several), best first, ties broken by the lower index. ``score`` is
  the softmax probability, or the raw output value when ``apply_softmax`` is false (for
  models whose last layer already is a softmax). ``label`` comes from the labels file, one
  label per line, line *i* naming class *i*; ``None`` when there is no label for the index.

The output tensor is read as rows of class scores: a 1-D output is one sample; otherwise
the first axis is the batch and all other axes are flattened, so ``[1, 1000, 1, 1]``
classifier heads work as they are. Softmax is computed in float64 after subtracting each
row's maximum, so logits of any magnitude (1e4 and beyond) give finite probabilities.

``labels`` in a recipe is a path next to the recipe; in a manifest it is the artifact-relative
path (``assets/labels.txt``). This module never opens it: the caller reads the text and
passes :func:`load_labels` of it, so the same code serves files on disk and archive members.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edgepack_core.errors import PostprocessError
from edgepack_core.schema import validate_by_kind

SPEC_VERSION = 1
DEFAULT_K = 5

_PROPERTIES: dict[str, Any] = {
    "kind": {"enum": ["raw", "softmax", "topk"]},
    "version": {"type": "integer", "const": SPEC_VERSION, "default": SPEC_VERSION},
    "output": {"type": "string", "minLength": 1, "description": "the model output to read (default: first)"},
    "k": {"type": "integer", "minimum": 1, "default": DEFAULT_K, "description": "topk: how many classes"},
    "labels": {"type": ["string", "null"], "minLength": 1,
               "description": "topk: labels file, one per line (recipe: a path; manifest: assets/labels.txt)"},
    "apply_softmax": {"type": "boolean", "default": True,
                      "description": "topk: score with softmax probabilities (false: raw output values)"},
}
_PLAIN_KEYS = ["kind", "version", "output"]

POSTPROCESS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "title": "Edgepack postprocessing spec",
    "description": "How the model's output becomes the 'result' of a prediction.",
    "additionalProperties": False,
    "required": ["kind"],
    "properties": _PROPERTIES,
    # k, labels and apply_softmax only mean something for topk; elsewhere they are mistakes.
    "oneOf": [
        {"additionalProperties": False,
         "properties": {"kind": {"enum": ["raw", "softmax"]}, **{key: {} for key in _PLAIN_KEYS[1:]}}},
        {"additionalProperties": False,
         "properties": {**{key: {} for key in _PROPERTIES}, "kind": {"const": "topk"}}},
    ],
}

# One complete schema per kind, so that once the kind is known an error names the key
# itself (``k`` on a softmax spec) instead of whichever oneOf branch failed deepest.
_KIND_SCHEMAS: dict[str, dict[str, Any]] = {
    kind: {
        "type": "object",
        "additionalProperties": False,
        "properties": {**{key: _PROPERTIES[key] for key in keys}, "kind": {"const": kind}},
    }
    for kind, keys in (("raw", _PLAIN_KEYS), ("softmax", _PLAIN_KEYS), ("topk", list(_PROPERTIES)))
}


def normalize_postprocess(spec: Mapping[str, Any] | None, *, document: str = "", path: str = "") -> dict[str, Any]:
    """Validate ``spec`` and return a new, complete spec with every default written out.

    ``None`` means ``raw``. ``document`` and ``path`` prefix error messages (e.g.
    ``path="postprocess"`` inside a recipe). Raises :class:`SchemaError`. Idempotent.
    """
    raw = validate_by_kind({"kind": "raw"} if spec is None else spec, _KIND_SCHEMAS, POSTPROCESS_SCHEMA,
                           document=document, path=path)
    out: dict[str, Any] = {"kind": raw["kind"], "version": raw.get("version", SPEC_VERSION)}
    if raw["kind"] == "topk":
        out["k"] = raw.get("k", DEFAULT_K)
        out["apply_softmax"] = raw.get("apply_softmax", True)
        out["labels"] = raw.get("labels")
    if "output" in raw:
        out["output"] = raw["output"]
    return out


def load_labels(text: str) -> list[str]:
    """One label per line; line numbers are class indices, so blank lines inside are kept
    (as empty labels) and only trailing blank lines, a BOM and line-end whitespace are dropped."""
    lines = [line.rstrip() for line in text.removeprefix("\ufeff").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def softmax(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax in float64: subtracting the maximum keeps exp() finite."""
    values = np.asarray(scores, dtype=np.float64)
    shifted = values - np.max(values, axis=axis, keepdims=True)
    exps = np.exp(shifted)
    return exps / np.sum(exps, axis=axis, keepdims=True)


class Postprocessor:
    """Turns the model's outputs into the ``result`` of a prediction (see module docs)."""

    def __init__(self, spec: Mapping[str, Any] | None, labels: Sequence[str] | None = None) -> None:
        self.spec = normalize_postprocess(spec)
        self.kind: str = self.spec["kind"]
        self.labels = list(labels) if labels is not None else None

    def __call__(self, outputs: Mapping[str, np.ndarray]) -> Any:
        if self.kind == "raw":
            return None
        rows, single = self._rows(self._select(outputs))
        if self.kind == "softmax":
            probabilities = softmax(rows, axis=1).tolist()
            return probabilities[0] if single else probabilities
        scores = softmax(rows, axis=1) if self.spec["apply_softmax"] else rows
        results = [self._topk(row) for row in scores]
        return results[0] if single else results

    def _select(self, outputs: Mapping[str, np.ndarray]) -> np.ndarray:
        if not outputs:
            raise PostprocessError("the model returned no outputs")
        name = self.spec.get("output")
        if name is None:
            return np.asarray(next(iter(outputs.values())))
        if name not in outputs:
            raise PostprocessError(f"no model output named {name!r} (outputs: {', '.join(outputs)})")
        return np.asarray(outputs[name])

    @staticmethod
    def _rows(output: np.ndarray) -> tuple[np.ndarray, bool]:
        if output.ndim == 0 or output.size == 0:
            raise PostprocessError(f"an output of shape {list(output.shape)} holds no class scores")
        rows = output.reshape(1, -1) if output.ndim == 1 else output.reshape(output.shape[0], -1)
        if rows.shape[1] == 0:
            raise PostprocessError(f"an output of shape {list(output.shape)} holds no class scores")
        return rows.astype(np.float64), rows.shape[0] == 1

    def _topk(self, scores: np.ndarray) -> list[dict[str, Any]]:
        order = np.argsort(-scores, kind="stable")[: self.spec["k"]]
        labels = self.labels or []
        return [
            {"index": int(i), "label": labels[i] if i < len(labels) else None, "score": float(scores[i])}
            for i in order
        ]
