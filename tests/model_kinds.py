"""Independent references for the model-kind end-to-end tests (tests/test_model_kinds_e2e.py).

Nothing here uses Edgepack's own pre- or postprocessing: the letterbox, the YOLOv8 decode with
class-wise NMS, the CTC greedy decode, the WAV reader and the framing are written again, plainly
(loops where loops are clearest), so that a served result that agrees with them is right and
not merely consistent with itself. Also: an ``edgepack-agent run`` daemon without MQTT, talked to
over real HTTP with urllib only (whatever server library the agent uses).
"""

from __future__ import annotations

import json
import tarfile
import urllib.error
import urllib.request
import wave
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from tests.agent_process import AgentProcess, free_port

# ----------------------------------------------------------------------------- images


def letterbox(image: Image.Image, size: int, pad_value: int) -> tuple[np.ndarray, float, float, float, float]:
    """``image`` fitted into ``size`` x ``size`` (bilinear), centered on ``pad_value`` gray:
    the NCHW float tensor / 255 and (scale_x, scale_y, pad_x, pad_y)."""
    factor = min(size / image.height, size / image.width)
    new_w = min(size, max(1, int(np.floor(image.width * factor + 0.5))))
    new_h = min(size, max(1, int(np.floor(image.height * factor + 0.5))))
    canvas = Image.new("RGB", (size, size), (pad_value,) * 3)
    left, top = (size - new_w) // 2, (size - new_h) // 2
    canvas.paste(image.convert("RGB").resize((new_w, new_h), Image.Resampling.BILINEAR), (left, top))
    tensor = np.asarray(canvas, np.float32).transpose(2, 0, 1)[None] / 255
    return tensor, new_w / image.width, new_h / image.height, float(left), float(top)


def gray_tensor(path: Path) -> np.ndarray:
    """A gray PNG as ``[1, 1, H, W]`` / 255 (the recognizer's and classifier's inputs are
    written at the model's size)."""
    return np.asarray(Image.open(path).convert("L"), np.float32)[None, None] / 255


# ----------------------------------------------------------------------------- detection


def iou(a: list[float], b: list[float]) -> float:
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def yolo_detections(head: np.ndarray, score_threshold: float = 0.25, iou_threshold: float = 0.45
                    ) -> list[dict[str, Any]]:
    """One image's YOLOv8 head ``[4 + classes, anchors]`` by brute force: per anchor its best
    class; every candidate above the threshold, best first, kept unless a kept box of its
    class overlaps it by more than ``iou_threshold``. Boxes x1, y1, x2, y2 in input pixels."""
    candidates = []
    for anchor in range(head.shape[1]):
        scores = [float(s) for s in head[4:, anchor]]
        best = max(range(len(scores)), key=lambda c: (scores[c], -c))
        if scores[best] > score_threshold:
            cx, cy, w, h = (float(v) for v in head[:4, anchor])
            candidates.append({"box": [cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], "score": scores[best],
                               "index": best, "anchor": anchor})
    candidates.sort(key=lambda d: (-d["score"], d["anchor"]))
    kept: list[dict[str, Any]] = []
    for candidate in candidates:
        if all(k["index"] != candidate["index"] or iou(k["box"], candidate["box"]) <= iou_threshold for k in kept):
            kept.append(candidate)
    return kept


def to_original(detections: list[dict[str, Any]], geometry: tuple[float, float, float, float], width: int,
                height: int) -> list[dict[str, Any]]:
    """Input-pixel boxes mapped back through the letterbox and clipped to the image."""
    scale_x, scale_y, pad_x, pad_y = geometry
    mapped = []
    for d in detections:
        x1, y1, x2, y2 = d["box"]
        box = [min(max((x1 - pad_x) / scale_x, 0), width), min(max((y1 - pad_y) / scale_y, 0), height),
               min(max((x2 - pad_x) / scale_x, 0), width), min(max((y2 - pad_y) / scale_y, 0), height)]
        mapped.append({**d, "box": box})
    return mapped


