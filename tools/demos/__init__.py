"""Demo models and data built from code and from datasets that pip packages ship.

Nothing is downloaded. Every builder is deterministic (fixed seeds), so the same checkout
builds the same models. ``build_all`` is what ``tools/build_demos.py`` and the tests call;
``build_torch_demos`` builds the models trained with torch (an optional dependency).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

from tools.demos.cache import CachedDemo, fill_in_parallel
from tools.demos.digits import build_digits
from tools.demos.dynamic_dims import build_dynamic_dims
from tools.demos.lstm_vad import build_lstm_vad
from tools.demos.mobilenet import build_mobilenet
from tools.demos.ocr_ctc import build_ocr
from tools.demos.softmax_classifier import build_softmax_classifier
from tools.demos.tabular import build_tabular
from tools.demos.tiny import build_tiny
from tools.demos.yolo import build_yolo

BUILDERS: dict[str, Callable[[Path], Path]] = {
    "mobilenet": build_mobilenet,
    "digits": build_digits,
    "tabular": build_tabular,
    "tiny": build_tiny,
}

# Models trained and exported with torch (an optional dependency: the README's demo command
# does not install it). Each is cached by its builder's source (tools/demos/cache.py), so a
# checkout trains each once.
TORCH_BUILDERS: dict[str, CachedDemo] = {  # the longest to train first: they start first in parallel
    "ocr": build_ocr,                         # CTC text recognizer, [batch, 32, 11]
    "yolo": build_yolo,                       # YOLOv8-style detector, [batch, 4 + 3, 180] head
    "lstm_vad": build_lstm_vad,               # stateful LSTM: input, state [2, batch, 128], sr
    "points": build_dynamic_dims,             # exported with literal -1 dims
    "orientation": build_softmax_classifier,  # a classifier ending in Softmax
}


def torch_available() -> bool:
    """Whether the torch demos can be built here."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _build_named(builders: Mapping[str, Callable[[Path], Path]], out_dir: Path, only: list[str] | None,
                 what: str) -> dict[str, Path]:
    names = only or list(builders)
    unknown = sorted(set(names) - set(builders))
    if unknown:
        raise ValueError(f"unknown {what}(s) {', '.join(unknown)}; known: {', '.join(builders)}")
    return {name: builders[name](Path(out_dir) / name) for name in names}


def build_all(out_dir: Path, only: list[str] | None = None) -> dict[str, Path]:
    """Build the named demos (all by default) under ``out_dir/<name>/``; return model paths."""
    return _build_named(BUILDERS, out_dir, only, "demo")


def build_torch_demos(out_dir: Path, only: list[str] | None = None, *, workers: int | None = None
                      ) -> dict[str, Path]:
    """Build the named torch demos (all by default) under ``out_dir/<name>/``; torch must import.

    The ones the cache lacks train ``workers`` at a time (default: the CPU count, at most 4) in
    fresh processes, each single-threaded: on CI's two cores the five train in about half the
    time, with the same weights."""
    names = only or list(TORCH_BUILDERS)
    demos = [TORCH_BUILDERS[name] for name in names if name in TORCH_BUILDERS]
    fill_in_parallel(demos, workers if workers is not None else min(os.cpu_count() or 1, 4))
    return _build_named(TORCH_BUILDERS, out_dir, only, "torch demo")
