"""Cold start of ``edgepack-agent predict`` against a bare onnxruntime script, side by side.

Each round starts two fresh processes, in alternating order, and times each from exec to exit
(hyperfine-style; this machine is noisy, so the figures are medians over the rounds):

- agent: ``edgepack-agent predict --artifact A --trust K --input F --json`` (verifies the
  whole artifact, extracts it, creates the session, runs the golden smoke test, preprocesses
  the input, runs, prints the JSON answer);
- bare: a script that loads the already extracted ``model.onnx``, preprocesses the image the
  same way (Pillow: the same reduced-size JPEG decode through ``draft``, the shorter side
  resized bilinear and center-cropped to 224, float32 scale/mean/std, NCHW), runs it with
  onnxruntime and prints a JSON top-5. No verification, no smoke test.

- bare, fast exit: the same script ending with ``os._exit`` once its answer is flushed, as the
  agent's predict does (no interpreter teardown): shows how much of the agent's lead is that.

Both run with bytecode caching on (``PYTHONPYCACHEPREFIX`` in a temp folder, warm-up rounds
first), as on a device where pip compiled the installed packages. The answer's top-1 class of
both is compared, so they do the same work. A third case runs the MobileNet-style artifact
as a plain tar (the same signed members, not gzip-compressed; the reader takes both) against
the same bare script: what the artifact's compression costs a cold start.

    python tools/bench/cold_start.py [--rounds 21] [--warmup 2] [--before DIR]

``--before DIR`` adds a third side in the same rotation: the agent from another tree, e.g.
``git archive REV device_agent edgepack_core | tar -x -C DIR`` (run with ``python -c``, as is
the current agent's console script).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from sdk.keys import write_keypair  # noqa: E402
from tools.bench.agent_overhead import package  # noqa: E402
from tools.demos import build_all  # noqa: E402

BARE_IMAGE = '''
import json, sys
import numpy as np
import onnxruntime as ort
from PIL import Image

model_path, image_path, labels_path = sys.argv[1:4]
session = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
image = Image.open(image_path)
scale = 224 / min(image.size)
image.draft("RGB", (round(image.size[0] * scale), round(image.size[1] * scale)))
image = image.convert("RGB")
scale = 224 / min(image.size)
width, height = max(224, round(image.size[0] * scale)), max(224, round(image.size[1] * scale))
image = image.resize((width, height), Image.BILINEAR)
left, top = (width - 224) // 2, (height - 224) // 2
pixels = np.asarray(image.crop((left, top, left + 224, top + 224)), dtype=np.float32)
std = np.array([0.229, 0.224, 0.225], np.float32)
bias = np.array([0.485, 0.456, 0.406], np.float32) / std
tensor = (pixels * (np.float32(1 / 255) / std) - bias).transpose(2, 0, 1)[None]
logits = session.run(None, {session.get_inputs()[0].name: np.ascontiguousarray(tensor)})[0][0]
probabilities = np.exp(logits - logits.max())
probabilities /= probabilities.sum()
labels = open(labels_path, encoding="utf-8").read().splitlines()
top = np.argsort(-probabilities)[:5]
print(json.dumps({"result": [{"index": int(i), "label": labels[i], "score": float(probabilities[i])} for i in top]}))
'''

BARE_TENSOR = '''
import json, sys
import numpy as np
import onnxruntime as ort

session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
outputs = session.run(None, {session.get_inputs()[0].name: np.load(sys.argv[2])})
print(json.dumps({"outputs": {o.name: v.tolist() for o, v in zip(session.get_outputs(), outputs)}}))
'''


# The bare script run to its end, then os._exit once its answer is flushed (no teardown).
FAST_EXIT = ("import os, runpy, sys\nsys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n"
             "sys.stdout.flush()\nos._exit(0)\n")


def timed(command: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(wall seconds from exec to exit, CPU seconds user+system of the child, its stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"{command[0]} failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu, done.stdout


def side_by_side(commands: dict[str, list[str]], env: dict[str, str], rounds: int,
                 warmup: int) -> tuple[dict[str, dict[str, list[float]]], dict[str, str]]:
    """Fresh processes, each round in a rotated order; the first ``warmup`` rounds are dropped.
    Returns the wall and CPU times of each side and the last stdout of each."""
    times: dict[str, dict[str, list[float]]] = {side: {"wall": [], "cpu": []} for side in commands}
    outputs = dict.fromkeys(commands, "")
    sides = list(commands)
    for index in range(warmup + rounds):
        shift = index % len(sides)
        for side in sides[shift:] + sides[:shift]:
            wall, cpu, outputs[side] = timed(commands[side], env)
            if index >= warmup:
                times[side]["wall"].append(wall)
                times[side]["cpu"].append(cpu)
    return times, outputs


def agent_from(tree: Path) -> list[str]:
    """``edgepack-agent`` run from another checkout's device_agent/ and edgepack_core/ (e.g.
    ``git archive REV device_agent edgepack_core | tar -x -C DIR``): the before side."""
    return [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); from device_agent.cli import main; "
            "sys.exit(main(sys.argv[1:]))", str(tree)]


def same_answer(name: str, first: str, second: str) -> bool:
    a, b = json.loads(first), json.loads(second)
    if name == "mobilenet":
        return a["result"][0]["index"] == b["result"][0]["index"]
    return a["outputs"] == b["outputs"]


def camera_jpeg(source: Path, out: Path) -> Path:
    """A 640x480 JPEG (quality 90) made from a demo image: what a camera pipeline sends."""
    from PIL import Image

    Image.open(source).convert("RGB").resize((640, 480), Image.BILINEAR).save(out, quality=90)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--before", type=Path, help="also run the agent from this tree (device_agent/, edgepack_core/)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edgepack-cold-"))
    build_all(folder / "demo", ["mobilenet", "tiny"])
    write_keypair(folder / "k.key", folder / "k.pub")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(folder / "pycache")
    agent_cli = str(Path(sys.executable).parent / "edgepack-agent")
    (folder / "bare_image.py").write_text(BARE_IMAGE)
    (folder / "bare_tensor.py").write_text(BARE_TENSOR)
    demo = folder / "demo"
    camera = camera_jpeg(next((demo / "mobilenet" / "images").iterdir()), folder / "camera.jpg")
    cases = {
        "mobilenet, 640x480 JPEG": ("mobilenet", camera, False),
        "mobilenet, plain tar": ("mobilenet", camera, True),
        "tiny (1x4), .npy": ("tiny", demo / "tiny" / "example.npy", False),
    }
    artifacts = {name: package(folder, name, folder / "k.key") for name in ("mobilenet", "tiny")}
    plain = folder / "mobilenet-plain.edgepkg"
    plain.write_bytes(gzip.decompress(artifacts["mobilenet"].read_bytes()))
    sizes = {"gzip": artifacts["mobilenet"].stat().st_size, "plain": plain.stat().st_size}
    print(f"mobilenet artifact: {sizes['gzip']} bytes gzip, {sizes['plain']} bytes plain tar")
    results: dict[str, Any] = {"mobilenet_artifact_bytes": sizes}
    header = f"{'case':<26} {'side':<9} {'wall':>8} {'ratio':>6}   {'CPU':>7} {'ratio':>6}  same answer as bare"
    print(header)
    for label, (name, example, uncompressed) in cases.items():
        artifact = plain if uncompressed else artifacts[name]
        model = demo / name / "model.onnx"
        predict = ["predict", "--artifact", str(artifact), "--trust", str(folder / "k.pub"), "--input", str(example),
                   "--json"]
        commands = {"agent": [agent_cli, *predict]}
        if args.before is not None:
            commands["before"] = [*agent_from(args.before), *predict]
        script = [str(folder / "bare_image.py"), str(model), str(example), str(demo / name / "labels.txt")] \
            if name == "mobilenet" else [str(folder / "bare_tensor.py"), str(model), str(example)]
        commands["bare"] = [sys.executable, *script]
        commands["bare+exit"] = [sys.executable, "-c", FAST_EXIT, *script]
        times, outputs = side_by_side(commands, env, args.rounds, args.warmup)
        medians = {side: {kind: statistics.median(values) for kind, values in t.items()} for side, t in times.items()}
        bare = medians["bare"]
        results[label] = {"rounds": args.rounds}
        for side, median in medians.items():
            agrees = same_answer(name, outputs[side], outputs["bare"])
            results[label][side] = {"wall_s": round(median["wall"], 4), "cpu_s": round(median["cpu"], 4),
                                    "ratio": round(median["wall"] / bare["wall"], 3),
                                    "cpu_ratio": round(median["cpu"] / bare["cpu"], 3), "same_answer": agrees}
            print(f"{label:<26} {side:<9} {median['wall'] * 1000:>5.0f} ms {median['wall'] / bare['wall']:>6.2f}   "
                  f"{median['cpu'] * 1000:>4.0f} ms {median['cpu'] / bare['cpu']:>6.2f}  {agrees}")
    print(json.dumps({"cold_start": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
