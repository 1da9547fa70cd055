"""Build the demo models and data from code (no downloads): ``python tools/build_demos.py --out demo``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.demos import BUILDERS, build_all
from tools.demos.vad import build_vad


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("demo"), help="output folder (default: demo/)")
    parser.add_argument("--only", action="append", choices=sorted(BUILDERS), help="build only this demo (repeat)")
    args = parser.parse_args()
    started = time.perf_counter()
    models = build_all(args.out, args.only)
    if not args.only:  # the stateful audio demo (tools/demos/vad.py): model and WAV clips
        models["vad"] = build_vad(args.out / "vad")
    for name, path in models.items():
        metrics = path.parent / "metrics.json"
        extra = ""
        if metrics.exists():
            data = json.loads(metrics.read_text())
            extra = f"  held-out accuracy {data['test_accuracy']:.2%} on {data['n_test']} samples"
        print(f"{name:<10} {path}  ({path.stat().st_size:,d} bytes){extra}")
    print(f"built {len(models)} demo(s) in {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
