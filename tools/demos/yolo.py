"""A YOLOv8-style detector trained from code on drawn shapes (needs torch; no downloads).

Shaped like an Ultralytics YOLOv8 export: input ``images [batch, 3, 96, 96]`` (RGB / 255,
letterboxed with gray 114), one output ``output0 [batch, 4 + 3, 180]``: per anchor cx, cy, w,
h in input pixels, decoded in the graph (distribution focal loss bins -> softmax -> a 1x1 conv
with weights 0..7 -> distances to the anchor point -> boxes x stride), concatenated with the
sigmoid scores of the classes square, circle and triangle. Conv + BatchNorm + SiLU backbone,
two levels (strides 8 and 16: 144 + 36 anchors), decoupled box and class branches.

Data: noisy backgrounds of random size (80..160 px a side) with one to three coloured shapes;
ground truth is the drawn bounding boxes. Training sees every scene through the device's own
letterbox preprocessing (``edgepack_core.preprocess``), so the boxes the agent maps back to the
original pixels are what the model learned. Trained with a fixed seed for a few hundred Adam
steps (center-sampling assignment, BCE on classes, DFL + IoU loss on boxes).

Writes ``model.onnx``, ``model.pt`` (the torch weights), ``labels.txt``, ``calib/`` and ``val/``
PNGs, ``val/boxes.json`` (``{file: [[x1, y1, x2, y2, class], ...]}`` in the PNG's pixels) and
``metrics.json`` (recall and precision against the drawn boxes at IoU 0.5, with onnxruntime).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from tools.demos.cache import CachedDemo

SEED = 0
SIZE = 96
CLASSES = ("square", "circle", "triangle")
COLOURS = ((215, 60, 50), (60, 195, 80), (70, 110, 235))
STRIDES = (8, 16)
REG_MAX = 8
PAD_VALUE = 114
GAP = 4  # pixels between shapes: touching shapes read as one object, to people too
SPEC = {"kind": "image", "color": "rgb", "scale": 1 / 255, "layout": "NCHW", "dtype": "float32",
        "resize": {"size": [SIZE, SIZE], "mode": "letterbox", "pad": "center", "pad_value": PAD_VALUE}}
TRAIN_SCENES, STEPS, BATCH = 1024, 500, 16
# 64 validation scenes hold about 100 reference detections: enough that recall and precision of
# 0.95 can be shown at 95% confidence (73 all found), where 24 scenes (37 detections) could not.
CALIB_COUNT, VAL_COUNT = 32, 64


# ----------------------------------------------------------------------------- data


def draw_scene(rng: np.random.Generator) -> tuple[Image.Image, list[list[float]]]:
    """A noisy canvas of random size with 1-3 non-overlapping shapes; their boxes
    ``[x1, y1, x2, y2, class]`` in canvas pixels."""
    width, height = (int(v) for v in rng.integers(80, 161, 2))
    base = rng.integers(25, 120, 3)
    pixels = base + rng.normal(0, 16, (height, width, 3)) + np.linspace(-20, 20, width)[None, :, None]
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")
    draw = ImageDraw.Draw(image)
    boxes: list[list[float]] = []
    for _ in range(int(rng.integers(1, 4))):
        for _attempt in range(20):
            side = int(rng.uniform(0.2, 0.42) * min(width, height))
            x1, y1 = int(rng.integers(0, width - side)), int(rng.integers(0, height - side))
            box = [x1, y1, x1 + side, y1 + side]
            if all(box[2] + GAP <= b[0] or b[2] + GAP <= box[0] or box[3] + GAP <= b[1] or b[3] + GAP <= box[1]
                   for b in boxes):
                break
        else:
            continue
        cls = int(rng.integers(len(CLASSES)))
        colour = tuple(int(c) for c in np.clip(np.array(COLOURS[cls]) + rng.integers(-25, 26, 3), 0, 255))
        corners = [x1, y1, x1 + side - 1, y1 + side - 1]
        if cls == 0:
            draw.rectangle(corners, fill=colour)
        elif cls == 1:
            draw.ellipse(corners, fill=colour)
        else:
            draw.polygon([(x1 + side / 2, y1), (x1 + side - 1, y1 + side - 1), (x1, y1 + side - 1)], fill=colour)
        boxes.append([*map(float, box), float(cls)])
    return image, boxes


def to_input(image: Image.Image, boxes: list[list[float]]) -> tuple[np.ndarray, np.ndarray]:
    """The model input the device computes for ``image`` and the boxes in input pixels."""
    from edgepack_core.geometry import image_geometry
    from edgepack_core.preprocess import Preprocessor

    pre = Preprocessor(SPEC)
    tensor = pre.from_image(image)[0]
    geometry = image_geometry(image.height, image.width, pre.spec.resize)
    mapped = np.array([[b[0] * geometry["scale_x"] + geometry["pad_x"], b[1] * geometry["scale_y"] + geometry["pad_y"],
                        b[2] * geometry["scale_x"] + geometry["pad_x"], b[3] * geometry["scale_y"] + geometry["pad_y"],
                        b[4]] for b in boxes], np.float32).reshape(-1, 5)
    return tensor, mapped


# ----------------------------------------------------------------------------- model


def anchor_points() -> tuple[np.ndarray, np.ndarray]:
    """Anchor centers in grid units ``[2, A]`` and each anchor's stride ``[1, A]`` (level by level)."""
    points, strides = [], []
    for stride in STRIDES:
        cells = SIZE // stride
        ys, xs = np.meshgrid(np.arange(cells) + 0.5, np.arange(cells) + 0.5, indexing="ij")
        points.append(np.stack([xs.ravel(), ys.ravel()]))
        strides.append(np.full(cells * cells, stride))
    return np.concatenate(points, 1).astype(np.float32), np.concatenate(strides)[None].astype(np.float32)


