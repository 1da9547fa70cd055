"""A MobileNet-style image classifier with deterministic weights (no training, no download).

Structure as in MobileNet v1 at width 0.5: a strided 3x3 stem, depthwise-separable blocks
(depthwise 3x3 Conv with group = channels, BatchNormalization, ReLU6 as Clip(0, 6); pointwise
1x1 Conv, BatchNormalization, ReLU6), GlobalAveragePool, Flatten and a Gemm classifier.
Input ``input`` float32 [batch, 3, 224, 224]; output ``logits`` [batch, 1000]. BatchNorm is
kept as separate nodes on purpose: the packager's folding pass has real work to do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from onnx import helper
from PIL import Image, ImageDraw

from tools.demos.onnx_util import float_input, initializer, save_model

CLASSES = 1000
# (out_channels, stride) of each depthwise-separable block, MobileNet v1 at width 0.5.
BLOCKS = [(32, 1), (64, 2), (64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (256, 1), (512, 2), (512, 1)]
STEM = 16


class _Graph:
    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.nodes: list = []
        self.inits: list = []
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def conv_bn_relu6(self, x: str, cin: int, cout: int, kernel: int, stride: int, group: int) -> str:
        conv, bn, out = self.name("conv"), self.name("bn"), self.name("relu6")
        fan_in = (cin // group) * kernel * kernel
        weight = self.rng.normal(0, np.sqrt(2.0 / fan_in), size=(cout, cin // group, kernel, kernel))
        self.inits += [
            initializer(f"{conv}.weight", weight),
            initializer(f"{bn}.scale", self.rng.uniform(0.5, 1.5, cout)),
            initializer(f"{bn}.bias", self.rng.normal(0, 0.1, cout)),
            initializer(f"{bn}.mean", self.rng.normal(0, 0.1, cout)),
            initializer(f"{bn}.var", self.rng.uniform(0.5, 1.5, cout)),
        ]
        pad = kernel // 2
        self.nodes += [
            helper.make_node("Conv", [x, f"{conv}.weight"], [conv], kernel_shape=[kernel, kernel],
                             strides=[stride, stride], pads=[pad] * 4, group=group),
            helper.make_node("BatchNormalization", [conv, f"{bn}.scale", f"{bn}.bias", f"{bn}.mean", f"{bn}.var"],
                             [bn], epsilon=1e-5),
            helper.make_node("Clip", [bn, "relu6.min", "relu6.max"], [out]),
        ]
        return out


def mobilenet_graph(seed: int = 0):
    rng = np.random.default_rng(seed)
    g = _Graph(rng)
    g.inits += [initializer("relu6.min", np.array(0.0)), initializer("relu6.max", np.array(6.0))]
    x = g.conv_bn_relu6("input", 3, STEM, 3, 2, 1)
    channels = STEM
    for cout, stride in BLOCKS:
        x = g.conv_bn_relu6(x, channels, channels, 3, stride, channels)  # depthwise
        x = g.conv_bn_relu6(x, channels, cout, 1, 1, 1)  # pointwise
        channels = cout
    g.inits += [
        initializer("fc.weight", rng.normal(0, np.sqrt(1.0 / channels), size=(CLASSES, channels))),
        initializer("fc.bias", rng.normal(0, 0.01, CLASSES)),
    ]
    g.nodes += [
        helper.make_node("GlobalAveragePool", [x], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["features"], axis=1),
        helper.make_node("Gemm", ["features", "fc.weight", "fc.bias"], ["logits"], transB=1),
    ]
    return helper.make_graph(g.nodes, "mobilenet_style", [float_input("input", ["batch", 3, 224, 224])],
                             [float_input("logits", ["batch", CLASSES])], g.inits)


def _synthetic_image(rng: np.random.Generator, index: int) -> Image.Image:
    """Procedural pictures of varied sizes and aspect ratios: gradients, shapes, noise."""
    width, height = int(rng.integers(160, 400)), int(rng.integers(160, 400))
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([xx / width, yy / height, (xx + yy) / (width + height)], axis=-1)
    base = (base[..., rng.permutation(3)] * 255).astype(np.uint8)
    image = Image.fromarray(base, "RGB")
    draw = ImageDraw.Draw(image)
    for _ in range(3 + index % 4):
        box = sorted(rng.integers(0, width, 2).tolist()), sorted(rng.integers(0, height, 2).tolist())
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        shape = [box[0][0], box[1][0], box[0][1], box[1][1]]
        (draw.ellipse if index % 2 else draw.rectangle)(shape, fill=color)
    noise = rng.normal(0, 12, size=(height, width, 3))
    return Image.fromarray(np.clip(np.asarray(image, np.float32) + noise, 0, 255).astype(np.uint8), "RGB")


PREPROCESS = {
    "kind": "image", "color": "rgb",
    "resize": {"size": [224, 224], "mode": "center-crop", "interpolation": "bilinear"},
    "scale": 1 / 255, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
    "layout": "NCHW", "dtype": "float32",
}


def build_mobilenet(out: Path, images: int = 16) -> Path:
    out = Path(out)
    model = save_model(mobilenet_graph(), out / "model.onnx",
                       "MobileNet-style classifier (width 0.5) with deterministic weights: a demo, not trained")
    (out / "labels.txt").write_text("".join(f"class_{i}\n" for i in range(CLASSES)))
    folder = out / "images"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    for i in range(images):
        _synthetic_image(rng, i).save(folder / f"img_{i:03d}.png", optimize=False)
    from edgepack_core.preprocess import Preprocessor

    pre = Preprocessor(PREPROCESS)
    batch = np.concatenate([pre.from_path(p) for p in sorted(folder.glob("*.png"))])
    np.savez(out / "calib.npz", input=batch)
    return model
