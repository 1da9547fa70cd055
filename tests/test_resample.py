"""Pillow's resize split in stripes over threads (edgepack_core/resample.py): the same bytes as
one ``Image.resize`` call, whatever the filter, color mode, pass order or stripe count."""

from __future__ import annotations

import os
import signal
import threading

import numpy as np
import pytest
from PIL import Image, __version__

from edgepack_core import resample
from edgepack_core.resample import horizontal_first, run_split, spans

PILLOW_MAJOR = int(__version__.split(".")[0])
FILTERS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
           "area": Image.Resampling.BOX, "nearest": Image.Resampling.NEAREST}


def _geometries(count: int, seed: int):
    """Random sources, boxes (fractional, whole-image, upscaling and downscaling) and sizes."""
    rng = np.random.default_rng(seed)
    for index in range(count):
        height, width = (int(v) for v in rng.integers(4, 300, 2))
        out_w, out_h = (int(v) for v in rng.integers(1, 200, 2))
        x0, y0 = rng.uniform(0, width / 3), rng.uniform(0, height / 3)
        box = (float(x0), float(y0), float(rng.uniform(x0 + 0.5, width)), float(rng.uniform(y0 + 0.5, height)))
        if index % 7 == 0:
            box = (0.0, 0.0, float(width), float(height))
        yield rng, (height, width), box, (out_w, out_h)


@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("interpolation", list(FILTERS))
def test_a_split_resize_is_one_resize_to_the_bit(monkeypatch, interpolation: str, mode: str) -> None:
    """60 random geometries per filter and mode, 2 to 4 stripes, sources built per stripe from
    a numpy array (as the raw-frame path does): every byte equal to one Image.resize. Both of
    Pillow 13's pass orders occur, and every smooth filter's resize really is split."""
    monkeypatch.setattr(resample, "MIN_SPLIT_TAPS", 0)
    orders, split = set(), 0
    for rng, (height, width), box, (out_w, out_h) in _geometries(60, seed=len(mode) * 10 + len(interpolation)):
        array = rng.integers(0, 256, (height, width, 3) if mode == "RGB" else (height, width), dtype=np.uint8)
        calls = []

        def region(left: int, top: int, right: int, bottom: int, array=array, calls=calls) -> Image.Image:
            calls.append((left, top, right, bottom))
            return Image.fromarray(np.ascontiguousarray(array[top:bottom, left:right]))

        got = resample.resample(region, (width, height), box, (out_w, out_h), interpolation,
                                threads=int(rng.integers(2, 5)))
        want = np.asarray(Image.fromarray(array).resize((out_w, out_h), FILTERS[interpolation], box=box))
        np.testing.assert_array_equal(got, want)
        orders.add(horizontal_first(width, height, out_w, out_h, PILLOW_MAJOR))
        split += len(calls) > 1
    if interpolation == "nearest":
        assert split == 0  # an affine transform in Pillow, not two passes: one call
    else:
        assert split >= 50  # all but the few whose box rows or columns are too few for two stripes
        assert orders == ({True, False} if PILLOW_MAJOR >= 13 else {True})


def test_a_pillow_image_cropped_per_stripe_gives_the_same_bytes(monkeypatch) -> None:
    """The same with the source an already decoded image, each stripe a crop of it."""
    monkeypatch.setattr(resample, "MIN_SPLIT_TAPS", 0)
    for rng, (height, width), box, (out_w, out_h) in _geometries(30, seed=99):
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        got = resample.resample(lambda *r, image=image: image.crop(r), image.size, box, (out_w, out_h), "bicubic",
                                threads=3)
        np.testing.assert_array_equal(got, np.asarray(image.resize((out_w, out_h), FILTERS["bicubic"], box=box)))


def test_below_the_split_threshold_the_source_is_built_once() -> None:
    calls = []
    image = Image.new("RGB", (40, 30), (10, 20, 30))

    def region(*rect: int) -> Image.Image:
        calls.append(rect)
        return image

    out = resample.resample(region, (40, 30), (0.0, 0.0, 40.0, 30.0), (20, 15), "bilinear", threads=4)
    assert calls == [(0, 0, 40, 30)] and out.shape == (15, 20, 3) and (out == (10, 20, 30)).all()
    assert resample.first_pass_taps((0.0, 0.0, 40.0, 30.0), (20, 15), "bilinear", horizontal=True) == 30 * 20 * 5


def test_pillow_pass_order_rule_at_its_boundary() -> None:
    """Pillow 13: vertical first only when the height shrinks, by more than twice the width's
    shrink; before 13 always horizontal first."""
    assert horizontal_first(100, 221, 90, 200, 13) is False   # 21 > 2 * 10
    assert horizontal_first(100, 220, 90, 200, 13) is True    # 20 = 2 * 10
    assert horizontal_first(100, 50, 90, 60, 13) is True      # the height grows
    assert horizontal_first(100, 221, 90, 200, 12) is True


def test_spans_tile_their_range() -> None:
    assert spans(10, 20, 3) == [(10, 13), (13, 16), (16, 20)]
    assert spans(0, 2, 4) == [(0, 1), (1, 2)]  # never an empty stripe
    assert spans(5, 6, 1) == [(5, 6)]


def test_a_busy_pool_never_makes_the_caller_wait() -> None:
    """Attack: another caller's work (here a call that blocks) holds every pool thread. The
    caller takes its queued stripes back and runs them itself, in order."""
    executor = resample._Pool.executor()
    release = threading.Event()
    blockers = [executor.submit(release.wait) for _ in range(resample._Pool.threads())]
    try:
        me = threading.get_ident()
        results = run_split([lambda i=i: (i, threading.get_ident()) for i in range(4)])
        assert results == [(i, me) for i in range(4)]
    finally:
        release.set()
        for blocker in blockers:
            blocker.result(timeout=10)


def test_a_stripe_error_reaches_the_caller() -> None:
    def fail() -> None:
        raise ValueError("stripe failed")

    with pytest.raises(ValueError, match="stripe failed"):
        run_split([lambda: 1, fail])
    with pytest.raises(ValueError, match="stripe failed"):
        run_split([fail, lambda: 1])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX")
def test_a_forked_child_gets_a_pool_of_its_own(monkeypatch) -> None:
    """A child forked after the pool started (its copy of the pool has no threads) gets a new
    pool: its second stripe runs on another thread while its first waits for it; and it
    resamples to the same bytes."""
    monkeypatch.setattr(resample, "MIN_SPLIT_TAPS", 0)
    assert run_split([lambda: 1, lambda: 2]) == [1, 2]  # the parent's pool exists
    image = Image.linear_gradient("L").resize((300, 200))
    box = (3.5, 2.0, 290.0, 199.0)
    want = np.asarray(image.resize((50, 40), FILTERS["bilinear"], box=box))
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's exit status is the assertion
        signal.alarm(20)
        started = threading.Event()
        waited, other = run_split([lambda: started.wait(10), lambda: (started.set(), threading.get_ident())[1]])
        got = resample.resample(lambda *r: image.crop(r), image.size, box, (50, 40), "bilinear", threads=2)
        os._exit(0 if waited and other != threading.get_ident() and np.array_equal(got, want) else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
