"""Which YOLO format a detection output has, judged from its layout and value ranges (pure).

Why: a raw, undecoded grid (a YOLOX export without its decode step: grid offsets, log-space
sizes, objectness logits) declared as ``yolov5`` decodes into boxes that are not on the image,
without a word. A decoded head carries, per anchor, a box in input pixels (centres within half
an image of it, sizes >= 0 and at most twice the image) and scores in [0, 1]. A raw grid whose
log sizes happen to be >= 0 still shows: every centre lies within a few pixels of the image's
corner (grid offsets, not pixels). A ``yolox`` output is judged after its grid decode, so a raw
YOLOX grid declared ``yolov5`` names ``yolox``, and a decoded one declared ``yolox`` names
``yolov5``. Scores that are logits while no format fits are left to the scores check
(sdk/packager/probabilities.py), which names the missing Sigmoid."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgepack_core.manifest import TensorSpec
from edgepack_core.postprocess import yolox_grid
from edgepack_core.postprocess_spec import MAX_ANCHORS, MAX_REG_MAX, RAW_FORMATS, YOLOX_STRIDES, PostprocessSpec
from edgepack_core.preprocess_spec import PreprocessSpec
from edgepack_core.raw_heads import level_classes, level_problem

YOLO_FORMATS = ("yolov8", "yolov5", "yolox")
SIZE_SLACK = 0.5  # pixels: a decoded size below -0.5 is no rounding error
CORNER = 3.0  # pixels: a decoded head whose every centre is this close to (0, 0) holds grid offsets
CORNER_MIN_SIDE, CORNER_MIN_ROWS = 32, 8  # judged so only on images and heads this large
RAW_GRID_HINT = (
    "no format fits: it looks like a raw, undecoded grid; declare format: yolov5-raw or yolov8-raw with "
    "the head's level outputs (one per stride, before the Detect layer's decode), format: yolox with the "
    "strides of a YOLOX export, or decode it in the graph and declare the format it then has"
)


Grid = tuple[tuple[int, int], tuple[int, ...]]  # (input height and width, strides) of a yolox head


def head_rows(fmt: str, output: np.ndarray, grid: Grid | None = None) -> np.ndarray | None:
    """One row per anchor ``[cx, cy, w, h, scores...]`` of a ``yolov8`` (``[batch, 4 + classes,
    anchors]``), ``yolov5`` (``[batch, anchors, 5 + classes]``) or ``yolox`` output (yolov5's
    layout, decoded over ``grid``); None when the layout is not the format's (the decoder names
    that), or a yolox output's anchors are not its grid's cells."""
    array = np.asarray(output)
    array = array[None] if array.ndim == 2 else array
    if array.ndim != 3 or array.dtype.kind != "f":
        return None
    rows = array.transpose(0, 2, 1) if fmt == "yolov8" else array
    if rows.shape[-1] < (5 if fmt == "yolov8" else 6) or rows.shape[1] == 0:
        return None
    rows = rows.astype(np.float64)
    if fmt == "yolox":
        if grid is None:
            return None
        cells, steps = yolox_grid(*grid)
        if rows.shape[1] != cells.shape[0]:
            return None
        rows = rows.copy()
        rows[:, :, 2:4] = np.exp(np.minimum(rows[:, :, 2:4], 80.0)) * steps
        rows[:, :, 0:2] = (rows[:, :, 0:2] + cells) * steps
    return rows.reshape(-1, rows.shape[-1])


def yolox_input_size(preprocess: PreprocessSpec, model_input: TensorSpec | None) -> tuple[int, int] | None:
    """(height, width) a yolox head's grids cover: the image resize's size, else the fixed
    spatial dims of the input (NCHW, or NHWC for a layout of NHWC); None when neither says."""
    if preprocess.kind == "image" and preprocess.resize is not None:
        height, width = preprocess.resize.size
        return int(height), int(width)
    shape = list(model_input.shape) if model_input is not None else []
    if len(shape) != 4:
        return None
    spatial = shape[1:3] if preprocess.kind == "image" and preprocess.layout == "NHWC" else shape[2:4]
    if all(isinstance(d, int) and d > 0 for d in spatial):
        return int(spatial[0]), int(spatial[1])
    return None


def _span(values: np.ndarray) -> str:
    return f"[{float(np.min(values)):.4g}, {float(np.max(values)):.4g}]"


def _pixel_problem(rows: np.ndarray, image: tuple[int, int]) -> str | None:
    height, width = image
    extent = np.array([width, height], np.float64)
    centers, sizes = rows[:, 0:2], rows[:, 2:4]
    if np.any(centers < -extent / 2) or np.any(centers > 1.5 * extent):
        return f"box centres over {_span(centers)}, off the {width}x{height} input"
    cornered = min(height, width) >= CORNER_MIN_SIDE and len(rows) >= CORNER_MIN_ROWS
    if cornered and float(np.max(np.abs(centers))) <= CORNER:
        return (f"every box centre within {CORNER:g} pixels of the corner of the {width}x{height} input "
                f"({_span(centers)}: grid offsets, not pixels)")
    if np.any(sizes > 2 * extent):
        return f"box sizes up to {float(np.max(sizes)):.4g}, beyond the {width}x{height} input"
    return None


def rows_problem(rows: np.ndarray, image: tuple[int, int] | None, scores_too: bool = True) -> str | None:
    """Why ``rows`` are no decoded head (sizes >= 0, boxes in input pixels when ``image``
    (height, width) is known, scores in [0, 1] unless not ``scores_too``); None when they are one."""
    sizes, scores = rows[:, 2:4], rows[:, 4:]
    if np.any(sizes < -SIZE_SLACK):
        return f"box sizes down to {float(np.min(sizes)):.4g} (decoded sizes are >= 0; a raw grid's are log-space)"
    problem = _pixel_problem(rows, image) if image is not None else None
    if problem is None and scores_too and (np.any(scores < 0.0) or np.any(scores > 1.0)):
        problem = f"scores over {_span(scores)}, not in [0, 1] (objectness or class logits)"
    return problem


def _grid(image: tuple[int, int] | None, strides: Sequence[int]) -> Grid | None:
    return None if image is None else (image, tuple(strides))


def format_problem(
    fmt: str,
    outputs: Sequence[np.ndarray],
    image: tuple[int, int] | None,
    strides: Sequence[int] = YOLOX_STRIDES,
    scores_too: bool = True,
) -> str | None:
    """The first problem of ``outputs`` read as ``fmt``; None when they fit, or when the layout
    is not the format's (left to the decoder's message)."""
    for output in outputs:
        rows = head_rows(fmt, output, _grid(image, strides))
        problem = None if rows is None else rows_problem(rows, image, scores_too)
        if problem is not None:
            return problem
    return None


def _scores_off(fmt: str, outputs: Sequence[np.ndarray], grid: Grid | None) -> bool:
    rows = [head_rows(fmt, o, grid) for o in outputs]
    return any(r is not None and (np.any(r[:, 4:] < 0.0) or np.any(r[:, 4:] > 1.0)) for r in rows)


def fitting_formats(
    outputs: Sequence[np.ndarray], image: tuple[int, int] | None, strides: Sequence[int] = YOLOX_STRIDES
) -> list[str]:
    """The YOLO formats whose layout and value ranges ``outputs`` have."""
    grid = _grid(image, strides)
    return [
        fmt
        for fmt in YOLO_FORMATS
        if all(head_rows(fmt, o, grid) is not None for o in outputs)
        and format_problem(fmt, outputs, image, strides) is None
    ]


def declared_format_problem(
    fmt: str, outputs: Sequence[np.ndarray], image: tuple[int, int] | None, strides: Sequence[int] = YOLOX_STRIDES
) -> str | None:
    """One line refusing ``fmt`` for ``outputs``, naming the format that fits when one does;
    None when ``fmt`` fits (or is not a YOLO format). ``strides``: the yolox grid levels."""
    if fmt not in YOLO_FORMATS or not outputs:
        return None
    if fmt == "yolox" and image is not None and any(head_rows(fmt, o, _grid(image, strides)) is None for o in outputs):
        cells = yolox_grid(image, strides)[0].shape[0]
        return (f"shape {list(np.shape(outputs[0]))}, not [batch, {cells}, 5 + classes]: the {cells} cells of "
                f"strides {list(strides)} over the {image[1]}x{image[0]} input (set postprocess.strides)")
    problem = format_problem(fmt, outputs, image, strides)
    if problem is None:
        return None
    others = [f for f in fitting_formats(outputs, image, strides) if f != fmt]
    if not others and _scores_off(fmt, outputs, _grid(image, strides)):
        return None  # logits fitting no format: the scores check names the missing Sigmoid
    hint = f"the output fits format {others[0]}: declare format: {others[0]}" if others else RAW_GRID_HINT
    return f"{problem}; {hint}"


def undecoded_boxes(
    fmt: str, outputs: Sequence[np.ndarray], image: tuple[int, int] | None, strides: Sequence[int] = YOLOX_STRIDES
) -> str | None:
    """What shows that a head whose scores are logits is also undecoded (its boxes not in the
    pixels of an image input: a Detect layer's raw logits, YOLOv8's distribution bins), so a
    final Sigmoid alone would not make it the format; None when its boxes are decoded."""
    if fmt not in YOLO_FORMATS or image is None:
        return None
    return format_problem(fmt, outputs, image, strides, scores_too=False)


def _level_fit(fmt: str, post: PostprocessSpec, shapes: Sequence[Sequence[int]],
               image: tuple[int, int] | None) -> tuple[str, str] | None:
    return level_problem(fmt, shapes, strides=post.strides, anchors=post.anchors, reg_max=post.reg_max,
                         input_size=image)


def raw_levels_problem(post: PostprocessSpec, shapes: Sequence[Sequence[int]], image: tuple[int, int] | None,
                       declared: bool = True) -> tuple[str, str] | None:
    """(recipe key, why) refusing level outputs of ``shapes`` for ``post``'s raw format, naming
    the other raw format when the outputs fit it (``declared``); or, for a decoded ``yolov5`` /
    ``yolov8`` declaration (not ``declared``), the raw format whose per-level grids the model's
    outputs are (its own family's first). None when nothing is to be said."""
    if declared:
        problem = _level_fit(post.format, post, shapes, image)
        if problem is None:
            return None
        other = next(f for f in RAW_FORMATS if f != post.format)
        if _level_fit(other, post, shapes, image) is None:
            return "format", f"{problem[1]}; the outputs fit format {other}: declare format: {other}"
        return problem
    family = [f for f in RAW_FORMATS if f.startswith(post.format)]
    for fmt in family + [f for f in RAW_FORMATS if f not in family]:
        if _level_fit(fmt, post, shapes, image) is None:
            return "format", (f"a raw per-level grid, not a decoded {post.format} head: the outputs "
                              f"{[list(s) for s in shapes]} fit format {fmt}: declare format: {fmt}")
    return None


def _score_channels(post: PostprocessSpec, level: np.ndarray, index: int) -> np.ndarray:
    array = np.asarray(level, np.float64)
    if post.format == "yolov8-raw":
        return array[:, 4 * post.reg_max :]
    if array.ndim == 5:
        return array[..., 4:]
    count = len(post.anchors[index]) // 2
    return array.reshape(array.shape[0], count, -1, *array.shape[2:])[:, :, 4:]


def sigmoid_applied(post: PostprocessSpec, samples: Sequence[Sequence[np.ndarray]]) -> tuple[bool, tuple[float, float]]:
    """Whether a raw head's score channels (objectness and classes; YOLOv8's classes) all lie
    in [0, 1] over ``samples`` (each the level outputs of one sample): the graph's Sigmoid
    already ran. With their (least, greatest) value."""
    values = np.concatenate([_score_channels(post, level, i).ravel() for levels in samples
                             for i, level in enumerate(levels)])
    least, greatest = float(np.min(values)), float(np.max(values))
    return bool(least >= 0.0 and greatest <= 1.0), (least, greatest)


def labels_problem(post: PostprocessSpec, shape: Sequence[int], labels: int) -> tuple[str, str] | None:
    """(recipe key, why) when a raw level of ``shape`` read with ``post``'s anchors or reg_max
    holds another class count than the ``labels`` file lists, while another anchor count or
    reg_max reads exactly that many: the declared one splits the channels wrongly. None when the
    counts agree, or no other value explains the labels (a partial labels file is allowed)."""
    if post.format == "yolov5-raw":
        count = len(post.anchors[0]) // 2
        got = level_classes(post.format, shape, anchors=count)
        fits = [n for n in range(1, MAX_ANCHORS + 1) if level_classes(post.format, shape, anchors=n) == labels]
        key, what, declared = "anchors", "anchors per cell", count
    else:
        got = level_classes(post.format, shape, reg_max=post.reg_max)
        fits = [r for r in range(1, MAX_REG_MAX + 1) if level_classes(post.format, shape, reg_max=r) == labels]
        key, what, declared = "reg_max", "reg_max", post.reg_max
    if got == labels or not fits:
        return None
    return key, (f"{what} {declared} reads {got} classes from a level of shape {list(shape)}, but the labels file "
                 f"lists {labels}: {what} {fits[0]} reads exactly {labels}")
