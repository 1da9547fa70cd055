"""Agent runtime overhead, measured side by side in one run.

- per-call: agent ``predict_tensors`` (validation, stats, postprocessing off) against a bare
  ``InferenceSession.run`` on the same model and inputs, interleaved in blocks so drift on a
  noisy machine hits both alike; medians. On the MobileNet-style demo and the tiny model.
- memory: RSS growth over 100,000 agent predict calls on the tiny model.
- footprint: RSS of a process holding an agent-loaded model vs a bare session.
- cold start: a fresh process from exec to first inference, agent CLI vs bare onnxruntime.

    python tools/bench/agent_overhead.py [--calls 3000] [--rss-calls 100000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from device_agent.providers import session_options  # noqa: E402
from device_agent.runtime import InferenceService, load_model  # noqa: E402
from edgepack_core.artifact import extract_artifact  # noqa: E402
from edgepack_core.signing import TrustStore, load_public_key  # noqa: E402
from sdk.keys import write_keypair  # noqa: E402
from sdk.packager.pipeline import build  # noqa: E402
from sdk.recipe import load_recipe  # noqa: E402
from tools.demos import build_all  # noqa: E402


def rss_bytes(pid: int | str = "self") -> int:
    with open(f"/proc/{pid}/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def package(folder: Path, name: str, key: Path) -> Path:
    recipe = folder / f"{name}.yaml"
    if name == "tiny":
        recipe.write_text("name: tiny\nversion: 1.0.0\nmodel: {path: demo/tiny/model.onnx}\ntargets: [x86]\n"
                          "validate: {data: synthetic}\n")
    else:
        text = (ROOT / "recipes" / f"{name}.yaml").read_text().replace("../demo/", "demo/")
        recipe.write_text(text)
    return build(load_recipe(recipe), key_paths=[str(key)], output=folder / f"{name}.edgepkg").output


def per_call(model, feed: dict, calls: int, block: int = 100) -> tuple[float, float]:
    import onnxruntime as ort

    raw = ort.InferenceSession(str(model.root / model.manifest.model_path), session_options(0),
                               providers=["CPUExecutionProvider"])
    names = [o.name for o in raw.get_outputs()]
    service = InferenceService(model)
    for _ in range(50):
        raw.run(names, feed)
        service.predict_tensors(feed, postprocess=False)
    agent_times, raw_times = [], []
    perf = time.perf_counter
    for _ in range(calls // block):
        for _ in range(block):
            t0 = perf()
            raw.run(names, feed)
            raw_times.append(perf() - t0)
        for _ in range(block):
            t0 = perf()
            service.predict_tensors(feed, postprocess=False)
            agent_times.append(perf() - t0)
    return statistics.median(agent_times), statistics.median(raw_times)


def cold_start(artifact: Path, public: Path, example: Path, model_path: Path) -> tuple[float, float]:
    agent = [str(Path(sys.executable).parent / "edgepack-agent"), "predict", "--artifact", str(artifact), "--trust",
             str(public), "--input", str(example), "--json"]
    bare = [sys.executable, "-c", "import sys, numpy as np, onnxruntime as ort; s = ort.InferenceSession(sys.argv[1], "
            "providers=['CPUExecutionProvider']); s.run(None, {'x': np.load(sys.argv[2])})", str(model_path),
            str(example)]
    results = []
    for command in (agent, bare):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            subprocess.run(command, check=True, capture_output=True)
            times.append(time.perf_counter() - t0)
        results.append(statistics.median(times))
    return results[0], results[1]


_RSS = "print(int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE'))"
_AGENT_PROCESS = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "from device_agent.runtime import load_model\n"
    "from edgepack_core.manifest import parse_manifest\n"
    "model = load_model(Path(sys.argv[2]), parse_manifest(Path(sys.argv[3]).read_bytes()))\n" + _RSS
)
_BARE_PROCESS = (
    "import os, sys, onnxruntime as ort\n"
    "session = ort.InferenceSession(sys.argv[1], providers=['CPUExecutionProvider'])\n" + _RSS
)


def footprint(root: Path, manifest_path: Path) -> tuple[int, int]:
    def rss_of(*command: str) -> int:
        return int(subprocess.run([sys.executable, "-c", *command], capture_output=True, text=True,
                                  check=True).stdout)

    agent = rss_of(_AGENT_PROCESS, str(ROOT), str(root), str(manifest_path))
    bare = rss_of(_BARE_PROCESS, str(root / "model" / "model.onnx"))
    return agent, bare


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rss-calls", type=int, default=100_000)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edgepack-bench-"))
    build_all(folder / "demo", ["mobilenet", "tiny"])
    write_keypair(folder / "k.key", folder / "k.pub")
    trust = TrustStore([load_public_key(folder / "k.pub")])
    results: dict = {}
    models = {}
    for name in ("mobilenet", "tiny"):
        artifact = package(folder, name, folder / "k.key")
        verified = extract_artifact(artifact, folder / f"x-{name}", trust)
        models[name] = (artifact, verified.root, load_model(verified.root, verified.manifest))
    rng = np.random.default_rng(0)
    feeds = {"mobilenet": {"input": rng.standard_normal((1, 3, 224, 224)).astype(np.float32)},
             "tiny": {"x": rng.standard_normal((1, 4)).astype(np.float32)}}
    for name in ("mobilenet", "tiny"):
        calls = args.calls if name == "tiny" else max(300, args.calls // 10)
        agent, raw = per_call(models[name][2], feeds[name], calls)
        results[name] = {"agent_median_us": round(agent * 1e6, 2), "raw_median_us": round(raw * 1e6, 2),
                         "ratio": round(agent / raw, 4), "overhead_us": round((agent - raw) * 1e6, 2)}
        print(f"{name:<10} agent {agent * 1e6:9.1f} us  raw run {raw * 1e6:9.1f} us  ratio {agent / raw:.3f}  "
              f"overhead {(agent - raw) * 1e6:+.1f} us  (medians)")

    service = InferenceService(models["tiny"][2])
    feed = feeds["tiny"]
    for _ in range(1000):
        service.predict_tensors(feed)
    before = rss_bytes()
    for _ in range(args.rss_calls):
        service.predict_tensors(feed)
    after = rss_bytes()
    results["rss_growth"] = {"calls": args.rss_calls, "before_bytes": before, "after_bytes": after,
                             "growth_bytes": after - before}
    print(f"RSS over {args.rss_calls:,d} predict calls: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB "
          f"({(after - before) / 1024:+.0f} KiB)")

    agent_rss, bare_rss = footprint(models["mobilenet"][1], models["mobilenet"][1] / "manifest.json")
    results["footprint"] = {"agent_bytes": agent_rss, "bare_bytes": bare_rss}
    print(f"RSS with the MobileNet-style model loaded: agent {agent_rss / 2**20:.1f} MiB, bare session "
          f"{bare_rss / 2**20:.1f} MiB ({agent_rss / bare_rss:.2f}x)")

    np.save(folder / "x.npy", feed["x"])
    agent_cold, bare_cold = cold_start(models["tiny"][0], folder / "k.pub", folder / "x.npy",
                                       models["tiny"][1] / "model" / "model.onnx")
    results["cold_start"] = {"agent_predict_s": round(agent_cold, 3), "bare_session_s": round(bare_cold, 3)}
    print(f"cold start to first inference (tiny, median of 5): agent CLI {agent_cold * 1000:.0f} ms "
          f"(verify + smoke test included), bare onnxruntime {bare_cold * 1000:.0f} ms")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
