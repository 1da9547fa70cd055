"""The shipped recipes' artifacts, pinned (issue 22, "Done when"): every artifact built from
recipes/ verifies, installs and answers as it did when the pin was taken, so a refactor of the
packager or the decoders that changes what ships fails here.

Each recipe of recipes/ is built from the demo models (tools/demos) with the real packager,
verified and extracted with the device's verifier, loaded by the device runtime (which runs the
golden smoke test: "installs"), and its golden inputs run through the device model and its
postprocessor ("answers"). What is compared with tests/pinned/<recipe>.json and .npz:

- the manifest, less what a build host or a clock decides (``created``, ``tools``,
  ``report.json``'s entry); per file its size, with the sha256 of assets;
- the shipped graph's op types and counts (a quantization decision shows here);
- the build report's passes and warnings less timings (``timings_s``, ``*_ms``, ``seconds``,
  ``search_s``, ``speedup``, times in its sentences, the "slower than fp32 on this machine"
  warning): the validation and quantization figures the task metrics computed;
- each golden sample: the input tensors' shape, dtype and summary figures, the output tensors
  (.npz) and the device's decoded answer.

Floats are compared with a tolerance (tight for fp32, the artifact's own golden tolerance for
lossy builds), never by their bytes: another CPU's kernels may round the last bit differently.
Two things of a recipe are set for the pin, because a clock decides them: ``quantize.min_speedup``
is 0 and ``quantize.max_search_s`` unbounded, so an int8 candidate ships on its accuracy alone.

Regenerate the pin only when a change of what ships is intended, and say why in the commit:

    python -m tests.test_pinned_demos --update [--only RECIPE ...]
"""

from __future__ import annotations

import argparse
import io
import json
import math
import re
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PINNED = Path(__file__).resolve().parent / "pinned"
PLAIN_RECIPES = ("digits", "digits-int8", "mobilenet", "mobilenet-dynamic", "mobilenet-int8", "tabular", "vad")
TORCH_RECIPES = ("lstm-vad", "ocr-int8", "orientation-int8", "points", "yolo-int8")
RECIPES = PLAIN_RECIPES + TORCH_RECIPES
TIMING_KEYS = frozenset({"timings_s", "seconds", "search_s", "speedup", "speedup_interval", "speed_call", "tools"})
# Timing figures inside report strings ("0.238 ms", "(1.38x fp32)"): this machine's clock.
TIMING_TEXT = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?\s*(?:ms\b|x\b)")
# Warnings the clock decides (int8 shipped while slower here, min_speedup 0).
CLOCK_WARNING = re.compile(r"slower than fp32 on this machine")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")
FP32_TOLERANCE = (1e-4, 1e-5)  # (rtol, atol) of fp32 tensors and report figures
REPORT_TOLERANCE = (1e-3, 1e-4)
WORKSPACE = "$WORKSPACE"


# ----------------------------------------------------------------------------- building


