"""`edgepack-agent rollback` (the offline command) proves the target serves before it commits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from device_agent.store import ModelStore
from edgepack_core.signing import TrustStore, load_public_key
from tests.artifacts import build_artifact, resign_with_changes, wrong_golden_outputs


def _rollback(store: Path, public: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "device_agent.cli", "rollback", "--store", str(store),
                           "--trust", str(public)], capture_output=True, text=True, timeout=120)


def test_offline_rollback_to_a_model_that_fails_its_smoke_test_leaves_state_alone(tmp_path, keypair):
    key, public = keypair
    good = build_artifact(tmp_path / "a", key, version="1.0.0", factor=2.0)
    broken = resign_with_changes(good, tmp_path / "broken.edgepkg", key, replace=wrong_golden_outputs(good))
    newer = build_artifact(tmp_path / "b", key, version="1.1.0", factor=3.0)
    store_dir = tmp_path / "store"
    store = ModelStore(store_dir, TrustStore([load_public_key(public)]))
    store.install(broken)  # installed without a smoke test: it verifies, but does not reproduce
    store.install(newer)
    state_before = (store_dir / "state.json").read_bytes()

    result = _rollback(store_dir, public)

    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "golden" in result.stderr or "smoke" in result.stderr
    assert (store_dir / "state.json").read_bytes() == state_before
    assert store.active().verified.manifest.version == "1.1.0"


def test_offline_rollback_to_a_good_model_commits(tmp_path, keypair):
    key, public = keypair
    store_dir = tmp_path / "store"
    store = ModelStore(store_dir, TrustStore([load_public_key(public)]))
    store.install(build_artifact(tmp_path / "a", key, version="1.0.0", factor=2.0))
    store.install(build_artifact(tmp_path / "b", key, version="1.1.0", factor=3.0))

    result = _rollback(store_dir, public)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "active: scale 1.0.0"
    state = json.loads((store_dir / "state.json").read_text())
    assert state["active"].startswith("scale-1.0.0")
