"""tools/gpu_check.py: on this machine (no NVIDIA GPU) it says so in one line and exits 0; the
"GPU present but the agent ran on the CPU" decision is a pure function; the GPU probes and the
whole check run with onnxruntime-gpu faked at its boundary (tests/fake_ort.py) over real
artifacts, the real verifier and the agent's real load path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import onnxruntime as ort
import pytest

from device_agent.providers import CUDA, TENSORRT
from edgepack_core.signing import TrustStore
from edgepack_core.targets import CPU
from tests.artifacts import build_artifact
from tests.fake_ort import FakeGpuOrt
from tools import gpu_check
from tools.gpu_check import ArtifactRun, gpu_evidence, max_difference, verdict

TOOL = Path(__file__).resolve().parent.parent / "tools" / "gpu_check.py"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("gpu")
    build_artifact(folder, keypair[0], version="1.0.0")
    build_artifact(folder, keypair[0], version="2.0.0", factor=3.0, name="triple")
    return folder


def run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120,
                          check=False, stdin=subprocess.DEVNULL)


def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(artifacts, keypair):
    assert gpu_evidence() == [], "this test needs a machine without an NVIDIA GPU"
    done = run_tool("--artifacts", str(artifacts), "--trust", str(keypair[1]))
    assert done.returncode == 0 and done.stderr == ""
    assert done.stdout.splitlines() == [gpu_check.no_gpu_line()]
    assert done.stdout.startswith("no NVIDIA GPU found")


@pytest.mark.parametrize(("args", "message"), [
    (["--artifacts", "ABSENT", "--trust", "KEY"], "ABSENT: no such folder (build the demos with --build)"),
    (["--artifacts", "DIR", "--trust", "ABSENT"], "ABSENT: no such key file"),
    (["--artifacts", "DIR", "--trust", "KEY", "--runs", "0"], "--runs must be at least 1, got 0"),
    (["--artifacts", "DIR", "--trust", "KEY", "--key", "KEY"], "--key only makes sense with --build"),
])
def test_bad_usage_is_one_line_and_exit_2(artifacts, keypair, tmp_path, args, message):
    real = {"DIR": str(artifacts), "KEY": str(keypair[1]), "ABSENT": str(tmp_path / "absent")}
    done = run_tool(*[real.get(a, a) for a in args])
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"gpu_check: error: {message.replace('ABSENT', real['ABSENT'])}"


def test_a_gpu_present_and_the_agent_on_the_cpu_fails():
    evidence = ["nvidia-smi: GPU 0: Orin (nvgpu)"]
    on_cpu = ArtifactRun("mobilenet 1.0.0", jetson_provider=CPU, x86_provider=CPU)
    on_trt = ArtifactRun("digits 1.0.0", jetson_provider=TENSORRT, x86_provider=CPU)
    on_cuda = ArtifactRun("tiny 1.0.0", jetson_provider=CUDA, x86_provider=CPU)
    status, line = verdict(evidence, [on_trt, on_cpu, on_cuda])
    assert status == 1
    assert line == ("FAIL: a CUDA device is present (nvidia-smi: GPU 0: Orin (nvgpu)) and the agent ran "
                    "mobilenet 1.0.0 on the CPU with the jetson profile")
    assert verdict(evidence, [on_trt, on_cuda]) == (0, "OK: 2 artifact(s) ran on CUDAExecutionProvider, "
                                                       "TensorrtExecutionProvider with the jetson profile")
    assert verdict(evidence, [ArtifactRun("x 1.0.0", error="does not load: ...")])[0] == 1
    assert verdict(evidence, [])[0] == 1  # nothing checked is no proof
    assert verdict([], [on_cpu]) == (0, gpu_check.no_gpu_line())  # no GPU: the CPU is right


def test_each_probe_alone_is_evidence_and_a_failing_nvidia_smi_is_not():
    def smi(stdout: str, returncode: int = 0):
        return lambda *a, **k: SimpleNamespace(returncode=returncode, stdout=stdout)

    none = {"which": lambda name: None, "exists": lambda path: False, "cuda_probe": lambda: False}
    assert gpu_evidence(**none) == []
    with_smi = {**none, "which": lambda name: "/usr/bin/nvidia-smi",
                "run": smi("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\n")}
    assert gpu_evidence(**with_smi) == ["nvidia-smi: GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)"]
    broken = {**with_smi, "run": smi("NVIDIA-SMI has failed because it couldn't communicate with the driver", 9)}
    assert gpu_evidence(**broken) == []
    assert gpu_evidence(**{**none, "exists": lambda path: path == "/dev/nvidia0"}) == ["/dev/nvidia0 exists"]
    assert gpu_evidence(**{**none, "exists": lambda path: path == "/etc/nv_tegra_release"}) == \
        ["a Jetson (/etc/nv_tegra_release)"]
    assert gpu_evidence(**{**none, "cuda_probe": lambda: True}) == ["onnxruntime's CUDA provider creates a session"]


def test_the_cuda_probe_model_loads_and_the_cpu_build_has_no_cuda():
    session = ort.InferenceSession(gpu_check.PROBE_MODEL, providers=[CPU])
    import numpy as np

    assert session.run(None, {"x": np.array([-2.0], np.float32)})[0].tolist() == [0.0]
    assert gpu_check.cuda_session_runs() is (CUDA in ort.get_available_providers())


def test_max_difference_between_profiles():
    import numpy as np

    a = {"y": np.array([1.0, np.nan, 3.0], np.float32), "k": np.array([1, 2])}
    assert max_difference(a, {"y": np.array([1.5, np.nan, 3.0], np.float32), "k": np.array([1, 2])}) == 0.5
    assert max_difference(a, {"y": np.array([1.0, 2.0, 3.0], np.float32), "k": np.array([1, 2])}) == float("inf")
    assert max_difference(a, {"y": a["y"], "k": np.array([1, 3])}) == 1.0
    assert max_difference({"s": np.array(["a"])}, {"s": np.array(["b"])}) == float("inf")


@pytest.mark.parametrize(("fake", "status", "provider"), [
    (FakeGpuOrt(), 0, TENSORRT),
    (FakeGpuOrt(missing={TENSORRT}), 0, CUDA),  # the CUDA-only box: now on CUDA
    (FakeGpuOrt(missing={TENSORRT, CUDA}), 1, CPU),  # GPU present, agent on the CPU: fails
])
def test_the_whole_check_through_the_agents_load_path(artifacts, keypair, monkeypatch, fake, status, provider):
    monkeypatch.setattr(ort, "get_available_providers", lambda: [TENSORRT, CUDA, CPU])
    lines: list[str] = []
    runs = gpu_check.check_artifacts(sorted(artifacts.glob("*.edgepkg")), TrustStore.from_paths([keypair[1]]),
                                     runs=3, factory=fake, say=lines.append)
    assert [run.name for run in runs] == ["scale 1.0.0", "triple 2.0.0"]
    assert {run.jetson_provider for run in runs} == {provider} and {run.x86_provider for run in runs} == {CPU}
    assert all(run.jetson_p50_ms > 0 and run.x86_p50_ms > 0 and run.max_abs_diff == 0.0 for run in runs)
    assert verdict(["fake GPU"], runs)[0] == status
    assert lines[0].startswith(f"scale 1.0.0: jetson on {provider} p50 ")
    assert ("  jetson: not using TensorrtExecutionProvider: onnxruntime fell back to " in "\n".join(lines)) == \
        (provider != TENSORRT)


def test_a_tampered_artifact_is_refused_not_run(artifacts, keypair, tmp_path):
    bad = tmp_path / "bad.edgepkg"
    data = bytearray((artifacts / "scale-1.0.0-2.0.edgepkg").read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    run = gpu_check.check_artifact(bad, TrustStore.from_paths([keypair[1]]), runs=1)
    assert run.error.startswith("refused: ") and not run.on_gpu


def test_the_check_imports_only_the_device_side(artifacts, keypair):
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); from tools import gpu_check;"
            "from edgepack_core.signing import TrustStore;"
            "runs = gpu_check.check_artifacts(sorted(Path(sys.argv[2]).glob('*.edgepkg')),"
            " TrustStore.from_paths([sys.argv[3]]), runs=1, say=lambda line: None);"
            "assert runs and all(r.jetson_provider for r in runs), runs;"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sdk', 'onnx', 'click', 'torch')))")
    done = subprocess.run([sys.executable, "-c", code, str(TOOL.parent.parent), str(artifacts), str(keypair[1])],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-1500:]
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
def test_build_makes_the_demo_artifacts_and_they_run_through_the_jetson_path(tmp_path, monkeypatch):
    """--build on a workstation (the host tools exist here): the four demos, signed with a new
    key pair whose public half is written to --trust; refused when that would overwrite a key."""
    folder, public = tmp_path / "artifacts", tmp_path / "gpu.pub"
    gpu_check.build_demos(folder, public, None)
    paths = sorted(folder.glob("*.edgepkg"))
    assert [p.stem for p in paths] == sorted(gpu_check.DEMOS)
    assert (folder / "gpu-check.key").stat().st_mode & 0o077 == 0
    monkeypatch.setattr(ort, "get_available_providers", lambda: [TENSORRT, CUDA, CPU])
    runs = gpu_check.check_artifacts(paths, TrustStore.from_paths([public]), runs=2, factory=FakeGpuOrt(),
                                     say=lambda line: None)
    assert [run.jetson_provider for run in runs] == [TENSORRT] * 4 and verdict(["fake GPU"], runs)[0] == 0
    with pytest.raises(gpu_check.UsageError, match="would write a new public key over"):
        gpu_check.build_demos(folder, public, None)
