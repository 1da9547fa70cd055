"""A document-orientation classifier that ends in Softmax (needs torch; no downloads).

Like the orientation classifiers OCR pipelines run before recognition, its graph already ends
in ``Softmax``: input ``image [batch, 1, 48, 48]`` (gray / 255), output ``probs [batch, 4]``,
the probabilities that the page is turned by 0, 90, 180 or 270 degrees. A served ``topk``
must report these probabilities as they are; a second softmax would flatten a 0.97 into 0.46.
Three strided Conv + ReLU layers and a linear layer on the flattened map (orientation needs
where things are, so no global pooling).

Data: synthetic pages (a dark title bar at the top left, left-aligned body lines of ragged
length, a page number at the bottom right) rotated by a multiple of 90 degrees, with noise.
Trained with a fixed seed for a few seconds.

Writes ``model.onnx``, ``model.pt`` (the torch weights), ``labels.txt``, ``calib/`` and
``val/`` PNGs with ``val/labels.csv`` (``file,label``) and ``metrics.json``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from tools.demos.cache import CachedDemo

SEED = 0
SIZE = 48
LABELS = ("0", "90", "180", "270")
STEPS, BATCH = 150, 32


def page(rng: np.random.Generator) -> np.ndarray:
    """An upright page, 8-bit gray."""
    pixels = np.full((SIZE, SIZE), float(rng.integers(200, 256)))
    margin = int(rng.integers(3, 7))
    top = int(rng.integers(3, 7))
    ink = float(rng.integers(0, 80))
    pixels[top:top + 5, margin:margin + int(rng.integers(18, 32))] = ink                   # title
    row = top + 9
    while row < SIZE - 9:
        pixels[row:row + 2, margin:margin + int(rng.integers(14, SIZE - margin - 3))] = ink  # a body line
        row += int(rng.integers(4, 7))
    pixels[SIZE - 6:SIZE - 3, SIZE - margin - 4:SIZE - margin] = ink                       # page number
    return np.clip(pixels + rng.normal(0, 30, pixels.shape), 0, 255).astype(np.uint8)


def turned(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` pages turned clockwise by label x 90 degrees, and the labels."""
    labels = rng.integers(0, len(LABELS), n)
    return np.stack([np.rot90(page(rng), -int(k)) for k in labels]), labels.astype(np.int64)


def make_model():
    import torch
    from torch import nn

    class OrientationClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(1, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU(),
                                          nn.Conv2d(16, 16, 3, 2, 1), nn.ReLU(), nn.Flatten())
            self.fc = nn.Linear(16 * 6 * 6, len(LABELS))

        def logits(self, image: torch.Tensor) -> torch.Tensor:
            return self.fc(self.features(image))

        def forward(self, image: torch.Tensor) -> torch.Tensor:
            return self.logits(image).softmax(1)

    return OrientationClassifier()


def train(seed: int = SEED, steps: int = STEPS):
    """(module, losses, seconds)."""
    import torch

    from tools.demos.torch_util import fit

    def batches(rng, _generator):
        while True:
            pages, labels = turned(rng, BATCH)
            yield torch.from_numpy(pages[:, None].astype(np.float32) / 255), torch.from_numpy(labels)

    # Label smoothing keeps the top probability near 0.9 instead of 1.0, as real classifiers
    # report; a double softmax then shows plainly (0.92 -> 0.45).
    return fit(make_model, batches, lambda m, x, y: torch.nn.functional.cross_entropy(
        m.logits(x), y, label_smoothing=0.1), seed=seed, steps=steps, lr=3e-3)


VAL_COUNT = 400


def _write_pages(folder: Path, rng: np.random.Generator, n: int, prefix: str, start: int = 0) -> dict[str, int]:
    folder.mkdir(parents=True, exist_ok=True)
    pages, labels = turned(rng, n)
    names = {}
    for i, (pixels, label) in enumerate(zip(pages, labels, strict=True), start):
        name = f"{prefix}_{i:03d}.png"
        Image.fromarray(np.ascontiguousarray(pixels), "L").save(folder / name, optimize=False)
        names[name] = int(label)
    return names


def _build(out: Path) -> Path:
    import onnxruntime as ort
    import torch

    from tools.demos.torch_util import save_and_export, write_metrics

    model, losses, seconds = train()
    path = save_and_export(model, out, [torch.zeros(1, 1, SIZE, SIZE)], input_names=["image"], output_names=["probs"],
                           dynamic_axes={"image": {0: "batch"}, "probs": {0: "batch"}})
    rng = np.random.default_rng(SEED + 1)
    _write_pages(out / "calib", rng, 48, "calib")
    val = _write_pages(out / "val", rng, 64, "val")
    # Enough labelled pages that a top-1 drop of at most 1 point can be shown at 95% confidence
    # (Newcombe's paired interval needs 381 when both models are right everywhere); written
    # after the first 64 so those stay the pages they were.
    val.update(_write_pages(out / "val", rng, VAL_COUNT - 64, "val", start=64))
    (out / "val" / "labels.csv").write_text("file,label\n" + "".join(f"{k},{v}\n" for k, v in val.items()))
    (out / "labels.txt").write_text("".join(f"{name}\n" for name in LABELS))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    right = 0
    for name, label in val.items():
        pixels = np.asarray(Image.open(out / "val" / name), np.float32)[None, None] / 255
        right += int(session.run(None, {"image": pixels})[0].argmax()) == label
    write_metrics(out, {"test_accuracy": round(right / len(val), 4), "n_test": len(val)}, losses, STEPS, seconds)
    return path


_HERE = Path(__file__).resolve().parent
# The orientation classifier and its pages, trained once per checkout (keyed by these files' source).
build_softmax_classifier = CachedDemo("orientation", _build, (_HERE / "softmax_classifier.py", _HERE / "torch_util.py"))
