"""Image in, answer out: the agent's image path against its tensor path, measured side by side.

For the MobileNet-style demo and a letterbox detector (the ``yolo-int8`` recipe and its torch
demo when both are there, else a YOLO-style 640x640 ONNX built here), through
``InferenceService``:

- tensors -> result (``predict_tensors``, postprocessing on) against image -> result
  (``predict``) for a 640x480 JPEG, a 1280x720 JPEG and a raw 1280x720 RGB frame, with the fast
  path and with the pre-change path (``Preprocessor(spec, reference=True)``: full decode,
  resize then crop, float32 step by step) in the same run; preprocessing alone beside them;
- the MobileNet-style demo packaged with ``preprocess.in_graph`` against the Python path;
- batches: images/s of ``predict`` on a list of JPEGs (mobilenet-dynamic) one by one
  (``max_batch`` 1) against batches of 2, 4, 8 and 16;
- where the time goes on the MobileNet-style demo's 1280x720 inputs: the raw frame with and
  without the split resize and the integer reduction, the JPEG's decode alone at 1/2, in YCbCr,
  at 1/8 (the floor: libjpeg entropy-decodes every coefficient whatever the scale) and in full.

Every figure is a median over rounds in which all candidates of a table run one after the
other (this machine is shared and noisy: drift hits them alike). The frames are procedural
1/f-noise scenes with shapes, JPEG quality 85 (Pillow, 4:2:0).

    python tools/bench/image_path.py [--rounds 100] [--batch-rounds 30]
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import yaml
from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from device_agent.runtime import InferenceService, LoadedModel, load_model  # noqa: E402
from edgepack_core import preprocess, resample  # noqa: E402
from edgepack_core.artifact import extract_artifact  # noqa: E402
from edgepack_core.preprocess import Preprocessor  # noqa: E402
from edgepack_core.signing import TrustStore, load_public_key  # noqa: E402
from sdk.keys import write_keypair  # noqa: E402
from sdk.packager.pipeline import build  # noqa: E402
from sdk.recipe import load_recipe  # noqa: E402
from tools.demos import build_all  # noqa: E402


def photo_like(width: int, height: int, seed: int = 0) -> np.ndarray:
    """A scene with a camera frame's JPEG bit rate: 1/f noise in three mixed channels and
    twelve flat rectangles (1.8 bits per pixel at quality 85)."""
    rng = np.random.default_rng(seed)
    fy, fx = np.fft.fftfreq(height)[:, None], np.fft.rfftfreq(width)[None, :]
    radius = np.hypot(fx, fy)
    radius[0, 0] = 1.0
    planes = []
    for _ in range(3):
        plane = np.fft.irfft2((rng.standard_normal(radius.shape) + 1j * rng.standard_normal(radius.shape)) / radius,
                              s=(height, width))
        planes.append((plane - plane.mean()) / plane.std())
    mixed = np.stack(planes, -1) @ np.array([[1, 0.6, 0.3], [0.2, 1, 0.4], [0.1, 0.3, 1]])
    image = Image.fromarray(np.clip(128 + 45 * mixed, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        xs, ys = sorted(rng.integers(0, width, 2).tolist()), sorted(rng.integers(0, height, 2).tolist())
        draw.rectangle([xs[0], ys[0], xs[1], ys[1]], fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return np.asarray(image)


def jpeg(array: np.ndarray, quality: int = 85) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def medians(candidates: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each candidate, all run once per round, in turn."""
    for call in candidates.values():  # warm-up: sessions, allocator, Pillow's plugins
        for _ in range(3):
            call()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    clock = time.perf_counter
    for _ in range(rounds):
        for name, call in candidates.items():
            started = clock()
            call()
            times[name].append(clock() - started)
    return {name: statistics.median(values) for name, values in times.items()}


# ----------------------------------------------------------------------------- artifacts


