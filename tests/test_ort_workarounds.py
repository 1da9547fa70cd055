"""onnxruntime's NchwcTransformer on float16 graphs (microsoft/onnxruntime issue 28392).

On x86-64 the CPU provider runs the float16 nodes it has no kernel for between Casts it inserts,
and the NCHWc layout transformer (``ORT_ENABLE_ALL``, the default) then dereferences a null
pointer: creating a session for the fp16 conversion of a CRNN recognizer (Conv + LSTM + MatMul +
Softmax, shaped like demo/ocr) dies by SIGSEGV. ``edgepack build`` with ``optimize: {fp16: true}``
failed in validate, and an x86-64 agent would die loading the artifact. Every session now turns
the transformer off for float16 models on x86-64 (``edgepack_core.ort_workarounds``).

Sessions that could crash are created in a subprocess (the worker, the CLIs, ``python -c``) so a
regression fails a test instead of killing pytest.
"""

from __future__ import annotations

import json
import platform
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from device_agent.providers import CUDA, TENSORRT
from device_agent.runtime import load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.ort_workarounds import NCHWC_TRANSFORMER, disabled_optimizers, is_x86_64
from edgepack_core.signing import TrustStore
from edgepack_core.targets import CPU
from sdk.packager import ort_host
from sdk.packager.ort_worker import holds_float16, session_workarounds
from sdk.packager.passes.fp16 import _to_fp16_graph
from tests.artifacts import build_artifact, resign_with_changes
from tests.conftest import run_cli
from tests.fake_ort import FakeGpuOrt

ROOT = Path(__file__).resolve().parents[1]
X86_64 = is_x86_64(platform.machine())
needs_x86_64 = pytest.mark.skipif(
    not X86_64, reason=f"NchwcTransformer exists only on x86-64 (MLAS NCHWc kernels); this host is "
                       f"{platform.machine()}, where float16 sessions never needed the workaround")
HIDDEN, CLASSES, HEIGHT, WIDTH = 16, 10, 16, 64


# ---------------------------------------------------------------- the decision (pure)

@pytest.mark.parametrize("machine", ["x86_64", "AMD64", "amd64", " X86_64 "])
def test_a_float16_model_on_x86_64_runs_without_the_nchwc_transformer(machine):
    assert disabled_optimizers(float16=True, machine=machine) == (NCHWC_TRANSFORMER,)


@pytest.mark.parametrize("machine", ["x86_64", "AMD64"])
def test_a_float32_model_on_x86_64_keeps_the_nchwc_transformer(machine):
    """It is what makes fp32 Convs fast on x86-64: only float16 models lose it."""
    assert disabled_optimizers(float16=False, machine=machine) == ()


@pytest.mark.parametrize("machine", ["aarch64", "arm64", "armv7l", "i686", "ppc64le", ""])
@pytest.mark.parametrize("float16", [True, False])
def test_other_machines_have_no_nchwc_transformer_to_turn_off(machine, float16):
    """arm64 (Jetson, Raspberry Pi, Apple) and 32-bit x86 have no MLAS NCHWc block size."""
    assert disabled_optimizers(float16=float16, machine=machine) == ()


# ---------------------------------------------------------------- models

def _init(rng: np.random.Generator, name: str, shape: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name)


