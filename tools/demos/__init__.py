"""Demo models and data built from code and from datasets that pip packages ship.

Nothing is downloaded. Every builder is deterministic (fixed seeds), so the same checkout
builds the same models. ``build_all`` is what ``tools/build_demos.py`` and the tests call.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tools.demos.digits import build_digits
from tools.demos.mobilenet import build_mobilenet
from tools.demos.tabular import build_tabular
from tools.demos.tiny import build_tiny

BUILDERS: dict[str, Callable[[Path], Path]] = {
    "mobilenet": build_mobilenet,
    "digits": build_digits,
    "tabular": build_tabular,
    "tiny": build_tiny,
}


def build_all(out_dir: Path, only: list[str] | None = None) -> dict[str, Path]:
    """Build the named demos (all by default) under ``out_dir/<name>/``; return model paths."""
    names = only or list(BUILDERS)
    unknown = sorted(set(names) - set(BUILDERS))
    if unknown:
        raise ValueError(f"unknown demo(s) {', '.join(unknown)}; known: {', '.join(BUILDERS)}")
    return {name: BUILDERS[name](Path(out_dir) / name) for name in names}
