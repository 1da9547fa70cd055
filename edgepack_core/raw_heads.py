"""Raw YOLOv5 and YOLOv8 heads: one output per grid level, decoded here (numpy only).

Why: exports meant for NPU toolchains (and any export that stops before the Detect layer's
inference step) leave one output per stride level, undecoded. Read as a decoded ``yolov5`` or
``yolov8`` head they give boxes that are not on the image; this module decodes them exactly as
the Detect layers do, on the host (validation) and on a device alike.

- ``yolov5-raw``: per level ``[batch, na * (5 + C), H, W]`` (the convolution's output) or
  ``[batch, na, H, W, 5 + C]`` (the Detect layer's training-mode view), told apart by rank.
  After a sigmoid (unless the graph applied it): ``xy = (2 s - 0.5 + cell) * stride``,
  ``wh = (2 s)^2 * anchor``, score = objectness x class score.
- ``yolov8-raw``: per level ``[batch, 4 * reg_max + C, H, W]``: each box side a distribution
  over ``reg_max`` bins (softmax, expectation: a distance in cells; ``reg_max`` 1 is the
  distance itself), boxes ``(cell centre -/+ distance) * stride``; class scores after a sigmoid
  (unless the graph applied it), no objectness.

:func:`level_problem` is the shape check both the packager (naming the recipe key) and the
decoders (as :class:`PostprocessError`) use.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgepack_core.errors import PostprocessError

Decoded = tuple[np.ndarray, np.ndarray, np.ndarray]  # per image: boxes x1y1x2y2 [A, 4], best score, best class


def sigmoid(values: np.ndarray) -> np.ndarray:
    result: np.ndarray = 1.0 / (1.0 + np.exp(-np.clip(values, -80.0, 80.0)))
    return result


def _v5_width(shape: Sequence[int], anchors: int) -> int | None:
    """5 + classes of a yolov5-raw level of ``shape`` holding ``anchors`` per cell; None when
    the shape cannot hold them."""
    if len(shape) == 5:
        return int(shape[4]) if shape[1] == anchors and shape[4] >= 6 else None
    if len(shape) == 4 and shape[1] % anchors == 0 and shape[1] // anchors >= 6:
        return int(shape[1] // anchors)
    return None


def level_problem(
    fmt: str,
    shapes: Sequence[Sequence[int]],
    *,
    strides: Sequence[int],
    anchors: Sequence[Sequence[float]] = (),
    reg_max: int = 16,
    input_size: Sequence[int] | None = None,
) -> tuple[str, str] | None:
    """(recipe key, why) when level outputs of ``shapes`` are not a ``fmt`` head over
    ``strides`` (and ``input_size`` (height, width) when known); None when they are."""
    if len(shapes) != len(strides):
        return "strides", f"{len(shapes)} level outputs but strides has {len(strides)} levels {list(strides)}"
    widths = set()
    for index, shape in enumerate(shapes):
        problem = _one_level(fmt, list(shape), index, anchors, reg_max)
        if problem is not None:
            return problem
        widths.add(_v5_width(shape, len(anchors[index]) // 2) if fmt == "yolov5-raw" else int(shape[1]))
        grid = _grid_problem(list(shape), index, strides[index], input_size)
        if grid is not None:
            return "strides", grid
    if len(widths) > 1:
        return (
            "outputs",
            f"levels of {sorted(w or 0 for w in widths)} channels per anchor: every level holds the same classes",
        )
    return None


def _one_level(
    fmt: str, shape: list[int], index: int, anchors: Sequence[Sequence[float]], reg_max: int
) -> tuple[str, str] | None:
    if fmt == "yolov5-raw":
        count = len(anchors[index]) // 2
        if len(shape) not in (4, 5):
            return (
                "format",
                f"level {index} has shape {shape}, not [batch, anchors*(5+classes), H, W] or "
                "[batch, anchors, H, W, 5+classes]",
            )
        if _v5_width(shape, count) is None:
            return "anchors", (
                f"level {index} of shape {shape} does not hold {count} anchors of 5 + classes "
                f"each (anchors[{index}] lists {count})"
            )
        return None
    if len(shape) != 4:
        return "format", f"level {index} has shape {shape}, not [batch, 4*reg_max+classes, H, W]"
    if shape[1] <= 4 * reg_max:
        return "reg_max", (
            f"level {index} of shape {shape} has {shape[1]} channels: 4 x reg_max {reg_max} = "
            f"{4 * reg_max} box bins leave no class channel"
        )
    return None


def level_classes(fmt: str, shape: Sequence[int], anchors: int = 3, reg_max: int = 16) -> int | None:
    """The class count a level of ``shape`` holds read as ``fmt`` with ``anchors`` per cell
    (yolov5-raw) or ``reg_max`` bins a side (yolov8-raw); None when it cannot be read so."""
    if fmt == "yolov5-raw":
        width = _v5_width(shape, anchors)
        return None if width is None else width - 5
    return int(shape[1]) - 4 * reg_max if len(shape) == 4 and shape[1] > 4 * reg_max else None


def _grid_problem(shape: list[int], index: int, stride: int, input_size: Sequence[int] | None) -> str | None:
    """A level's H x W grid covers the input at its stride (floor or ceil of size / stride)."""
    if input_size is None:
        return None
    rows, cols = (shape[2], shape[3])
    height, width = int(input_size[0]), int(input_size[1])
    if (rows - 1) * stride < height < (rows + 1) * stride and (cols - 1) * stride < width < (cols + 1) * stride:
        return None
    return (
        f"level {index} is a {cols}x{rows} grid, but stride {stride} over the {width}x{height} input makes "
        f"{-(-width // stride)}x{-(-height // stride)} (set postprocess.strides, in the order of the outputs)"
    )