def prepare_workspace(root: Path, *, torch: bool) -> Path:
    """demo/ built from code and recipes/ copied beside it, with the clock taken out of
    quantization (see the module docstring); returns the recipes folder."""
    from tools.demos import build_all, build_torch_demos
    from tools.demos.vad import build_vad

    build_all(root / "demo", ["digits", "mobilenet", "tabular"])
    build_vad(root / "demo" / "vad")
    if torch:
        build_torch_demos(root / "demo")
    recipes = root / "recipes"
    recipes.mkdir(parents=True, exist_ok=True)
    for name in RECIPES if torch else PLAIN_RECIPES:
        recipe = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
        if "quantize" in recipe:
            recipe["quantize"] = {**recipe["quantize"], "min_speedup": 0, "max_search_s": 1e9}
        (recipes / f"{name}.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return recipes


def build_recipe(recipes: Path, name: str, key: Path) -> Path:
    """The signed artifact of ``recipes/<name>.yaml``, built by the real packager."""
    from sdk.packager.pipeline import build
    from sdk.recipe import load_recipe

    output = recipes.parent / "dist" / f"{name}.edgepkg"
    build(load_recipe(recipes / f"{name}.yaml", allow_external_paths=True), key_paths=[str(key)], output=output)
    return output


# ----------------------------------------------------------------------------- the snapshot


def _no_timing(value: Any, workspace: str) -> Any:
    """A report value without what the clock decided, the workspace path made stable."""
    if isinstance(value, dict):
        return {k: _no_timing(v, workspace) for k, v in value.items() if k not in TIMING_KEYS and not k.endswith("_ms")}
    if isinstance(value, list):
        return [_no_timing(v, workspace) for v in value]
    if isinstance(value, str):
        return TIMING_TEXT.sub("<time>", value.replace(workspace, WORKSPACE))
    return value


def stable_manifest(manifest: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest less the clock and the build host; files by size (assets also by sha256)."""
    stable = {k: v for k, v in manifest.items() if k not in ("created", "tools", "files")}
    stable["files"] = {
        name: (
            {"size": entry["size"], "sha256": entry["sha256"]}
            if name.startswith("assets/")
            else {"size": entry["size"]}
        )
        for name, entry in sorted(manifest["files"].items())
        if name != manifest.get("report")
    }
    return stable


def _summary(array: np.ndarray) -> dict[str, Any]:
    """Shape, dtype and figures of a tensor too large to commit (a 224x224 image)."""
    values = array.astype(np.float64) if array.dtype.kind in "biuf" else np.zeros(1)
    return {
        "shape": list(array.shape),
        "dtype": array.dtype.name,
        "sum": float(values.sum()),
        "l2": float(np.sqrt(np.sum(values * values))),
        "min": float(values.min(initial=0.0)),
        "max": float(values.max(initial=0.0)),
    }


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(path.read_bytes()), allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def snapshot(artifact: Path, trust: Path, workspace: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Verify, extract and install ``artifact`` as a device does, run its golden inputs, and
    return (the pinned document, the golden output tensors by ``<sample>/<output>``)."""
    import onnx

    from device_agent.runtime import load_model
    from edgepack_core.artifact import extract_artifact
    from edgepack_core.signing import TrustStore, load_public_key

    with tempfile.TemporaryDirectory() as folder:
        verified = extract_artifact(artifact, Path(folder) / "x", TrustStore([load_public_key(trust)]), durable=False)
        root, manifest = verified.root, verified.manifest
        model = load_model(root, manifest)  # the golden smoke test runs here
        graph = onnx.load(root / manifest.model_path, load_external_data=False).graph
        report = json.loads((root / manifest.raw["report"]).read_text())
        samples, tensors = [], {}
        for n, sample in enumerate(manifest.golden.get("samples", [])):
            inputs, expected = _npz(root / sample["inputs"]), _npz(root / sample["outputs"])
            outputs = model.run(inputs)
            samples.append(
                {"inputs": {k: _summary(v) for k, v in sorted(inputs.items())}, "answer": model.postprocessor(outputs)}
            )
            tensors.update({f"{n}/{k}": v for k, v in expected.items()})
    doc = {
        "manifest": stable_manifest(manifest.raw),
        "ops": dict(sorted(Counter(n.op_type for n in graph.node).items())),
        "report": _no_timing(
            {"passes": report["passes"], "warnings": [w for w in report["warnings"] if not CLOCK_WARNING.search(w)]},
            str(workspace),
        ),
        "golden": samples,
    }
    return json.loads(json.dumps(doc, default=float)), tensors


# ----------------------------------------------------------------------------- comparing


def _close(a: float, b: float, tolerance: tuple[float, float]) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= tolerance[1] + tolerance[0] * abs(b)


def _same_text(got: str, want: str, tolerance: tuple[float, float]) -> bool:
    """Equal but for the numbers in them, which may differ within the tolerance."""
    if NUMBER.sub("#", got) != NUMBER.sub("#", want):
        return False
    return all(
        _close(float(g), float(w), tolerance) for g, w in zip(NUMBER.findall(got), NUMBER.findall(want), strict=True)
    )


def differences(got: Any, want: Any, tolerance: tuple[float, float], where: str = "") -> list[str]:
    """Every place where ``got`` differs from ``want`` (JSON values), numbers within tolerance."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(set(got) ^ set(want))} added or missing"]
        return [d for k in want for d in differences(got[k], want[k], tolerance, f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: {len(got)} items, pinned {len(want)}"]
        return [
            d
            for n, (g, w) in enumerate(zip(got, want, strict=True))
            for d in differences(g, w, tolerance, f"{where}[{n}]")
        ]
    numbers = (int, float)
    if (
        isinstance(want, numbers)
        and isinstance(got, numbers)
        and not isinstance(want, bool)
        and not isinstance(got, bool)
    ):
        return [] if _close(float(got), float(want), tolerance) else [f"{where}: {got!r}, pinned {want!r}"]
    if isinstance(want, str) and isinstance(got, str) and _same_text(got, want, tolerance):
        return []
    return [] if got == want else [f"{where}: {got!r}, pinned {want!r}"]


def tensor_differences(
    got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray], tolerance: tuple[float, float]
) -> list[str]:
    """Golden output tensors against the pinned ones: same names, shapes, dtypes, values."""
    if set(got) != set(want):
        return [f"golden outputs {sorted(got)}, pinned {sorted(want)}"]
    found = []
    for name in sorted(want):
        a, b = got[name], want[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            found.append(f"golden {name}: {a.dtype}{list(a.shape)}, pinned {b.dtype}{list(b.shape)}")
        elif not np.allclose(a, b, rtol=tolerance[0], atol=tolerance[1], equal_nan=True):
            found.append(f"golden {name}: max |diff| {float(np.max(np.abs(a - b))):.3g}")
    return found


def tensor_tolerance(doc: Mapping[str, Any]) -> tuple[float, float]:
    """fp32 builds: tight; lossy ones: the artifact's own golden tolerance (what its device accepts)."""
    manifest = doc["manifest"]
    if manifest["model"]["precision"] == "fp32":
        return FP32_TOLERANCE
    return float(manifest["golden"]["rtol"]), float(manifest["golden"]["atol"])


def pin_differences(
    doc: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    pinned: Mapping[str, Any],
    pinned_tensors: Mapping[str, np.ndarray],
) -> list[str]:
    """Everything where a snapshot left its pin (empty: identical)."""
    found = differences(doc["manifest"], pinned["manifest"], FP32_TOLERANCE, "manifest")
    found += differences(doc["ops"], pinned["ops"], FP32_TOLERANCE, "ops")
    found += differences(doc["report"], pinned["report"], REPORT_TOLERANCE, "report")
    found += differences(doc["golden"], pinned["golden"], tensor_tolerance(pinned), "golden")
    return found + tensor_differences(tensors, pinned_tensors, tensor_tolerance(pinned))


def read_pin(name: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    return json.loads((PINNED / f"{name}.json").read_text()), _npz(PINNED / f"{name}.npz")


def write_pin(name: str, doc: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
    PINNED.mkdir(exist_ok=True)
    (PINNED / f"{name}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **tensors)
    (PINNED / f"{name}.npz").write_bytes(buffer.getvalue())


# ----------------------------------------------------------------------------- tests


def test_the_comparison_notices_a_changed_answer_and_ignores_the_clock():
    doc = {
        "manifest": {"model": {"precision": "fp32"}, "golden": {}},
        "ops": {"Conv": 2},
        "report": {"why": "recall 1, precision 0.97 (<time> fp32)"},
        "golden": [{"answer": [{"index": 3, "label": "3", "score": 0.5}]}],
    }
    tensors = {"0/logits": np.array([[0.5, 1.0]], np.float32)}
    assert pin_differences(doc, tensors, doc, tensors) == []
    assert _no_timing({"a_ms": 1, "why": "0.238 ms (1.38x fp32)", "seconds": 2}, "/w") == {
        "why": "<time> (<time> fp32)"
    }
    moved = json.loads(json.dumps(doc))
    moved["golden"][0]["answer"][0]["index"] = 4
    moved["report"]["why"] = "recall 1, precision 0.96 (<time> fp32)"
    assert pin_differences(moved, tensors, doc, tensors) == [
        "report.why: 'recall 1, precision 0.96 (<time> fp32)', pinned 'recall 1, precision 0.97 (<time> fp32)'",
        "golden[0].answer[0].index: 4, pinned 3",
    ]
    at_the_tolerance = {"0/logits": tensors["0/logits"] + np.float32(FP32_TOLERANCE[1] / 2)}
    assert pin_differences(doc, at_the_tolerance, doc, tensors) == []
    assert pin_differences(doc, {"0/logits": tensors["0/logits"] + 1e-3}, doc, tensors) == [
        "golden 0/logits: max |diff| 0.001"
    ]


@pytest.fixture(scope="session")
def pinned_recipes(tmp_path_factory) -> Path:
    from tools.demos import torch_available

    return prepare_workspace(tmp_path_factory.mktemp("pinned"), torch=torch_available())


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_demo_artifact_verifies_installs_and_answers_as_pinned(recipe, pinned_recipes, keypair):
    if recipe in TORCH_RECIPES:
        pytest.importorskip("torch", reason="the demo model is trained with torch (installed in CI)")
    artifact = build_recipe(pinned_recipes, recipe, keypair[0])
    doc, tensors = snapshot(artifact, keypair[1], pinned_recipes.parent)
    found = pin_differences(doc, tensors, *read_pin(recipe))
    assert not found, (
        f"{recipe} no longer builds what was pinned (if intended: python -m tests.test_pinned_demos "
        f"--update --only {recipe}):\n" + "\n".join(found[:20])
    )


def main(argv: list[str] | None = None) -> int:
    """``--update``: rebuild the pinned recipes and rewrite tests/pinned/ (a deliberate act)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--update", action="store_true", required=True, help="rewrite tests/pinned/")
    parser.add_argument("--only", action="append", choices=RECIPES, help="this recipe only (repeat)")
    args = parser.parse_args(argv)
    from sdk.keys import write_keypair

    root = Path(tempfile.mkdtemp(prefix="edgepack-pin-"))
    try:
        write_keypair(root / "pin.key", root / "pin.pub")
        recipes = prepare_workspace(root, torch=True)
        for name in args.only or RECIPES:
            doc, tensors = snapshot(build_recipe(recipes, name, root / "pin.key"), root / "pin.pub", root)
            write_pin(name, doc, tensors)
            print(f"pinned {name}: {doc['manifest']['model']['precision']}, {len(doc['golden'])} golden sample(s)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
