"""edgepack_core.faults: the one test-only switch behind every crash point in the product."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from edgepack_core import faults
from edgepack_core.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
PRODUCT = ("edgepack_core", "device_agent", "sdk")


def _die_at(point: str, switch: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    script = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
              f"from edgepack_core import faults\nfaults.point({point!r})\n")
    return subprocess.run([sys.executable, "-c", script], env=switch, capture_output=True, timeout=60)


@pytest.mark.parametrize(("value", "point", "sig"), [
    ("after-switch", "after-switch", signal.SIGKILL),
    ("ort-worker:SIGSEGV", "ort-worker", signal.SIGSEGV),
    ("fleet-recorded-wave-2:SIGABRT", "fleet-recorded-wave-2", signal.SIGABRT),
])
def test_the_switch_names_a_point_and_optionally_a_signal(value, point, sig):
    assert faults.parse(value) == faults.Fault(point, sig)


@pytest.mark.parametrize(("value", "named"), [("after-switch:SIGFOO", "'SIGFOO'"), (":SIGKILL", "no crash point")])
def test_a_bad_switch_is_refused_naming_the_bad_part(value, named):
    with pytest.raises(UsageError, match=re.escape(named)):
        faults.parse(value)


def test_an_armed_point_kills_the_process_with_the_named_signal():
    assert _die_at("after-switch", faults.switch("after-switch")).returncode == -signal.SIGKILL
    assert _die_at("ort-worker", faults.switch("ort-worker", "SIGSEGV")).returncode == -signal.SIGSEGV


def test_a_point_the_switch_does_not_name_does_nothing(monkeypatch):
    assert _die_at("before-switch", faults.switch("after-switch")).returncode == 0
    monkeypatch.delenv(faults.ENV, raising=False)
    faults.point("after-switch")  # unset: returns


def test_no_product_module_has_a_crash_hook_of_its_own():
    """Every test-only kill goes through faults.point: no other module reads an EDGEPACK_TEST or
    crash variable or signals its own process."""
    own_kill = re.compile(r"os\.kill\(os\.getpid\(\)|EDGEPACK_(TEST|SIMULATE)|CRASH")
    found = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
             for package in PRODUCT for path in sorted((REPO / package).rglob("*.py"))
             if path.name != "faults.py"
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
             if own_kill.search(line)]
    assert found == []
