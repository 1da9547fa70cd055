"""A CTC text recognizer (CRNN) trained from code on rendered digit strings (needs torch).

Shaped like a CRNN / PaddleOCR recognizer export: input ``x [batch, 1, 32, 128]`` (gray / 255),
output ``probs [batch, 32, 11]``: 32 time steps of softmax probabilities over the blank (class
0) and the digits 0-9 (classes 1..10, the charset's lines). Conv + BatchNorm + ReLU layers pool
the height away, a bidirectional LSTM reads the 32 columns, a linear layer and a Softmax end it.

Data: strings of 3 to 8 digits drawn with Pillow's default font (size 20) on a noisy light
background, with random position, gray levels and noise. Trained with CTC loss and a fixed
seed for a few hundred Adam steps; the held-out string accuracy (greedy decoding with
onnxruntime) goes into ``metrics.json``.

Writes ``model.onnx``, ``model.pt`` (the torch weights), ``charset.txt`` (one digit a line; the
blank takes no line), ``calib/`` and ``val/`` PNGs, ``val/texts.json`` (``{file: text}``) and
``metrics.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from tools.demos.cache import CachedDemo

SEED = 0
HEIGHT, WIDTH = 32, 128
STEPS_T = 32
CHARSET = "0123456789"
BLANK = 0
TRAIN_IMAGES, STEPS, BATCH = 2048, 600, 16
CALIB_COUNT, VAL_COUNT = 32, 32


def font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=20)


def render(text: str, rng: np.random.Generator) -> Image.Image:
    """``text`` in dark gray on a noisy light background, at a random place (8-bit gray)."""
    typeface = font()
    left, top, right, bottom = typeface.getbbox(text)
    x = int(rng.integers(2, max(3, WIDTH - (right - left) - 2))) - left
    y = (HEIGHT - (bottom - top)) // 2 - top + int(rng.integers(-3, 4))
    background = int(rng.integers(170, 256))
    pixels = background + rng.normal(0, 8, (HEIGHT, WIDTH))
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "L")
    ImageDraw.Draw(image).text((x, y), text, fill=int(rng.integers(0, 90)), font=typeface)
    return image


def random_text(rng: np.random.Generator) -> str:
    return "".join(CHARSET[int(i)] for i in rng.integers(0, len(CHARSET), int(rng.integers(3, 9))))


def make_model():
    import torch
    from torch import nn

    def conv(c_in: int, c_out: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, 1, 1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())

    class Recognizer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(conv(1, 16), nn.MaxPool2d(2),          # 16 x 64
                                          conv(16, 24), nn.MaxPool2d(2),         # 8 x 32
                                          conv(24, 32), nn.MaxPool2d((2, 1)),    # 4 x 32
                                          conv(32, 48), nn.MaxPool2d((4, 1)))    # 1 x 32
            self.rnn = nn.LSTM(48, 48, bidirectional=True, batch_first=True)
            self.fc = nn.Linear(96, len(CHARSET) + 1)

        def logits(self, x: torch.Tensor) -> torch.Tensor:
            columns = self.features(x).squeeze(2).transpose(1, 2)     # [B, T, 48]
            return self.fc(self.rnn(columns)[0])                      # [B, T, classes]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.logits(x).softmax(-1)

    return Recognizer()


def ctc_loss(model, images, targets, lengths):
    import torch

    log_probs = model.logits(images).log_softmax(-1).transpose(0, 1)          # [T, B, C]
    steps = torch.full((images.shape[0],), STEPS_T, dtype=torch.long)
    return torch.nn.functional.ctc_loss(log_probs, targets, steps, lengths, blank=BLANK, zero_infinity=True)


def greedy(probs: np.ndarray) -> str:
    """Greedy CTC of one ``[T, classes]`` row: argmax per step, repeats collapsed, blanks dropped."""
    best = probs.argmax(-1)
    kept = [int(c) for i, c in enumerate(best) if c != BLANK and (i == 0 or c != best[i - 1])]
    return "".join(CHARSET[c - 1] for c in kept)


def train(seed: int = SEED, steps: int = STEPS):
    """(module, losses, seconds)."""
    import torch

    from tools.demos.torch_util import fit

    def batches(rng, generator):
        texts = [random_text(rng) for _ in range(TRAIN_IMAGES)]
        images = np.stack([np.asarray(render(t, rng)) for t in texts])[:, None]
        while True:
            pick = torch.randint(0, len(texts), (BATCH,), generator=generator).numpy()
            labels = [[CHARSET.index(c) + 1 for c in texts[i]] for i in pick]
            yield (torch.from_numpy(images[pick]).float() / 255,
                   torch.tensor([c for row in labels for c in row], dtype=torch.long),
                   torch.tensor([len(row) for row in labels], dtype=torch.long))

    return fit(make_model, batches, ctc_loss, seed=seed, steps=steps, lr=3e-3)


def _write_texts(folder: Path, rng: np.random.Generator, count: int, prefix: str) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    texts = {}
    for i in range(count):
        text = random_text(rng)
        name = f"{prefix}_{i:03d}.png"
        render(text, rng).save(folder / name, optimize=False)
        texts[name] = text
    return texts


def _accuracy(model_path: Path, folder: Path, texts: dict[str, str]) -> float:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    right = 0
    for name, text in texts.items():
        pixels = np.asarray(Image.open(folder / name), np.float32)[None, None] / 255
        right += greedy(session.run(None, {"x": pixels})[0][0]) == text
    return right / len(texts)


def _build(out: Path) -> Path:
    import torch

    from tools.demos.torch_util import save_and_export, write_metrics

    model, losses, seconds = train()
    path = save_and_export(model, out, [torch.zeros(1, 1, HEIGHT, WIDTH)], input_names=["x"], output_names=["probs"],
                           dynamic_axes={"x": {0: "batch"}, "probs": {0: "batch"}})
    rng = np.random.default_rng(SEED + 1)
    _write_texts(out / "calib", rng, CALIB_COUNT, "calib")
    texts = _write_texts(out / "val", rng, VAL_COUNT, "val")
    (out / "val" / "texts.json").write_text(json.dumps(texts, indent=1) + "\n")
    (out / "charset.txt").write_text("".join(f"{c}\n" for c in CHARSET))
    write_metrics(out, {"string_accuracy": round(_accuracy(path, out / "val", texts), 4), "n_val": len(texts)},
                  losses, STEPS, seconds)
    return path


_HERE = Path(__file__).resolve().parent
# The trained recognizer and its data under ``out``, trained once per checkout (the cache key is these files' source).
build_ocr = CachedDemo("ocr", _build, (_HERE / "ocr_ctc.py", _HERE / "torch_util.py"))
