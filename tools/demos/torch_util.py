"""What the torch demos share: deterministic training and a checked TorchScript export.

Imported only when torch is installed (``tools.demos.torch_available`` says whether it is).
Exports use the TorchScript exporter (``dynamo=False``, opset 17), as ``sdk/export.py`` does and
as most published ONNX models were made, and each export is checked against torch with
onnxruntime before it is written.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

OPSET = 17
EXPORT_TOLERANCE = 1e-4


@contextlib.contextmanager
def deterministic(seed: int) -> Iterator[torch.Generator]:
    """Seeded, single-threaded torch for the block (the previous thread count comes back):
    the same checkout trains the same weights on any machine with the same kernels."""
    threads = torch.get_num_threads()
    torch.manual_seed(seed)
    torch.set_num_threads(1)
    try:
        yield torch.Generator().manual_seed(seed)
    finally:
        torch.set_num_threads(threads)


def adam_steps(module: torch.nn.Module, batches: Iterator[tuple[torch.Tensor, ...]],
               loss_fn, *, steps: int, lr: float) -> list[float]:
    """``steps`` Adam updates with a cosine-decayed learning rate; the loss of each step."""
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=lr * 0.05)
    module.train()
    losses = []
    for _ in range(steps):
        loss = loss_fn(module, *next(batches))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 10.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
    module.eval()
    return losses


def fit(make_model: Callable[[], torch.nn.Module],
        batches: Callable[[np.random.Generator, torch.Generator], Iterator[tuple[torch.Tensor, ...]]],
        loss_fn, *, seed: int, steps: int, lr: float) -> tuple[torch.nn.Module, list[float], float]:
    """A fresh model trained deterministically: ``batches(numpy rng, torch generator)`` yields
    the loss function's inputs. Returns (module in eval mode, losses, seconds)."""
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    with deterministic(seed) as generator:
        model = make_model()
        losses = adam_steps(model, batches(rng, generator), loss_fn, steps=steps, lr=lr)
    return model, losses, time.perf_counter() - started


def save_and_export(module: torch.nn.Module, out: Path, example: Sequence[torch.Tensor], **names: Any) -> Path:
    """``out/model.pt`` (the weights: the tests' fp32 torch reference) and the checked export
    ``out/model.onnx`` (``names``: export's input_names, output_names, dynamic_axes)."""
    out.mkdir(parents=True, exist_ok=True)
    torch.save(module.state_dict(), out / "model.pt")
    return export(module, example, out / "model.onnx", **names)


def write_metrics(out: Path, metrics: Mapping[str, Any], losses: list[float], steps: int, seconds: float) -> None:
    """``out/metrics.json``: the task figures and how the training went."""
    record = {**metrics, "steps": steps, "final_loss": round(float(np.mean(losses[-20:])), 4),
              "seconds": round(seconds, 1), "trainer": "torch"}
    (out / "metrics.json").write_text(json.dumps(record, indent=2) + "\n")


def export(module: torch.nn.Module, example: Sequence[torch.Tensor], path: Path, *, input_names: Sequence[str],
           output_names: Sequence[str], dynamic_axes: Mapping[str, Mapping[int, str]] | None) -> Path:
    """TorchScript export of ``module`` on ``example``; its outputs checked with onnxruntime."""
    import onnxruntime as ort

    module.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        # The exporter's advice (LSTM batch sizes when h0/c0 are not inputs, nn.LSTM's shape
        # checks while tracing, the TorchScript exporter's deprecation) is about other models
        # or a choice made on purpose: these demos pass their state as inputs, and each export
        # is checked below.
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        expected = module(*example)
        torch.onnx.export(module, tuple(example), str(path), opset_version=OPSET, input_names=list(input_names),
                          output_names=list(output_names), dynamic_axes=dict(dynamic_axes or {}), dynamo=False)
    expected = [expected] if isinstance(expected, torch.Tensor) else list(expected)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {name: tensor.numpy() for name, tensor in zip(input_names, example, strict=True)})
    for name, ours, theirs in zip(output_names, got, expected, strict=True):
        worst = float(np.max(np.abs(ours - theirs.numpy()))) if ours.size else 0.0
        if ours.shape != tuple(theirs.shape) or worst > EXPORT_TOLERANCE:
            raise RuntimeError(f"{path.name}: output {name} differs from torch by {worst:.3g}")
    return path
