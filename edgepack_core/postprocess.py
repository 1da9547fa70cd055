"""The declarative postprocessing spec: what ``predict`` reports as ``result``.

Runs identically on the host (validation, ``inspect``) and on a device, with numpy only.
Every decoder is a pure function of the output arrays (and, for detection, the geometry the
preprocessor applied), so each is tested against hand-computed references.

Kinds (one model output is read: ``output``, or the model's first output):

- ``raw``: no interpretation; the result is ``None`` and callers show the raw outputs.
- ``softmax``: class probabilities, ``list[float]`` for one sample, ``list[list[float]]``
  for a batch of several.
- ``topk``: the ``k`` best classes as ``[{"index", "label", "score"}]`` for one sample (a
  list of such lists for several), best first, ties broken by the lower index. ``score`` is
  the softmax probability, or the raw output value when ``apply_softmax`` is false (for
  models whose last layer already is a softmax: the packager resolves the default from the
  graph). ``label`` comes from the labels file, one label per line, line *i* naming class
  *i*; ``None`` when there is no label for the index.
- ``detection``: boxes after class-wise non-maximum suppression, as
  ``[{"box": [x1, y1, x2, y2], "score", "index", "label"}]`` best first (a list of such lists
  for a batch of several). ``format`` says how the model reports them:

  - ``yolov8``: one output ``[batch, 4 + classes, anchors]``: cx, cy, w, h in input pixels,
    then one (already sigmoid) score per class, no objectness;
  - ``yolov5``: one output ``[batch, anchors, 5 + classes]``: cx, cy, w, h, objectness,
    class scores; an anchor's score is objectness x class score;
  - ``yolox``: YOLOX's own ONNX export (``decode_in_inference`` off, its default): one output
    ``[batch, anchors, 5 + classes]`` whose anchors are the cells of one grid per stride
    (``strides``, default 8, 16, 32) over the ``input_size`` (height, width), each level row by
    row; per anchor grid offsets, log sizes, then objectness and class scores (already sigmoid).
    Decoded as YOLOX's demo_postprocess does, ``cx = (x + col) * stride``, ``w = exp(w) * stride``,
    then scored like ``yolov5``. A decoded YOLOX head is ``yolov5``;
  - ``boxes_scores``: the model already decodes: ``outputs.boxes`` ``[N, 4]`` (x1, y1, x2, y2
    in input pixels), ``outputs.scores`` ``[N]`` and optionally ``outputs.classes`` ``[N]``
    (class 0 without it), each with an optional leading batch axis;
  - ``yolov5-raw``, ``yolov8-raw``: one undecoded output per grid level (``outputs``, in the
    order of ``strides``), decoded as the Detect layers do (:mod:`edgepack_core.raw_heads`).

  Each anchor keeps its best class; candidates with ``score > score_threshold`` enter NMS,
  which per class keeps the best box and drops every box of that class whose IoU with a
  kept one is ``> iou_threshold``; the ``max_detections`` best survivors remain. With the
  preprocessing geometry (``scale_x``, ``scale_y``, ``pad_x``, ``pad_y``, ``original_size``)
  boxes are mapped back to the original image's pixels, ``x = (x_in - pad_x) / scale_x``,
  and clipped to ``[0, width] x [0, height]``; without it (tensor inputs) they stay in the
  model input's pixels.
- ``ctc``: greedy CTC decoding of ``[batch, T, classes]`` (``layout: NTC``, or ``TNC``;
  ``[T, classes]`` is one sample): per step the argmax class, repeats collapsed, the
  ``blank`` dropped. The result is ``{"text", "score"}`` (a list for a batch of several);
  ``score`` is the mean, over the kept steps, of each step's highest probability: of the
  output itself when ``apply_softmax`` is false (the graph ends in Softmax), of its softmax
  otherwise; 0.0 when nothing is kept (PaddleOCR's convention). The charset file has one
  symbol per line; the blank takes no line: with ``blank`` *b*, class *i < b* is line *i*
  and class *i > b* is line *i - 1*. PaddleOCR's recognizers (blank 0, ``ppocr_keys``
  lines for classes 1..N) and CRNNs with the blank last both fit. ``append_space: true``
  adds a space as the last symbol (PaddleOCR's ``use_space_char``).

The output tensor of ``softmax``/``topk`` is read as rows of class scores: a 1-D output is
one sample; otherwise the first axis is the batch and all other axes are flattened, so
``[1, 1000, 1, 1]`` classifier heads work as they are. Softmax is computed in float64 after
subtracting each row's maximum, so logits of any magnitude give finite probabilities.

``labels`` and ``charset`` in a recipe are paths next to the recipe; in a manifest the
artifact-relative paths (``assets/labels.txt``, ``assets/charset.txt``). This module never
opens them: the caller reads the text and passes :func:`load_labels` /
:func:`load_charset` of it, so the same code serves files on disk and archive members.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from edgepack_core.errors import PostprocessError
from edgepack_core.postprocess_spec import PostprocessSpec, parse_postprocess
from edgepack_core.raw_heads import decode_yolov5_raw, decode_yolov8_raw

__all__ = [
    "PostprocessSpec",
    "Postprocessor",
    "box_iou",
    "class_rows",
    "ctc_collapse",
    "ctc_greedy",
    "decode_boxes_scores",
    "decode_yolo",
    "decode_yolox",
    "load_charset",
    "load_labels",
    "nms",
    "select_detections",
    "softmax",
    "to_original",
    "top_k",
    "yolox_grid",
]

def load_labels(text: str) -> list[str]:
    """One label per line; line numbers are class indices, so blank lines inside are kept
    (as empty labels) and only trailing blank lines, a BOM and line-end whitespace are dropped."""
    lines = [line.rstrip() for line in text.removeprefix("\ufeff").splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def load_charset(text: str, *, append_space: bool = False) -> list[str]:
    """One symbol per line, kept exactly (a symbol may be a space) but for the line end and a
    BOM; a final empty line is the file's last newline, not a symbol."""
    symbols = text.removeprefix("\ufeff").split("\n")
    if symbols and symbols[-1] == "":
        symbols.pop()
    symbols = [s[:-1] if s.endswith("\r") else s for s in symbols]
    return [*symbols, " "] if append_space else symbols


