"""Quantization search benchmark: per model, fp32 against what the search shipped (size, p50
latency, task metric), how many candidates it tried and how long it searched, and the best int8
candidate that kept the accuracy budget (what the speed rule turned down, if it did).

    python tools/bench/quant_search.py [--runs 200] [--only detector,recognizer]
    python tools/bench/quant_search.py --variants   # the calibration variants, first candidate only

Models: the torch-exported ones of tests/quant_models.py (a YOLOv8-style detector, the same with
an outlier channel, a CTC recognizer for x86 and for a Jetson) and the digits and MobileNet-style
demos through their repo recipes. Every build runs the real search with real timings (the
latency rule included). p50s are measured afterwards side by side: fp32 and shipped in
alternating blocks in one onnxruntime worker, one thread (the search's own measure) and all
cores, the median of each model's runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sdk.bench import InputHints, make_feed  # noqa: E402
from sdk.keys import write_keypair  # noqa: E402
from sdk.packager import ort_host  # noqa: E402
from sdk.packager.pipeline import build  # noqa: E402
from sdk.recipe import load_recipe, recipe_from_dict  # noqa: E402

SAMPLES = 32
BLOCKS = 5


def _torch_cases(folder: Path) -> list[tuple[str, Any]]:
    from tests.quant_models import detector_images, export_detector, export_recognizer, line_images

    export_detector(folder / "detector.onnx")
    export_detector(folder / "outlier.onnx", outlier=True)
    export_recognizer(folder / "recognizer.onnx")
    for name, images in (("det", detector_images), ("line", line_images)):
        np.savez(folder / f"{name}-calib.npz", images=images(SAMPLES, seed=1))
        np.savez(folder / f"{name}-val.npz", images=images(SAMPLES, seed=2))

    def doc(model: str, data: str, postprocess: dict, **extra: Any) -> dict:
        return {"name": model, "version": "1.0.0", "model": {"path": f"{model}.onnx"}, "postprocess": postprocess,
                "quantize": {"mode": "static", "calibration": {"npz": f"{data}-calib.npz"}},
                "validate": {"data": {"npz": f"{data}-val.npz"}}, **extra}

    detection = {"kind": "detection", "format": "yolov8"}
    ctc = {"kind": "ctc", "blank": 0}
    return [
        ("detector (YOLOv8-style)", recipe_from_dict(doc("detector", "det", detection), folder)),
        ("detector, outlier channel", recipe_from_dict(doc("outlier", "det", detection), folder)),
        ("CTC recognizer, x86", recipe_from_dict(doc("recognizer", "line", ctc), folder)),
        ("CTC recognizer, jetson", recipe_from_dict(doc("recognizer", "line", ctc, targets=["jetson"]), folder)),
    ]


def _demo_cases(folder: Path) -> list[tuple[str, Any]]:
    from tools.demos import build_all

    build_all(folder / "demo", ["digits", "mobilenet"])
    shutil.copytree(ROOT / "recipes", folder / "recipes")
    return [(f"{name} (repo recipe)", load_recipe(folder / "recipes" / f"{name}.yaml", allow_external_paths=True))
            for name in ("digits-int8", "mobilenet-int8")]


def _side_by_side(fp32: bytes, shipped: bytes, feed: dict[str, np.ndarray], runs: int, threads: int
                  ) -> tuple[float, float]:
    """p50 ms of both models, alternating blocks of ``runs / BLOCKS`` runs."""
    times: dict[str, list[float]] = {"fp32": [], "shipped": []}
    for model in (fp32, shipped):
        ort_host.measure_latency(model, feed, runs=1, warmup=5, threads=threads)
    for _ in range(BLOCKS):
        for name, model in (("fp32", fp32), ("shipped", shipped)):
            times[name] += ort_host.measure_latency(model, feed, runs=max(1, runs // BLOCKS), warmup=0,
                                                    threads=threads)
    return float(np.median(times["fp32"]) * 1000), float(np.median(times["shipped"]) * 1000)


def _metric(entry: dict[str, Any]) -> str:
    task = entry.get("task") or {}
    outputs = task.get("outputs") or [{}]
    return "; ".join(o.get("why", "").split(": ", 1)[-1] for o in outputs) or entry.get("error", "")


def _case(label: str, recipe: Any, folder: Path, key: Path, runs: int) -> dict[str, Any]:
    started = time.monotonic()
    result = build(recipe, key_paths=[str(key)], output=folder / "out" / f"{recipe.name}-{len(label)}.edgepkg")
    wall = time.monotonic() - started
    report = result.report["passes"]["quantize"]
    with tarfile.open(result.output) as tar:
        shipped = tar.extractfile("model/model.onnx").read()
    fp32 = Path(recipe.data["model"]["path"]).read_bytes()
    feed = make_feed(ort_host.describe(fp32).inputs, InputHints())
    one = _side_by_side(fp32, shipped, feed, runs, threads=1)
    every = _side_by_side(fp32, shipped, feed, runs, threads=0)
    kept = [e for e in report["candidates"] if e.get("budget_met") and e.get("kind") == "int8"]
    best = max(kept, key=lambda e: e["speedup"], default=None)
    validate = result.report["passes"]["validate"]
    return {
        "model": label, "precision": result.manifest.raw["model"]["precision"], "preset": report["preset"],
        "fp32_bytes": len(fp32), "shipped_bytes": len(shipped),
        "fp32_p50_ms_1t": round(one[0], 4), "shipped_p50_ms_1t": round(one[1], 4),
        "fp32_p50_ms": round(every[0], 4), "shipped_p50_ms": round(every[1], 4),
        "shipped_metric": validate.get("summary", ""),
        "candidates": [{"stage": e["stage"], "kind": e["kind"], "verdict": e.get("verdict", "error"),
                        "metric": _metric(e), "speedup": e.get("speedup"), "bytes": e.get("bytes")}
                       for e in report["candidates"]],
        "tried": len(report["candidates"]), "search_s": report["search_s"], "build_s": round(wall, 1),
        "best_int8_kept": None if best is None else {"stage": best["stage"], "speedup": best["speedup"],
                                                     "bytes": best["bytes"]},
        "warnings": result.warnings,
    }


VARIANTS = (("minmax", True), ("minmax", False), ("percentile", True), ("entropy", True))


def _variants(cases: list[tuple[str, Any]], folder: Path, key: Path) -> list[dict[str, Any]]:
    """Each torch case's requested candidate alone under each calibration method / per-channel
    setting (search off, speed rule off): whether a variant keeps a budget that MinMax misses."""
    rows = []
    for label, recipe in cases:
        for method, per_channel in VARIANTS:
            data = json.loads(json.dumps(recipe.data))
            data["quantize"].update(search=False, min_speedup=0, method=method, per_channel=per_channel)
            data["validate"]["allow_failure"] = True
            variant = recipe_from_dict(data, folder)
            result = build(variant, key_paths=[str(key)], output=folder / "out" / "variant.edgepkg")
            entry = result.report["passes"]["quantize"]["candidates"][0]
            rows.append({"model": label, "method": method, "per_channel": per_channel,
                         "budget_met": entry.get("budget_met"), "metric": _metric(entry)})
            print(f"{label:<28} {method:<10} {'per-channel' if per_channel else 'per-tensor':<11} {_metric(entry)}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200, help="timed runs per model per setting (in 5 blocks)")
    parser.add_argument("--only", default="", help="comma-separated substrings of the model labels to run")
    parser.add_argument("--variants", action="store_true",
                        help="instead: the calibration-method and per-channel variants on the torch models")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edgepack-quant-search-bench-"))
    write_keypair(folder / "k.key", folder / "k.pub")
    if args.variants:
        print(json.dumps(_variants(_torch_cases(folder), folder, folder / "k.key")))
        return 0
    cases = _torch_cases(folder) + _demo_cases(folder)
    wanted = [w for w in args.only.split(",") if w]
    rows = []
    for label, recipe in cases:
        if wanted and not any(w.lower() in label.lower() for w in wanted):
            continue
        row = _case(label, recipe, folder, folder / "k.key", args.runs)
        rows.append(row)
        print(f"\n{label}: shipped {row['precision']} (preset {row['preset']}), {row['tried']} candidate(s), "
              f"search {row['search_s']:.1f} s")
        print(f"  size {row['fp32_bytes']:,d} -> {row['shipped_bytes']:,d} bytes; p50 1 thread "
              f"{row['fp32_p50_ms_1t']:.3f} -> {row['shipped_p50_ms_1t']:.3f} ms; all cores "
              f"{row['fp32_p50_ms']:.3f} -> {row['shipped_p50_ms']:.3f} ms")
        print(f"  shipped against fp32: {row['shipped_metric']}")
        for n, c in enumerate(row["candidates"], start=1):
            print(f"  {n}. {c['stage']:<17} {c['verdict']:<45} {c['metric'][:70]:<70} "
                  f"{(c['speedup'] or 0):.2f}x")
        for warning in row["warnings"]:
            print(f"  warning: {warning}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
