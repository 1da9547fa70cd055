"""Which YOLO format a detection output has, judged from its layout and value ranges (pure).

Why: a raw, undecoded grid (a YOLOX export without its decode step: grid offsets, log-space
sizes, objectness logits) declared as ``yolov5`` decodes into boxes that are not on the image,
without a word. A decoded head carries, per anchor, a box in input pixels (centres within half
an image of it, sizes >= 0 and at most twice the image) and scores in [0, 1]. Scores that are
logits while no format fits are left to the scores check (sdk/packager/probabilities.py), which
names the missing Sigmoid."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

YOLO_FORMATS = ("yolov8", "yolov5")
SIZE_SLACK = 0.5  # pixels: a decoded size below -0.5 is no rounding error
RAW_GRID_HINT = (
    "no format fits: it looks like a raw, undecoded grid; decode it in the graph (a YOLOX export "
    "with decode_in_inference=True, a YOLOv5/v8 export with its Detect layer) and declare the format it then has"
)


def head_rows(fmt: str, output: np.ndarray) -> np.ndarray | None:
    """One row per anchor ``[cx, cy, w, h, scores...]`` of a ``yolov8`` (``[batch, 4 + classes,
    anchors]``) or ``yolov5`` (``[batch, anchors, 5 + classes]``) output; None when the layout
    is not the format's (the decoder names that)."""
    array = np.asarray(output)
    array = array[None] if array.ndim == 2 else array
    if array.ndim != 3 or array.dtype.kind != "f":
        return None
    rows = array.transpose(0, 2, 1) if fmt == "yolov8" else array
    if rows.shape[-1] < (5 if fmt == "yolov8" else 6) or rows.shape[1] == 0:
        return None
    return rows.reshape(-1, rows.shape[-1]).astype(np.float64)


def _span(values: np.ndarray) -> str:
    return f"[{float(np.min(values)):.4g}, {float(np.max(values)):.4g}]"


def _pixel_problem(rows: np.ndarray, image: tuple[int, int]) -> str | None:
    height, width = image
    extent = np.array([width, height], np.float64)
    centers, sizes = rows[:, 0:2], rows[:, 2:4]
    if np.any(centers < -extent / 2) or np.any(centers > 1.5 * extent):
        return f"box centres over {_span(centers)}, off the {width}x{height} input"
    if np.any(sizes > 2 * extent):
        return f"box sizes up to {float(np.max(sizes)):.4g}, beyond the {width}x{height} input"
    return None


def rows_problem(rows: np.ndarray, image: tuple[int, int] | None) -> str | None:
    """Why ``rows`` are no decoded head (sizes >= 0, boxes in input pixels when ``image``
    (height, width) is known, scores in [0, 1]); None when they are one."""
    sizes, scores = rows[:, 2:4], rows[:, 4:]
    if np.any(sizes < -SIZE_SLACK):
        return f"box sizes down to {float(np.min(sizes)):.4g} (decoded sizes are >= 0; a raw grid's are log-space)"
    problem = _pixel_problem(rows, image) if image is not None else None
    if problem is None and (np.any(scores < 0.0) or np.any(scores > 1.0)):
        problem = f"scores over {_span(scores)}, not in [0, 1] (objectness or class logits)"
    return problem


def format_problem(fmt: str, outputs: Sequence[np.ndarray], image: tuple[int, int] | None) -> str | None:
    """The first problem of ``outputs`` read as ``fmt``; None when they fit, or when the layout
    is not the format's (left to the decoder's message)."""
    for output in outputs:
        rows = head_rows(fmt, output)
        problem = None if rows is None else rows_problem(rows, image)
        if problem is not None:
            return problem
    return None


def _scores_off(fmt: str, outputs: Sequence[np.ndarray]) -> bool:
    rows = [head_rows(fmt, o) for o in outputs]
    return any(r is not None and (np.any(r[:, 4:] < 0.0) or np.any(r[:, 4:] > 1.0)) for r in rows)


def fitting_formats(outputs: Sequence[np.ndarray], image: tuple[int, int] | None) -> list[str]:
    """The YOLO formats whose layout and value ranges ``outputs`` have."""
    return [
        fmt
        for fmt in YOLO_FORMATS
        if all(head_rows(fmt, o) is not None for o in outputs) and format_problem(fmt, outputs, image) is None
    ]


def declared_format_problem(fmt: str, outputs: Sequence[np.ndarray], image: tuple[int, int] | None) -> str | None:
    """One line refusing ``fmt`` for ``outputs``, naming the format that fits when one does;
    None when ``fmt`` fits (or is not a YOLO format)."""
    if fmt not in YOLO_FORMATS or not outputs:
        return None
    problem = format_problem(fmt, outputs, image)
    if problem is None:
        return None
    others = [f for f in fitting_formats(outputs, image) if f != fmt]
    if not others and _scores_off(fmt, outputs):
        return None  # logits fitting no format: the scores check names the missing Sigmoid
    hint = f"the output fits format {others[0]}: declare format: {others[0]}" if others else RAW_GRID_HINT
    return f"{problem}; {hint}"
