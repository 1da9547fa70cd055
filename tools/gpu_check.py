"""Does the agent really run on this machine's NVIDIA GPU?

    python tools/gpu_check.py --artifacts DIR --trust KEY [--runs 50]
    python tools/gpu_check.py --artifacts DIR --trust KEY --build [--key PRIVATE]

For a Jetson (or any box with an NVIDIA GPU) with onnxruntime-gpu installed and no network.
Each signed artifact in DIR (``*.edgepkg``) is verified and loaded through the agent's own load
path (``device_agent.runtime.load_model``: provider chain, warm-up on the golden samples) with
the ``jetson`` profile and with ``x86``; for each the provider really used, every fallback with
its reason, the p50 latency of each over ``--runs`` runs of its first golden input, and the
largest difference between the two profiles' outputs are printed.

Exit status: 1 when a CUDA device is present (nvidia-smi lists a GPU, /dev/nvidia0,
/proc/driver/nvidia, a Jetson's /etc/nv_tegra_release, or onnxruntime's CUDA provider creating
a session) and an artifact ran on the CPU with the ``jetson`` profile (or did not load); 0
when everything ran on the GPU. On a machine without an NVIDIA GPU it says so in one line and
exits 0. Bad usage: one line, exit 2.

Only the device side is imported (``device_agent``, ``edgepack_core``, numpy, onnxruntime): it
runs on a device with the agent installed. ``--build`` builds the demo artifacts into DIR first
with the host tools (``edgepack``, which a device does not have) and signs them with ``--key``
(or a new key pair: the private key in DIR, the public one written to ``--trust``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout: its agent (on a device, the installed one is the same)
    sys.path.insert(0, str(ROOT))

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
# A one-node ONNX model (Relu on float[1], opset 11, IR 7) for the CUDA probe, so the probe needs
# neither the onnx package nor an artifact: made with onnx.helper and SerializeToString().
PROBE_MODEL = bytes.fromhex(
    "08071208656467657061636b3a330a0c0a0178120179220452656c751201705a0f0a0178120a0a08080112040a020801620f0a01791"
    "20a0a08080112040a02080142040a00100b")
NVIDIA_PATHS = {"/dev/nvidia0": "/dev/nvidia0 exists", "/proc/driver/nvidia": "/proc/driver/nvidia exists",
                "/etc/nv_tegra_release": "a Jetson (/etc/nv_tegra_release)"}
DEMOS = ("mobilenet", "digits", "tabular", "tiny")


class UsageError(Exception):
    """Bad arguments: one line, exit 2."""


# ---------------------------------------------------------------- is there a GPU (I/O, each probe alone)


def nvidia_smi_gpus(which: Callable[[str], str | None] = shutil.which,
                    run: Callable[..., Any] = subprocess.run) -> list[str]:
    """The ``GPU n: ...`` lines of ``nvidia-smi -L``; none without the tool or when it fails
    (driver not loaded)."""
    binary = which("nvidia-smi")
    if binary is None:
        return []
    try:
        done = run([binary, "-L"], capture_output=True, text=True, timeout=20, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode != 0:
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip().startswith("GPU ")]


def cuda_session_runs() -> bool:
    """onnxruntime's CUDA provider creates a session (and keeps CUDA in it) on the probe model."""
    import onnxruntime as ort

    if CUDA not in ort.get_available_providers():
        return False
    try:
        session = ort.InferenceSession(PROBE_MODEL, providers=[CUDA, CPU])
    except Exception:  # onnxruntime raises untyped errors when CUDA cannot start
        return False
    return session.get_providers()[:1] == [CUDA]


def gpu_evidence(*, which: Callable[[str], str | None] = shutil.which, run: Callable[..., Any] = subprocess.run,
                 exists: Callable[[str], bool] = os.path.exists,
                 cuda_probe: Callable[[], bool] = cuda_session_runs) -> list[str]:
    """Every sign of an NVIDIA GPU on this machine, in words; empty when there is none."""
    evidence = [f"nvidia-smi: {line}" for line in nvidia_smi_gpus(which, run)]
    evidence += [words for path, words in NVIDIA_PATHS.items() if exists(path)]
    if cuda_probe():
        evidence.append("onnxruntime's CUDA provider creates a session")
    return evidence


