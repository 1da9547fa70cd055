"""A small CNN trained on scikit-learn's bundled digits data set, in numpy (no torch needed).

Real data, real training: 1,797 8x8 grayscale digits ship inside the scikit-learn wheel. The
pixels (0..16) are written as 8-bit PNGs (round(v * 255 / 16)) and the model is trained on
exactly what the device's preprocessing makes of those PNGs (gray, scale 1/255), so the
accuracy measured here is the accuracy a device gets from the images.

Network: Conv 3x3 (1->8, pad 1) + ReLU + MaxPool 2x2 + Flatten + Gemm (128->32) + ReLU +
Gemm (32->10). Trained with Adam on a stratified 75/25 split; the held-out accuracy is
written to metrics.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
from onnx import helper
from PIL import Image

from tools.demos.onnx_util import float_input, initializer, save_model

SEED = 0
FILTERS, HIDDEN, CLASSES = 8, 32, 10


def load_data(seed: int = SEED) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test, pixels_train, pixels_test); x is [N,1,8,8] float32
    exactly as the PNG -> gray -> 1/255 preprocessing yields, pixels the uint8 images."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.round(digits.images * 255.0 / 16.0).astype(np.uint8)
    p_train, p_test, y_train, y_test = train_test_split(
        pixels, digits.target, test_size=0.25, random_state=seed, stratify=digits.target)
    x_train = (p_train.astype(np.float32) / 255.0)[:, None]
    x_test = (p_test.astype(np.float32) / 255.0)[:, None]
    return x_train, y_train.astype(np.int64), x_test, y_test.astype(np.int64), p_train, p_test


def _im2col(x: np.ndarray) -> np.ndarray:
    """[N,1,8,8] -> [N,9,64] patches of a 3x3 kernel with padding 1."""
    padded = np.pad(x[:, 0], ((0, 0), (1, 1), (1, 1)))
    cols = [padded[:, i:i + 8, j:j + 8].reshape(len(x), 64) for i in range(3) for j in range(3)]
    return np.stack(cols, axis=1)


class NumpyCNN:
    def __init__(self, rng: np.random.Generator) -> None:
        self.params = {
            "conv_w": rng.normal(0, np.sqrt(2 / 9), (FILTERS, 9)).astype(np.float32),
            "conv_b": np.zeros(FILTERS, np.float32),
            "fc1_w": rng.normal(0, np.sqrt(2 / 128), (HIDDEN, 128)).astype(np.float32),
            "fc1_b": np.zeros(HIDDEN, np.float32),
            "fc2_w": rng.normal(0, np.sqrt(1 / HIDDEN), (CLASSES, HIDDEN)).astype(np.float32),
            "fc2_b": np.zeros(CLASSES, np.float32),
        }

    def forward(self, x: np.ndarray) -> tuple[np.ndarray, dict]:
        p = self.params
        cols = _im2col(x)  # N,9,64
        conv = np.einsum("fk,nkp->nfp", p["conv_w"], cols) + p["conv_b"][None, :, None]  # N,F,64
        relu = np.maximum(conv, 0).reshape(len(x), FILTERS, 8, 8)
        windows = relu.reshape(len(x), FILTERS, 4, 2, 4, 2).transpose(0, 1, 2, 4, 3, 5).reshape(
            len(x), FILTERS, 4, 4, 4)
        pooled = windows.max(axis=-1)
        argmax = windows.argmax(axis=-1)
        flat = pooled.reshape(len(x), -1)
        h_pre = flat @ p["fc1_w"].T + p["fc1_b"]
        h = np.maximum(h_pre, 0)
        logits = h @ p["fc2_w"].T + p["fc2_b"]
        return logits, {"cols": cols, "conv": conv, "argmax": argmax, "flat": flat, "h_pre": h_pre, "h": h}

    def backward(self, logits: np.ndarray, y: np.ndarray, cache: dict) -> dict[str, np.ndarray]:
        p, n = self.params, len(y)
        probs = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs /= probs.sum(axis=1, keepdims=True)
        d_logits = probs
        d_logits[np.arange(n), y] -= 1
        d_logits /= n
        grads = {"fc2_w": d_logits.T @ cache["h"], "fc2_b": d_logits.sum(0)}
        d_h = d_logits @ p["fc2_w"] * (cache["h_pre"] > 0)
        grads["fc1_w"], grads["fc1_b"] = d_h.T @ cache["flat"], d_h.sum(0)
        d_pooled = (d_h @ p["fc1_w"]).reshape(n, FILTERS, 4, 4)
        d_windows = np.zeros((n, FILTERS, 4, 4, 4), np.float32)
        np.put_along_axis(d_windows, cache["argmax"][..., None], d_pooled[..., None], axis=-1)
        d_relu = d_windows.reshape(n, FILTERS, 4, 4, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(n, FILTERS, 64)
        d_conv = d_relu * (cache["conv"] > 0)
        grads["conv_w"] = np.einsum("nfp,nkp->fk", d_conv, cache["cols"])
        grads["conv_b"] = d_conv.sum(axis=(0, 2))
        return grads

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.forward(x)[0]


def train(x: np.ndarray, y: np.ndarray, epochs: int = 40, batch: int = 32, lr: float = 3e-3,
          seed: int = SEED) -> NumpyCNN:
    rng = np.random.default_rng(seed)
    model = NumpyCNN(rng)
    moments = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in model.params.items()}
    step = 0
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for start in range(0, len(x), batch):
            idx = order[start:start + batch]
            logits, cache = model.forward(x[idx])
            grads = model.backward(logits, y[idx], cache)
            step += 1
            for key, grad in grads.items():
                m, v = moments[key]
                m[:] = 0.9 * m + 0.1 * grad
                v[:] = 0.999 * v + 0.001 * grad * grad
                m_hat, v_hat = m / (1 - 0.9**step), v / (1 - 0.999**step)
                model.params[key] -= (lr * m_hat / (np.sqrt(v_hat) + 1e-8)).astype(np.float32)
    return model


def to_onnx(model: NumpyCNN, path: Path) -> Path:
    p = model.params
    inits = [
        initializer("conv.weight", p["conv_w"].reshape(FILTERS, 1, 3, 3)), initializer("conv.bias", p["conv_b"]),
        initializer("fc1.weight", p["fc1_w"]), initializer("fc1.bias", p["fc1_b"]),
        initializer("fc2.weight", p["fc2_w"]), initializer("fc2.bias", p["fc2_b"]),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "conv.weight", "conv.bias"], ["conv"], kernel_shape=[3, 3], pads=[1] * 4),
        helper.make_node("Relu", ["conv"], ["conv_relu"]),
        helper.make_node("MaxPool", ["conv_relu"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["pool"], ["flat"], axis=1),
        helper.make_node("Gemm", ["flat", "fc1.weight", "fc1.bias"], ["fc1"], transB=1),
        helper.make_node("Relu", ["fc1"], ["fc1_relu"]),
        helper.make_node("Gemm", ["fc1_relu", "fc2.weight", "fc2.bias"], ["logits"], transB=1),
    ]
    graph = helper.make_graph(nodes, "digits_cnn", [float_input("image", ["batch", 1, 8, 8])],
                              [float_input("logits", ["batch", CLASSES])], inits)
    return save_model(graph, path, "Small CNN trained on scikit-learn's digits (8x8 gray, pixels/255)")


def _write_pngs(folder: Path, pixels: np.ndarray, labels: np.ndarray | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rows = ["file,label"]
    for i, image in enumerate(pixels):
        name = f"digit_{i:04d}.png"
        Image.fromarray(image, "L").save(folder / name, optimize=False)
        if labels is not None:
            rows.append(f"{name},{int(labels[i])}")
    if labels is not None:
        (folder / "labels.csv").write_text("\n".join(rows) + "\n")


def build_digits(out: Path, epochs: int = 40, calib_count: int = 100) -> Path:
    out = Path(out)
    started = time.perf_counter()
    x_train, y_train, x_test, y_test, p_train, p_test = load_data()
    model = train(x_train, y_train, epochs=epochs)
    seconds = time.perf_counter() - started
    path = to_onnx(model, out / "model.onnx")
    train_acc = float((model.predict(x_train).argmax(1) == y_train).mean())
    test_acc = float((model.predict(x_test).argmax(1) == y_test).mean())
    (out / "labels.txt").write_text("".join(f"{d}\n" for d in range(10)))
    _write_pngs(out / "calib", p_train[:calib_count], None)
    _write_pngs(out / "val", p_test, y_test)
    np.savez(out / "calib.npz", image=x_train[:calib_count])
    np.savez(out / "val.npz", image=x_test, label=y_test)
    metrics = {"test_accuracy": round(test_acc, 4), "train_accuracy": round(train_acc, 4), "n_test": len(y_test),
               "n_train": len(y_train), "trainer": "numpy", "epochs": epochs, "seconds": round(seconds, 2)}
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return path
