"""Build the demo models and data from code (no downloads): ``python tools/build_demos.py --out demo``.

The torch demos (a YOLOv8-style detector, a CTC recognizer, an LSTM VAD, a model with -1 dims
and a classifier ending in Softmax; tools/demos/__init__.py, TORCH_BUILDERS) are trained with
torch and built only when torch imports; without it they are skipped with a note, and the
other demos build as before. Trained demos are cached in .cache/demos (tools/demos/cache.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.demos import BUILDERS, TORCH_BUILDERS, build_all, build_torch_demos, torch_available
from tools.demos.vad import build_vad

_SCORES = (("test_accuracy", "held-out accuracy"), ("string_accuracy", "held-out string accuracy"),
           ("recall", "recall vs drawn boxes"), ("frame_accuracy_16k_clip", "frame accuracy"))


def _summary(path: Path) -> str:
    metrics = path.parent / "metrics.json"
    if not metrics.exists():
        return ""
    data = json.loads(metrics.read_text())
    return "".join(f"  {label} {data[key]:.2%}" for key, label in _SCORES if key in data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("demo"), help="output folder (default: demo/)")
    parser.add_argument("--only", action="append", choices=sorted([*BUILDERS, *TORCH_BUILDERS]),
                        help="build only this demo (repeat)")
    args = parser.parse_args()
    started = time.perf_counter()
    only = args.only or []
    plain = [name for name in only if name in BUILDERS]
    trained = [name for name in only if name in TORCH_BUILDERS]
    models = build_all(args.out, plain) if plain or not only else {}
    if not only:  # the stateful audio demo (tools/demos/vad.py): model and WAV clips
        models["vad"] = build_vad(args.out / "vad")
    if trained or not only:
        if torch_available():
            models.update(build_torch_demos(args.out, trained or None))
        else:
            print(f"skipped {', '.join(trained or TORCH_BUILDERS)}: torch is not installed (these demos are "
                  "trained with it; EDGEPACK_WITH_TORCH=1 bash tools/setup_venv.sh installs the pinned CPU build)")
    for name, path in models.items():
        print(f"{name:<12} {path}  ({path.stat().st_size:,d} bytes){_summary(path)}")
    print(f"built {len(models)} demo(s) in {time.perf_counter() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
