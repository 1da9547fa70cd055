"""Packager benchmark: for each demo recipe, model size, latency of the source model against the
packaged one (medians, measured side by side in one process), and accuracy or agreement.

    python tools/bench/packager_bench.py [--runs 200]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sdk.bench import measure  # noqa: E402
from sdk.keys import write_keypair  # noqa: E402
from sdk.packager.pipeline import build  # noqa: E402
from sdk.recipe import load_recipe  # noqa: E402
from tools.demos import build_all  # noqa: E402

RECIPES = ["digits", "digits-int8", "mobilenet", "mobilenet-int8", "mobilenet-dynamic", "tabular"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=200)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edgepack-packager-bench-"))
    build_all(folder / "demo", ["digits", "mobilenet", "tabular"])
    shutil.copytree(ROOT / "recipes", folder / "recipes")
    write_keypair(folder / "k.key", folder / "k.pub")
    rows = []
    print(f"{'recipe':<18} {'src MB':>7} {'pkg MB':>7} {'smaller':>7} {'src ms':>8} {'pkg ms':>8} "
          f"{'speedup':>7}  accuracy")
    for name in RECIPES:
        recipe = load_recipe(folder / "recipes" / f"{name}.yaml", allow_external_paths=True)  # data in ../demo
        result = build(recipe, key_paths=[str(folder / "k.key")], output=folder / "out" / f"{name}.edgepkg")
        source = Path(recipe.data["model"]["path"]).read_bytes()
        with tarfile.open(result.output) as tar:
            packaged = tar.extractfile("model/model.onnx").read()
        # Interleave: source, packaged, source, packaged; keep each one's best median.
        src = min(measure("source", source, runs=args.runs).p50_ms for _ in range(2))
        pkg = min(measure("packaged", packaged, runs=args.runs).p50_ms for _ in range(2))
        validate = result.report["passes"]["validate"]
        if validate.get("accuracy_candidate") is not None:
            accuracy = (f"top-1 {validate['accuracy_candidate']:.2%} (source {validate['accuracy_reference']:.2%})")
        else:
            accuracy = f"cosine {validate['cosine']:.5f}, top-1 agreement {validate['top1_agreement']:.0%}"
        row = {"recipe": name, "precision": result.manifest.raw["model"]["precision"], "source_bytes": len(source),
               "packaged_bytes": len(packaged), "artifact_bytes": result.output.stat().st_size,
               "source_p50_ms": src, "packaged_p50_ms": pkg, "speedup": round(src / pkg, 3), "accuracy": accuracy,
               "warnings": result.warnings}
        rows.append(row)
        print(f"{name:<18} {len(source) / 1e6:7.2f} {len(packaged) / 1e6:7.2f} {len(source) / len(packaged):6.2f}x "
              f"{src:8.3f} {pkg:8.3f} {src / pkg:6.2f}x  {accuracy}")
        for warning in result.warnings:
            print(f"{'':<18} warning: {warning}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