def matched(found: list[dict[str, Any]], truth: list[dict[str, Any]], threshold: float = 0.5) -> int:
    """How many of ``truth`` a box of ``found`` matches one to one, same class, IoU >= threshold
    (the pairs of highest IoU first)."""
    pairs = sorted(((iou(f["box"], t["box"]), i, j) for i, f in enumerate(found) for j, t in enumerate(truth)
                    if f["index"] == t["index"]), reverse=True)
    used_found: set[int] = set()
    used_truth: set[int] = set()
    for overlap, i, j in pairs:
        if overlap >= threshold and i not in used_found and j not in used_truth:
            used_found.add(i)
            used_truth.add(j)
    return len(used_truth)


def ground_truth(boxes: list[list[float]]) -> list[dict[str, Any]]:
    """``val/boxes.json`` rows ``[x1, y1, x2, y2, class]`` as detections."""
    return [{"box": b[:4], "index": int(b[4])} for b in boxes]


# ----------------------------------------------------------------------------- sequences


def ctc_greedy(probs: np.ndarray, charset: str, blank: int = 0) -> str:
    """``[T, classes]``: argmax per step, repeats collapsed, blanks dropped; class i > blank is
    ``charset[i - 1]`` (the charset file has no line for the blank)."""
    text, previous = [], None
    for step in probs:
        best = int(np.argmax(step))
        if best != previous and best != blank:
            text.append(charset[best - 1])
        previous = best
    return "".join(text)


def read_wav_16bit(path: Path) -> tuple[np.ndarray, int]:
    """A mono 16-bit PCM WAV with the standard library: samples / 32768 and the rate."""
    with wave.open(str(path)) as wav:
        assert wav.getsampwidth() == 2 and wav.getnchannels() == 1
        data = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
        return data.astype(np.float32) / 32768, wav.getframerate()


def cut_frames(samples: np.ndarray, frame: int, context: int) -> np.ndarray:
    """Frames of ``frame`` samples every ``frame``, each with the ``context`` samples before it
    (zeros before the start), the last one zero-padded: ``[n, 1, context + frame]``."""
    count = max(1, -(-len(samples) // frame))
    out = np.zeros((count, 1, context + frame), np.float32)
    for i in range(count):
        for j in range(context + frame):
            k = i * frame - context + j
            if 0 <= k < len(samples):
                out[i, 0, j] = samples[k]
    return out


def softmax(values: np.ndarray) -> np.ndarray:
    exps = np.exp(values - values.max(-1, keepdims=True))
    return exps / exps.sum(-1, keepdims=True)


# ----------------------------------------------------------------------------- artifacts and the agent


def artifact_member(artifact: Path, name: str) -> bytes:
    with tarfile.open(artifact) as tar:
        return tar.extractfile(name).read()


class AgentDaemon(AgentProcess):
    """``edgepack-agent run`` serving one artifact on a free loopback port, without MQTT (the
    start, health polling and SIGTERM stop of :class:`tests.agent_process.AgentProcess`)."""

    def __init__(self, folder: Path, artifact: Path, trust: Path) -> None:  # no super(): it configures MQTT
        folder.mkdir(parents=True, exist_ok=True)
        self.folder, self.device, self.port = folder, folder.name, free_port()
        self.config, self.log = folder / "agent.yaml", folder / "agent.log"
        self.extra_env = {"PYTHONWARNINGS": "ignore"}
        self.proc = None
        self.config.write_text(f"device_id: {folder.name}\nstore: {folder / 'store'}\ntrust: [{trust}]\n"
                               f"profile: x86\nartifact: {artifact}\napi: {{listen: '127.0.0.1:{self.port}'}}\n")
        self.start()

    def request(self, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, Any]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=body, method=method,
                                         headers=headers or {})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                raw = response.read()
                return response.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as err:
            raw = err.read()
            return err.code, json.loads(raw) if raw else None

    def predict(self, body: bytes, content_type: str, query: str = "", **headers: str) -> dict[str, Any]:  # type: ignore[override]
        status, answer = self.request("POST", f"/predict{query}", body, {"Content-Type": content_type, **headers})
        assert status == 200, answer
        return answer
