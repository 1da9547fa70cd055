"""Warm-up before the swap, the engine cache's life, and what /healthz and the fleet are told.

``load_model`` runs the golden samples on the one session it keeps (the smoke test is the
warm-up), so TensorRT's engine is built during activation and the daemon swaps in a model that
is ready. A Jetson's onnxruntime is faked at its boundary (``tests/fake_ort.py``: the providers
it reports, what it registers and says); the model, the artifacts, the store and the daemon are
real."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from device_agent.errors import SmokeTestError
from device_agent.providers import CUDA, TENSORRT, cache_key, this_device
from device_agent.runtime import InferenceService, load_model
from device_agent.store import ModelStore
from device_agent.telemetry.reporter import AgentStatus, state_document
from edgepack_core.artifact import extract_artifact
from edgepack_core.protocol.payloads import validate_payload
from edgepack_core.signing import TrustStore
from edgepack_core.targets import CPU
from tests.artifacts import build_artifact, resign_with_changes, wrong_golden_outputs
from tests.fake_ort import FakeGpuOrt


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("warmup")
    built = {version: build_artifact(folder, keypair[0], version=version) for version in ("1.0.0", "1.1.0", "1.2.0")}
    built["no-golden"] = resign_with_changes(built["1.0.0"], folder / "no-golden.edgepkg", keypair[0],
                                             manifest_changes={"golden": {"samples": []}})
    good = build_artifact(folder, keypair[0], version="1.3.0", factor=4.0)
    built["bad-golden"] = resign_with_changes(good, folder / "bad-golden.edgepkg", keypair[0],
                                              replace=wrong_golden_outputs(good))
    return built


@pytest.fixture
def trust(keypair):
    return TrustStore.from_paths([str(keypair[1])])


@pytest.fixture
def jetson_build(monkeypatch):
    """onnxruntime-gpu for Jetson as it reports itself (the real build here has no GPU)."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: [TENSORRT, CUDA, CPU])


def extracted(artifact: Path, tmp_path: Path, trust: TrustStore):
    return extract_artifact(artifact, tmp_path / "x", trust)


def golden_count(verified) -> int:
    return len(verified.manifest.golden["samples"])


def test_golden_samples_run_on_the_one_session_before_load_returns(artifacts, tmp_path, trust):
    verified = extracted(artifacts["1.0.0"], tmp_path, trust)
    fake = FakeGpuOrt()
    model = load_model(verified.root, verified.manifest, factory=fake)
    assert len(fake.sessions) == 1 and model.session is fake.sessions[0]  # no second session
    assert fake.sessions[0].runs == golden_count(verified) >= 1
    assert model.smoke.samples == golden_count(verified) and model.warmup_s > 0
    assert model.cache_dir is None  # the CPU provider compiles nothing to keep
    described = model.describe()
    assert described["provider"] == CPU and described["provider_fallbacks"] == []
    assert described["session_providers"] == [CPU] and described["warmup_ms"] > 0


def test_tensorrt_engine_is_built_during_activation_not_by_the_first_request(artifacts, tmp_path, trust,
                                                                             jetson_build):
    store = ModelStore(tmp_path / "store", trust)
    fake = FakeGpuOrt()
    loaded = []
    installed = store.install(artifacts["1.0.0"], smoke_test=lambda m: loaded.append(
        load_model(m.directory, m.verified.manifest, profile="jetson", factory=fake)))
    model = loaded[0]
    assert model.provider == TENSORRT and model.session_providers == (TENSORRT, CUDA, CPU)
    assert fake.events[:2] == [("session", id(model.session)), ("engine built", id(model.session))]
    built = len([e for e in fake.events if e[0] == "engine built"])
    InferenceService(model).predict_tensors({"x": np.ones((1, 4), np.float32)})
    assert len([e for e in fake.events if e[0] == "engine built"]) == built == 1  # the live request built nothing
    engine_dir = fake.calls[0][0][1]["trt_engine_cache_path"]
    assert model.cache_dir is not None and engine_dir == str(model.cache_dir / "tensorrt")
    assert model.cache_dir.parent == tmp_path / "store" / "cache" / installed.key
    assert model.cache_dir.name == cache_key(installed.verified.manifest.model_sha256, ort.__version__, this_device())
    assert model.cache_dir.name.startswith(installed.verified.manifest.model_sha256[:16] + f"-ort{ort.__version__}-")
    assert model.cache_dir.is_dir()


def test_tensorrt_outside_the_golden_tolerances_falls_back_to_cuda_and_says_why(artifacts, tmp_path, trust,
                                                                                jetson_build):
    verified = extracted(artifacts["1.0.0"], tmp_path, trust)
    model = load_model(verified.root, verified.manifest, profile="jetson", factory=FakeGpuOrt(distort={TENSORRT: 1.01}))
    assert model.provider == CUDA
    (provider, reason), = model.fallbacks
    assert provider == TENSORRT and reason.startswith("its outputs missed the golden samples: output y differs")
    assert model.describe()["provider_fallbacks"] == [{"provider": TENSORRT, "reason": reason}]


def test_the_issues_cuda_only_box_runs_on_cuda_not_cpu(artifacts, tmp_path, trust, jetson_build):
    verified = extracted(artifacts["1.0.0"], tmp_path, trust)
    model = load_model(verified.root, verified.manifest, profile="jetson", factory=FakeGpuOrt(missing={TENSORRT}))
    assert model.provider == CUDA
    assert "libnvinfer.so.10: cannot open shared object file" in dict(model.fallbacks)[TENSORRT]
    # Outside a store (predict's temporary directory) the cache stays beside the model, inside
    # the folder that is removed with it, never in the folder above.
    assert model.cache_dir.parent == tmp_path / "cache" / verified.root.name


