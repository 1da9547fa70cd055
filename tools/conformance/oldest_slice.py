"""A slice of onnx's node tests, packaged for the `rpi` target and run on the oldest onnxruntime.

Why: the manifest's ``min_onnxruntime`` and the target limits are only as good as the table
behind them. This proves them on the real old runtime: artifacts built here (with the
current onnxruntime, for a target whose devices run 1.16) must load, pass their smoke test and
answer right on onnxruntime 1.16, wherever bare onnxruntime 1.16 itself passes the same test.

Two phases, two interpreters:

    python -m tools.conformance.oldest_slice build OUT [--every 5]     # main venv (has onnx)
    .venv-oldest/bin/python -m tools.conformance.oldest_slice run OUT  # agent extra only

``build`` writes, per test, the artifact, the original model, and the test's inputs and
expected outputs as npz (the device side has no onnx to read .pb files). ``run`` compares bare
onnxruntime and the agent's path against the expected outputs, with onnx's runner tolerances.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

RTOL, ATOL = 1e-3, 1e-7  # onnx.backend.test's own tolerances
TARGET = "rpi"


# ----------------------------------------------------------------------------- build (host)


def _npz_safe(array: np.ndarray) -> np.ndarray:
    return array.astype(str) if array.dtype == object else array


def _build_case(test: Any, out: Path, key: Path) -> str:
    """Build one test for the rpi target; return 'built', 'skip', 'needs-newer' or 'error: ...'."""
    import onnx

    from sdk.packager.pipeline import build
    from tools.conformance.backends import (
        feed_names,
        minimal_recipe,
        non_finite,
        recipe_from_document,
        write_test_data,
    )

    model = test.model
    if model is None or not test.data_sets or \
            not all(v.type.HasField("tensor_type") for v in [*model.graph.input, *model.graph.output]):
        return "skip"
    inputs, outputs = (list(map(np.asarray, part)) for part in test.data_sets[0])
    names = feed_names(model, len(inputs))
    case = out / test.name
    case.mkdir(parents=True)
    onnx.save(model, str(case / "original.onnx"))
    try:
        write_test_data(case / "data", dict(zip(names, inputs, strict=True)),
                        {o.name: v for o, v in zip(model.graph.output, outputs, strict=True)})
    except (NotImplementedError, TypeError, ValueError):  # sequence or optional data: not a plain tensor test
        shutil.rmtree(case)
        return "skip"
    document = minimal_recipe("original.onnx", {"test_data": "data"},
                              [n for n, v in zip(names, inputs, strict=True) if non_finite(v)],
                              [o.name for o, v in zip(model.graph.output, outputs, strict=True) if non_finite(v)])
    document["targets"] = [TARGET]
    try:
        build(recipe_from_document(document, case), key_paths=[str(key)], output=case / "model.edgepkg")
    except Exception as err:  # recorded per case: the summary counts what did not build and why
        shutil.rmtree(case)
        return "needs-newer" if f"target {TARGET} runs onnxruntime" in str(err) else f"error: {err}"
    np.savez(case / "inputs.npz", **{n: _npz_safe(v) for n, v in zip(names, inputs, strict=True)})
    np.savez(case / "expected.npz", **{o.name: _npz_safe(v) for o, v in zip(model.graph.output, outputs,
                                                                             strict=True)})
    shutil.rmtree(case / "data")
    return "built"


def build_slice(out: Path, every: int) -> int:
    from onnx.backend.test.loader import load_model_tests

    from sdk.keys import write_keypair

    out.mkdir(parents=True, exist_ok=True)
    key, public = out / "release.key", out / "release.pub"
    if not key.exists():
        write_keypair(key, public)
    with warnings.catch_warnings():  # onnx computes some expected outputs as inf on purpose
        warnings.simplefilter("ignore", RuntimeWarning)
        tests = sorted(load_model_tests(kind="node"), key=lambda t: t.name)[::every]
    tally: dict[str, int] = {}
    errors = []
    for test in tests:
        status = _build_case(test, out, key)
        kind = status.split(":")[0]
        tally[kind] = tally.get(kind, 0) + 1
        if kind == "error":
            errors.append(f"{test.name}: {status[7:].splitlines()[0][:160]}")
    print(f"built {tally.get('built', 0)} of {len(tests)} node tests for target {TARGET}: {json.dumps(tally)}")
    for line in errors:
        print(f"  not built: {line}")
    return 0


# ----------------------------------------------------------------------------- run (device)


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as archive:
        return {name: archive[name] for name in archive.files}


def _matches(got: np.ndarray, want: np.ndarray) -> bool:
    got = np.asarray(got)
    if want.dtype.kind in "US":
        return got.shape == want.shape and np.array_equal(got.astype(str), want)
    if got.shape != want.shape:
        return False
    if want.dtype.kind in "fc":
        return bool(np.allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True))
    return bool(np.array_equal(got, want))


def _bare(case: Path, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(str(case / "original.onnx"), options, providers=["CPUExecutionProvider"])
    feed = {k: (v.astype(object) if v.dtype.kind == "U" else v) for k, v in inputs.items()}
    return session.run(None, feed)


def _edgepack(case: Path, trust: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from device_agent.runtime import InferenceService, load_model
    from edgepack_core.artifact import extract_artifact

    verified = extract_artifact(case / "model.edgepkg", case / "installed", trust)
    service = InferenceService(load_model(verified.root, verified.manifest))
    specs = service.model.input_specs
    return service.predict_tensors({k: v for k, v in inputs.items() if k in specs}, postprocess=False).outputs


def _run_case(case: Path, trust: Any) -> tuple[bool, bool, str]:
    inputs, expected = _load(case / "inputs.npz"), _load(case / "expected.npz")
    try:
        bare = _bare(case, inputs)
        bare_ok = all(_matches(g, w) for g, w in zip(bare, expected.values(), strict=True))
    except Exception:  # bare onnxruntime of this version cannot run the test: it does not count
        return False, False, ""
    try:
        got = _edgepack(case, trust, inputs)
    except Exception as err:  # the agent refused or failed: reported with its message
        return bare_ok, False, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    ok = all(_matches(got[name], want) for name, want in expected.items())
    return bare_ok, ok, "" if ok else "outputs differ from the test's expected outputs"


def run_slice(out: Path) -> int:
    import onnxruntime as ort

    from edgepack_core.signing import TrustStore, load_public_key

    trust = TrustStore([load_public_key(out / "release.pub")])
    bare_passes = edgepack_passes = 0
    failures = []
    for case in sorted(p for p in out.iterdir() if (p / "model.edgepkg").exists()):
        bare_ok, ok, why = _run_case(case, trust)
        if not bare_ok:
            continue
        bare_passes += 1
        edgepack_passes += ok
        if not ok:
            failures.append(f"{case.name}: {why}")
    print(f"onnxruntime {ort.__version__}: bare passes {bare_passes}, Edgepack passes {edgepack_passes} of them")
    for line in failures:
        print(f"  FAIL {line}")
    return 0 if bare_passes and not failures else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.conformance.oldest_slice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="phase", required=True)
    build_parser = sub.add_parser("build", help="package a slice of the node tests (host, main venv)")
    build_parser.add_argument("out", type=Path)
    build_parser.add_argument("--every", type=int, default=5, help="take every N-th node test (default 5)")
    run_parser = sub.add_parser("run", help="run the packaged slice on this interpreter's onnxruntime")
    run_parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.phase == "build":
        return build_slice(args.out, max(1, args.every))
    return run_slice(args.out)


if __name__ == "__main__":
    sys.exit(main())
