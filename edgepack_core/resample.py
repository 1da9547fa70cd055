"""Pillow's antialiased resize of a box, its first pass split in stripes over the cores, to the bit.

Pillow resamples in two separable passes (``src/libImaging/Resample.c``): a horizontal pass
over the source rows the output needs, rounded to 8 bits, then a vertical pass over that (or,
from Pillow 13, the vertical pass first when the height shrinks by more than twice what the
width does). Each output pixel of a pass depends only on its own row (horizontal) or column
(vertical) and on filter weights computed from the pass's box and sizes alone. So the first
pass run on stripes of rows (horizontal) or columns (vertical) of the same source, with the
same box and sizes along its axis, computes the very same bytes; :func:`resample` runs it so
on a small thread pool (Pillow releases the GIL inside a pass), puts the stripes together and
runs the second pass on the caller's thread: the result equals one ``image.resize(size,
filter, box=box)`` to the bit (tests/test_resample.py: every filter, L and RGB, both pass
orders, 2 to 4 stripes).

What does *not* give the same bytes, and is not done: resizing stripes of the output with
sub-boxes of the box. Pillow takes the box as float32 and derives each pass's scale from it,
so a sub-box moves the filter centres by a rounding error, and a stripe's own pass order can
differ from the whole image's (measured: 55% of random bilinear geometries differ, by one
level). Measured and not kept: splitting the second pass as well (the column crops and a second
pool round trip cost what it saved) and splitting the resize of an image Pillow already holds
(a decoded JPEG: Pillow has no views, so each stripe needs a copy of its rows, 1.41 ms against
1.26 ms in one call).

The source is given as a function of a rectangle, so a caller holding a numpy frame builds
Pillow images of only the rows (or columns) each stripe reads, on the stripe's thread: the copy
into Pillow is split too. Nearest-neighbour (an affine transform in Pillow, not two passes)
and first passes too small to pay for the hand-off run in one call on the caller's thread.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

    from PIL import Image

Box = tuple[float, float, float, float]
# (left, top, right, bottom) in source pixels -> a Pillow image of exactly that part of the source.
Region = Callable[[int, int, int, int], "Image.Image"]
T = TypeVar("T")

# One thread per core, the caller's included, at most this many: the stripes of one resize are
# a few hundred microseconds each, and more threads than cores only queue.
MAX_THREADS = 4
# Below this many filter taps in the first pass a split costs more than it saves: a pool round
# trip, the stripes put together, and the GIL taken back between Pillow calls (~0.15 ms on the
# 2-core development machine, where a tap of an RGB pass costs ~2 ns).
MIN_SPLIT_TAPS = 300_000
# Pillow's filter supports at scale 1 (the filter reads support * max(1, scale) pixels each side).
FILTER_SUPPORT = {"nearest": 0.5, "bilinear": 1.0, "bicubic": 2.0, "area": 0.5}


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def horizontal_first(width: int, height: int, out_w: int, out_h: int, pillow_major: int) -> bool:
    """The order of Pillow's two passes for an image of ``width`` x ``height`` resized to
    ``out_w`` x ``out_h``: horizontal first always before Pillow 13; from 13 vertical first
    when the height shrinks and by more than twice what the width does. Pure."""
    if pillow_major < 13:
        return True
    return not (height - out_h > 0 and height - out_h > (width - out_w) * 2)


def pass_taps(box_size: float, out_size: int, interpolation: str) -> int:
    """Filter taps per output pixel of one pass (Pillow's ksize bound). Pure."""
    return 2 * math.ceil(FILTER_SUPPORT[interpolation] * max(1.0, box_size / out_size)) + 1


def first_pass_taps(box: Box, out_size: tuple[int, int], interpolation: str, *, horizontal: bool) -> int:
    """What a split shares out: the filter taps of the first pass over the source lines it
    reads (horizontal: box rows x output width x taps per pixel). Pure."""
    (out_w, out_h), (width, height) = out_size, (box[2] - box[0], box[3] - box[1])
    if horizontal:
        return math.ceil(height) * out_w * pass_taps(width, out_w, interpolation)
    return math.ceil(width) * out_h * pass_taps(height, out_h, interpolation)


def spans(start: int, stop: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut in at most ``parts`` contiguous, non-empty, nearly equal spans. Pure."""
    parts = max(1, min(parts, stop - start))
    edges = [start + (stop - start) * index // parts for index in range(parts + 1)]
    return list(itertools.pairwise(edges))


def reach(low: float, high: float, size: int, out_size: int, interpolation: str) -> tuple[int, int]:
    """The source pixels ``[first, last)`` a pass over ``[low, high)`` may read, generously
    (every tap Pillow's bounds can give, plus one), clamped to ``[0, size)``. Pure."""
    margin = FILTER_SUPPORT[interpolation] * max(1.0, (high - low) / out_size)
    return max(0, math.floor(low - margin) - 1), min(size, math.ceil(high + margin) + 1)


class _Pool:
    """The process's one bounded pool of stripe threads, created on first use (a tensor-only
    process never starts it) and forgotten in a forked child, whose copy has no threads."""

    _lock = threading.Lock()
    _executor: ThreadPoolExecutor | None = None

    @classmethod
    def threads(cls) -> int:
        return max(1, min(MAX_THREADS, usable_cores()))

    @classmethod
    def executor(cls) -> ThreadPoolExecutor:
        from concurrent.futures import ThreadPoolExecutor  # here: a process without images never needs it

        with cls._lock:
            if cls._executor is None:
                cls._executor = ThreadPoolExecutor(max_workers=cls.threads() - 1,
                                                   thread_name_prefix="edgepack-resample")
            return cls._executor

    @classmethod
    def forget(cls) -> None:
        cls._lock = threading.Lock()
        cls._executor = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_Pool.forget)


def run_split(calls: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``calls[1:]`` on the pool and ``calls[0]`` on this thread; returns their results in
    order. A call the pool has not started by the time this thread is done is taken back and
    run here, so a pool busy with other callers' stripes never makes this one wait for them."""
    if len(calls) == 1:
        return [calls[0]()]
    executor = _Pool.executor()
    futures: list[Future[T]] = [executor.submit(call) for call in calls[1:]]
    try:
        first = calls[0]()
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    rest = [call() if future.cancel() else future.result() for future, call in zip(futures, calls[1:], strict=True)]
    return [first, *rest]


def resample(region: Region, size: tuple[int, int], box: Box, out_size: tuple[int, int], interpolation: str, *,
             threads: int | None = None) -> np.ndarray:
    """``np.asarray(region(0, 0, *size).resize(out_size, filter, box=box))``, to the bit.

    ``size`` is the source's (width, height), ``out_size`` the result's (width, height). When
    the first pass is worth it (:func:`first_pass_taps` at least :data:`MIN_SPLIT_TAPS`), it
    runs in stripes over ``threads`` (default: one per usable core, at most
    :data:`MAX_THREADS`), each stripe's source built by ``region`` on the stripe's thread; the
    second pass, on the caller's thread, reads the stripes put together.
    """
    from PIL import Image, __version__

    width, height = size
    out_w, out_h = out_size
    threads = _Pool.threads() if threads is None else threads
    resampling = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
                  "bicubic": Image.Resampling.BICUBIC, "area": Image.Resampling.BOX}[interpolation]
    across = horizontal_first(width, height, out_w, out_h, int(__version__.split(".")[0]))
    if threads < 2 or interpolation == "nearest" or \
            first_pass_taps(box, out_size, interpolation, horizontal=across) < MIN_SPLIT_TAPS:
        image = region(0, 0, width, height)
        if image.size == (out_w, out_h) and box == (0.0, 0.0, float(width), float(height)):
            return np.asarray(image)
        return np.asarray(image.resize((out_w, out_h), resample=resampling, box=box))
    if across:  # horizontal pass on stripes of rows, then the vertical pass
        first, last = reach(box[1], box[3], height, out_h, interpolation)  # the rows the vertical pass reads
        stripes = spans(first, last, threads)

        def rows(top: int, bottom: int) -> Image.Image:
            return _horizontal_pass(region(0, top, width, bottom), box, out_w, resampling)

        parts = run_split([functools.partial(rows, top, bottom) for top, bottom in stripes])
        # The vertical pass's weights depend on the source height: it runs over the full height,
        # whose rows outside [first, last) nothing reads.
        middle = Image.new(parts[0].mode, (out_w, height))
        for (top, _), part in zip(stripes, parts, strict=True):
            middle.paste(part, (0, top))
        return np.asarray(_vertical_pass(middle, box, out_h, resampling))
    first, last = reach(box[0], box[2], width, out_w, interpolation)  # the columns the horizontal pass reads
    stripes = spans(first, last, threads)

    def columns(left: int, right: int) -> Image.Image:
        return _vertical_pass(region(left, 0, right, height), box, out_h, resampling)

    parts = run_split([functools.partial(columns, left, right) for left, right in stripes])
    middle = Image.new(parts[0].mode, (width, out_h))
    for (left, _), part in zip(stripes, parts, strict=True):
        middle.paste(part, (left, 0))
    return np.asarray(_horizontal_pass(middle, box, out_w, resampling))


def _horizontal_pass(image: Image.Image, box: Box, out_w: int, resampling: Any) -> Image.Image:
    """Pillow's horizontal pass alone (full height, and a vertical box of scale 1 from 0: no vertical pass)."""
    return image.resize((out_w, image.height), resample=resampling, box=(box[0], 0, box[2], image.height))


def _vertical_pass(image: Image.Image, box: Box, out_h: int, resampling: Any) -> Image.Image:
    """Pillow's vertical pass alone."""
    return image.resize((image.width, out_h), resample=resampling, box=(0, box[1], image.width, box[3]))