def _checked(
    fmt: str, levels: Sequence[np.ndarray], strides: Sequence[int], anchors: Sequence[Sequence[float]], reg_max: int
) -> list[np.ndarray]:
    arrays = [np.asarray(level, dtype=np.float64) for level in levels]
    problem = level_problem(fmt, [a.shape for a in arrays], strides=strides, anchors=anchors, reg_max=reg_max)
    if problem is not None:
        raise PostprocessError(f"a {fmt} head: {problem[1]} ({problem[0]})")
    return arrays


def _cells(rows: int, cols: int) -> np.ndarray:
    """[rows, cols, 2] of (col, row)."""
    col, row = np.meshgrid(np.arange(cols), np.arange(rows))
    return np.stack([col, row], axis=-1).astype(np.float64)


def _best(boxes: np.ndarray, class_scores: np.ndarray) -> list[Decoded]:
    decoded = []
    for image_boxes, scores in zip(boxes, class_scores, strict=True):
        best = np.argmax(scores, axis=1)
        decoded.append((image_boxes, scores[np.arange(len(best)), best], best))
    return decoded


def decode_yolov5_raw(
    levels: Sequence[np.ndarray], strides: Sequence[int], anchors: Sequence[Sequence[float]], apply_sigmoid: bool = True
) -> list[Decoded]:
    """Raw YOLOv5 level outputs -> per image (boxes x1y1x2y2 in input pixels, score, class)."""
    arrays = _checked("yolov5-raw", levels, strides, anchors, 16)
    boxes, scores = [], []
    for array, stride, sizes in zip(arrays, strides, anchors, strict=True):
        count = len(sizes) // 2
        if array.ndim == 4:  # [B, na*(5+C), H, W] -> [B, na, H, W, 5+C]
            batch, _, rows, cols = array.shape
            array = array.reshape(batch, count, -1, rows, cols).transpose(0, 1, 3, 4, 2)
        values = sigmoid(array) if apply_sigmoid else array
        cells = _cells(array.shape[2], array.shape[3])
        wh_anchor = np.asarray(sizes, dtype=np.float64).reshape(count, 1, 1, 2)
        xy = (values[..., 0:2] * 2.0 - 0.5 + cells) * stride
        wh = (values[..., 2:4] * 2.0) ** 2 * wh_anchor
        batch = array.shape[0]
        boxes.append(np.concatenate([xy - wh / 2, xy + wh / 2], axis=-1).reshape(batch, -1, 4))
        scores.append((values[..., 5:] * values[..., 4:5]).reshape(batch, -1, array.shape[-1] - 5))
    return _best(np.concatenate(boxes, axis=1), np.concatenate(scores, axis=1))


def _distances(bins: np.ndarray, reg_max: int) -> np.ndarray:
    """[B, 4 * reg_max, A] -> [B, 4, A]: each side's expected bin (the DFL decode)."""
    batch, _, anchors = bins.shape
    sides = bins.reshape(batch, 4, reg_max, anchors)
    if reg_max == 1:
        return sides[:, :, 0]
    shifted = np.exp(sides - sides.max(axis=2, keepdims=True))
    weights = shifted / shifted.sum(axis=2, keepdims=True)
    distances: np.ndarray = np.einsum("bsra,r->bsa", weights, np.arange(reg_max, dtype=np.float64))
    return distances


def decode_yolov8_raw(
    levels: Sequence[np.ndarray], strides: Sequence[int], reg_max: int = 16, apply_sigmoid: bool = True
) -> list[Decoded]:
    """Raw YOLOv8 level outputs -> per image (boxes x1y1x2y2 in input pixels, score, class)."""
    arrays = _checked("yolov8-raw", levels, strides, (), reg_max)
    boxes, scores = [], []
    for array, stride in zip(arrays, strides, strict=True):
        batch, channels, rows, cols = array.shape
        flat = array.reshape(batch, channels, rows * cols)
        distances = _distances(flat[:, : 4 * reg_max], reg_max).transpose(0, 2, 1)  # [B, A, 4]: l, t, r, b
        centres = _cells(rows, cols).reshape(-1, 2) + 0.5
        boxes.append(np.concatenate([centres - distances[..., 0:2], centres + distances[..., 2:4]], axis=-1) * stride)
        classes = flat[:, 4 * reg_max :].transpose(0, 2, 1)
        scores.append(sigmoid(classes) if apply_sigmoid else classes)
    return _best(np.concatenate(boxes, axis=1), np.concatenate(scores, axis=1))