# ---------------------------------------------------------------- the verdict (pure)


@dataclass
class ArtifactRun:
    """One artifact through the agent's load path with both profiles."""

    name: str
    jetson_provider: str = ""
    jetson_fallbacks: list[tuple[str, str]] = field(default_factory=list)
    jetson_p50_ms: float | None = None
    x86_provider: str = ""
    x86_p50_ms: float | None = None
    max_abs_diff: float | None = None
    error: str = ""

    @property
    def on_gpu(self) -> bool:
        return not self.error and self.jetson_provider not in ("", CPU)


def no_gpu_line() -> str:
    return ("no NVIDIA GPU found (nvidia-smi, /dev/nvidia0, /proc/driver/nvidia, /etc/nv_tegra_release, "
            "onnxruntime's CUDA provider): nothing to check")


def verdict(evidence: Sequence[str], runs: Sequence[ArtifactRun]) -> tuple[int, str]:
    """(exit status, last line). A CUDA device present and any artifact on the CPU (or not
    loaded) with the jetson profile is a failure. Pure."""
    if not evidence:
        return 0, no_gpu_line()
    if not runs:
        return 1, "FAIL: a CUDA device is present but there was no artifact to check"
    on_cpu = [run.name for run in runs if not run.on_gpu]
    if on_cpu:
        return 1, (f"FAIL: a CUDA device is present ({'; '.join(evidence)}) and the agent ran "
                   f"{', '.join(on_cpu)} on the CPU with the jetson profile")
    used = sorted({run.jetson_provider for run in runs})
    return 0, f"OK: {len(runs)} artifact(s) ran on {', '.join(used)} with the jetson profile"


def format_run(run: ArtifactRun) -> list[str]:
    """The lines printed for one artifact. Pure."""
    if run.error:
        return [f"{run.name}: {run.error}"]
    diff = "n/a" if run.max_abs_diff is None else f"{run.max_abs_diff:.3g}"
    lines = [f"{run.name}: jetson on {run.jetson_provider} p50 {run.jetson_p50_ms:.3f} ms | x86 on "
             f"{run.x86_provider} p50 {run.x86_p50_ms:.3f} ms | max |diff| {diff}"]
    lines += [f"  jetson: not using {provider}: {reason}" for provider, reason in run.jetson_fallbacks]
    return lines


def max_difference(first: Mapping[str, Any], second: Mapping[str, Any]) -> float:
    """Largest absolute difference between two runs' outputs (NaN/inf where both have them are
    equal; a non-numeric output that differs counts as infinity). Pure."""
    import numpy as np

    worst = 0.0
    for name, value in first.items():
        a, b = np.asarray(value), np.asarray(second[name])
        if a.shape != b.shape:
            return float("inf")
        if a.dtype.kind not in "biuf" or b.dtype.kind not in "biuf":
            worst = worst if np.array_equal(a, b) else float("inf")
            continue
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        finite = np.isfinite(a64) & np.isfinite(b64)
        if not np.array_equal(np.isfinite(a64), np.isfinite(b64)):
            return float("inf")
        if finite.any():
            worst = max(worst, float(np.max(np.abs(a64[finite] - b64[finite]))))
    return worst


# ---------------------------------------------------------------- running the artifacts (I/O)


