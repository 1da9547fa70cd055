"""Model kinds benchmark (issue 15): each torch-trained demo kind built fp32 and with the default
quantization search, side by side: model size, p50 latency (one thread, medians of interleaved
rounds in one process) and the task metric of what a device answers (the agent's Python API on
the verified artifact), for fp32 and for what the search shipped.

    python tools/bench/model_kinds.py [--runs 300] [--rounds 3] [--json out.json]

Needs torch (the demos are trained with it; cached in .cache/demos). "Default search" is the
recipe's own quantize section (recipes/*.yaml); recipes/lstm-vad.yaml ships fp32 by choice, so
for it the search is asked explicitly: static int8 calibrated on its clips, judged on `output`.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from device_agent.runtime import InferenceService, load_model  # noqa: E402
from edgepack_core.artifact import extract_artifact  # noqa: E402
from edgepack_core.signing import TrustStore, load_public_key  # noqa: E402
from sdk.keys import write_keypair  # noqa: E402
from sdk.packager import ort_host  # noqa: E402
from sdk.packager.pipeline import build  # noqa: E402
from sdk.recipe import recipe_from_dict  # noqa: E402
from tools.demos import build_torch_demos, lstm_vad, yolo  # noqa: E402


@dataclass
class Side:
    """One build of a kind: fp32 or what the search shipped."""

    precision: str
    model: bytes
    service: InferenceService
    note: str = ""
    metric: dict[str, float] = field(default_factory=dict)
    p50_ms: float = 0.0


def _service(artifact: Path, folder: Path, trust: TrustStore) -> InferenceService:
    verified = extract_artifact(artifact, folder, trust)
    return InferenceService(load_model(verified.root, verified.manifest))


def _note(report: dict[str, Any]) -> str:
    quantize = report["passes"].get("quantize") or {}
    if quantize.get("applied"):
        chosen = quantize.get("chosen", {})
        kept = chosen.get("kept_float") or {}
        extra = f", kept float: {', '.join(kept)}" if kept else ""
        return f"{chosen.get('mode')} {chosen.get('method', '')} {chosen.get('stage', '')}{extra}".strip()
    reasons = [w for w in report["warnings"] if "fp32" in w]
    return reasons[0] if reasons else "fp32"


# ----------------------------------------------------------------------------- task metrics


def detector_metrics(demo: Path) -> tuple[Callable[[Side], dict[str, float]], Callable[[Side, Side], dict]]:
    truth = json.loads((demo / "val" / "boxes.json").read_text())
    images = {name: (demo / "val" / name).read_bytes() for name in truth}

    def detections(side: Side) -> dict[str, list[list[float]]]:
        return {name: [[*d["box"], d["score"], d["index"]] for d in side.service.predict(data).result]
                for name, data in images.items()}

    def own(side: Side) -> dict[str, float]:
        found = detections(side)
        hits = sum(yolo.match_counts(found[n], truth[n]) for n in truth)
        return {"recall": hits / sum(map(len, truth.values())),
                "precision": hits / max(sum(map(len, found.values())), 1)}

    def against(side: Side, fp32: Side) -> dict[str, float]:
        mine, ref = detections(side), detections(fp32)
        as_truth = {n: [[*b[:4], b[5]] for b in ref[n]] for n in ref}
        hits = sum(yolo.match_counts(mine[n], as_truth[n]) for n in ref)
        shift = max((abs(a[4] - b[4]) for n in ref for a in mine[n] for b in ref[n]
                     if a[5] == b[5] and yolo.iou(a[:4], b[:4]) >= 0.5), default=0.0)
        return {"recall_vs_fp32": hits / max(sum(map(len, ref.values())), 1),
                "precision_vs_fp32": hits / max(sum(map(len, mine.values())), 1), "max_score_shift": shift}

    return own, against


def recognizer_metrics(demo: Path) -> tuple[Callable, Callable]:
    texts = json.loads((demo / "val" / "texts.json").read_text())
    images = {name: (demo / "val" / name).read_bytes() for name in texts}

    def own(side: Side) -> dict[str, float]:
        right = sum(side.service.predict(data).result["text"] == texts[name] for name, data in images.items())
        return {"string_accuracy": right / len(texts)}

    def against(side: Side, fp32: Side) -> dict[str, float]:
        agree = total = 0
        for data in images.values():
            a = side.service.predict(data).outputs["probs"].argmax(-1)
            b = fp32.service.predict(data).outputs["probs"].argmax(-1)
            agree, total = agree + int((a == b).sum()), total + a.size
        return {"step_agreement_vs_fp32": agree / total}

    return own, against


def vad_metrics(demo: Path) -> tuple[Callable, Callable]:
    clips = {name: (demo / "audio" / name).read_bytes() for name in sorted(lstm_vad.demo_clips())}
    truth = lstm_vad.demo_clips()["talk-16k-pcm16.wav"][3]

    def own(side: Side) -> dict[str, float]:
        voiced = side.service.predict(clips["talk-16k-pcm16.wav"]).outputs["output"][:, 0, 0] > 0.5
        return {"frame_accuracy": float((voiced == truth[:len(voiced)]).mean())}

    def against(side: Side, fp32: Side) -> dict[str, float]:
        worst = max(float(np.abs(side.service.predict(d).outputs["output"] - fp32.service.predict(d).outputs["output"])
                          .max()) for d in clips.values())
        return {"max_abs_vs_fp32": worst}

    return own, against


def classifier_metrics(demo: Path, tensors: bool) -> tuple[Callable, Callable]:
    if tensors:
        val = np.load(demo / "val.npz")
        samples = [{"points": p} for p in val["points"]]
        labels = [int(v) for v in val["label"]]
    else:
        rows = (demo / "val" / "labels.csv").read_text().splitlines()[1:]
        samples = [(demo / "val" / row.split(",")[0]).read_bytes() for row in rows]
        labels = [int(row.split(",")[1]) for row in rows]

    def answer(side: Side, sample: Any) -> list[dict]:
        return (side.service.predict_tensors(sample) if tensors else side.service.predict(sample)).result

    def own(side: Side) -> dict[str, float]:
        right = [answer(side, s)[0]["index"] == y for s, y in zip(samples, labels, strict=True)]
        return {"top1": float(np.mean(right))}

    def against(side: Side, fp32: Side) -> dict[str, float]:
        shift = max(abs(answer(side, s)[0]["score"] - answer(fp32, s)[0]["score"]) for s in samples)
        return {"max_top_score_shift": shift}

    return own, against


# ----------------------------------------------------------------------------- the run


def latency_feed(recipe: str, demo: Path, service: InferenceService) -> dict[str, np.ndarray]:
    """One real model-ready input of the kind (what a device feeds per call)."""
    model = service.model
    if recipe.startswith("points"):
        return {"points": np.load(demo / "example.npy")}
    if recipe.startswith("lstm"):
        frames = model.preprocessor.from_audio_bytes((demo / "audio" / "talk-16k-pcm16.wav").read_bytes())
        return {"input": frames[5], "state": np.zeros((2, 1, lstm_vad.HIDDEN), np.float32),
                "sr": np.array(16000, np.int64)}
    image = sorted((demo / "val").glob("*.png"))[0]
    return {model.image_input: model.preprocessor.image_with_geometry(image.read_bytes())[0]}


KINDS = [  # (kind, recipe, demo folder, metrics)
    ("YOLOv8-style detector", "yolo-int8", "yolo", lambda d: detector_metrics(d)),
    ("CTC recognizer", "ocr-int8", "ocr", lambda d: recognizer_metrics(d)),
    ("stateful LSTM VAD", "lstm-vad", "lstm_vad", lambda d: vad_metrics(d)),
    ("-1 dims point classifier", "points", "points", lambda d: classifier_metrics(d, tensors=True)),
    ("classifier ending in Softmax", "orientation-int8", "orientation", lambda d: classifier_metrics(d, False)),
]


def _documents(recipe: str) -> tuple[dict, dict]:
    document = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())
    fp32 = copy.deepcopy(document)
    fp32.pop("quantize", None)
    searched = copy.deepcopy(document)
    if "quantize" not in searched:  # lstm-vad ships fp32 by choice: ask the search anyway
        searched["quantize"] = {"mode": "static", "calibration": document["validate"]["data"]}
    return fp32, searched


def run_kind(recipe: str, demo: Path, folder: Path, key: Path, trust: TrustStore) -> tuple[Side, Side]:
    sides = []
    for label, document in zip(("fp32", "search"), _documents(recipe), strict=True):
        result = build(recipe_from_dict(document, folder / "recipes", allow_external_paths=True), key_paths=[str(key)],
                       output=folder / "dist" / f"{recipe}-{label}.edgepkg")
        service = _service(result.output, folder / "extracted" / f"{recipe}-{label}", trust)
        model = (service.model.root / service.model.manifest.model_path).read_bytes()
        sides.append(Side(result.manifest.raw["model"]["precision"], model, service,
                          "" if label == "fp32" else _note(result.report)))
    return sides[0], sides[1]


def time_sides(sides: list[Side], feed: dict[str, np.ndarray], runs: int, rounds: int) -> None:
    """Interleaved rounds (fp32, shipped, fp32, ...); each side keeps its best median."""
    best = [float("inf")] * len(sides)
    for _ in range(rounds):
        for i, side in enumerate(sides):
            times = ort_host.measure_latency(side.model, feed, runs=runs, warmup=20, threads=1)
            best[i] = min(best[i], float(np.median(times)) * 1000)
    for side, p50 in zip(sides, best, strict=True):
        side.p50_ms = p50


def _figures(metric: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in metric.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edgepack-model-kinds-"))
    (folder / "recipes").mkdir()
    build_torch_demos(folder / "demo")
    write_keypair(folder / "k.key", folder / "k.pub")
    trust = TrustStore([load_public_key(folder / "k.pub")])
    rows = []
    print("| kind | shipped | size fp32 | size shipped | p50 fp32 | p50 shipped | speedup | task metric fp32 | "
          "task metric shipped | search |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for kind, recipe, demo_name, metrics in KINDS:
        demo = folder / "demo" / demo_name
        fp32, shipped = run_kind(recipe, demo, folder, folder / "k.key", trust)
        time_sides([fp32, shipped], latency_feed(recipe, demo, fp32.service), args.runs, args.rounds)
        own, against = metrics(demo)
        fp32.metric, shipped.metric = own(fp32), {**own(shipped), **against(shipped, fp32)}
        row = {"kind": kind, "recipe": recipe, "shipped": shipped.precision, "fp32_bytes": len(fp32.model),
               "shipped_bytes": len(shipped.model), "fp32_p50_ms": round(fp32.p50_ms, 4),
               "shipped_p50_ms": round(shipped.p50_ms, 4), "fp32_metric": fp32.metric,
               "shipped_metric": shipped.metric, "search": shipped.note}
        rows.append(row)
        print(f"| {kind} (`{recipe}`) | {shipped.precision} | {len(fp32.model) / 1e3:.1f} KB | "
              f"{len(shipped.model) / 1e3:.1f} KB | {fp32.p50_ms:.3f} ms | {shipped.p50_ms:.3f} ms | "
              f"{fp32.p50_ms / shipped.p50_ms:.2f}x | {_figures(fp32.metric)} | {_figures(shipped.metric)} | "
              f"{shipped.note} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    ort_host.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