def crnn_model() -> onnx.ModelProto:
    """A small CRNN like demo/ocr's: Conv-Relu-MaxPool twice, Squeeze of the height, LSTM over
    the width, MatMul + Add + Softmax per step, with a dynamic batch (a static batch of 1 does
    not reach the crash in onnxruntime 1.32)."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("MaxPool", ["r2"], ["p2"], kernel_shape=[HEIGHT // 2, 1], strides=[HEIGHT // 2, 1]),
        helper.make_node("Squeeze", ["p2", "axis2"], ["features"]),                    # [b, 16, W/2]
        helper.make_node("Transpose", ["features"], ["steps"], perm=[2, 0, 1]),        # [W/2, b, 16]
        helper.make_node("LSTM", ["steps", "W", "R", "B"], ["Y"], hidden_size=HIDDEN),  # [W/2, 1, b, H]
        helper.make_node("Squeeze", ["Y", "axis1"], ["hidden"]),
        helper.make_node("Transpose", ["hidden"], ["by_batch"], perm=[1, 0, 2]),
        helper.make_node("MatMul", ["by_batch", "Wo"], ["mm"]),
        helper.make_node("Add", ["bo", "mm"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=-1),
    ]
    inits = [_init(rng, "w1", [8, 1, 3, 3]), _init(rng, "b1", [8]), _init(rng, "w2", [16, 8, 3, 3]),
             _init(rng, "b2", [16]), _init(rng, "W", [1, 4 * HIDDEN, 16]), _init(rng, "R", [1, 4 * HIDDEN, HIDDEN]),
             _init(rng, "B", [1, 8 * HIDDEN]), _init(rng, "Wo", [HIDDEN, CLASSES]), _init(rng, "bo", [CLASSES]),
             numpy_helper.from_array(np.array([2], np.int64), "axis2"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    graph = helper.make_graph(
        nodes, "crnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1, HEIGHT, WIDTH])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", WIDTH // 2, CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _lines(count: int = 2) -> np.ndarray:
    return np.random.default_rng(1).uniform(0, 1, (count, 1, HEIGHT, WIDTH)).astype(np.float32)


def _session_in_subprocess(path: Path, *, workaround: bool) -> subprocess.CompletedProcess:
    keywords = f"disabled_optimizers=[{NCHWC_TRANSFORMER!r}]" if workaround else ""
    code = (f"import onnxruntime as o\no.InferenceSession({str(path)!r}, providers=['CPUExecutionProvider'], "
            f"{keywords})\nprint('loaded')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


# ---------------------------------------------------------------- what the worker reads of a model

def test_the_fp16_conversion_holds_float16_and_the_fp32_model_does_not():
    model = crnn_model()
    assert not holds_float16(model)
    assert holds_float16(_to_fp16_graph(model))


def test_a_cast_to_float16_inside_a_subgraph_counts():
    """Float16 compute that only a Cast inside an If branch starts is still float16 compute."""
    branch = helper.make_graph([helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
                                helper.make_node("Cast", ["h"], ["y"], to=TensorProto.FLOAT)], "branch", [],
                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    identity = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "other", [],
                                 [helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])])
    graph = helper.make_graph([helper.make_node("If", ["c"], ["out"], then_branch=branch, else_branch=identity)], "g",
                              [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert holds_float16(model)
    model.graph.node[0].attribute[1].g.node[0].attribute[0].i = TensorProto.DOUBLE
    assert not holds_float16(model)


def test_the_worker_turns_the_transformer_off_only_for_the_float16_model(tmp_path: Path):
    fp32, fp16 = crnn_model(), _to_fp16_graph(crnn_model())
    onnx.save(fp16, tmp_path / "fp16.onnx")
    expected = {"disabled_optimizers": [NCHWC_TRANSFORMER]} if X86_64 else {}
    assert session_workarounds(fp16.SerializeToString()) == expected
    assert session_workarounds(str(tmp_path / "fp16.onnx")) == expected
    assert session_workarounds(fp32.SerializeToString()) == {}


# ---------------------------------------------------------------- real onnxruntime, x86-64

@pytest.fixture(scope="module")
def fp16_crnn(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("crnn") / "crnn-fp16.onnx"
    onnx.save(_to_fp16_graph(crnn_model()), path)
    return path


@needs_x86_64
def test_premise_a_plain_session_of_the_fp16_crnn_dies_by_sigsegv_and_the_workaround_loads_it(fp16_crnn):
    """Proves the model below reaches the upstream bug, so the tests after it prove the fix."""
    plain = _session_in_subprocess(fp16_crnn, workaround=False)
    if plain.returncode == 0:
        pytest.skip(f"onnxruntime {ort.__version__} no longer crashes on this model (issue 28392 fixed?): "
                    "the workaround could be gated on the version in edgepack_core/ort_workarounds.py")
    assert plain.returncode == -signal.SIGSEGV, plain.stderr[-2000:]
    fixed = _session_in_subprocess(fp16_crnn, workaround=True)
    assert fixed.returncode == 0 and "loaded" in fixed.stdout, fixed.stderr[-2000:]


@needs_x86_64
def test_the_packager_worker_runs_the_fp16_crnn_next_to_its_fp32_model(fp16_crnn):
    """Through the worker (a crash there is an OrtCrashError, not a dead pytest)."""
    feeds = [{"x": _lines()}]
    want = ort_host.run_feeds(crnn_model().SerializeToString(), feeds, label="crnn fp32")[0]["probs"]
    for model in (fp16_crnn.read_bytes(), str(fp16_crnn)):
        got = ort_host.run_feeds(model, feeds, label="crnn fp16")[0]["probs"]
        assert got.dtype == np.float32 and got.shape == (2, WIDTH // 2, CLASSES)
        np.testing.assert_allclose(got, want, atol=5e-3)
    optimized = onnx.load_from_string(ort_host.optimize_offline(fp16_crnn.read_bytes(), "all", label="crnn fp16"))
    assert holds_float16(optimized)


def cli_build(folder: Path, name: str, model: onnx.ModelProto, recipe_lines: str, key: Path) -> Path:
    """``edgepack build`` (the real CLI, a subprocess) of ``model`` with a recipe of ``name``,
    the raw postprocess, target x86 and ``recipe_lines``; the artifact's path."""
    onnx.save(model, folder / f"{name}.onnx")
    (folder / "recipe.yaml").write_text(f"name: {name}\nversion: 1.0.0\nmodel: {{path: {name}.onnx}}\n"
                                        f"postprocess: {{kind: raw}}\ntargets: [x86]\n{recipe_lines}")
    built = run_cli("edgepack", "build", str(folder / "recipe.yaml"), "--key", str(key), "--json",
                    "-o", str(folder / f"{name}.edgepkg"), cwd=folder, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    return folder / f"{name}.edgepkg"


@pytest.fixture(scope="module")
def fp16_artifact(tmp_path_factory, keypair) -> Path:
    """The CRNN built with ``optimize: {fp16: true}``."""
    return cli_build(tmp_path_factory.mktemp("fp16-build"), "crnn", crnn_model(),
                     "optimize: {fp16: true}\nvalidate: {data: synthetic, metric: cosine, min_cosine: 0.999}\n",
                     keypair[0])


@needs_x86_64
def test_an_fp16_build_of_the_crnn_succeeds_with_precision_fp16(fp16_artifact):
    """It failed with "validate: onnxruntime crashed with SIGSEGV ... on session creation"."""
    with tarfile.open(fp16_artifact) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        shipped = onnx.load_from_string(tar.extractfile("model/model.onnx").read())
    assert manifest["model"]["precision"] == "fp16"
    assert holds_float16(shipped)


@needs_x86_64
def test_the_agent_loads_and_runs_the_fp16_artifact(fp16_artifact, keypair, tmp_path):
    """``edgepack-agent predict`` (a subprocess): verify, load with the smoke test, infer."""
    np.save(tmp_path / "line.npy", _lines(1))
    result = run_cli("edgepack-agent", "predict", "--artifact", str(fp16_artifact), "--trust", str(keypair[1]),
                     "--input", str(tmp_path / "line.npy"), "--json", "--outputs", "raw")
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    answer = json.loads(result.stdout)
    assert answer["provider"] == CPU
    probs = np.asarray(answer["outputs"]["probs"], np.float32)
    assert probs.shape == (1, WIDTH // 2, CLASSES)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-2)


# ---------------------------------------------------------------- the agent's provider chain

@pytest.fixture(scope="module")
def labelled(tmp_path_factory, keypair) -> dict[str, Path]:
    """A float32 scale model's artifact as built, and re-signed claiming precision fp16: its
    sessions are safe in this process, and the manifest is all the agent reads."""
    folder = tmp_path_factory.mktemp("labelled")
    fp32 = build_artifact(folder, keypair[0])
    with tarfile.open(fp32) as tar:
        model = json.loads(tar.extractfile("manifest.json").read())["model"]
    fp16 = resign_with_changes(fp32, folder / "labelled-fp16.edgepkg", keypair[0],
                               manifest_changes={"model": {**model, "precision": "fp16"}})
    return {"fp32": fp32, "fp16": fp16}


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_every_choice_of_an_accelerator_chain_gets_the_same_workaround(labelled, keypair, tmp_path, monkeypatch,
                                                                       precision):
    """TensorRT, then CUDA, then the CPU: each session is told the same, because onnxruntime puts
    the CPU provider behind every accelerator and a float16 node it declines lands there."""
    monkeypatch.setattr(ort, "get_available_providers", lambda: [TENSORRT, CUDA, CPU])
    verified = extract_artifact(labelled[precision], tmp_path / "x", TrustStore.from_paths([str(keypair[1])]))
    fake = FakeGpuOrt(missing={TENSORRT, CUDA})
    model = load_model(verified.root, verified.manifest, profile="jetson", factory=fake)
    assert model.provider == CPU and [chain[0][0] for chain in fake.calls][:2] == [TENSORRT, CUDA]
    expected = {"disabled_optimizers": [NCHWC_TRANSFORMER]} if precision == "fp16" and X86_64 else {}
    assert fake.keywords == [expected] * len(fake.calls)


# ---------------------------------------------------------------- a model that is fp16 already

@pytest.fixture(scope="module")
def exported_fp16_artifact(tmp_path_factory, keypair) -> Path:
    """The CRNN exported in float16 already (no conversion by the build): the manifest's precision
    is read from the graph, so the agent knows to avoid the transformer."""
    return cli_build(tmp_path_factory.mktemp("exported-fp16"), "crnn16", _to_fp16_graph(crnn_model()),
                     "validate: {data: synthetic}\n", keypair[0])


def test_a_model_exported_in_fp16_ships_as_fp16_and_an_fp32_one_as_fp32(exported_fp16_artifact, keypair):
    """The manifest's precision is what the graph holds, also when no pass changed it; golden
    tolerances widen with it. An fp32 model built the same way stays fp32."""
    with tarfile.open(exported_fp16_artifact) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
    assert manifest["model"]["precision"] == "fp16"
    assert manifest["golden"]["rtol"] > 1e-3  # the reduced tolerance, not fp32's
    with tarfile.open(build_artifact(exported_fp16_artifact.parent / "fp32", keypair[0])) as tar:
        assert json.loads(tar.extractfile("manifest.json").read())["model"]["precision"] == "fp32"


@needs_x86_64
def test_the_agent_runs_a_model_exported_in_fp16(exported_fp16_artifact, keypair, tmp_path):
    """Before the precision came from the graph, this artifact said fp32 and an x86-64 agent
    created its session with the transformer on: SIGSEGV."""
    np.save(tmp_path / "line.npy", _lines(1).astype(np.float32))
    result = run_cli("edgepack-agent", "predict", "--artifact", str(exported_fp16_artifact), "--trust",
                     str(keypair[1]), "--input", str(tmp_path / "line.npy"), "--json", "--outputs", "raw")
    assert result.returncode == 0, (result.returncode, result.stderr[-3000:])
    probs = np.asarray(json.loads(result.stdout)["outputs"]["probs"], np.float32)
    assert probs.shape == (1, WIDTH // 2, CLASSES)
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=1e-2)
