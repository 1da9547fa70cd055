"""Test-only crash points: the one switch by which the crash-safety tests kill a real process at
an exact step, as a power cut, a segfault or the kernel's OOM killer would.

Product code marks a step with ``faults.point("after-switch")``; the switch is the environment
variable ``EDGEPACK_TEST_FAULT`` = ``POINT`` or ``POINT:SIGNAL`` (SIGKILL unless named), e.g.
``after-switch`` or ``ort-worker:SIGSEGV``. Unset, as it always is outside the tests, a point is
one dictionary lookup and does nothing. The points are listed in docs/architecture.md.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from edgepack_core.errors import UsageError

ENV = "EDGEPACK_TEST_FAULT"


@dataclass(frozen=True)
class Fault:
    """Where to die (``point``) and how (``signal``)."""

    point: str
    signal: signal.Signals


def parse(value: str) -> Fault:
    """``POINT`` or ``POINT:SIGNAL`` as a :class:`Fault`; :class:`UsageError` naming a bad part."""
    point, _, name = value.partition(":")
    if not point:
        raise UsageError(f"{ENV}={value!r}: no crash point named (POINT or POINT:SIGNAL)")
    try:
        return Fault(point, signal.Signals[name or "SIGKILL"])
    except KeyError as err:
        raise UsageError(f"{ENV}={value!r}: {name!r} is not a signal name (e.g. SIGKILL, SIGSEGV)") from err


def switch(point: str, signal_name: str = "SIGKILL") -> dict[str, str]:
    """The environment entry that arms ``point`` (for tests that start a process)."""
    return {ENV: f"{point}:{signal_name}"}


def point(name: str) -> None:
    """Die here with the switch's signal if the switch names this point; otherwise nothing."""
    value = os.environ.get(ENV)
    if value is None:
        return
    fault = parse(value)
    if fault.point == name:
        os.kill(os.getpid(), fault.signal)