def make_model():
    """The detector as a torch module (an untrained one; :func:`train` fits it)."""
    import torch
    from torch import nn

    def conv(c_in: int, c_out: int, stride: int = 1) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.SiLU())

    class Detector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(conv(3, 16, 2), conv(16, 24, 2))    # stride 4
            self.p3 = nn.Sequential(conv(24, 32, 2), conv(32, 32))        # stride 8
            self.p4 = nn.Sequential(conv(32, 48, 2), conv(48, 48))        # stride 16
            self.box = nn.ModuleList(nn.Sequential(conv(c, 24), nn.Conv2d(24, 4 * REG_MAX, 1)) for c in (32, 48))
            self.cls = nn.ModuleList(nn.Sequential(conv(c, 24), nn.Conv2d(24, len(CLASSES), 1)) for c in (32, 48))
            for branch in self.cls:  # YOLO's prior: every score starts near 0.01, not 0.5
                nn.init.constant_(branch[-1].bias, -4.6)
            self.dfl = nn.Conv2d(REG_MAX, 1, 1, bias=False).requires_grad_(False)
            self.dfl.weight.data[:] = torch.arange(REG_MAX, dtype=torch.float32).view(1, REG_MAX, 1, 1)
            points, strides = anchor_points()
            self.count = int(points.shape[1])
            self.register_buffer("anchors", torch.from_numpy(points)[None])
            self.register_buffer("strides", torch.from_numpy(strides)[None])

        def head(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """Box bin logits ``[B, 4*REG_MAX, A]`` and class logits ``[B, classes, A]``."""
            p3 = self.p3(self.stem(images))
            p4 = self.p4(p3)
            box = torch.cat([b(f).flatten(2) for b, f in zip(self.box, (p3, p4), strict=True)], 2)
            cls = torch.cat([c(f).flatten(2) for c, f in zip(self.cls, (p3, p4), strict=True)], 2)
            return box, cls

        def distances(self, box: torch.Tensor) -> torch.Tensor:
            """DFL: the expected bin of each side, ``[B, 4, A]`` in grid units (l, t, r, b)."""
            # Fixed sizes but the batch (-1): the exported output keeps its static [batch, 7, 180].
            bins = box.reshape(-1, 4, REG_MAX, self.count).transpose(2, 1).softmax(1)
            return self.dfl(bins).reshape(-1, 4, self.count)

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            box, cls = self.head(images)
            left_top, right_bottom = self.distances(box).chunk(2, 1)
            top_left, bottom_right = self.anchors - left_top, self.anchors + right_bottom
            xywh = torch.cat(((top_left + bottom_right) / 2, bottom_right - top_left), 1) * self.strides
            return torch.cat((xywh, cls.sigmoid()), 1)

    return Detector()


# ----------------------------------------------------------------------------- training


def assign(targets, points, strides):
    """Center sampling: an anchor is positive for the smallest box that contains its center
    within 1.5 strides of the box's center. Returns (class index or -1 ``[B, A]``, the
    assigned box ``[B, A, 4]`` in input pixels)."""
    import torch

    px, py = points[0] * strides[0], points[1] * strides[0]                       # [A] pixels
    boxes, labels = targets[..., :4], targets[..., 4]                              # [B, M, 4], [B, M]
    x1, y1, x2, y2 = (boxes[..., i, None] for i in range(4))                       # [B, M, 1]
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    radius = 1.5 * strides[0]
    inside = (px > x1) & (px < x2) & (py > y1) & (py < y2)
    central = ((px - cx).abs() < radius) & ((py - cy).abs() < radius)
    valid = (labels >= 0)[..., None] & inside & central                           # [B, M, A]
    area = ((x2 - x1) * (y2 - y1)).expand_as(valid).masked_fill(~valid, float("inf"))
    best = area.argmin(1)                                                          # [B, A]
    positive = valid.any(1)
    cls = torch.where(positive, labels.gather(1, best).long(), torch.full_like(best, -1))
    chosen = boxes.gather(1, best[..., None].expand(-1, -1, 4))
    return cls, chosen


def detection_loss(model, images, targets):
    import torch
    import torch.nn.functional as F

    box_logits, cls_logits = model.head(images)
    points, strides = model.anchors[0], model.strides[0]
    cls, chosen = assign(targets, points, strides)
    positive = cls >= 0
    count = max(int(positive.sum()), 1)
    onehot = F.one_hot(cls.clamp(min=0), len(CLASSES)).float() * positive[..., None]
    loss_cls = F.binary_cross_entropy_with_logits(cls_logits.transpose(1, 2), onehot, reduction="sum") / count
    if not positive.any():
        return loss_cls
    anchor_px = (points * strides).T                                                  # [A, 2]
    stride = strides[0][None, :, None].expand(positive.shape[0], -1, 1)[positive]    # [P, 1]
    anchor = anchor_px[None].expand(positive.shape[0], -1, -1)[positive]              # [P, 2]
    box = chosen[positive]                                                            # [P, 4]
    target = torch.cat((anchor - box[:, :2], box[:, 2:] - anchor), 1) / stride       # l, t, r, b in grid units
    target = target.clamp(0, REG_MAX - 1.01)
    bins = box_logits.view(box_logits.shape[0], 4, REG_MAX, -1).permute(0, 3, 1, 2)[positive]  # [P, 4, R]
    left = target.floor().long()
    weight_right = target - left
    log_probs = bins.log_softmax(-1)
    loss_dfl = -(log_probs.gather(-1, left[..., None])[..., 0] * (1 - weight_right)
                 + log_probs.gather(-1, (left + 1)[..., None])[..., 0] * weight_right).mean()
    predicted = (bins.softmax(-1) * torch.arange(REG_MAX, dtype=torch.float32)).sum(-1)
    loss_iou = (1 - _ltrb_iou(predicted, target)).mean()
    return loss_cls + 0.5 * loss_dfl + 2.0 * loss_iou


def _ltrb_iou(a, b):
    """IoU of boxes given as distances (l, t, r, b) from the same point."""
    import torch

    inter = (torch.minimum(a[:, 0], b[:, 0]) + torch.minimum(a[:, 2], b[:, 2])) * \
        (torch.minimum(a[:, 1], b[:, 1]) + torch.minimum(a[:, 3], b[:, 3]))
    area_a = (a[:, 0] + a[:, 2]) * (a[:, 1] + a[:, 3])
    area_b = (b[:, 0] + b[:, 2]) * (b[:, 1] + b[:, 3])
    return inter / (area_a + area_b - inter + 1e-6)


def training_set(rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` scenes as model inputs (uint8, to stay small) and targets padded to 3 boxes
    (class -1 pads)."""
    images = np.empty((count, 3, SIZE, SIZE), np.uint8)
    targets = np.full((count, 3, 5), -1.0, np.float32)
    for i in range(count):
        tensor, boxes = to_input(*draw_scene(rng))
        images[i] = np.round(tensor * 255)
        targets[i, :len(boxes)] = boxes
    return images, targets


def train(seed: int = SEED, steps: int = STEPS):
    """The detector trained on drawn scenes with a fixed seed; (module, losses, seconds)."""
    import torch

    from tools.demos.torch_util import fit

    def batches(rng, generator):
        images, targets = training_set(rng, TRAIN_SCENES)
        while True:
            pick = torch.randint(0, len(images), (BATCH,), generator=generator).numpy()
            yield torch.from_numpy(images[pick]).float() / 255, torch.from_numpy(targets[pick])

    return fit(make_model, batches, detection_loss, seed=seed, steps=steps, lr=4e-3)


# ----------------------------------------------------------------------------- reference decoding


def decode(output: np.ndarray, score_threshold: float = 0.25, iou_threshold: float = 0.45) -> list[list[float]]:
    """One image's ``[4 + classes, A]`` head -> ``[[x1, y1, x2, y2, score, class]]`` after
    class-wise NMS, in input pixels. Plain loops: the builder's own quality check."""
    cx, cy, w, h = output[:4]
    scores = output[4:]
    cls, score = scores.argmax(0), scores.max(0)
    found = []
    for a in np.argsort(-score, kind="stable"):
        if score[a] <= score_threshold:
            break
        box = [cx[a] - w[a] / 2, cy[a] - h[a] / 2, cx[a] + w[a] / 2, cy[a] + h[a] / 2]
        if all(f[5] != cls[a] or iou(box, f[:4]) <= iou_threshold for f in found):
            found.append([*map(float, box), float(score[a]), float(cls[a])])
    return found


def iou(a, b) -> float:
    inter = max(0.0, min(a[2], b[2]) - max(a[0], b[0])) * max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def match_counts(found: list[list[float]], truth: list[list[float]], threshold: float = 0.5) -> int:
    """Ground-truth boxes matched one to one by a found box of their class at IoU >= threshold."""
    used: set[int] = set()
    hits = 0
    for t in truth:
        best = max(((iou(f[:4], t[:4]), i) for i, f in enumerate(found) if i not in used and f[5] == t[4]),
                   default=(0.0, -1))
        if best[0] >= threshold:
            used.add(best[1])
            hits += 1
    return hits


# ----------------------------------------------------------------------------- build


def _write_scenes(folder: Path, rng: np.random.Generator, count: int, prefix: str) -> dict[str, list[list[float]]]:
    folder.mkdir(parents=True, exist_ok=True)
    truth = {}
    for i in range(count):
        image, boxes = draw_scene(rng)
        name = f"{prefix}_{i:03d}.png"
        image.save(folder / name, optimize=False)
        truth[name] = boxes
    return truth


def _evaluate(model_path: Path, folder: Path, truth: dict[str, list[list[float]]]) -> dict[str, float]:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    hits = found_total = truth_total = 0
    for name, boxes in truth.items():
        image = Image.open(folder / name)
        tensor, mapped = to_input(image, boxes)
        found = decode(session.run(None, {"images": tensor[None]})[0][0])
        hits += match_counts(found, mapped.tolist())
        found_total += len(found)
        truth_total += len(boxes)
    return {"recall": round(hits / max(truth_total, 1), 4), "precision": round(hits / max(found_total, 1), 4),
            "boxes": truth_total, "detections": found_total}


def _stamp_head_shape(path: Path) -> None:
    """The TorchScript exporter leaves the head's dims symbolic after the batch-agnostic
    reshapes; onnx's own inference proves them static. Written as ``[batch, 7, 180]``, the
    way Ultralytics exports declare ``[1, 84, 8400]``."""
    import onnx

    model = onnx.load(path)
    dims = model.graph.output[0].type.tensor_type.shape.dim
    dims[1].dim_value, dims[2].dim_value = 4 + len(CLASSES), int(anchor_points()[0].shape[1])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)


def _build(out: Path) -> Path:
    import torch

    from tools.demos.torch_util import save_and_export, write_metrics

    model, losses, seconds = train()
    path = save_and_export(model, out, [torch.zeros(1, 3, SIZE, SIZE)], input_names=["images"],
                           output_names=["output0"], dynamic_axes={"images": {0: "batch"}, "output0": {0: "batch"}})
    _stamp_head_shape(path)
    rng = np.random.default_rng(SEED + 1)
    _write_scenes(out / "calib", rng, CALIB_COUNT, "calib")
    truth = _write_scenes(out / "val", rng, VAL_COUNT, "val")
    (out / "val" / "boxes.json").write_text(json.dumps(truth, indent=1) + "\n")
    (out / "labels.txt").write_text("".join(f"{name}\n" for name in CLASSES))
    write_metrics(out, _evaluate(path, out / "val", truth), losses, STEPS, seconds)
    return path


_HERE = Path(__file__).resolve().parent
# The trained detector and its data under ``out``, trained once per checkout (the cache key is these files' source).
build_yolo = CachedDemo("yolo", _build, (_HERE / "yolo.py", _HERE / "torch_util.py"))
