"""A stateful LSTM voice-activity model exported from torch (needs torch; no downloads).

The signature of Silero-style VAD exports: inputs ``input [batch, samples]`` float32 (one frame
of 512 samples at 16 kHz with 64 samples of context before it), ``state [2, batch, 128]`` (the
LSTM's h and c stacked) and a scalar int64 ``sr``; outputs ``output [batch, 1]`` (the
probability that the frame is voiced) and ``stateN [2, batch, 128]``, fed back as ``state`` on
the next frame. A learned filterbank (Conv1d, kernel 64, stride 32) on the frame, log
magnitudes scaled by ``sr / 16000``, a strided Conv1d encoder averaged over time, one LSTM
step and a linear decoder with a sigmoid.

Trained with a fixed seed for a few seconds on synthetic sequences: voiced stretches
(harmonic tones, 90-300 Hz, random amplitude) against silence and noise, eight frames a
sequence, the state carried from frame to frame as the agent carries it. The numpy-built
``tools/demos/vad.py`` stays as the torch-free demo of the same signature.

Writes ``model.onnx``, ``model.pt`` (the torch weights), ``audio/`` WAV clips (16 kHz PCM 16,
44.1 kHz stereo PCM 24, 8 kHz float) and ``metrics.json`` (frame accuracy on held-out clips).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.demos.cache import CachedDemo
from tools.demos.vad import write_wav

SEED = 0
SAMPLE_RATE, FRAME, CONTEXT, HIDDEN = 16000, 512, 64, 128
SEQUENCE, STEPS, BATCH = 8, 150, 16


def make_model():
    import torch
    from torch import nn

    class LstmVad(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.filters = nn.Conv1d(1, 32, 64, stride=32)
            self.encoder = nn.Sequential(nn.Conv1d(32, 48, 3, stride=2), nn.ReLU())
            self.project = nn.Linear(48, 64)
            self.lstm = nn.LSTM(64, HIDDEN)
            self.decoder = nn.Linear(HIDDEN, 1)

        def features(self, frames: torch.Tensor, sr: torch.Tensor) -> torch.Tensor:
            """``[batch, samples]`` -> ``[batch, 64]``."""
            bank = torch.log1p(self.filters(frames.unsqueeze(1)).abs() * (sr.float() / SAMPLE_RATE))
            return torch.relu(self.project(self.encoder(bank).mean(2)))

        def forward(self, frames: torch.Tensor, state: torch.Tensor, sr: torch.Tensor):
            out, (h, c) = self.lstm(self.features(frames, sr).unsqueeze(0), (state[0:1], state[1:2]))
            return torch.sigmoid(self.decoder(out[0])), torch.cat((h, c), 0)

    return LstmVad()


def voiced(rng: np.random.Generator, length: int, rate: int = SAMPLE_RATE) -> np.ndarray:
    """A harmonic tone of random pitch and amplitude: what the model calls voiced."""
    t = np.arange(length) / rate
    f0, amplitude = rng.uniform(90, 300), rng.uniform(0.08, 0.6)
    tone = sum(np.sin(2 * np.pi * f0 * k * t + rng.uniform(0, 6.3)) / k for k in (1, 2, 3, 4))
    return amplitude * tone / 2 + rng.normal(0, 0.01, length)


def unvoiced(rng: np.random.Generator, length: int) -> np.ndarray:
    """Silence or broadband noise."""
    return rng.normal(0, rng.choice([0.0005, 0.01, rng.uniform(0.02, 0.15)]), length)


def frames_of(samples: np.ndarray, hop: int = FRAME) -> np.ndarray:
    """``[n, CONTEXT + FRAME]`` frames with the context before each (zeros before the start)."""
    padded = np.concatenate([np.zeros(CONTEXT), samples, np.zeros(FRAME)])
    count = max(1, -(-len(samples) // hop))
    return np.stack([padded[i * hop:i * hop + CONTEXT + FRAME] for i in range(count)]).astype(np.float32)


def sequence(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Eight frames of alternating voiced / unvoiced stretches and the per-frame labels."""
    labels = np.zeros(SEQUENCE, np.float32)
    samples = np.zeros(SEQUENCE * FRAME)
    start = 0
    while start < SEQUENCE:
        length = int(rng.integers(1, 5))
        kind = rng.random() < 0.5
        piece = voiced(rng, length * FRAME) if kind else unvoiced(rng, length * FRAME)
        samples[start * FRAME:(start + length) * FRAME] = piece[:max(0, SEQUENCE - start) * FRAME]
        labels[start:start + length] = kind
        start += length
    return frames_of(samples), labels