def softmax(scores: np.ndarray, axis: int = -1) -> np.ndarray:
    """Numerically stable softmax in float64: subtracting the maximum keeps exp() finite."""
    values = np.asarray(scores, dtype=np.float64)
    shifted = values - np.max(values, axis=axis, keepdims=True)
    exps = np.exp(shifted)
    probabilities: np.ndarray = exps / np.sum(exps, axis=axis, keepdims=True)
    return probabilities


# ----------------------------------------------------------------------------- detection


def box_iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one x1y1x2y2 box with each of ``boxes``; 0 where the union is empty."""
    width = np.clip(np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0]), 0, None)
    height = np.clip(np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1]), 0, None)
    inter = width * height
    area = max(box[2] - box[0], 0) * max(box[3] - box[1], 0)
    areas = np.clip(boxes[:, 2] - boxes[:, 0], 0, None) * np.clip(boxes[:, 3] - boxes[:, 1], 0, None)
    union = area + areas - inter
    ious: np.ndarray = np.divide(inter, union, out=np.zeros_like(inter, dtype=np.float64), where=union > 0)
    return ious


def nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou_threshold: float,
        max_detections: int) -> np.ndarray:
    """Class-wise greedy NMS: indices of the kept boxes, best score first (ties: lower index).

    A box is dropped when its IoU with an already kept box of the same class is above
    ``iou_threshold``; boxes of different classes never suppress each other."""
    boxes = np.asarray(boxes, dtype=np.float64)
    order = np.argsort(-np.asarray(scores, dtype=np.float64), kind="stable")
    classes = np.asarray(classes)
    kept: list[int] = []
    while order.size and len(kept) < max_detections:
        best, rest = int(order[0]), order[1:]
        kept.append(best)
        same = classes[rest] == classes[best]
        overlap = box_iou(boxes[best], boxes[rest]) > iou_threshold
        order = rest[~(same & overlap)]
    return np.asarray(kept, dtype=np.int64)


def select_detections(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, *, score_threshold: float,
                      iou_threshold: float, max_detections: int) -> np.ndarray:
    """Indices of what one image reports: the candidates scoring above ``score_threshold``,
    through class-wise :func:`nms`, best first. The device's answer and the packager's
    detection metric both decode with this."""
    candidates = np.flatnonzero(np.asarray(scores) > score_threshold)
    kept: np.ndarray = candidates[nms(boxes[candidates], scores[candidates], classes[candidates], iou_threshold,
                                      max_detections)]
    return kept


def _xywh_to_xyxy(xywh: np.ndarray) -> np.ndarray:
    half = xywh[:, 2:4] / 2
    return np.concatenate([xywh[:, 0:2] - half, xywh[:, 0:2] + half], axis=1)


def decode_yolo(output: np.ndarray, fmt: str) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per image of the batch: (boxes x1y1x2y2 [A, 4], best score [A], best class [A])."""
    output = np.asarray(output, dtype=np.float64)
    shape = list(output.shape)  # as the model returned it, for the messages
    if output.ndim == 2:
        output = output[None]
    minimum = 5 if fmt == "yolov8" else 6
    if output.ndim != 3:
        raise PostprocessError(f"a {fmt} output must be [batch, ...] of rank 3, got shape {shape}")
    rows = output.transpose(0, 2, 1) if fmt == "yolov8" else output
    if rows.shape[2] < minimum:
        layout = "[batch, 4 + classes, anchors]" if fmt == "yolov8" else "[batch, anchors, 5 + classes]"
        raise PostprocessError(f"a {fmt} output is {layout}, got shape {shape}")
    decoded = []
    for image in rows:
        class_scores = image[:, 4:] if fmt == "yolov8" else image[:, 5:] * image[:, 4:5]
        best = np.argmax(class_scores, axis=1)
        decoded.append((_xywh_to_xyxy(image[:, :4]), class_scores[np.arange(len(best)), best], best))
    return decoded


