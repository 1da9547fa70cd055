"""A non-image demo: an MLP on scikit-learn's bundled wine data set (13 measurements, 3 cultivars).

The feature standardization is part of the graph (Sub, Div), so a device feeds the raw
measurements as one float32 row per sample: input ``features`` [batch, 13], output
``logits`` [batch, 3]. Trained in numpy with Adam on a stratified
75/25 split; the held-out accuracy is written to metrics.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from onnx import helper

from tools.demos.onnx_util import float_input, initializer, save_model

SEED = 0
HIDDEN = 16


def load_data(seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]:
    from sklearn.datasets import load_wine
    from sklearn.model_selection import train_test_split

    data = load_wine()
    x_train, x_test, y_train, y_test = train_test_split(
        data.data.astype(np.float32), data.target, test_size=0.25, random_state=seed, stratify=data.target)
    return x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64), list(data.target_names)


def train(x: np.ndarray, y: np.ndarray, epochs: int = 200, lr: float = 3e-3, seed: int = SEED) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mean, std = x.mean(0), x.std(0) + 1e-6
    z = (x - mean) / std
    p = {
        "w1": rng.normal(0, np.sqrt(2 / z.shape[1]), (HIDDEN, z.shape[1])).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": rng.normal(0, np.sqrt(1 / HIDDEN), (3, HIDDEN)).astype(np.float32),
        "b2": np.zeros(3, np.float32),
    }
    moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in p.items()}
    for step in range(1, epochs + 1):
        h_pre = z @ p["w1"].T + p["b1"]
        h = np.maximum(h_pre, 0)
        logits = h @ p["w2"].T + p["b2"]
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        d = probs
        d[np.arange(len(y)), y] -= 1
        d /= len(y)
        d_h = d @ p["w2"] * (h_pre > 0)
        grads = {"w2": d.T @ h, "b2": d.sum(0), "w1": d_h.T @ z, "b1": d_h.sum(0)}
        for key, grad in grads.items():
            m, v = moments[key]
            m[:] = 0.9 * m + 0.1 * grad
            v[:] = 0.999 * v + 0.001 * grad * grad
            p[key] -= (lr * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.999**step)) + 1e-8)).astype(np.float32)
    p["mean"], p["std"] = mean.astype(np.float32), std.astype(np.float32)
    return p


def predict(p: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    h = np.maximum(((x - p["mean"]) / p["std"]) @ p["w1"].T + p["b1"], 0)
    return h @ p["w2"].T + p["b2"]


def to_onnx(p: dict[str, np.ndarray], path: Path) -> Path:
    inits = [initializer(name, p[key]) for name, key in
             (("mean", "mean"), ("std", "std"), ("fc1.weight", "w1"), ("fc1.bias", "b1"),
              ("fc2.weight", "w2"), ("fc2.bias", "b2"))]
    nodes = [
        helper.make_node("Sub", ["features", "mean"], ["centered"]),
        helper.make_node("Div", ["centered", "std"], ["standardized"]),
        helper.make_node("Gemm", ["standardized", "fc1.weight", "fc1.bias"], ["fc1"], transB=1),
        helper.make_node("Relu", ["fc1"], ["fc1_relu"]),
        helper.make_node("Gemm", ["fc1_relu", "fc2.weight", "fc2.bias"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(nodes, "tabular_mlp", [float_input("features", ["batch", 13])],
                              [float_input("logits", ["batch", 3])], inits)
    return save_model(graph, path, "MLP on scikit-learn wine data (raw features, standardized in-graph)")


def build_tabular(out: Path) -> Path:
    out = Path(out)
    started = time.perf_counter()
    x_train, y_train, x_test, y_test, names = load_data()
    params = train(x_train, y_train)
    seconds = time.perf_counter() - started
    path = to_onnx(params, out / "model.onnx")
    test_acc = float((predict(params, x_test).argmax(1) == y_test).mean())
    train_acc = float((predict(params, x_train).argmax(1) == y_train).mean())
    (out / "labels.txt").write_text("".join(f"{n}\n" for n in names))
    np.savez(out / "calib.npz", features=x_train[:100])
    np.savez(out / "val.npz", features=x_test, label=y_test)
    np.save(out / "example.npy", x_test[:1])
    metrics = {"test_accuracy": round(test_acc, 4), "train_accuracy": round(train_acc, 4), "n_test": len(y_test),
               "trainer": "numpy", "seconds": round(seconds, 2)}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return path
