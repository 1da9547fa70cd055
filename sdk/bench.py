"""``edgepack bench``: latency and throughput on this machine, original and packaged side by side.

Medians and p95 over repeated single-sample runs after a warm-up, both models measured in the
same worker process one after the other (timed next to the session, so the pipe to the worker
never enters the figures), so the ratio is meaningful on a noisy machine.

Any model can be measured: the input shapes come, in this order, from ``--shape NAME=1x3x224x224``,
the recipe's ``inputs:`` section (``--recipe``), the golden samples inside an artifact, and the
model's own fixed dims. A dynamic dim that none of them fixes is one clear usage error, never a
traceback from onnxruntime.
"""

from __future__ import annotations

import io
import json
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgepack_core.artifact import Limits, extract_artifact
from edgepack_core.errors import UsageError
from edgepack_core.signing import TrustStore
from sdk.errors import BuildError
from sdk.packager import ort_host

MAX_INPUT_ELEMENTS = 1 << 28  # 1 GiB of float32 per input: a typo in --shape must not eat the host
_ORT_DTYPES = {
    "float": np.float32, "double": np.float64, "float16": np.float16, "int8": np.int8, "int16": np.int16,
    "int32": np.int32, "int64": np.int64, "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32,
    "uint64": np.uint64, "bool": np.bool_, "string": np.str_,
}


@dataclass(frozen=True)
class Timing:
    label: str
    p50_ms: float
    p95_ms: float
    throughput_per_s: float
    bytes: int
    shapes: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "p50_ms": self.p50_ms, "p95_ms": self.p95_ms,
                "throughput_per_s": self.throughput_per_s, "bytes": self.bytes, "shapes": self.shapes}


@dataclass(frozen=True)
class InputHints:
    """What the user told us about the inputs: ``--shape`` values, the recipe's ``inputs:``
    section, and the artifact's first golden sample."""

    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    recipe: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    golden: Mapping[str, np.ndarray] = field(default_factory=dict)


def parse_shape(text: str) -> tuple[str | None, tuple[int, ...]]:
    """``NAME=1x3x224x224`` (or just ``1x3x224x224`` for a one-input model; ``NAME=`` or
    ``scalar`` for a rank-0 input) into (name, dims)."""
    name, sep, dims = text.rpartition("=")
    if not sep:
        name, dims = "", text
    dims = dims.strip()
    if dims in ("", "scalar"):
        return name or None, ()
    try:
        shape = tuple(int(d) for d in dims.lower().split("x"))
    except ValueError as err:
        raise UsageError(f"--shape {text}: dims are integers joined by x, e.g. x=1x3x224x224") from err
    if any(d < 0 for d in shape):
        raise UsageError(f"--shape {text}: dims cannot be negative")
    return name or None, shape


def shapes_by_name(texts: list[str], input_names: list[str]) -> dict[str, tuple[int, ...]]:
    """The ``--shape`` options keyed by input name; a nameless one fits a one-input model only."""
    shapes: dict[str, tuple[int, ...]] = {}
    for text in texts:
        name, dims = parse_shape(text)
        if name is None:
            if len(input_names) != 1:
                raise UsageError(f"--shape {text}: the model has {len(input_names)} inputs "
                                 f"({', '.join(input_names)}); write NAME=DIMS")
            name = input_names[0]
        if name not in input_names:
            raise UsageError(f"--shape {text}: the model has no input {name!r} (inputs: {', '.join(input_names)})")
        shapes[name] = dims
    return shapes