def yolo_style_model(path: Path, size: int = 640, classes: int = 3) -> None:
    """A YOLOv8-style head on a small strided backbone with fixed random weights: input
    ``images [batch, 3, size, size]``, output ``output0 [batch, 4 + classes, (size/32)^2]``."""
    from onnx import TensorProto, helper, numpy_helper, save

    rng = np.random.default_rng(0)
    nodes, inits, x, cin = [], [], "images", 3
    for i, cout in enumerate((16, 32, 64, 128, 128)):
        weight = rng.normal(0, np.sqrt(2 / (cin * 9)), (cout, cin, 3, 3)).astype(np.float32)
        inits.append(numpy_helper.from_array(weight, f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], kernel_shape=[3, 3], strides=[2, 2],
                                   pads=[1, 1, 1, 1]),
                  helper.make_node("Sigmoid", [f"c{i}"], [f"s{i}"]),
                  helper.make_node("Mul", [f"c{i}", f"s{i}"], [f"a{i}"])]
        x, cin = f"a{i}", cout
    inits += [numpy_helper.from_array(rng.normal(0, 0.05, (4 + classes, cin, 1, 1)).astype(np.float32), "head"),
              numpy_helper.from_array(np.array([0, 4 + classes, -1], np.int64), "shape")]
    nodes += [helper.make_node("Conv", [x, "head"], ["raw"], kernel_shape=[1, 1]),
              helper.make_node("Reshape", ["raw", "shape"], ["output0"])]
    graph = helper.make_graph(nodes, "yolo_style", [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                                                                  ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("output0", TensorProto.FLOAT,
                                                             ["batch", 4 + classes, (size // 32) ** 2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    save(model, path)


def detector_recipe(folder: Path) -> tuple[str, dict[str, Any]]:
    """The repo's letterbox detector recipe with its torch demo when both are there, else the
    YOLO-style model above with a letterbox recipe written here."""
    recipe = ROOT / "recipes" / "yolo-int8.yaml"
    try:
        from tools.demos import build_torch_demos

        if recipe.exists():
            build_torch_demos(folder / "demo", ["yolo"])
            return "yolo-int8", yaml.safe_load(recipe.read_text())
    except ImportError:  # no torch (or an older tree): the model built here
        pass
    yolo_style_model(folder / "demo" / "yolo640" / "model.onnx")
    return "yolo640", {
        "name": "yolo640", "version": "1.0.0", "model": {"path": "../demo/yolo640/model.onnx"},
        "preprocess": {"kind": "image", "resize": {"size": [640, 640], "mode": "letterbox", "pad_value": 114},
                       "scale": 1 / 255},
        "postprocess": {"kind": "detection", "format": "yolov8"}, "validate": {"data": "synthetic"},
        "targets": ["x86"]}


def package(folder: Path, name: str, document: dict[str, Any], key: Path, trust: TrustStore) -> LoadedModel:
    (folder / "recipes").mkdir(exist_ok=True)
    path = folder / "recipes" / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    artifact = build(load_recipe(path, allow_external_paths=True), key_paths=[str(key)],
                     output=folder / f"{name}.edgepkg").output
    verified = extract_artifact(artifact, folder / f"x-{name}", trust)
    return load_model(verified.root, verified.manifest)


def reference_service(model: LoadedModel) -> InferenceService:
    """The same model behind the pre-change image path (full decode, resize then crop, float32
    step by step)."""
    from dataclasses import replace

    return InferenceService(replace(model, preprocessor=Preprocessor(model.manifest.preprocess, reference=True)))


# ----------------------------------------------------------------------------- measurements


def image_vs_tensor(label: str, model: LoadedModel, inputs: dict[str, Any], rounds: int) -> dict[str, Any]:
    fast, before = InferenceService(model), reference_service(model)
    pre_fast, pre_before = fast.model.preprocessor, before.model.preprocessor  # type: ignore[union-attr]
    name = model.image_input
    assert name is not None
    tensor = {name: pre_fast.from_array(inputs["raw 1280x720"])}
    candidates: dict[str, Callable[[], Any]] = {"tensors": lambda: fast.predict_tensors(tensor)}
    for kind, data in inputs.items():
        candidates[f"{kind} -> result"] = lambda d=data: fast.predict(d)
        candidates[f"{kind} -> result, before"] = lambda d=data: before.predict(d)
        candidates[f"{kind} preprocessing"] = lambda d=data: pre_fast.image_with_geometry(d)
        candidates[f"{kind} preprocessing, before"] = lambda d=data: pre_before.image_with_geometry(d)
        if isinstance(data, bytes):  # the floor: libjpeg at the scale the fast path asks for, nothing else
            candidates[f"{kind} decode"] = lambda d=data: pre_fast._decode_reduced(d)
    result = medians(candidates, rounds)
    base = result["tensors"]
    print(f"\n{label}: tensors -> result {base * 1000:.2f} ms (median of {rounds})")
    print(f"  {'input':<15} {'image -> result':>16} {'x tensors':>9} {'before':>10} {'x tensors':>9} "
          f"{'preprocessing':>14} {'before':>9} {'of it decode':>12}")
    rows = {}
    for kind in inputs:
        now, old = result[f"{kind} -> result"], result[f"{kind} -> result, before"]
        pre, pre_old = result[f"{kind} preprocessing"], result[f"{kind} preprocessing, before"]
        decode = result.get(f"{kind} decode", 0.0)
        rows[kind] = {"result_ms": round(now * 1000, 3), "ratio": round(now / base, 3),
                      "before_ms": round(old * 1000, 3), "before_ratio": round(old / base, 3),
                      "preprocess_ms": round(pre * 1000, 3), "preprocess_before_ms": round(pre_old * 1000, 3),
                      "decode_ms": round(decode * 1000, 3)}
        print(f"  {kind:<15} {now * 1000:13.2f} ms {now / base:8.2f}x {old * 1000:7.2f} ms {old / base:8.2f}x "
              f"{pre * 1000:11.2f} ms {pre_old * 1000:6.2f} ms {decode * 1000:9.2f} ms")
    return {"tensors_ms": round(base * 1000, 3), "inputs": rows}


def variant(call: Callable[[], Any], *, split: bool = True, reduced: bool = True) -> Callable[[], Any]:
    """``call`` with the raw-frame path's resize split over one thread only and/or without the
    integer reduction (module settings swapped for the call, then restored)."""
    def run() -> Any:
        threads, reduction = resample._Pool.__dict__["threads"], preprocess.array_reduction
        if not split:
            resample._Pool.threads = classmethod(lambda cls: 1)  # type: ignore[method-assign]
        if not reduced:
            preprocess.array_reduction = lambda *args: 1
        try:
            return call()
        finally:
            resample._Pool.threads, preprocess.array_reduction = threads, reduction  # type: ignore[method-assign]
    return run


def decode(data: bytes, scale: int, mode: str = "RGB") -> Callable[[], Any]:
    """Pillow's JPEG decode at 1/``scale`` (libjpeg's DCT scaling) into ``mode``, nothing else."""
    def run() -> Any:
        image = Image.open(io.BytesIO(data))
        if scale > 1:
            image.draft(mode, (image.width // scale, image.height // scale))
        image.load()
        return image
    return run


def where_the_time_goes(model: LoadedModel, inputs: dict[str, Any], rounds: int) -> dict[str, Any]:
    """The MobileNet-style demo's 1280x720 inputs step by step, against tensors -> result: the
    raw frame with and without the split resize and the reduction (both off: the previous fast
    path); the JPEG's decode alone at 1/2 (what the fast path asks for), in YCbCr (no colour
    conversion at the decoded size), at 1/8 (the least work libjpeg can do: every coefficient is
    still entropy-decoded) and in full."""
    service = InferenceService(model)
    pre = service.model.preprocessor  # type: ignore[union-attr]
    frame, data = inputs["raw 1280x720"], inputs["JPEG 1280x720"]
    tensor = {"input": pre.from_array(frame)}
    candidates: dict[str, Callable[[], Any]] = {
        "tensors -> result": lambda: service.predict_tensors(tensor),
        "raw -> result": lambda: service.predict(frame),
        "raw -> result, one thread": variant(lambda: service.predict(frame), split=False),
        "raw -> result, not reduced": variant(lambda: service.predict(frame), reduced=False),
        "raw -> result, neither": variant(lambda: service.predict(frame), split=False, reduced=False),
        "raw preprocessing": lambda: pre.from_array(frame),
        "raw preprocessing, one thread": variant(lambda: pre.from_array(frame), split=False),
        "raw preprocessing, not reduced": variant(lambda: pre.from_array(frame), reduced=False),
        "raw preprocessing, neither": variant(lambda: pre.from_array(frame), split=False, reduced=False),
        "JPEG -> result": lambda: service.predict(data),
        "JPEG preprocessing": lambda: pre.image_with_geometry(data),
        "JPEG decode at 1/2": decode(data, 2),
        "JPEG decode at 1/2 in YCbCr": decode(data, 2, "YCbCr"),
        "JPEG decode at 1/8": decode(data, 8),
        "JPEG decode, full size": decode(data, 1),
    }
    result = medians(candidates, rounds)
    base = result["tensors -> result"]
    print(f"\nwhere the time goes, mobilenet 1280x720 (median of {rounds}; x tensors -> result)")
    rows = {}
    for name, seconds in result.items():
        rows[name] = {"ms": round(seconds * 1000, 3), "x_tensors": round(seconds / base, 3)}
        print(f"  {name:<32} {seconds * 1000:7.2f} ms  {seconds / base:5.2f}x")
    return rows


def in_graph_vs_python(python: LoadedModel, lowered: LoadedModel, inputs: dict[str, Any],
                       rounds: int) -> dict[str, Any]:
    a, b = InferenceService(python), InferenceService(lowered)
    floats = {"input": python.preprocessor.from_array(inputs["raw 1280x720"])}
    pixels = {"input": lowered.preprocessor.from_array(inputs["raw 1280x720"])}
    candidates: dict[str, Callable[[], Any]] = {"tensors python": lambda: a.predict_tensors(floats),
                                                "tensors in-graph": lambda: b.predict_tensors(pixels)}
    for kind, data in inputs.items():
        candidates[f"{kind} python"] = lambda d=data: a.predict(d)
        candidates[f"{kind} in-graph"] = lambda d=data: b.predict(d)
    result = medians(candidates, rounds)
    print(f"\nin-graph preprocessing against the Python path (mobilenet, median of {rounds})")
    rows = {}
    for kind in ["tensors", *inputs]:
        py, ig = result[f"{kind} python"], result[f"{kind} in-graph"]
        rows[kind] = {"python_ms": round(py * 1000, 3), "in_graph_ms": round(ig * 1000, 3), "ratio": round(ig / py, 3)}
        print(f"  {kind:<15} python {py * 1000:7.2f} ms  in-graph {ig * 1000:7.2f} ms  ({ig / py:.3f}x)")
    same = all(np.array_equal(a.predict(d).outputs["logits"], b.predict(d).outputs["logits"]) for d in inputs.values())
    print(f"  same logits on every input: {same}")
    return {**rows, "same_logits": same}


def batches(model: LoadedModel, images: list[bytes], rounds: int) -> dict[str, Any]:
    service = InferenceService(model)

    def run(size: int) -> Callable[[], Any]:
        def call() -> Any:
            service.max_batch = size
            return service.predict(images)
        return call

    sizes = (1, 2, 4, 8, 16)
    result = medians({str(size): run(size) for size in sizes}, rounds)
    one = len(images) / result["1"]
    print(f"\nbatches: {len(images)} JPEGs 640x480 through mobilenet-dynamic (median of {rounds})")
    rows = {}
    for size in sizes:
        rate = len(images) / result[str(size)]
        rows[size] = {"images_per_s": round(rate, 1), "ratio": round(rate / one, 3)}
        print(f"  max_batch {size:>2}: {rate:7.1f} images/s  ({rate / one:.2f}x one by one)")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--batch-rounds", type=int, default=30)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="edgepack-image-bench-"))
    try:
        build_all(folder / "demo", ["mobilenet"])
        write_keypair(folder / "k.key", folder / "k.pub")
        trust = TrustStore([load_public_key(folder / "k.pub")])
        recipes = {name: yaml.safe_load((ROOT / "recipes" / f"{name}.yaml").read_text())
                   for name in ("mobilenet", "mobilenet-dynamic")}
        lowered = {**recipes["mobilenet"], "name": "mobilenet-in-graph",
                   "preprocess": {**recipes["mobilenet"]["preprocess"], "in_graph": True}}
        detector_name, detector = detector_recipe(folder)
        models = {name: package(folder, name, doc, folder / "k.key", trust) for name, doc in
                  (("mobilenet", recipes["mobilenet"]), ("mobilenet-in-graph", lowered),
                   ("mobilenet-dynamic", recipes["mobilenet-dynamic"]), (detector_name, detector))}
        frame = photo_like(1280, 720)
        inputs = {"JPEG 640x480": jpeg(np.asarray(Image.fromarray(frame).resize((640, 480), Image.Resampling.BOX))),
                  "JPEG 1280x720": jpeg(frame), "raw 1280x720": frame}
        sizes = {k: len(v) for k, v in inputs.items() if isinstance(v, bytes)}
        pixels = {"JPEG 640x480": 640 * 480, "JPEG 1280x720": 1280 * 720}
        print("inputs:", ", ".join(f"{k} {n / 1024:.0f} KiB ({n * 8 / pixels[k]:.2f} bits/pixel)"
                                   for k, n in sizes.items()))
        results: dict[str, Any] = {"inputs_bytes": sizes}
        results["mobilenet"] = image_vs_tensor("mobilenet (224x224 center-crop)", models["mobilenet"], inputs,
                                               args.rounds)
        results["where_the_time_goes"] = where_the_time_goes(models["mobilenet"], inputs, args.rounds)
        results[detector_name] = image_vs_tensor(f"{detector_name} (letterbox)", models[detector_name], inputs,
                                                 max(20, args.rounds // 4))
        results["in_graph"] = in_graph_vs_python(models["mobilenet"], models["mobilenet-in-graph"], inputs,
                                                 args.rounds)
        scenes = [jpeg(photo_like(640, 480, seed)) for seed in range(16)]
        results["batches"] = batches(models["mobilenet-dynamic"], scenes, args.batch_rounds)
        print(json.dumps(results))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