def yolox_grid(input_size: Sequence[int], strides: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(cell [A, 2] as (col, row), stride [A, 1]) of every anchor of a YOLOX head over an input of
    ``input_size`` (height, width): one grid per stride, ``size // stride`` cells a side, row by
    row, the levels in order (YOLOX's demo_postprocess)."""
    height, width = int(input_size[0]), int(input_size[1])
    cells, steps = [], []
    for stride in strides:
        cols, rows = np.meshgrid(np.arange(width // stride), np.arange(height // stride))
        cells.append(np.stack([cols, rows], axis=-1).reshape(-1, 2))
        steps.append(np.full((cells[-1].shape[0], 1), stride))
    return np.concatenate(cells).astype(np.float64), np.concatenate(steps).astype(np.float64)


def decode_yolox(output: np.ndarray, strides: Sequence[int],
                 input_size: Sequence[int] | None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """A raw YOLOX grid ``[batch, anchors, 5 + classes]`` decoded into input pixels, then read as
    ``yolov5`` rows: per image (boxes x1y1x2y2, best score, best class)."""
    output = np.asarray(output, dtype=np.float64)
    shape = list(output.shape)
    output = output[None] if output.ndim == 2 else output
    if output.ndim != 3 or output.shape[2] < 6:
        raise PostprocessError(f"a yolox output is [batch, anchors, 5 + classes], got shape {shape}")
    if input_size is None:
        raise PostprocessError("format yolox needs input_size: [height, width] of the model input")
    cells, steps = yolox_grid(input_size, strides)
    if output.shape[1] != cells.shape[0]:
        raise PostprocessError(f"a yolox output over a {input_size[0]}x{input_size[1]} input with strides "
                               f"{list(strides)} has {cells.shape[0]} anchors, got shape {shape}")
    decoded = output.copy()
    decoded[:, :, 0:2] = (output[:, :, 0:2] + cells) * steps
    decoded[:, :, 2:4] = np.exp(np.minimum(output[:, :, 2:4], 80.0)) * steps  # exp(80) * stride: no overflow
    return decode_yolo(decoded, "yolov5")


def decode_boxes_scores(boxes: np.ndarray, scores: np.ndarray,
                        classes: np.ndarray | None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Already decoded outputs, with or without a leading batch axis, split per image."""
    boxes, scores = np.asarray(boxes, dtype=np.float64), np.asarray(scores, dtype=np.float64)
    if boxes.ndim == 2:
        boxes, scores = boxes[None], scores.reshape(1, -1)
        classes = None if classes is None else np.asarray(classes).reshape(1, -1)
    if boxes.ndim != 3 or boxes.shape[2] != 4:
        raise PostprocessError(f"boxes must be [N, 4] or [batch, N, 4], got shape {list(boxes.shape)}")
    if scores.shape != boxes.shape[:2]:
        raise PostprocessError(f"scores of shape {list(scores.shape)} do not match boxes {list(boxes.shape)}")
    labels = np.zeros(scores.shape, dtype=np.int64) if classes is None else np.asarray(classes)
    if labels.shape != scores.shape:
        raise PostprocessError(f"classes of shape {list(labels.shape)} do not match scores {list(scores.shape)}")
    return [(b, s, c.astype(np.int64)) for b, s, c in zip(boxes, scores, labels, strict=True)]


def to_original(boxes: np.ndarray, geometry: Mapping[str, Any] | None) -> np.ndarray:
    """Boxes in model-input pixels -> the original image's pixels, clipped to the image
    (the inverse of the preprocessor's resize; see :func:`edgepack_core.geometry.image_geometry`)."""
    if geometry is None:
        return boxes
    height, width = geometry["original_size"]
    mapped = np.empty_like(boxes, dtype=np.float64)
    mapped[:, 0::2] = (boxes[:, 0::2] - geometry["pad_x"]) / geometry["scale_x"]
    mapped[:, 1::2] = (boxes[:, 1::2] - geometry["pad_y"]) / geometry["scale_y"]
    mapped[:, 0::2] = np.clip(mapped[:, 0::2], 0, width)
    mapped[:, 1::2] = np.clip(mapped[:, 1::2], 0, height)
    return mapped


# ----------------------------------------------------------------------------- ctc


def ctc_greedy(steps: np.ndarray, blank: int, symbols: Sequence[str] | None, *,
               apply_softmax: bool) -> dict[str, Any]:
    """Greedy CTC decoding of one sample ``[T, classes]`` (see module docs for the charset rule)."""
    steps = np.asarray(steps, dtype=np.float64)
    if steps.ndim != 2 or steps.shape[1] == 0:
        raise PostprocessError(f"a ctc sample must be [steps, classes], got shape {list(steps.shape)}")
    if blank >= steps.shape[1]:
        raise PostprocessError(f"blank {blank} is not a class of an output with {steps.shape[1]} classes")
    if symbols is not None and len(symbols) != steps.shape[1] - 1:
        raise PostprocessError(f"the charset has {len(symbols)} symbols but the output has {steps.shape[1]} "
                               f"classes (the charset plus the blank: {len(symbols) + 1})")
    probabilities = softmax(steps, axis=1) if apply_softmax else steps
    best = np.argmax(probabilities, axis=1)
    keep = ctc_collapse(best, blank)
    kept = best[keep]
    text = "".join(_symbol(int(i), blank, symbols) for i in kept)
    score = float(np.mean(probabilities[keep, kept])) if kept.size else 0.0
    return {"text": text, "score": score}


def ctc_collapse(best: np.ndarray, blank: int) -> np.ndarray:
    """Which steps of a greedy CTC path ``best`` (one class index per step) are kept: not the
    blank and not a repeat of the step before. The shared rule of the device's ``ctc`` result
    and the packager's sequence metric."""
    best = np.asarray(best)
    keep: np.ndarray = best != blank
    keep[1:] &= best[1:] != best[:-1]
    return keep


def _symbol(index: int, blank: int, symbols: Sequence[str] | None) -> str:
    if symbols is None:  # no charset: the class index itself, so a result is never silently empty
        return f"[{index}]"
    return symbols[index if index < blank else index - 1]


# ----------------------------------------------------------------------------- classes


def class_rows(output: np.ndarray) -> np.ndarray:
    """An output as float64 rows of class scores: a 1-D output is one row; otherwise the first
    axis is the batch and every other axis is flattened (``[1, 1000, 1, 1]`` heads)."""
    output = np.asarray(output)
    if output.ndim == 0 or output.size == 0:
        raise PostprocessError(f"an output of shape {list(output.shape)} holds no class scores")
    rows = output.reshape(1, -1) if output.ndim == 1 else output.reshape(output.shape[0], -1)
    return rows.astype(np.float64)


def top_k(rows: np.ndarray, k: int) -> np.ndarray:
    """Per row, the indices of the ``k`` best scores, best first, ties to the lower index (a NaN
    ranks last). The device's ``topk`` result and the packager's top-1 metric both use it."""
    return np.argsort(-np.asarray(rows, dtype=np.float64), axis=1, kind="stable")[:, :k]


# ----------------------------------------------------------------------------- executor


class Postprocessor:
    """Turns the model's outputs into the ``result`` of a prediction (see module docs)."""

    def __init__(self, spec: PostprocessSpec | Mapping[str, Any] | None, labels: Sequence[str] | None = None,
                 charset: Sequence[str] | None = None) -> None:
        self.spec = parse_postprocess(spec)
        self.kind: str = self.spec.kind
        self.labels = list(labels) if labels is not None else None
        self.charset = list(charset) if charset is not None else None

    def __call__(self, outputs: Mapping[str, np.ndarray], geometry: Mapping[str, Any] | None = None) -> Any:
        """``geometry``: what the image preprocessing did (detection maps boxes back through it)."""
        if self.kind == "raw":
            return None
        if self.kind == "detection":
            return self._detection(outputs, geometry)
        if self.kind == "ctc":
            return self._ctc(self._select(outputs))
        rows = class_rows(self._select(outputs))
        single = rows.shape[0] == 1
        if self.kind == "softmax":
            probabilities = softmax(rows, axis=1).tolist()
            return probabilities[0] if single else probabilities
        scores = softmax(rows, axis=1) if self.spec.softmax else rows
        results = [self._topk(row) for row in scores]
        return results[0] if single else results

    def _select(self, outputs: Mapping[str, np.ndarray], name: str | None = None) -> np.ndarray:
        if not outputs:
            raise PostprocessError("the model returned no outputs")
        name = name or self.spec.output
        if name is None:
            return np.asarray(next(iter(outputs.values())))
        if name not in outputs:
            raise PostprocessError(f"no model output named {name!r} (outputs: {', '.join(outputs)})")
        return np.asarray(outputs[name])

    def _levels(self, outputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """A raw head's level outputs: those the spec names, else every output in order."""
        if self.spec.levels is None:
            return [np.asarray(value) for value in outputs.values()]
        return [self._select(outputs, name) for name in self.spec.levels]

    def _label(self, index: int) -> str | None:
        labels = self.labels or []
        return labels[index] if 0 <= index < len(labels) else None

    def _topk(self, scores: np.ndarray) -> list[dict[str, Any]]:
        order = top_k(scores[None], self.spec.k)[0]
        return [{"index": int(i), "label": self._label(int(i)), "score": float(scores[i])} for i in order]

    def _detection(self, outputs: Mapping[str, np.ndarray], geometry: Mapping[str, Any] | None) -> Any:
        results = [self._detections(*image, geometry) for image in self._decode(outputs)]
        return results[0] if len(results) == 1 else results

    def _decode(self, outputs: Mapping[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per image (boxes x1y1x2y2 in input pixels, best score, best class) of the format."""
        spec = self.spec
        sigmoid = spec.apply_sigmoid is not False
        if spec.outputs is not None:  # format boxes_scores
            names = spec.outputs
            classes = self._select(outputs, names.classes) if names.classes else None
            return decode_boxes_scores(self._select(outputs, names.boxes), self._select(outputs, names.scores),
                                       classes)
        if spec.format == "yolox":
            return decode_yolox(self._select(outputs), spec.strides, spec.input_size)
        if spec.format == "yolov5-raw":
            return decode_yolov5_raw(self._levels(outputs), spec.strides, spec.anchors, sigmoid)
        if spec.format == "yolov8-raw":
            return decode_yolov8_raw(self._levels(outputs), spec.strides, spec.reg_max, sigmoid)
        return decode_yolo(self._select(outputs), spec.format)

    def _detections(self, boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray,
                    geometry: Mapping[str, Any] | None) -> list[dict[str, Any]]:
        kept = select_detections(boxes, scores, classes, score_threshold=self.spec.score_threshold,
                                 iou_threshold=self.spec.iou_threshold, max_detections=self.spec.max_detections)
        mapped = to_original(boxes[kept], geometry)
        return [{"box": [float(v) for v in box], "score": float(scores[i]), "index": int(classes[i]),
                 "label": self._label(int(classes[i]))} for box, i in zip(mapped, kept, strict=True)]

    def _ctc(self, output: np.ndarray) -> Any:
        if output.ndim == 2:
            output = output[None] if self.spec.layout == "NTC" else output[:, None]
        if output.ndim != 3:
            raise PostprocessError(f"a ctc output must be [batch, steps, classes], got shape {list(output.shape)}")
        samples = output if self.spec.layout == "NTC" else output.transpose(1, 0, 2)
        results = [ctc_greedy(sample, self.spec.blank, self.charset, apply_softmax=self.spec.softmax)
                   for sample in samples]
        return results[0] if len(results) == 1 else results
