"""CI runs README's test command in two steps that together run each test once: the tests marked
slow (the conformance run, the 60 s broker outage, ...) apart from the rest (.ci/run)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LONG_TESTS = [
    ("tests.test_conformance", "test_edgepack_passes_what_bare_onnxruntime_passes"),
    ("tests.test_telemetry_reporter", "test_broker_outage_of_60_seconds_loses_no_telemetry"),
]


@pytest.mark.parametrize(("module", "name"), LONG_TESTS)
def test_the_long_tests_are_marked_slow(module, name):
    test = getattr(importlib.import_module(module), name)
    assert "slow" in {mark.name for mark in getattr(test, "pytestmark", [])}, f"{module}.{name} lost its slow mark"


def test_ci_runs_the_slow_tests_in_their_own_step_after_the_others():
    steps = [line.strip() for line in (REPO / ".ci" / "run").read_text(encoding="utf-8").splitlines()
             if line.strip().startswith("bash tools/test.sh")]
    assert steps == ["bash tools/test.sh --no-slow", "bash tools/test.sh --slow"]
    script = (REPO / "tools" / "test.sh").read_text(encoding="utf-8")
    assert '-m "not slow"' in script and "-m slow" in script


def test_the_test_command_type_checks_the_three_packages_before_the_tests():
    script = (REPO / "tools" / "test.sh").read_text(encoding="utf-8")
    assert "check() { .venv/bin/ruff check . && .venv/bin/python -m mypy edgepack_core device_agent sdk; }" in script
    runs = [line.strip() for line in script.splitlines() if "exec .venv/bin/python -m pytest" in line]
    assert len(runs) == 4 and sum(line.split(")")[1].strip().startswith("check &&") for line in runs) == 3, runs
