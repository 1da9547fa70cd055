"""Streams at the speed of the slowest stage: a 1280x720 H.264 clip at 30 FPS through the
detector demo, measured side by side in one run (issue 26's benchmarks).

Per round, one after the other on the same clip and models:

- decode alone (PyAV, frame threads, to RGB) and inference alone (the detector's
  ``InferenceService.predict`` on the decoded frames held in memory): per-frame times D and I,
  so the bound a two-stage pipeline can reach is 1 / max(D, I);
- one thread doing both (decode a frame, run it, the next): the loop users write themselves;
- the agent's pipeline (``PipelineRunner``, file source, policy ``every``): its frames/s against
  the bound and against the one-thread loop;
- a detector -> classifier chain (the digits demo on up to 8 crops per frame) against the
  detector alone.

Then, once: frame age under ``latest`` with the clip pushed in real time at 30 FPS (a camera)
for ``--age-seconds``: p50/p99 of how old a frame is when its inference starts, against one
inference period plus one frame interval; and a real ``edgepack-agent run`` (the detector
installed): its RSS idle, and its RSS and CPU while a pipeline reads the clip in real time
(``loop``, ``realtime``, ``latest``) for ``--agent-seconds``. Medians over ``--rounds``; the machine is shared and
noisy. Needs PyAV (``pip install 'edgepack-agent[streams]'``); the detector demo needs torch
(else a YOLO-style 640x640 ONNX built here stands in, and the output says so).

    python tools/bench/streams.py [--seconds 10] [--rounds 3] [--age-seconds 60] [--agent-seconds 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from device_agent.pipelines.runner import PipelineRunner  # noqa: E402
from device_agent.pipelines.spec import parse_pipelines  # noqa: E402
from device_agent.runtime import InferenceService  # noqa: E402
from edgepack_core.signing import TrustStore, load_public_key  # noqa: E402
from sdk.keys import write_keypair  # noqa: E402
from tools.bench.image_path import detector_recipe, package, photo_like  # noqa: E402
from tools.demos import build_all  # noqa: E402

WIDTH, HEIGHT, FPS = 1280, 720, 30


def make_clip(path: Path, seconds: float) -> Path:
    """A camera-like H.264 clip: a textured still background with coloured shapes moving on it
    (libx264, CRF 23, a keyframe a second)."""
    import av

    background = photo_like(WIDTH, HEIGHT)
    rng = np.random.default_rng(1)
    shapes = [(rng.uniform(0, WIDTH - 120), rng.uniform(0, HEIGHT - 120), rng.uniform(-8, 8), rng.uniform(-5, 5),
               tuple(int(v) for v in rng.integers(40, 255, 3))) for _ in range(6)]
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=FPS)
        stream.width, stream.height, stream.pix_fmt = WIDTH, HEIGHT, "yuv420p"
        stream.options = {"crf": "23", "preset": "veryfast", "g": str(FPS)}
        for index in range(int(seconds * FPS)):
            frame = background.copy()
            for x0, y0, dx, dy, colour in shapes:
                x, y = int(x0 + dx * index) % (WIDTH - 120), int(y0 + dy * index) % (HEIGHT - 120)
                frame[y:y + 110, x:x + 110] = colour
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def decode_all(path: Path) -> list[np.ndarray]:
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]


def timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def one_thread(path: Path, service: InferenceService) -> int:
    """Decode a frame, run it, the next: the loop a user writes."""
    import av

    count = 0
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            service.predict(frame.to_ndarray(format="rgb24"))
            count += 1
    return count


def pipeline_document(clip: Path, stages: list[dict[str, Any]], **source: Any) -> Any:
    (spec,) = parse_pipelines([{"name": "bench", "source": {"file": str(clip), "policy": "every", "queue": 4,
                                                            **source}, "stages": stages}])
    return spec


def run_pipeline(clip: Path, services: dict[str, InferenceService], stages: list[dict[str, Any]]) -> float:
    runner = PipelineRunner(pipeline_document(clip, stages), "bench", services.get, [])
    start = time.perf_counter()
    runner.start()
    runner.finished.wait(600)
    elapsed = time.perf_counter() - start
    runner.stop()
    return runner.counters.frames / elapsed


def one_round(clip: Path, frames: list[np.ndarray], services: dict[str, InferenceService], detector: str,
              classifier: str) -> dict[str, float]:
    service = services[detector]
    decode_s = timed(lambda: decode_all(clip)) / len(frames)
    infer_s = timed(lambda: [service.predict(f) for f in frames]) / len(frames)
    sequential = len(frames) / timed(lambda: one_thread(clip, service))
    piped = run_pipeline(clip, services, [{"model": detector}])
    crops = sum(min(8, len(service.predict(f).result)) for f in frames[:30]) / 30
    chain = run_pipeline(clip, services, [{"model": detector},
                                          {"model": classifier, "crop": {"from": detector, "max": 8}}])
    return {"decode_ms": decode_s * 1000, "inference_ms": infer_s * 1000, "bound_fps": 1 / max(decode_s, infer_s),
            "one_thread_fps": sequential, "pipeline_fps": piped, "chain_fps": chain, "crops_per_frame": crops}


def proc_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def frame_ages(frames: list[np.ndarray], services: dict[str, InferenceService], detector: str,
               seconds: float) -> dict[str, float]:
    """Push the clip at 30 FPS in real time (looping) into a ``latest`` pipeline: the ages of
    the frames answered, p50/p99."""
    (spec,) = parse_pipelines([{"name": "age", "source": {"push": True, "policy": "latest", "queue": 1},
                                "stages": [{"model": detector}]}])
    runner = PipelineRunner(spec, "bench", services.get, [])
    runner.start()
    index, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        delay = start + index / FPS - time.perf_counter()
        if delay > 0:
            threading.Event().wait(delay)  # pacing a simulated camera, not synchronising threads
        runner.push(frames[index % len(frames)])
        index += 1
    runner.stop()
    ages = sorted(runner.counters.ages_s)
    return {"pushed": index, "answered": runner.counters.frames, "dropped": runner.queue.dropped,
            "age_p50_ms": 1000 * ages[len(ages) // 2], "age_p99_ms": 1000 * ages[max(0, int(len(ages) * 0.99) - 1)]}


def agent_figures(folder: Path, artifact: Path, clip: Path, seconds: float) -> dict[str, float]:
    """A real ``edgepack-agent run``: RSS idle (the detector loaded, no pipeline), then RSS and
    CPU while a pipeline reads the clip in real time; medians of one sample a second."""
    out: dict[str, float] = {}
    for label, pipelines in (("idle", []), ("streaming", [{
            "name": "cam", "source": {"file": str(clip), "loop": True, "realtime": True, "policy": "latest"},
            "stages": [{"model": artifact.stem}]}])):
        config = folder / f"agent-{label}.yaml"
        config.write_text(yaml.safe_dump({"device_id": "bench", "store": str(folder / f"store-{label}"),
                                          "trust": [str(folder / "k.pub")],
                                          "models": [{"name": artifact.stem, "artifact": str(artifact)}],
                                          "pipelines": pipelines}))
        agent = subprocess.Popen([sys.executable, "-m", "device_agent.cli", "run", "--config", str(config)],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            threading.Event().wait(5)  # let it install and settle before sampling
            cpu0, wall0, samples = proc_cpu_s(agent.pid), time.perf_counter(), []
            for _ in range(int(seconds)):
                threading.Event().wait(1)
                samples.append(proc_rss_mib(agent.pid))
            out[f"{label}_rss_mib"] = statistics.median(samples)
            out[f"{label}_cpu_cores"] = (proc_cpu_s(agent.pid) - cpu0) / (time.perf_counter() - wall0)
        finally:
            agent.terminate()
            agent.wait(30)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the clip")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--age-seconds", type=float, default=60.0)
    parser.add_argument("--agent-seconds", type=float, default=30.0)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edgepack-streams-bench-"))
    try:
        build_all(folder / "demo", ["digits"])
        write_keypair(folder / "k.key", folder / "k.pub")
        trust = TrustStore([load_public_key(folder / "k.pub")])
        detector, document = detector_recipe(folder)
        classifier = "digits"
        digits = yaml.safe_load((ROOT / "recipes" / "digits.yaml").read_text())
        models = {detector: package(folder, detector, document, folder / "k.key", trust),
                  classifier: package(folder, classifier, digits, folder / "k.key", trust)}
        services = {name: InferenceService(model) for name, model in models.items()}
        clip = make_clip(folder / "clip.mp4", args.seconds)
        frames = decode_all(clip)
        print(f"clip: {len(frames)} frames {WIDTH}x{HEIGHT} at {FPS} FPS, {clip.stat().st_size / 1e6:.1f} MB H.264; "
              f"detector {detector}, classifier {classifier}")
        rounds = [one_round(clip, frames, services, detector, classifier) for _ in range(args.rounds)]
        median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        median["pipeline_vs_bound"] = statistics.median(r["pipeline_fps"] / r["bound_fps"] for r in rounds)
        median["pipeline_vs_one_thread"] = statistics.median(r["pipeline_fps"] / r["one_thread_fps"] for r in rounds)
        median["chain_vs_detector"] = statistics.median(r["chain_fps"] / r["pipeline_fps"] for r in rounds)
        ages = frame_ages(frames, services, detector, args.age_seconds)
        ages["budget_ms"] = median["inference_ms"] + 1000 / FPS
        agent = agent_figures(folder, folder / f"{detector}.edgepkg", clip, args.agent_seconds)
        print(f"decode {median['decode_ms']:.2f} ms/frame, inference {median['inference_ms']:.2f} ms/frame: "
              f"bound {median['bound_fps']:.1f} FPS")
        print(f"pipeline {median['pipeline_fps']:.1f} FPS = {median['pipeline_vs_bound']:.2f}x the bound, "
              f"{median['pipeline_vs_one_thread']:.2f}x one thread ({median['one_thread_fps']:.1f} FPS)")
        print(f"chain (up to 8 crops, {median['crops_per_frame']:.1f} a frame) {median['chain_fps']:.1f} FPS = "
              f"{median['chain_vs_detector']:.2f}x the detector alone")
        print(f"latest at 30 FPS for {args.age_seconds:.0f} s: {ages['answered']} of {ages['pushed']} frames answered, "
              f"{ages['dropped']} dropped; age p50 {ages['age_p50_ms']:.1f} ms, p99 {ages['age_p99_ms']:.1f} ms "
              f"(budget: one inference + one frame interval = {ages['budget_ms']:.1f} ms)")
        print(f"edgepack-agent run: idle {agent['idle_rss_mib']:.0f} MiB RSS, {agent['idle_cpu_cores']:.3f} cores; "
              f"streaming the clip in real time {agent['streaming_rss_mib']:.0f} MiB RSS, "
              f"{agent['streaming_cpu_cores']:.2f} cores")
        print(json.dumps({"rounds": args.rounds, "median": median, "latest": ages, "agent": agent}, indent=1))
        return 0
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
