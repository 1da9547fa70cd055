"""A full disk is a health state, not a silent failure.

Below ``updates.min_free_bytes`` free on the store's filesystem the device cannot journal a
job, record a command id, download, stage or queue an event in its outbox, so it says so:
``/healthz`` answers ``degraded`` with the reason, and every command is answered ``failed: no
space ...`` from memory (the job event is published straight to the broker, nothing is
written). The rule (:func:`space_problem`) is pure; :func:`free_bytes` reads what the OS
grants an unprivileged writer (``f_bavail``, not the root-reserved ``f_bfree``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

DEFAULT_MIN_FREE_BYTES = 16 * 1024 * 1024


def space_problem(free: int, min_free: int) -> str:
    """Why ``free`` bytes are not enough ("" when at least ``min_free`` are free). Pure."""
    if free >= min_free:
        return ""
    return f"no space: {free} bytes free on the store's filesystem, under updates.min_free_bytes ({min_free})"


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged process may still write on the filesystem holding ``path``."""
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


class FreeSpace:
    """The store filesystem's free space against its floor, read anew on every question (one
    ``statvfs``: microseconds, and a disk fills and empties without telling anyone)."""

    def __init__(self, path: Path, min_free: int = DEFAULT_MIN_FREE_BYTES) -> None:
        self.path = Path(path)
        self.min_free = int(min_free)

    def problem(self) -> str:
        """ "" while there is room, else the reason (also when the filesystem cannot be read)."""
        try:
            return space_problem(free_bytes(self.path), self.min_free)
        except OSError as err:
            return f"no space: cannot read the free space of {self.path}: {err.strerror or err}"

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` adds: nothing while there is room; ``degraded`` and why when not."""
        problem = self.problem()
        return {"status": "degraded", "degraded": [problem]} if problem else {}
