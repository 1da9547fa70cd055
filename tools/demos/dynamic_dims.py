"""A point-cloud classifier exported with literal ``-1`` dims (needs torch; no downloads).

Some exporters (older paddle2onnx, keras converters, hand-edited graphs) write a dynamic dim as
``dim_value: -1`` instead of a named ``dim_param``. This model is exported by torch with named
dims and then rewritten that way: input ``points [-1, -1, 3]`` (any batch, any number of
points), output ``logits [-1, 3]``. A PointNet-style network: a per-point MLP (MatMul), a max
over the points, a small classifier; classes sphere, cube and plane (points sampled on each
surface, random size and noise). Trained with a fixed seed for a few seconds.

Writes ``model.onnx``, ``model.pt`` (the torch weights), ``labels.txt``, ``calib.npz`` and
``val.npz`` (``points [N, 1, 96, 3]``: N samples of one cloud each, and ``label [N]``),
``clouds.npz`` (clouds of other sizes for serving tests: ``points_64``, ``points_200`` with
``label_64`` / ``label_200``), ``example.npy`` (one cloud ``[1, 64, 3]``) and ``metrics.json``
(held-out accuracy with onnxruntime).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tools.demos.cache import CachedDemo

SEED = 0
CLASSES = ("sphere", "cube", "plane")
POINTS, STEPS, BATCH = 96, 250, 32
VAL_COUNT = 400  # labelled validation clouds


def cloud(rng: np.random.Generator, cls: int, count: int) -> np.ndarray:
    """``count`` points on the surface of a ``CLASSES[cls]`` of random size, with noise."""
    if cls == 0:
        points = rng.normal(size=(count, 3))
        points /= np.linalg.norm(points, axis=1, keepdims=True)
    elif cls == 1:
        points = rng.uniform(-1, 1, (count, 3))
        face = rng.integers(0, 3, count)
        points[np.arange(count), face] = rng.choice([-1.0, 1.0], count)
    else:
        points = np.concatenate([rng.uniform(-1, 1, (count, 2)), np.zeros((count, 1))], 1)
    return (points * rng.uniform(0.5, 2.0) + rng.normal(0, 0.02, (count, 3))).astype(np.float32)


def clouds(rng: np.random.Generator, n: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    labels = rng.integers(0, len(CLASSES), n)
    return np.stack([cloud(rng, int(c), count) for c in labels]), labels.astype(np.int64)


def make_model():
    import torch
    from torch import nn

    class PointClassifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.point = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 64), nn.ReLU())
            self.head = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, len(CLASSES)))

        def forward(self, points: torch.Tensor) -> torch.Tensor:
            return self.head(self.point(points).amax(1))

    return PointClassifier()


def train(seed: int = SEED, steps: int = STEPS):
    """(module, losses, seconds)."""
    import torch

    from tools.demos.torch_util import fit

    def batches(rng, _generator):
        while True:
            points, labels = clouds(rng, BATCH, POINTS)
            yield torch.from_numpy(points), torch.from_numpy(labels)

    return fit(make_model, batches, lambda m, x, y: torch.nn.functional.cross_entropy(m(x), y), seed=seed,
               steps=steps, lr=3e-3)


def literal_minus_one(path: Path) -> None:
    """Rewrite every named dim of the graph's inputs and outputs as ``dim_value: -1``."""
    import onnx

    model = onnx.load(path)
    for value in [*model.graph.input, *model.graph.output]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.dim_value = -1
    del model.graph.value_info[:]  # inferred shapes named the old dims
    onnx.save(model, path)


def _build(out: Path) -> Path:
    import onnxruntime as ort
    import torch

    from tools.demos.torch_util import save_and_export, write_metrics

    model, losses, seconds = train()
    path = save_and_export(model, out, [torch.zeros(1, POINTS, 3)], input_names=["points"], output_names=["logits"],
                           dynamic_axes={"points": {0: "batch", 1: "count"}, "logits": {0: "batch"}})
    literal_minus_one(path)
    rng = np.random.default_rng(SEED + 1)
    data = {name: clouds(rng, n, POINTS) for name, n in (("calib", 64), ("val", 96))}
    extra = {}
    for count in (64, 200):
        points, labels = clouds(rng, 6, count)
        extra.update({f"points_{count}": points, f"label_{count}": labels})
    # More labelled clouds, from their own generator so the ones above stay what they were:
    # a top-1 drop of at most 1 point shown at 95% confidence needs 381 or more.
    more = clouds(np.random.default_rng(SEED + 2), VAL_COUNT - 96, POINTS)
    data["val"] = (np.concatenate([data["val"][0], more[0]]), np.concatenate([data["val"][1], more[1]]))
    for name, (points, labels) in data.items():
        np.savez(out / f"{name}.npz", points=points[:, None], label=labels)
    np.savez(out / "clouds.npz", **extra)
    np.save(out / "example.npy", extra["points_64"][:1])  # one cloud of 64 points, for predict --input
    (out / "labels.txt").write_text("".join(f"{name}\n" for name in CLASSES))
    val = np.load(out / "val.npz")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    predicted = session.run(None, {"points": val["points"][:, 0]})[0].argmax(1)
    write_metrics(out, {"test_accuracy": round(float((predicted == val["label"]).mean()), 4),
                        "n_test": len(predicted)}, losses, STEPS, seconds)
    return path


_HERE = Path(__file__).resolve().parent
# The -1-dims point classifier and its data, trained once per checkout (keyed by these files' source).
build_dynamic_dims = CachedDemo("dynamic_dims", _build, (_HERE / "dynamic_dims.py", _HERE / "torch_util.py"))
