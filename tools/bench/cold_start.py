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

Both run with bytecode caching on (``PYTHONPYCACHEPREFIX`` in a temp folder, warm-up rounds
first), as on a device where pip compiled the installed packages. The answer's top-1 class of
both is compared, so they do the same work.

    python tools/bench/cold_start.py [--rounds 21] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def side_by_side(agent: list[str], bare: list[str], env: dict[str, str], rounds: int,
                 warmup: int) -> tuple[dict[str, list[float]], dict[str, list[float]], str, str]:
    """Alternating fresh processes; the first ``warmup`` rounds are dropped. Returns the wall
    and CPU times of each side and the last stdout of each."""
    agent_times: dict[str, list[float]] = {"wall": [], "cpu": []}
    bare_times: dict[str, list[float]] = {"wall": [], "cpu": []}
    outputs = {"agent": "", "bare": ""}
    for index in range(warmup + rounds):
        order = [("agent", agent, agent_times), ("bare", bare, bare_times)]
        if index % 2:
            order.reverse()
        for side, command, times in order:
            wall, cpu, outputs[side] = timed(command, env)
            if index >= warmup:
                times["wall"].append(wall)
                times["cpu"].append(cpu)
    return agent_times, bare_times, outputs["agent"], outputs["bare"]


def camera_jpeg(source: Path, out: Path) -> Path:
    """A 640x480 JPEG (quality 90) made from a demo image: what a camera pipeline sends."""
    from PIL import Image

    Image.open(source).convert("RGB").resize((640, 480), Image.BILINEAR).save(out, quality=90)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=2)
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
    cases = {
        "mobilenet, 640x480 JPEG": ("mobilenet", camera_jpeg(next((demo / "mobilenet" / "images").iterdir()),
                                                            folder / "camera.jpg")),
        "tiny (1x4), .npy": ("tiny", demo / "tiny" / "example.npy"),
    }
    results = {}
    print(f"{'case':<26} {'agent wall':>11} {'bare wall':>10} {'ratio':>6}   {'agent CPU':>10} {'bare CPU':>9} "
          f"{'ratio':>6}  same answer")
    for label, (name, example) in cases.items():
        artifact = package(folder, name, folder / "k.key")
        model = demo / name / "model.onnx"
        agent = [agent_cli, "predict", "--artifact", str(artifact), "--trust", str(folder / "k.pub"),
                 "--input", str(example), "--json"]
        if name == "mobilenet":
            bare = [sys.executable, str(folder / "bare_image.py"), str(model), str(example),
                    str(demo / name / "labels.txt")]
        else:
            bare = [sys.executable, str(folder / "bare_tensor.py"), str(model), str(example)]
        agent_times, bare_times, agent_out, bare_out = side_by_side(agent, bare, env, args.rounds, args.warmup)
        agent_answer, bare_answer = json.loads(agent_out), json.loads(bare_out)
        if name == "mobilenet":
            agrees = agent_answer["result"][0]["index"] == bare_answer["result"][0]["index"]
        else:
            agrees = agent_answer["outputs"] == bare_answer["outputs"]
        agent_s, bare_s = statistics.median(agent_times["wall"]), statistics.median(bare_times["wall"])
        agent_cpu, bare_cpu = statistics.median(agent_times["cpu"]), statistics.median(bare_times["cpu"])
        results[label] = {"agent_s": round(agent_s, 4), "bare_s": round(bare_s, 4), "ratio": round(agent_s / bare_s, 3),
                          "agent_cpu_s": round(agent_cpu, 4), "bare_cpu_s": round(bare_cpu, 4),
                          "cpu_ratio": round(agent_cpu / bare_cpu, 3), "same_answer": agrees, "rounds": args.rounds}
        print(f"{label:<26} {agent_s * 1000:>8.0f} ms {bare_s * 1000:>7.0f} ms {agent_s / bare_s:>6.2f}   "
              f"{agent_cpu * 1000:>7.0f} ms {bare_cpu * 1000:>6.0f} ms {agent_cpu / bare_cpu:>6.2f}  {agrees}")
    print(json.dumps({"cold_start": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
