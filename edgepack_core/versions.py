"""Artifact versions: semver-like, strictly ordered, and the no-downgrade rule."""

from __future__ import annotations

import re
from functools import total_ordering

from edgepack_core.errors import DowngradeError, UsageError

VERSION_PATTERN = r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?$"
_VERSION_RE = re.compile(VERSION_PATTERN)


@total_ordering
class Version:
    """MAJOR.MINOR.PATCH[-pre][+build], compared as semver 2.0 says (build metadata ignored)."""

    def __init__(self, text: str) -> None:
        match = _VERSION_RE.match(text)
        if not match:
            raise UsageError(f"version {text!r} is not MAJOR.MINOR.PATCH[-pre][+build]")
        self.text = text
        self.release = tuple(int(match.group(i)) for i in (1, 2, 3))
        self.pre: tuple[tuple[int, int | str], ...] = tuple(
            (0, int(p)) if p.isdigit() else (1, p) for p in (match.group(4) or "").split(".") if p
        )

    def _key(self) -> tuple[tuple[int, ...], int, tuple[tuple[int, int | str], ...]]:
        # A release sorts after its pre-releases: give it an empty, "high" pre-release marker.
        return (self.release, 1 if not self.pre else 0, self.pre)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Version) and self._key() == other._key()

    def __lt__(self, other: Version) -> bool:
        return self._key() < other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Version({self.text!r})"


def check_upgrade(candidate: str, installed: str | None, *, force: bool = False, artifact: str = "") -> None:
    """Refuse a candidate version older than or equal to the installed one unless forced.

    Equal is refused too: re-installing the same version under a different build would let
    two different models share one version number on a fleet.
    """
    if installed is None or force:
        return
    if Version(candidate) <= Version(installed):
        raise DowngradeError(candidate, installed, artifact=artifact)
