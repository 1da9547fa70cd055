"""Sample data for calibration, validation and golden samples, fed through the device's own
preprocessing code so the host measures exactly what a device will compute."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgepack_core.errors import PreprocessError
from edgepack_core.manifest import TensorSpec
from edgepack_core.preprocess import Preprocessor
from sdk.errors import RecipeError

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".pgm", ".tif", ".tiff"}
Feed = dict[str, np.ndarray]


@dataclass
class Samples:
    """Model-ready feeds (batch 1 each) and optional integer labels, one per feed."""

    feeds: list[Feed]
    labels: list[int] | None = None

    def __len__(self) -> int:
        return len(self.feeds)


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(np.float32 if name == "bfloat16" else name)


def _fixed_shape(spec: TensorSpec) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) and d > 0 else 1 for d in spec.shape)


def _target_input(preprocess: Mapping[str, Any], inputs: Sequence[TensorSpec]) -> str:
    return preprocess.get("input") or inputs[0].name


def _read_labels_csv(path: Path, key: str) -> dict[str, int]:
    labels: dict[str, int] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                labels[row["file"]] = int(row["label"])
            except (KeyError, ValueError):
                raise RecipeError(key, f"{path}: needs columns file,label with integer labels") from None
    return labels


def load_samples(
    source: Mapping[str, Any], preprocess: Mapping[str, Any], inputs: Sequence[TensorSpec], *, key: str,
    limit: int | None = None,
) -> Samples:
    """Load ``source`` (a recipe data section: images folder or npz) as model feeds."""
    limit = source.get("limit", limit)
    if "npz" in source:
        return _load_npz(Path(source["npz"]), inputs, key, limit)
    folder = Path(source["images"])
    if preprocess.get("kind") != "image":
        raise RecipeError(f"{key}.images", "image data needs an image preprocessing spec (preprocess.kind: image)")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise RecipeError(f"{key}.images", f"{folder} holds no images")
    files = files[:limit] if limit else files
    labels_map = _read_labels_csv(Path(source["labels"]), f"{key}.labels") if "labels" in source else None
    name = _target_input(preprocess, inputs)
    pre = Preprocessor(preprocess)
    feeds: list[Feed] = []
    labels: list[int] = []
    for file in files:
        try:
            feeds.append({name: pre.from_path(file)})
        except PreprocessError as err:
            raise RecipeError(f"{key}.images", f"{file.name}: {err}") from None
        if labels_map is not None:
            if file.name not in labels_map:
                raise RecipeError(f"{key}.labels", f"no label for {file.name}")
            labels.append(labels_map[file.name])
    return Samples(feeds, labels if labels_map is not None else None)


def _load_npz(path: Path, inputs: Sequence[TensorSpec], key: str, limit: int | None) -> Samples:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as err:
        raise RecipeError(f"{key}.npz", f"{path}: not a readable .npz ({err})") from None
    missing = [i.name for i in inputs if i.name not in arrays]
    if missing:
        raise RecipeError(f"{key}.npz", f"{path}: no array for input(s) {', '.join(missing)}")
    count = min(len(arrays[i.name]) for i in inputs)
    count = min(count, limit) if limit else count
    feeds = [
        {i.name: arrays[i.name][n : n + 1].astype(_numpy_dtype(i.dtype), copy=False) for i in inputs}
        for n in range(count)
    ]
    labels = [int(v) for v in arrays["label"][:count]] if "label" in arrays else None
    return Samples(feeds, labels)


def synthetic_samples(
    count: int, preprocess: Mapping[str, Any], inputs: Sequence[TensorSpec], seed: int = 0
) -> Samples:
    """Deterministic made-up inputs when a recipe gives no data. Image models get random
    images pushed through the real preprocessing, so the golden samples exercise it too."""
    rng = np.random.default_rng(seed)
    image_input = _target_input(preprocess, inputs) if preprocess.get("kind") == "image" else None
    pre = Preprocessor(preprocess) if image_input else None
    feeds: list[Feed] = []
    for _ in range(count):
        feed: Feed = {}
        for spec in inputs:
            if spec.name == image_input and pre is not None:
                height, width = preprocess.get("resize", {}).get("size", (64, 64))
                image = rng.integers(0, 256, size=(int(height) + 7, int(width) + 5, 3), dtype=np.uint8)
                feed[spec.name] = pre.from_array(image)
            elif np.issubdtype(_numpy_dtype(spec.dtype), np.floating):
                feed[spec.name] = rng.standard_normal(_fixed_shape(spec)).astype(_numpy_dtype(spec.dtype))
            elif spec.dtype == "bool":
                feed[spec.name] = rng.integers(0, 2, size=_fixed_shape(spec)).astype(bool)
            else:
                feed[spec.name] = rng.integers(0, 10, size=_fixed_shape(spec)).astype(_numpy_dtype(spec.dtype))
        feeds.append(feed)
    return Samples(feeds)