def _first_input(model: Any) -> dict[str, Any]:
    import numpy as np

    samples = model.manifest.golden.get("samples", [])
    if samples:
        with np.load(model.root / samples[0]["inputs"], allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    return {name: np.zeros(tuple(d if isinstance(d, int) else 1 for d in shape), dtype=dtype)
            for name, (dtype, shape) in model.input_specs.items()}


def _p50_ms(model: Any, feed: Mapping[str, Any], runs: int) -> tuple[float, dict[str, Any]]:
    outputs = model.run(feed)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        model.run(feed)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000, outputs


def check_artifact(path: Path, trust: Any, *, runs: int, factory: Callable[..., Any] | None = None) -> ArtifactRun:
    """Verify, then load with each profile through the agent's load path and time it."""
    from device_agent.runtime import load_model
    from edgepack_core.artifact import extract_artifact
    from edgepack_core.errors import EdgepackError

    with tempfile.TemporaryDirectory(prefix="edgepack-gpu-check-") as tmp:
        try:
            verified = extract_artifact(path, Path(tmp) / "model", trust)
        except EdgepackError as err:
            return ArtifactRun(path.name, error=f"refused: {err}")
        result = ArtifactRun(f"{verified.manifest.name} {verified.manifest.version}")
        try:
            jetson = load_model(verified.root, verified.manifest, profile="jetson", factory=factory)
            feed = _first_input(jetson)
            result.jetson_p50_ms, jetson_out = _p50_ms(jetson, feed, runs)
            result.jetson_provider, result.jetson_fallbacks = jetson.provider, list(jetson.fallbacks)
            del jetson
            x86 = load_model(verified.root, verified.manifest, profile="x86", factory=factory)
            result.x86_p50_ms, x86_out = _p50_ms(x86, feed, runs)
            result.x86_provider = x86.provider
        except EdgepackError as err:
            result.error = f"does not load: {err}"
            return result
        result.max_abs_diff = max_difference(jetson_out, x86_out)
        return result


def check_artifacts(paths: Sequence[Path], trust: Any, *, runs: int,
                    factory: Callable[..., Any] | None = None,
                    say: Callable[[str], None] = print) -> list[ArtifactRun]:
    results = []
    for path in paths:
        result = check_artifact(path, trust, runs=runs, factory=factory)
        for line in format_run(result):
            say(line)
        results.append(result)
    return results


def build_demos(directory: Path, trust_path: Path, key: Path | None) -> None:
    """``--build``: the demo artifacts, built and signed with the host tools."""
    try:
        from sdk.keys import write_keypair
        from tools.bench.agent_overhead import package
        from tools.demos import build_all
    except ImportError as err:
        raise UsageError(f"--build needs the host tools (pip install edgepack; missing {err.name})") from None
    directory.mkdir(parents=True, exist_ok=True)
    if key is None:
        if trust_path.exists():
            raise UsageError(f"--build without --key would write a new public key over {trust_path}")
        key = directory / "gpu-check.key"
        write_keypair(key, trust_path)
    build_all(directory / "demo", list(DEMOS))
    for name in DEMOS:
        package(directory, name, key)


# ---------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", required=True, type=Path, help="folder of signed .edgepkg artifacts")
    parser.add_argument("--trust", required=True, type=Path, help="the public key the artifacts are signed with")
    parser.add_argument("--runs", type=int, default=50, help="timed runs per profile (default 50)")
    parser.add_argument("--build", action="store_true", help="build the demo artifacts into --artifacts first")
    parser.add_argument("--key", type=Path, help="with --build: the private key to sign with")
    return parser.parse_args(argv)


def check_usage(args: argparse.Namespace) -> None:
    if args.runs < 1:
        raise UsageError(f"--runs must be at least 1, got {args.runs}")
    if args.key is not None and not args.build:
        raise UsageError("--key only makes sense with --build")
    if args.build:
        return
    if not args.artifacts.is_dir():
        raise UsageError(f"{args.artifacts}: no such folder (build the demos with --build)")
    if not args.trust.is_file():
        raise UsageError(f"{args.trust}: no such key file")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_usage(args)
        evidence = gpu_evidence()
        if not evidence:
            print(no_gpu_line())
            return 0
        if args.build:
            build_demos(args.artifacts, args.trust, args.key)
        from edgepack_core.errors import EdgepackError
        from edgepack_core.signing import TrustStore

        try:
            trust = TrustStore.from_paths([args.trust])
        except EdgepackError as err:
            raise UsageError(str(err)) from None
    except UsageError as err:
        print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2
    import onnxruntime as ort

    print(f"GPU: {'; '.join(evidence)}")
    print(f"onnxruntime {ort.__version__}: {', '.join(ort.get_available_providers())}")
    paths = sorted(args.artifacts.glob("*.edgepkg"))
    status, last = verdict(evidence, check_artifacts(paths, trust, runs=args.runs))
    print(last)
    return status


if __name__ == "__main__":
    sys.exit(main())
