"""The model store: verified installs, atomic switch, rollback, and kill -9 at every step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from device_agent.errors import SmokeTestError, StoreError
from device_agent.runtime import load_model
from device_agent.store import ModelStore
from edgepack_core import faults
from edgepack_core.artifact import read_extracted
from edgepack_core.errors import DowngradeError, IntegrityError
from edgepack_core.signing import TrustStore, load_public_key
from tests.artifacts import build_artifact, resign_with_changes, wrong_golden_outputs


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("artifacts")
    key = keypair[0]
    return {
        "v1": build_artifact(folder, key, version="1.0.0", factor=2.0),
        "v2": build_artifact(folder, key, version="1.1.0", factor=3.0),
        "v3": build_artifact(folder, key, version="1.2.0", factor=4.0),
        "nan": build_artifact(folder, key, version="2.0.0", nan=True),
    }


@pytest.fixture()
def trust(keypair):
    return TrustStore([load_public_key(keypair[1])])


def _smoke(model):
    load_model(model.directory, model.verified.manifest)


def test_install_activates_and_keeps_previous_for_rollback(tmp_path, artifacts, trust):
    store = ModelStore(tmp_path / "store", trust)
    store.install(artifacts["v1"], smoke_test=_smoke)
    store.install(artifacts["v2"], smoke_test=_smoke)
    assert store.active().version == "1.1.0" and store.previous().version == "1.0.0"
    store.install(artifacts["v3"], smoke_test=_smoke)
    assert [p.name for p in (tmp_path / "store" / "models").iterdir()].__len__() == 2, "older versions pruned"
    assert store.rollback().version == "1.1.0"
    assert store.active().version == "1.1.0" and store.previous().version == "1.2.0"


def test_downgrade_or_reinstall_is_refused_unless_forced(tmp_path, artifacts, trust):
    store = ModelStore(tmp_path / "store", trust)
    store.install(artifacts["v2"], smoke_test=_smoke)
    for older in ("v1", "v2"):
        with pytest.raises((DowngradeError, StoreError)):
            store.install(artifacts[older], smoke_test=_smoke)
    assert store.active().version == "1.1.0"
    store.install(artifacts["v1"], force=True, smoke_test=_smoke)
    assert store.active().version == "1.0.0"


def test_model_failing_its_smoke_test_is_not_activated(tmp_path, artifacts, trust, keypair):
    store = ModelStore(tmp_path / "store", trust)
    store.install(artifacts["v1"], smoke_test=_smoke)
    with pytest.raises(SmokeTestError, match="non-finite"):
        store.install(artifacts["nan"], smoke_test=_smoke)
    wrong = resign_with_changes(artifacts["v2"], tmp_path / "wrong.edgepkg", keypair[0],
                                replace=wrong_golden_outputs(artifacts["v2"]))
    with pytest.raises(SmokeTestError, match="differs from golden"):
        store.install(wrong, smoke_test=_smoke)
    assert store.active().version == "1.0.0"
    assert len(list((tmp_path / "store" / "models").iterdir())) == 1, "rejected models leave nothing behind"


def test_file_damaged_on_disk_falls_back_to_previous_at_recovery(tmp_path, artifacts, trust):
    store = ModelStore(tmp_path / "store", trust)
    store.install(artifacts["v1"], smoke_test=_smoke)
    active = store.install(artifacts["v2"], smoke_test=_smoke)
    (active.directory / "model" / "model.onnx").write_bytes(b"corrupted by a bad SD card")
    with pytest.raises(IntegrityError):
        store.active()
    recovered = store.recover()
    assert recovered is not None and recovered.version == "1.0.0"


_INSTALL_SCRIPT = """
import sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from device_agent.runtime import load_model
from device_agent.store import ModelStore
from edgepack_core.signing import TrustStore
store = ModelStore(Path({store!r}), TrustStore.from_paths([{pub!r}]))
store.install(Path({artifact!r}), smoke_test=lambda m: load_model(m.directory, m.verified.manifest))
print("installed", flush=True)
"""


@pytest.mark.parametrize("point", ["after-extract", "after-smoke", "before-switch", "after-switch"])
def test_power_cut_during_install_leaves_old_or_new_model_valid(tmp_path, artifacts, trust, keypair, point):
    """kill -9 of a real installing process at each step; after recovery exactly one valid model
    is active (the old one before the commit point, the new one after) and nothing half-done remains."""
    store_dir = tmp_path / "store"
    store = ModelStore(store_dir, trust)
    store.install(artifacts["v1"], smoke_test=_smoke)
    script = _INSTALL_SCRIPT.format(repo=str(Path(__file__).resolve().parent.parent), store=str(store_dir),
                                    pub=str(keypair[1]), artifact=str(artifacts["v2"]))
    proc = subprocess.run([sys.executable, "-c", script], env={**_env(), **faults.switch(point)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, f"expected SIGKILL at {point}: {proc.stderr}"
    recovered = ModelStore(store_dir, trust).recover()
    expected = "1.1.0" if point == "after-switch" else "1.0.0"
    assert recovered is not None and recovered.version == expected
    read_extracted(recovered.directory, trust)
    leftovers = [p.name for p in (store_dir / "models").iterdir() if p.name.startswith(".")]
    assert leftovers == []
    assert len(list((store_dir / "models").iterdir())) <= 2


def test_kill_9_at_random_moments_of_an_install_never_breaks_the_store(tmp_path, artifacts, trust, keypair):
    """External kill -9 after growing delays (not at chosen points): the store always recovers."""
    import time

    store_dir = tmp_path / "store"
    ModelStore(store_dir, trust).install(artifacts["v1"], smoke_test=_smoke)
    script = _INSTALL_SCRIPT.format(repo=str(Path(__file__).resolve().parent.parent), store=str(store_dir),
                                    pub=str(keypair[1]), artifact=str(artifacts["v2"]))
    seen = set()
    for delay in (0.05, 0.2, 0.4, 0.6, 0.9, 1.5):
        proc = subprocess.Popen([sys.executable, "-c", script], env=_env(), stdout=subprocess.PIPE)
        time.sleep(delay)
        proc.kill()
        proc.wait(10)
        recovered = ModelStore(store_dir, trust).recover()
        assert recovered is not None and recovered.version in ("1.0.0", "1.1.0")
        read_extracted(recovered.directory, trust)
        seen.add(recovered.version)
        if recovered.version == "1.1.0":
            ModelStore(store_dir, trust).rollback()
    assert "1.0.0" in seen


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != faults.ENV}
