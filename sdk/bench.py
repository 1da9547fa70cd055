"""``edgepack bench``: latency and throughput on this machine, original and packaged side by side.

Medians and p95 over repeated single-sample runs after a warm-up, both models measured in the
same process one after the other, so the ratio is meaningful on a noisy machine.
"""

from __future__ import annotations

import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepack_core.artifact import extract_artifact
from edgepack_core.manifest import TensorSpec
from edgepack_core.signing import TrustStore
from sdk.errors import BuildError
from sdk.packager.data import synthetic_samples
from sdk.packager.ort_host import cpu_session
from sdk.packager.passes.model_checks import graph_io


@dataclass(frozen=True)
class Timing:
    label: str
    p50_ms: float
    p95_ms: float
    throughput_per_s: float
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "p50_ms": self.p50_ms, "p95_ms": self.p95_ms,
                "throughput_per_s": self.throughput_per_s, "bytes": self.bytes}


def _inputs(model_bytes: bytes) -> list[TensorSpec]:
    import onnx

    return graph_io(onnx.load_from_string(model_bytes))[0]


def measure(label: str, model_bytes: bytes, *, runs: int = 100, warmup: int = 10, threads: int = 0) -> Timing:
    session = cpu_session(model_bytes, threads=threads)
    feed = synthetic_samples(1, {"kind": "tensor"}, _inputs(model_bytes)).feeds[0]
    names = [o.name for o in session.get_outputs()]
    for _ in range(warmup):
        session.run(names, feed)
    times = []
    started = time.perf_counter()
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(names, feed)
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - started
    return Timing(label, round(float(np.median(times)) * 1000, 4), round(float(np.percentile(times, 95)) * 1000, 4),
                  round(runs / total, 1), len(model_bytes))


def packaged_model(artifact: Path, trust: TrustStore | None) -> bytes:
    """The model inside an artifact: verified and extracted with a trust store, else read for
    measuring only (a benchmark never installs or serves it)."""
    if trust is not None:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "x"
            verified = extract_artifact(artifact, root, trust)
            return (root / verified.manifest.model_path).read_bytes()
    try:
        with tarfile.open(artifact, "r:*") as tar:
            member = tar.extractfile("model/model.onnx")
            if member is None:
                raise KeyError
            return member.read()
    except (tarfile.TarError, KeyError, OSError) as err:
        raise BuildError("bench", f"{artifact}: no model/model.onnx inside ({err})") from None


def bench(target: Path, *, original: Path | None = None, trust: TrustStore | None = None, runs: int = 100,
          threads: int = 0) -> list[Timing]:
    results = []
    if original is not None:
        results.append(measure(f"original {original.name}", original.read_bytes(), runs=runs, threads=threads))
    if target.suffix == ".edgepkg":
        results.append(measure(f"packaged {target.name}", packaged_model(target, trust), runs=runs, threads=threads))
    else:
        results.append(measure(target.name, target.read_bytes(), runs=runs, threads=threads))
    return results
