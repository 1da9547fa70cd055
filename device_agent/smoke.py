"""The load-time smoke test: a model becomes active only if its golden samples reproduce.

Pure comparison (``compare_outputs``) separated from running the session, so the decision is
unit-tested on arrays and the run is tested on real sessions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from device_agent.errors import SmokeTestError
from edgepack_core.manifest import Manifest, TensorSpec
from edgepack_core.tensor_compare import same_non_finite


@dataclass(frozen=True)
class SmokeReport:
    samples: int
    max_abs_diff: float
    # The golden samples' input shapes: sizes the model is proven to run (``run_failures.py``
    # tells a client's wrong size from a model bug by them).
    input_shapes: tuple[dict[str, tuple[int, ...]], ...] = ()

    def to_json(self) -> dict[str, float | int]:
        return {"samples": self.samples, "max_abs_diff": self.max_abs_diff}


def shape_matches(shape: Sequence[int], declared: Sequence[int | str]) -> bool:
    """Symbolic dims (strings) match any size; fixed dims must be equal."""
    return len(shape) == len(declared) and all(
        isinstance(d, str) or int(d) == shape[axis] for axis, d in enumerate(declared))


def compare_outputs(
    got: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray], declared: Sequence[TensorSpec],
    *, rtol: float, atol: float,
) -> tuple[str | None, float]:
    """Return (problem or None, max abs diff) for one golden sample. Pure."""
    worst = 0.0
    for spec in declared:
        if spec.name not in got:
            return f"output {spec.name} is missing", worst
        value = got[spec.name]
        if not shape_matches(value.shape, spec.shape):
            return f"output {spec.name} has shape {list(value.shape)}, declared {list(spec.shape)}", worst
        if spec.name not in expected:
            return f"golden outputs lack {spec.name}", worst
        want = expected[spec.name]
        if value.shape != want.shape:
            return f"output {spec.name} has shape {list(value.shape)}, golden {list(want.shape)}", worst
        if np.issubdtype(value.dtype, np.inexact):  # float or complex: compared within tolerance
            if not same_non_finite(value, want):
                return f"output {spec.name} holds non-finite values where golden has other values", worst
            finite = np.isfinite(want)
            diff = float(np.max(np.abs(value[finite].astype(np.float64) - want[finite].astype(np.float64)))) \
                if finite.any() else 0.0
            worst = max(worst, diff)
            if not np.allclose(value, want, rtol=rtol, atol=atol, equal_nan=True):
                return f"output {spec.name} differs from golden by up to {diff:.3g} (rtol {rtol}, atol {atol})", worst
        elif not np.array_equal(value, want):
            return f"output {spec.name} differs from golden", worst
    return None, worst


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def run_smoke_test(
    root: Path, manifest: Manifest, run: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]],
) -> SmokeReport:
    """Run every golden sample through ``run`` and compare; raise SmokeTestError on a miss."""
    golden = manifest.golden
    samples = golden.get("samples", [])
    rtol, atol = float(golden.get("rtol", 1e-3)), float(golden.get("atol", 1e-4))
    label = f"{manifest.name} {manifest.version}"
    worst = 0.0
    shapes = []
    for index, sample in enumerate(samples):
        try:
            inputs = _load_npz(root / sample["inputs"])
            expected = _load_npz(root / sample["outputs"])
        except (OSError, ValueError) as err:
            raise SmokeTestError(label, index, f"golden data unreadable: {err}") from err
        try:
            got = run(inputs)
        except Exception as err:  # a session that cannot run its own golden inputs fails the test
            raise SmokeTestError(label, index, f"inference failed: {str(err).splitlines()[0][:200]}") from err
        shapes.append({name: tuple(value.shape) for name, value in inputs.items()})
        problem, diff = compare_outputs(got, expected, manifest.outputs, rtol=rtol, atol=atol)
        worst = max(worst, diff)
        if problem:
            raise SmokeTestError(label, index, problem)
    return SmokeReport(samples=len(samples), max_abs_diff=worst, input_shapes=tuple(shapes))