def test_without_golden_samples_an_accelerator_warms_up_on_zeros_and_the_cpu_does_not(artifacts, tmp_path, trust,
                                                                                     monkeypatch):
    verified = extracted(artifacts["no-golden"], tmp_path, trust)
    cpu = FakeGpuOrt()
    model = load_model(verified.root, verified.manifest, factory=cpu)
    assert model.provider == CPU and cpu.sessions[0].runs == 0 and model.smoke is None  # cold start pays nothing
    monkeypatch.setattr(ort, "get_available_providers", lambda: [TENSORRT, CUDA, CPU])
    gpu = FakeGpuOrt()
    model = load_model(verified.root, verified.manifest, profile="jetson", factory=gpu)
    assert model.provider == TENSORRT and gpu.sessions[0].runs == 1 and gpu.sessions[0].engine_built


def test_the_daemon_swaps_a_model_in_only_after_its_warm_up(artifacts, tmp_path, keypair, jetson_build):
    from device_agent.config import check_config
    from device_agent.daemon import Daemon

    fake = FakeGpuOrt()

    class JetsonDaemon(Daemon):
        def load(self, installed):
            return load_model(installed.directory, installed.verified.manifest, profile=self.config.profile,
                              factory=fake)

    config = check_config({"device_id": "d", "store": "store", "trust": [str(keypair[1])], "profile": "jetson",
                           "artifact": str(artifacts["1.0.0"]), "api": {"enabled": False}}, tmp_path / "agent.yaml")
    daemon = JetsonDaemon(config)
    swap = daemon.service.swap
    daemon.service.swap = lambda model: (fake.events.append(("swap", id(model.session))), swap(model))[1]
    daemon.start()  # first install
    daemon.install_artifact(artifacts["1.1.0"])  # an update
    daemon.stop()
    swaps = [index for index, event in enumerate(fake.events) if event[0] == "swap"]
    assert len(swaps) == 2
    for index in swaps:
        session = fake.events[index][1]
        assert fake.events.index(("engine built", session)) < index  # built before it served
    assert daemon.status().provider_fallbacks == []
    assert daemon.status().provider == TENSORRT


def test_the_engine_cache_goes_with_its_model(artifacts, tmp_path, trust, jetson_build):
    store = ModelStore(tmp_path / "store", trust)
    fake = FakeGpuOrt()

    def install(artifact: Path):
        def load(m):
            loaded = load_model(m.directory, m.verified.manifest, profile="jetson", factory=fake)
            (loaded.cache_dir / "tensorrt").mkdir(exist_ok=True)
            (loaded.cache_dir / "tensorrt" / "model.engine").write_bytes(b"engine")  # what TensorRT writes
        return store.install(artifact, smoke_test=load)

    first = install(artifacts["1.0.0"])
    second = install(artifacts["1.1.0"])
    caches = store.root / "cache"
    assert {p.name for p in caches.iterdir()} == {first.key, second.key}
    (caches / "scale-0.9.0-000000000000").mkdir()  # left by a crash: no model refers to it
    third = install(artifacts["1.2.0"])  # pruning removes 1.0.0 (neither active nor previous)
    assert {p.name for p in caches.iterdir()} == {second.key, third.key}
    assert not (store.models / first.key).exists()
    with pytest.raises(SmokeTestError, match=r"smoke test of scale 1\.3\.0 failed"):
        install(artifacts["bad-golden"])  # misses its golden samples on every provider: discarded
    assert {p.name for p in caches.iterdir()} == {second.key, third.key}


def test_healthz_and_the_published_state_name_the_provider_and_each_fallback(artifacts, tmp_path, trust,
                                                                             jetson_build):
    verified = extracted(artifacts["1.0.0"], tmp_path, trust)
    model = load_model(verified.root, verified.manifest, profile="jetson",
                       factory=FakeGpuOrt(missing={TENSORRT, CUDA}))
    described = model.describe()
    assert described["provider"] == CPU
    assert [f["provider"] for f in described["provider_fallbacks"]] == [TENSORRT, CUDA]
    assert all(f["reason"].startswith("onnxruntime fell back to CPU for ") for f in described["provider_fallbacks"])
    status = AgentStatus(provider=model.provider, profile="jetson", provider_fallbacks=model.fallbacks_json())
    doc = state_document("dev-1", True, status, [])
    validate_payload("state", doc)
    assert doc["provider"] == CPU and doc["provider_fallbacks"] == described["provider_fallbacks"]
    for count, chars in ((16, 1000), (17, 1001)):  # the schema's bounds: at the limit, one over
        many = [{"provider": f"P{i}", "reason": "r" * chars} for i in range(count)]
        bounded = state_document("dev-1", True, AgentStatus(provider=CPU, provider_fallbacks=many), [])
        validate_payload("state", bounded)
        assert len(bounded["provider_fallbacks"]) == 16 and len(bounded["provider_fallbacks"][-1]["reason"]) == 1000
    assert json.loads(json.dumps(doc)) == doc


def test_a_cache_that_cannot_be_created_does_not_stop_the_model(artifacts, tmp_path, trust, jetson_build, caplog):
    """A store whose medium refuses writes still serves (docs/agent.md): the engine is built,
    not kept. (Root ignores permission bits, so a file stands where the cache folder goes.)"""
    store = ModelStore(tmp_path / "store", trust)
    installed = store.install(artifacts["1.0.0"])
    (store.root / "cache").write_bytes(b"not a folder")
    fake = FakeGpuOrt()
    with caplog.at_level("WARNING"):
        model = load_model(installed.directory, installed.verified.manifest, profile="jetson", factory=fake)
    assert model.provider == TENSORRT and model.cache_dir is None
    assert "trt_engine_cache_path" not in fake.calls[0][0][1] and "no engine cache" in caplog.text
