"""Detection matching for the task metrics: a build's boxes against the reference's.

Boxes are matched greedily by IoU within a class (:func:`match_detections`), and recall,
precision and the matched scores' shift summarise a set of images (:func:`detection_agreement`).
The YOLOv8 decoder is the device's own (:mod:`edgepack_core.postprocess`), so a build is judged
on the boxes its devices would answer. Pure numpy, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgepack_core.errors import PostprocessError
from edgepack_core.postprocess import box_iou, decode_yolo, select_detections
from sdk.errors import MetricInputError

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


# One sample's outputs (by name) -> its detections, one entry per image of the batch.
DetectionDecoder = Callable[[Mapping[str, np.ndarray]], list[Detections]]


def iou_matrix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Intersection over union of every box of ``a`` ``[n, 4]`` with every box of ``b`` ``[m, 4]``
    (NMS's :func:`~edgepack_core.postprocess.box_iou`, row by row)."""
    a, b = np.asarray(a, np.float64).reshape(-1, 4), np.asarray(b, np.float64).reshape(-1, 4)
    return np.array([box_iou(box, b) for box in a], np.float64).reshape(len(a), len(b))


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

    reference: int  # detections of the reference model, all images
    candidate: int
    matched: int
    mean_score_diff: float | None  # mean |score_ref - score_cand| over matched pairs
    score_diffs: tuple[float, ...] = ()  # each matched pair's |score_ref - score_cand|

    @property
    def recall(self) -> float:
        return self.matched / self.reference if self.reference else 1.0

    @property
    def precision(self) -> float:
        return self.matched / self.candidate if self.candidate else (1.0 if not self.reference else 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "reference_detections": self.reference,
            "candidate_detections": self.candidate,
            "matched": self.matched,
            "recall": round(self.recall, 6),
            "precision": round(self.precision, 6),
            "mean_score_diff": None if self.mean_score_diff is None else round(self.mean_score_diff, 6),
        }


def detection_agreement(ref: Sequence[Detections], cand: Sequence[Detections], iou: float = 0.5) -> DetectionAgreement:
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
    return DetectionAgreement(
        sum(len(r) for r in ref),
        sum(len(c) for c in cand),
        matched,
        float(np.mean(diffs)) if diffs else None,
        tuple(diffs),
    )


def decode_yolov8(
    output: np.ndarray, *, score_threshold: float = 0.25, iou_threshold: float = 0.45, max_detections: int = 300
) -> list[Detections]:
    """Detections of a YOLOv8-style head ``[batch, 4 + classes, anchors]`` (cx, cy, w, h then
    per-class scores) in the model's input pixels, decoded as the device decodes them
    (:func:`~edgepack_core.postprocess.decode_yolo`, :func:`~edgepack_core.postprocess.select_detections`).
    The metric's decoder for recipes whose postprocess is not ``kind: detection``; a recipe that
    declares one is decoded by the shared postprocessor with its own thresholds instead."""
    try:
        images = decode_yolo(output, "yolov8")
    except PostprocessError as err:
        raise MetricInputError(str(err)) from err
    found = []
    for boxes, scores, classes in images:
        kept = select_detections(
            boxes,
            scores,
            classes,
            score_threshold=score_threshold,
            iou_threshold=iou_threshold,
            max_detections=max_detections,
        )
        found.append(Detections.of(boxes[kept], scores[kept], classes[kept]))
    return found


def yolov8_decoder(output: str) -> DetectionDecoder:
    """The metric's own decoder of one sample: its ``output`` read as a YOLOv8 head."""

    def decode(sample: Mapping[str, np.ndarray]) -> list[Detections]:
        return decode_yolov8(sample[output])

    return decode
