"""Real signed artifacts for device-side tests, built with the real packager."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from edgepack_core.signing import load_private_key
from sdk.artifact_writer import write_artifact
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe


def scale_model(path: Path, factor: float = 2.0, *, nan: bool = False, width: int = 4) -> Path:
    """y = x * factor (or sqrt(-|x|) = NaN with ``nan``); input x float32 [batch, width]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])
    k = helper.make_tensor("k", TensorProto.FLOAT, [1], [factor])
    if nan:
        nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["n"]),
                 helper.make_node("Sqrt", ["n"], ["y"])]
        inits = []
    else:
        nodes = [helper.make_node("Mul", ["x", "k"], ["y"])]
        inits = [k]
    graph = helper.make_graph(nodes, "scale", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path


def build_artifact(folder: Path, key: Path, *, version: str = "1.0.0", factor: float = 2.0, nan: bool = False,
                   name: str = "scale", extra: str = "") -> Path:
    """Package a scale model through the real pipeline; returns the .edgepkg path.

    ``nan``: a validly signed artifact whose model answers NaN. The packager refuses to sign
    such golden samples, so the finite model is built and its model file swapped and re-signed
    (what a device must still refuse at its smoke test)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = scale_model(folder / f"model-{version}-{factor}.onnx", factor)
    recipe = folder / f"recipe-{version}-{factor}.yaml"
    consent = "" if "validate:" in extra else "validate: {data: synthetic}\n"
    recipe.write_text(f"name: {name}\nversion: {version}\nmodel: {{path: {model.name}}}\n"
                      f"postprocess: {{kind: raw}}\ntargets: [x86, rpi]\n{consent}{extra}")
    out = folder / f"{name}-{version}-{factor}.edgepkg"
    build(load_recipe(recipe), key_paths=[str(key)], output=out)
    if not nan:
        return out
    nan_model = scale_model(folder / f"model-{version}-nan.onnx", nan=True).read_bytes()
    return resign_with_changes(out, folder / f"{name}-{version}-{factor}-nan.edgepkg", key,
                               replace={"model/model.onnx": nan_model})


def resign_with_changes(artifact: Path, out: Path, key: Path, *, replace: dict[str, bytes] | None = None,
                        manifest_changes: dict | None = None) -> Path:
    """Rebuild a validly signed artifact with some files replaced (e.g. wrong golden outputs)."""
    files: dict[str, bytes] = {}
    with tarfile.open(artifact) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        for member in tar.getmembers():
            if member.name not in ("manifest.json", "manifest.sig"):
                files[member.name] = tar.extractfile(member).read()
    files.update(replace or {})
    manifest.update(manifest_changes or {})
    write_artifact(out, manifest, files, [load_private_key(key)])
    return out


def wrong_golden_outputs(artifact: Path) -> dict[str, bytes]:
    """Golden output files with every value shifted by 1 (a model that no longer reproduces)."""
    replaced = {}
    with tarfile.open(artifact) as tar:
        for member in tar.getmembers():
            if member.name.endswith(".outputs.npz"):
                data = np.load(io.BytesIO(tar.extractfile(member).read()))
                buffer = io.BytesIO()
                np.savez(buffer, **{k: data[k] + 1.0 for k in data.files})
                replaced[member.name] = buffer.getvalue()
    return replaced