def _fmt(dims: list[Any] | tuple[Any, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in dims) + "]"


def resolve_shape(name: str, declared: list[int | str | None], given: tuple[int, ...] | None, where: str
                  ) -> tuple[int, ...]:
    """The dims to feed ``name``: the given ones when they fit the model's rank and fixed dims,
    else the model's own when all are fixed but a leading batch dim (then 1). Pure; raises
    UsageError naming what to pass."""
    if given is not None:
        if len(given) != len(declared):
            raise UsageError(f"{where}: input {name} has rank {len(declared)} {_fmt(declared)}, "
                             f"the shape given has rank {len(given)} {_fmt(given)}")
        for axis, (want, got) in enumerate(zip(declared, given, strict=True)):
            if isinstance(want, int) and want >= 0 and want != got:
                raise UsageError(f"{where}: input {name} has dim {axis} fixed to {want}, the shape given says {got}")
        shape = given
    else:
        open_axes = [axis for axis, d in enumerate(declared) if not (isinstance(d, int) and d >= 0)]
        if open_axes == [0] and len(declared) >= 2:
            # A free leading dim is the batch: a device runs one sample per call, as
            # onnxruntime's perf test assumes. Any other free dim has no safe default.
            declared = [1, *declared[1:]]
        elif open_axes:
            raise UsageError(f"input {name} has dynamic dims {_fmt(declared)}: pass --shape {name}=DIMS "
                             f"(dims joined by x, e.g. 1x3x224x224), a --recipe whose inputs.{name}.shape "
                             "fixes them, or an artifact with golden samples")
        shape = tuple(int(d) for d in declared)  # type: ignore[arg-type]
    if int(np.prod(shape, dtype=np.int64)) > MAX_INPUT_ELEMENTS:
        raise UsageError(f"{where}: input {name} of shape {_fmt(shape)} is over {MAX_INPUT_ELEMENTS:,d} elements")
    return shape


def numpy_dtype(name: str, ort_type: str) -> np.dtype:
    """numpy dtype of an onnxruntime type string such as ``tensor(float)``."""
    inner = ort_type[len("tensor("):-1] if ort_type.startswith("tensor(") else ""
    if inner not in _ORT_DTYPES:
        raise UsageError(f"input {name} is {ort_type}: bench feeds numpy tensors "
                         "(float, integer, bool, string), not this type")
    return np.dtype(_ORT_DTYPES[inner])


def synthetic_value(shape: tuple[int, ...], dtype: np.dtype, spec: Mapping[str, Any], rng: np.random.Generator
                    ) -> np.ndarray:
    """A value for timing: the recipe's constant, values in its range, else index-safe zeros for
    integers (any index or count input accepts 0), normal floats, False, empty strings."""
    if spec.get("role") == "constant" and "value" in spec:
        return np.asarray(spec["value"], dtype=dtype)
    if dtype.kind == "f":
        low, high = spec.get("range", (None, None))
        if low is not None and high is not None:
            return rng.uniform(float(low), float(high), size=shape).astype(dtype)
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind in "iu" and "range" in spec:
        low, high = spec["range"]
        return rng.integers(int(low), int(high), size=shape, endpoint=True).astype(dtype)
    if dtype.kind == "U":
        return np.full(shape, "", dtype=object)
    return np.zeros(shape, dtype=dtype)


def make_feed(inputs: list[dict[str, Any]], hints: InputHints) -> dict[str, np.ndarray]:
    """One feed for the model's inputs, following the hint order of the module docstring."""
    rng = np.random.default_rng(0)
    feed: dict[str, np.ndarray] = {}
    for spec in inputs:
        name, declared = spec["name"], list(spec["shape"])
        dtype = numpy_dtype(name, spec["type"])
        recipe = hints.recipe.get(name, {})
        if name in hints.shapes:
            shape = resolve_shape(name, declared, hints.shapes[name], "--shape")
        elif "shape" in recipe:
            shape = resolve_shape(name, declared, tuple(int(d) for d in recipe["shape"]), f"recipe inputs.{name}")
        elif name in hints.golden:
            feed[name] = hints.golden[name]
            continue
        else:
            shape = resolve_shape(name, declared, None, "model")
        feed[name] = synthetic_value(shape, dtype, recipe, rng)
    return feed


def measure(label: str, model_bytes: bytes, *, hints: InputHints | None = None, runs: int = 100, warmup: int = 10,
            threads: int = 0) -> Timing:
    hints = hints or InputHints()
    with ort_host.in_pass("bench", model=label):
        feed = make_feed(ort_host.describe(model_bytes).inputs, hints)
        times = ort_host.measure_latency(model_bytes, feed, runs=runs, warmup=warmup, threads=threads)
    total = float(np.sum(times))
    return Timing(label, round(float(np.median(times)) * 1000, 4), round(float(np.percentile(times, 95)) * 1000, 4),
                  round(runs / total, 1) if total else 0.0, len(model_bytes),
                  {k: list(np.shape(v)) for k, v in feed.items()})


@dataclass(frozen=True)
class Packaged:
    model: bytes
    golden: dict[str, np.ndarray]


def packaged_model(artifact: Path, trust: TrustStore | None) -> Packaged:
    """The model (and first golden sample) inside an artifact: verified and extracted with a
    trust store, else read for measuring only (a benchmark never installs or serves it)."""
    if trust is not None:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "x"
            verified = extract_artifact(artifact, root, trust)
            samples = verified.manifest.golden.get("samples", [])
            golden = (root / samples[0]["inputs"]).read_bytes() if samples else None
            return Packaged((root / verified.manifest.model_path).read_bytes(), _golden_feed(golden))
    return _read_unverified(artifact)


def _read_unverified(artifact: Path) -> Packaged:
    limits = Limits()
    try:
        with tarfile.open(artifact, "r:*") as tar:
            manifest = json.loads(_member_bytes(tar, "manifest.json", limits.max_manifest_bytes))
            model_path = str(manifest.get("model", {}).get("path", "model/model.onnx"))
            samples = manifest.get("golden", {}).get("samples", [])
            model = _member_bytes(tar, model_path, limits.max_member_bytes)
            golden = _member_bytes(tar, samples[0]["inputs"], limits.max_member_bytes) if samples else None
    except (tarfile.TarError, KeyError, OSError, ValueError, TypeError, AttributeError) as err:
        raise BuildError("bench", f"{artifact}: not a readable artifact ({err})") from err
    return Packaged(model, _golden_feed(golden))


def _member_bytes(tar: tarfile.TarFile, name: str, limit: int) -> bytes:
    member = tar.getmember(name)
    stream = tar.extractfile(member) if member.isfile() and member.size <= limit else None
    if stream is None:
        raise ValueError(f"{name} is not a regular file within the size limit")
    return stream.read()


def _golden_feed(data: bytes | None) -> dict[str, np.ndarray]:
    if data is None:
        return {}
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    except (ValueError, OSError):  # a golden sample numpy cannot read without pickle: not used
        return {}


def bench(target: Path, *, original: Path | None = None, trust: TrustStore | None = None, runs: int = 100,
          threads: int = 0, shapes: list[str] | None = None, recipe_inputs: Mapping[str, Any] | None = None
          ) -> list[Timing]:
    """Measure ``target`` (a model or an artifact) and optionally its ``original``."""
    if target.suffix == ".edgepkg":
        packaged = packaged_model(target, trust)
        candidates = [(f"packaged {target.name}", packaged.model)]
        golden = packaged.golden
    else:
        candidates, golden = [(target.name, _read(target))], {}
    if original is not None:
        candidates.insert(0, (f"original {original.name}", _read(original)))
    results = []
    for label, model in candidates:
        with ort_host.in_pass("bench", model=label):
            names = [i["name"] for i in ort_host.describe(model).inputs]
        hints = InputHints(shapes_by_name(list(shapes or []), names), dict(recipe_inputs or {}), golden)
        results.append(measure(label, model, hints=hints, runs=runs, threads=threads))
    return results


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise BuildError("bench", f"{path}: {err.strerror}") from err
