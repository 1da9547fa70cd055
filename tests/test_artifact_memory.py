"""Hostile archives cost no memory before the signature check: each one, fed to the real
``edgepack verify`` and ``edgepack-agent install`` subprocesses, is refused with one line on
stderr while the child's peak memory stays within 16 MB of its peak on a valid artifact of
about the same size (the 1 GiB PAX header used to cost 3.2 GB)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import cli
from tests.hostile_archives import (
    huge_gnu_longname,
    huge_pax_header,
    second_tar_appended,
    second_tar_in_stream,
    trailing_garbage,
    valid_artifact,
)

SLACK_KIB = 16 * 1024

# Runs one command in a fresh interpreter and reports the command's own peak RSS: the helper
# waits for a single child, so RUSAGE_CHILDREN's ru_maxrss is that child's peak (KiB on Linux).
_PEAK = (
    "import json, resource, subprocess, sys\n"
    "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, stdin=subprocess.DEVNULL)\n"
    "print(json.dumps({'rc': p.returncode, 'stdout': p.stdout, 'stderr': p.stderr,\n"
    "                  'peak_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n"
)


def _peak(*argv: str) -> dict:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", _PEAK, *argv], capture_output=True, text=True, timeout=300,
                          check=True, env=env)
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def files(tmp_path_factory, keypair) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("hostile")
    valid = valid_artifact(folder, keypair[0])
    return {
        "valid": valid,
        "pax_header_declaring_1gib": huge_pax_header(folder / "pax.edgepkg"),
        "gnu_longname_declaring_1gib": huge_gnu_longname(folder / "gnu.edgepkg"),
        "second_tar_in_the_same_stream": second_tar_in_stream(valid, folder / "stream2.edgepkg"),
        "second_tar_appended_after_the_stream": second_tar_appended(valid, folder / "appended.edgepkg"),
        "trailing_garbage": trailing_garbage(valid, folder / "garbage.edgepkg"),
    }


ATTACKS = ["pax_header_declaring_1gib", "gnu_longname_declaring_1gib", "second_tar_in_the_same_stream",
           "second_tar_appended_after_the_stream", "trailing_garbage"]


def _verify(path: Path, public: Path) -> dict:
    return _peak(cli("edgepack"), "verify", str(path), "--trust", str(public))


def _install(path: Path, public: Path, store: Path) -> dict:
    return _peak(cli("edgepack-agent"), "install", "--store", str(store), "--artifact", str(path),
                 "--trust", str(public))


@pytest.fixture(scope="module")
def baselines(files, keypair, tmp_path_factory) -> dict[str, int]:
    public = keypair[1]
    verified = _verify(files["valid"], public)
    assert verified["rc"] == 0, verified["stderr"]
    installed = _install(files["valid"], public, tmp_path_factory.mktemp("store") / "store")
    assert installed["rc"] == 0, installed["stderr"]
    return {"verify": verified["peak_kib"], "install": installed["peak_kib"]}


def _refused_in_one_line(result: dict) -> str:
    assert result["rc"] == 1, result
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result["stderr"], result["stderr"]
    return lines[0]


def test_hostile_files_are_about_the_size_of_the_valid_one(files):
    sizes = {name: path.stat().st_size for name, path in files.items()}
    assert max(sizes.values()) < 2 * min(sizes.values()), sizes


@pytest.mark.parametrize("attack", ATTACKS)
def test_edgepack_verify_refuses_hostile_archive_within_memory_bound(attack, files, keypair, baselines):
    result = _verify(files[attack], keypair[1])
    line = _refused_in_one_line(result)
    assert "evil.sh" not in result["stdout"] and "OK" not in result["stdout"], line
    assert result["peak_kib"] <= baselines["verify"] + SLACK_KIB, (attack, result["peak_kib"], baselines)


@pytest.mark.parametrize("attack", ATTACKS)
def test_agent_install_refuses_hostile_archive_within_memory_bound(attack, files, keypair, baselines, tmp_path):
    store = tmp_path / "store"
    result = _install(files[attack], keypair[1], store)
    _refused_in_one_line(result)
    assert result["peak_kib"] <= baselines["install"] + SLACK_KIB, (attack, result["peak_kib"], baselines)
    assert not (store / "state.json").exists()
    assert [p.name for p in (store / "models").iterdir()] == [], "nothing installed or left half-extracted"
    assert not list(store.rglob("evil.sh"))
