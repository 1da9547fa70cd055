"""Reproducible builds (issue 23 item 10): with ``SOURCE_DATE_EPOCH`` set, two ``edgepack build``
runs of one shipped recipe, data and key give byte-identical artifacts; without it the artifact
still records the real build time and timings."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml

from sdk.errors import RecipeError
from sdk.keys import write_keypair
from sdk.packager import reproducible
from tests.conftest import cli

REPO = Path(__file__).resolve().parent.parent
EPOCH = "1700000000"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits demo built from code, recipes/digits-int8.yaml beside it (static int8:
    calibration, the quantize search and its speed gate all run), and one signing key."""
    from tools.demos import build_all

    root = tmp_path_factory.mktemp("repro")
    build_all(root / "demo", ["digits"])
    (root / "recipes").mkdir()
    recipe = yaml.safe_load((REPO / "recipes" / "digits-int8.yaml").read_text())
    recipe["validate"]["samples"] = 64
    (root / "recipes" / "digits-int8.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    write_keypair(root / "key.pem", root / "key.pub")
    return root


def _build_run(root: Path, name: str, env: dict[str, str]) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """``edgepack build`` of the recipe as a subprocess, ``SOURCE_DATE_EPOCH`` only from ``env``."""
    clean = {k: v for k, v in os.environ.items() if k != "SOURCE_DATE_EPOCH"}
    clean["PYTHONPATH"] = os.pathsep.join([str(REPO), clean.get("PYTHONPATH", "")])
    out = root / "dist" / f"{name}.edgepkg"
    recipe, key = root / "recipes" / "digits-int8.yaml", root / "key.pem"
    args = ["build", str(recipe), "--key", str(key), "--output", str(out), "--allow-external-paths"]
    done = subprocess.run(
        [cli("edgepack"), *args], cwd=root, env={**clean, **env}, capture_output=True, text=True, timeout=600
    )
    return out, done


def _build(root: Path, name: str, env: dict[str, str]) -> Path:
    out, done = _build_run(root, name, env)
    assert done.returncode == 0, done.stderr
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _member(artifact: Path, suffix: str) -> dict:
    with tarfile.open(artifact) as tar:
        name = next(n for n in tar.getnames() if n.endswith(suffix))
        handle = tar.extractfile(name)
        assert handle is not None
        return json.loads(handle.read())


def test_two_builds_under_source_date_epoch_are_byte_identical(workspace: Path) -> None:
    first = _build(workspace, "first", {"SOURCE_DATE_EPOCH": EPOCH})
    second = _build(workspace, "second", {"SOURCE_DATE_EPOCH": EPOCH})
    assert _sha256(first) == _sha256(second)
    assert _member(first, "manifest.json")["created"].startswith("2023-11-14T22:13:20")


def test_without_source_date_epoch_the_artifact_records_real_times(workspace: Path) -> None:
    artifact = _build(workspace, "clock", {})
    assert not _member(artifact, "manifest.json")["created"].startswith("2023-11-14")
    report = _member(artifact, "report.json")
    assert any(v > 0 for v in report["timings_s"].values())


@pytest.mark.parametrize(
    ("raw", "epoch"),
    [("", None), ("0", 0), (" 1700000000 ", 1700000000), (str(reproducible.MAX_EPOCH), reproducible.MAX_EPOCH)],
)
def test_source_date_epoch_is_whole_seconds(raw, epoch):
    assert reproducible.source_date_epoch({"SOURCE_DATE_EPOCH": raw}) == epoch


@pytest.mark.parametrize("raw", ["-1", "1.5", "yesterday", str(reproducible.MAX_EPOCH + 1)])
def test_a_source_date_epoch_that_is_not_whole_seconds_is_refused(raw):
    with pytest.raises(RecipeError, match="SOURCE_DATE_EPOCH"):
        reproducible.source_date_epoch({"SOURCE_DATE_EPOCH": raw})


def test_created_is_the_epoch_when_set_and_the_clock_otherwise():
    now = datetime(2026, 11, 29, 4, 30, 12, 999, tzinfo=timezone.utc)
    assert reproducible.created(0, now) == "1970-01-01T00:00:00Z"
    assert reproducible.created(None, now) == "2026-11-29T04:30:12Z"


def test_the_report_without_clock_keeps_every_figure_but_the_clock():
    report = {
        "timings_s": {"quantize": 1.6},
        "passes": {
            "quantize": {
                "candidates": [
                    {
                        "latency_ms": 0.1,
                        "latency_int8_ms": 0.2,
                        "speedup": 0.66,
                        "speedup_interval": [0.6, 0.7],
                        "seconds": 0.1,
                        "speed_call": "faster",
                        "bytes": 9714,
                        "max_search_s": 600,
                    }
                ],
                "search_s": 0.1,
            }
        },
        "warnings": ["the int8 model is slower than fp32 on this machine (0.66x); 1.9x"],
    }
    assert reproducible.without_clock(report) == {
        "passes": {"quantize": {"candidates": [{"speed_call": "faster", "bytes": 9714, "max_search_s": 600}]}},
        "warnings": ["the int8 model is slower than fp32 on this machine (<clock>); <clock>"],
    }


def test_a_bad_source_date_epoch_stops_the_build_with_one_line(workspace: Path) -> None:
    out, done = _build_run(workspace, "bad", {"SOURCE_DATE_EPOCH": "2023-11-14"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "SOURCE_DATE_EPOCH" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not out.exists()