def vad_loss(model, frames, labels):
    import torch

    batch = frames.shape[0]
    state = torch.zeros(2, batch, HIDDEN)
    sr = torch.tensor(SAMPLE_RATE)
    loss = torch.zeros(())
    for step in range(frames.shape[1]):
        prob, state = model(frames[:, step], state, sr)
        loss = loss + torch.nn.functional.binary_cross_entropy(prob[:, 0].clamp(1e-6, 1 - 1e-6), labels[:, step])
    return loss / frames.shape[1]


def train(seed: int = SEED, steps: int = STEPS):
    """(module, losses, seconds)."""
    import torch

    from tools.demos.torch_util import fit

    def batches(rng, _generator):
        while True:
            pairs = [sequence(rng) for _ in range(BATCH)]
            yield torch.from_numpy(np.stack([p[0] for p in pairs])), torch.from_numpy(np.stack([p[1] for p in pairs]))

    return fit(make_model, batches, vad_loss, seed=seed, steps=steps, lr=3e-3)


def demo_clips(seed: int = SEED) -> dict[str, tuple[np.ndarray, int, str, np.ndarray]]:
    """Held-out clips: name -> (samples, rate, encoding, voiced mask per 16 kHz frame)."""
    rng = np.random.default_rng(seed + 1)
    clips = {}
    for name, rate, encoding, channels in (("talk-16k-pcm16.wav", 16000, "pcm16", 1),
                                           ("talk-44k-stereo-pcm24.wav", 44100, "pcm24", 2),
                                           ("talk-8k-float32.wav", 8000, "float32", 1)):
        seconds_per_part = 0.16
        parts, mask = [], []
        for i in range(8):
            length = int(rate * seconds_per_part)
            parts.append(voiced(rng, length, rate) if i % 2 else unvoiced(rng, length))
            mask.append(bool(i % 2))
        samples = np.concatenate(parts)
        if channels == 2:
            samples = np.stack([samples, samples * 0.8], 1)
        frames16 = -(-int(len(parts) * seconds_per_part * SAMPLE_RATE) // FRAME)
        truth = np.array([mask[min(int(f * FRAME / SAMPLE_RATE / seconds_per_part), 7)] for f in range(frames16)])
        clips[name] = (np.clip(samples, -1, 1), rate, encoding, truth)
    return clips


def _build(out: Path) -> Path:
    import torch

    from tools.demos.torch_util import save_and_export, write_metrics

    model, losses, seconds = train()
    example = [torch.zeros(1, CONTEXT + FRAME), torch.zeros(2, 1, HIDDEN), torch.tensor(SAMPLE_RATE)]
    path = save_and_export(model, out, example, input_names=["input", "state", "sr"],
                           output_names=["output", "stateN"],
                           dynamic_axes={"input": {0: "batch", 1: "samples"}, "state": {1: "batch"},
                                         "output": {0: "batch"}, "stateN": {1: "batch"}})
    right = total = 0
    for name, (samples, rate, encoding, truth) in demo_clips().items():
        write_wav(out / "audio" / name, samples, rate, encoding=encoding)
        if rate == SAMPLE_RATE:  # accuracy on the clip the model's own rate needs no resampling
            state = torch.zeros(2, 1, HIDDEN)
            for frame, label in zip(frames_of(samples), truth, strict=False):
                with torch.no_grad():
                    prob, state = model(torch.from_numpy(frame[None]), state, torch.tensor(SAMPLE_RATE))
                right += bool(prob[0, 0] > 0.5) == bool(label)
                total += 1
    write_metrics(out, {"frame_accuracy_16k_clip": round(right / total, 4), "frames": total}, losses, STEPS, seconds)
    return path


_HERE = Path(__file__).resolve().parent
# The trained LSTM VAD and its clips under ``out``, trained once per checkout (the cache key is these files' source).
build_lstm_vad = CachedDemo("lstm_vad", _build, (_HERE / "lstm_vad.py", _HERE / "torch_util.py", _HERE / "vad.py"))
