"""Small models shaped like real exports, for the quantization search's tests and benchmark.

Built from code with torch (TorchScript exporter, opset 17, as most published ONNX models were
made): no downloads, no training. Seeded random weights give every anchor or time step the same
answer, so each model also gets the path a trained one would have learnt (set by hand, below);
what matters here is the graph's shape and the value ranges that break naive int8:

- :func:`export_detector`: a YOLOv8-style detector. A strided SiLU conv backbone, two levels
  (strides 8 and 16) each with a box branch (4 x ``REG_MAX`` distribution bins) and a class
  branch, the DFL decode (softmax over bins, a 1x1 conv with weights 0..REG_MAX-1, anchor
  points, strides) giving boxes in pixels, Concat'ed with sigmoid class scores into one
  ``[1, 4 + classes, anchors]`` output: the wide-range Concat that rounds every score under
  0.5 to 0 under one uint8 scale. Objects score 0.38 to 0.9 by their brightness, the background
  near 0. ``outlier=True`` makes one backbone channel 1000x larger (and its consumers' weights
  as much smaller), as large trained models have outlier channels: only ranking tensors by
  their rounding error finds it.
- :func:`export_recognizer`: a CTC text recognizer: conv backbone, height pooled into the
  channels, two Gemm/MatMul (Linear) layers to ``[1, T=64, 17]`` logits (blank, then 16
  classes bucketing a stroke's brightness, neighbouring classes close: the close calls of a
  real recognizer with thousands of classes, which int8 flips and fp16 keeps).
- :func:`detector_images`, :func:`line_images`: inputs with coloured objects / strokes.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

REG_MAX = 8
DETECTOR_SIZE = 256
DETECTOR_CLASSES = 3
LINE_SHAPE = (1, 1, 32, 128)
RECOGNIZER_CLASSES = 17  # the blank, then 16 classes
STROKE_SPAN = 0.55  # recognizer: class centres from STROKE_BASE over this much column brightness
STROKE_BASE = 0.15
RECOGNIZER_GAIN = 1.0 / (STROKE_SPAN / (RECOGNIZER_CLASSES - 2)) ** 2  # neighbours one logit apart at a centre
OUTLIER_SCALE = 1000.0
OUTLIER_CHANNEL = 3
DIM_LOGIT = -0.5
BRIGHT_LOGIT = 2.2
DIMMEST = 0.6  # object colours: own channel 0.6 to 1.0, the others OTHER_CHANNELS
SIZES = (10, 20)  # object sides in pixels: a few anchors each, as small objects have
OBJECTS = (4, 10)  # objects per image
OTHER_CHANNELS = 0.2


class _Detector(nn.Module):
    def __init__(self, classes: int, outlier: bool) -> None:
        super().__init__()
        act = nn.SiLU
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), act(), nn.Conv2d(8, 16, 3, 2, 1), act(),
                                  nn.Conv2d(16, 16, 3, 2, 1), act())
        self.down = nn.Sequential(nn.Conv2d(16, 32, 3, 2, 1), act())
        self.box = nn.ModuleList([nn.Conv2d(16, 4 * REG_MAX, 1), nn.Conv2d(32, 4 * REG_MAX, 1)])
        self.cls = nn.ModuleList([nn.Conv2d(16, classes, 1), nn.Conv2d(32, classes, 1)])
        self.dfl = nn.Conv2d(REG_MAX, 1, 1, bias=False)
        with torch.no_grad():
            self.dfl.weight.copy_(torch.arange(REG_MAX, dtype=torch.float32).view(1, REG_MAX, 1, 1))
            for conv in self.box:
                conv.weight.mul_(0.3)
        anchors, strides = [], []
        for stride in (8, 16):
            side = DETECTOR_SIZE // stride
            ys, xs = torch.meshgrid(torch.arange(side) + 0.5, torch.arange(side) + 0.5, indexing="ij")
            anchors.append(torch.stack([xs.flatten(), ys.flatten()]))
            strides.append(torch.full((1, side * side), float(stride)))
        self.register_buffer("anchors", torch.cat(anchors, 1)[None])
        self.register_buffer("strides", torch.cat(strides, 1)[None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p3 = self.stem(x)
        p4 = self.down(p3)
        levels = [torch.cat([box(p), cls(p)], 1).flatten(2)
                  for p, box, cls in zip((p3, p4), self.box, self.cls, strict=True)]
        joined = torch.cat(levels, 2)
        box, cls = joined.split((4 * REG_MAX, joined.shape[1] - 4 * REG_MAX), 1)
        batch, _, anchors = box.shape
        bins = box.view(batch, 4, REG_MAX, anchors).transpose(2, 1).softmax(1)
        distance = self.dfl(bins).view(batch, 4, anchors)
        lt, rb = distance.chunk(2, 1)
        top_left, bottom_right = self.anchors - lt, self.anchors + rb
        boxes = torch.cat([(top_left + bottom_right) / 2, bottom_right - top_left], 1) * self.strides
        return torch.cat([boxes, cls.sigmoid()], 1)


class _Recognizer(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 16, 3, 1, 1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(16, 32, 3, 1, 1), nn.ReLU(), nn.MaxPool2d((2, 1)))
        self.project = nn.Linear(32 * 8, 64)
        self.classify = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.features(x)                       # [1, 32, 8, 64]
        f = f.permute(0, 3, 1, 2).flatten(2)       # [1, T=64, 256]
        return self.classify(torch.relu(self.project(f)))


def _design_recognizer(module: _Recognizer) -> None:
    """Give the seeded random recognizer the path a trained one would have: channel 0 of both
    convs averages the image, unit 0 of the projection averages that column over the height,
    and the classifier buckets the column's brightness into the classes with logits
    ``GAIN * (2 f c_k - c_k^2)`` (the argmax of a negative squared distance to class k's
    centre: 0 for the blank, then STROKE_BASE + (k - 1) w): background columns read blank,
    each stroke the class of its brightness, the neighbouring class a margin behind that int8
    rounding crosses near bucket edges, as on a real recognizer's close calls. The random
    channels stay, smaller."""
    classes = module.classify.out_features
    width = STROKE_SPAN / (classes - 2)
    centres = torch.cat([torch.zeros(1), STROKE_BASE + torch.arange(classes - 1, dtype=torch.float32) * width])
    middle = float(centres.mean())
    with torch.no_grad():
        for conv in (module.features[0], module.features[3]):
            conv.weight[1:].mul_(0.5)
            conv.weight[0].zero_()
            conv.weight[0, 0].fill_(1.0 / 9)
            conv.bias[0] = 0.0
        # units 0 and 1: the column's brightness above and below the middle centre (ReLU keeps
        # one of them), so the logits stay near 0 and only their differences are large
        module.project.weight.mul_(0.2)
        module.project.weight[:2].zero_()
        module.project.weight[0, :8] = 1.0 / 8
        module.project.weight[1, :8] = -1.0 / 8
        module.project.bias[0], module.project.bias[1] = -middle, middle
        offsets = centres - middle
        module.classify.weight.mul_(0.05)
        module.classify.weight[:, 0] = RECOGNIZER_GAIN * 2 * offsets
        module.classify.weight[:, 1] = -RECOGNIZER_GAIN * 2 * offsets
        module.classify.bias.copy_(-RECOGNIZER_GAIN * offsets ** 2)


def _export(module: nn.Module, shape: tuple[int, ...], path: Path, output: str) -> Path:
    module.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter, chosen on purpose
        torch.onnx.export(module, (torch.zeros(shape),), str(path), input_names=["images"], output_names=[output],
                          opset_version=17, dynamo=False)
    return path


def export_detector(path: Path, *, outlier: bool = False, seed: int = 0) -> Path:
    """The YOLOv8-style detector at ``path``: input ``images [1, 3, 256, 256]``, output
    ``output0 [1, 4 + 3, 1280]`` (cx, cy, w, h in pixels, then class scores)."""
    torch.manual_seed(seed)
    module = _Detector(DETECTOR_CLASSES, outlier).eval()
    _colour_detector(module)
    if outlier:
        _outlier_channel(module)
    return _export(module, (1, 3, DETECTOR_SIZE, DETECTOR_SIZE), path, "output0")


def _colour_detector(module: _Detector) -> None:
    """Give the seeded random backbone a colour path a trained detector would have learnt:
    channels 0-2 of every backbone conv average R, G, B over their window (the other channels
    stay random, halved), and each class conv reads ``gain * (own colour - mean of the others) +
    bias``. Background cells score near 0, an object's cells 0.38 to 0.9 by its brightness.
    Small objects (10-20 px) give each object a peak anchor, so NMS keeps one box per object
    however a little rounding reorders close scores."""
    with torch.no_grad():
        for conv in (module.stem[0], module.stem[2], module.stem[4], module.down[0]):
            window = conv.weight.shape[2] * conv.weight.shape[3]
            conv.weight[:3].zero_()
            conv.bias[:3].zero_()
            for channel in range(3):
                conv.weight[channel, channel] = 1.0 / window
            conv.weight[3:].mul_(0.5)
        # Calibrate each level on flat images: the dimmest object colour (0.6 on its channel,
        # 0.2 on the others) scores logit DIM_LOGIT, the brightest (1.0) BRIGHT_LOGIT.
        flat = torch.full((2, 3, 128, 128), OTHER_CHANNELS)
        flat[0, 0], flat[1, 0] = DIMMEST, 1.0
        p3 = module.stem(flat)
        for feature, conv in zip((p3, module.down(p3)), module.cls, strict=True):
            colour = feature[:, :3, 4, 4]
            contrast = colour[:, 0] - colour[:, 1:].mean(1)
            gain = (BRIGHT_LOGIT - DIM_LOGIT) / float(contrast[1] - contrast[0])
            conv.weight.zero_()
            for cls in range(DETECTOR_CLASSES):
                conv.weight[cls, :3, 0, 0] = -gain / 2
                conv.weight[cls, cls, 0, 0] = gain
            conv.bias.fill_(DIM_LOGIT - gain * float(contrast[0]))


def _outlier_channel(module: _Detector) -> None:
    """Make one random channel (3) of the stride-8 feature OUTLIER_SCALE times larger and its
    consumers' weights as much smaller, as large trained models have outlier channels: the
    model computes nearly the same (that channel goes through SiLU at 1000x, close to ReLU), but
    one uint8 scale over that feature rounds every other channel, the colour path included, to
    nothing. Only ranking tensors by their own rounding error finds it."""
    with torch.no_grad():
        last = module.stem[4]
        last.bias[OUTLIER_CHANNEL] += 1.0  # positive, so the outlier survives SiLU into the feature
        last.weight[OUTLIER_CHANNEL].mul_(OUTLIER_SCALE)
        last.bias[OUTLIER_CHANNEL].mul_(OUTLIER_SCALE)
        for conv in (module.down[0], module.box[0], module.cls[0]):
            conv.weight[:, OUTLIER_CHANNEL].div_(OUTLIER_SCALE)


def _scenes(count: int, seed: int) -> tuple[np.ndarray, list[list[tuple[int, int, int, int, int, float]]]]:
    """``count`` images ``[count, 3, 256, 256]`` in [0, 1] (dim noise, 4-9 boxes each coloured
    by its class: red, green or blue) and their objects ``(x, y, w, h, class, brightness)``."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(0.0, 0.15, (count, 3, DETECTOR_SIZE, DETECTOR_SIZE)).astype(np.float32)
    scenes = []
    for image in images:
        objects = []
        for _ in range(rng.integers(OBJECTS[0], OBJECTS[1])):
            x, y = (int(v) for v in rng.integers(0, DETECTOR_SIZE - SIZES[1], 2))
            w, h = (int(v) for v in rng.integers(SIZES[0], SIZES[1], 2))
            cls = int(rng.integers(0, DETECTOR_CLASSES))
            colour = np.full(3, OTHER_CHANNELS, np.float32)
            colour[cls] = brightness = float(rng.uniform(DIMMEST, 1.0))
            image[:, y:y + h, x:x + w] = colour[:, None, None]
            objects.append((x, y, w, h, cls, brightness))
        scenes.append(objects)
    return images, scenes


def export_recognizer(path: Path, *, seed: int = 0) -> Path:
    """The CTC recognizer at ``path``: input ``images [1, 1, 32, 128]``, output
    ``logits [1, 64, 12]`` (per time step, class 0 the blank)."""
    torch.manual_seed(seed)
    module = _Recognizer(RECOGNIZER_CLASSES)
    _design_recognizer(module)
    return _export(module, LINE_SHAPE, path, "logits")


def detector_images(count: int, seed: int) -> np.ndarray:
    """``[count, 1, 3, 256, 256]`` float images in [0, 1]: dim noise with 2-5 coloured boxes."""
    return _scenes(count, seed)[0][:, None]


def line_images(count: int, seed: int) -> np.ndarray:
    """``[count, 1, 1, 32, 128]`` text-line-like images: vertical strokes of random width."""
    rng = np.random.default_rng(seed)
    images = rng.uniform(0.0, 0.1, (count, *LINE_SHAPE)).astype(np.float32)
    for image in images:
        for _ in range(rng.integers(4, 10)):
            x = rng.integers(0, 120)
            image[0, 0, 6:26, x:x + rng.integers(2, 8)] = rng.uniform(0.6, 1.0)
    return images
