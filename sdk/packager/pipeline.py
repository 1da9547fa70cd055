"""The build: run the registered passes in order, then bundle and sign the artifact."""

from __future__ import annotations

import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

import edgepack_core
from edgepack_core.manifest import FORMAT_VERSION, REPORT_NAME, Manifest, parse_manifest
from edgepack_core.signing import RELEASE, SigningKey, load_private_key
from edgepack_core.targets import profile_providers
from sdk.artifact_writer import write_artifact
from sdk.errors import RecipeError
from sdk.packager import ort_host, reproducible
from sdk.packager.data import manifest_inputs, manifest_outputs
from sdk.packager.pass_guard import run_guarded
from sdk.packager.passes import base
from sdk.packager.passes.base import BuildContext, Progress, model_label
from sdk.recipe import Recipe

# Importing the pass modules registers them.
from sdk.packager.passes import (  # noqa: F401  isort: skip
    check, convert_opset, eliminate_identity, export_pytorch, fix_shapes, fold_batchnorm, fp16, golden, io_spec, load,
    opset, ort_format, ort_optimize, preprocess_graph, quantize, runtime_compat, shape_inference, target_report,
    validate,
)
from sdk.packager.passes import artifact_size, golden_stream, precision  # noqa: F401  isort: skip

MODEL_MEMBER = "model/model.onnx"

# The order of a build. Each name is a registered pass; a pass skips itself when its
# recipe section asks for nothing (``Pass.applies``).
PIPELINE: list[str] = [
    "export_pytorch",
    "load",
    "check",
    "convert_opset",
    "opset",
    "shape_inference",
    "io_spec",
    "preprocess_graph_plan",
    "fix_shapes",
    "eliminate_identity",
    "fold_batchnorm",
    "ort_optimize",
    "fp16",
    "quantize",
    "validate",
    "preprocess_graph",
    "target_report",
    "golden",
    "ort_format",
    "runtime_compat",
    "precision",
    "golden_stream",
    "artifact_size",
]


@dataclass
class BuildResult:
    output: Path
    manifest: Manifest
    report: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def tool_versions() -> dict[str, str]:
    return {
        "edgepack": edgepack_core.__version__,
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
    }


def resolve_signing_keys(recipe: Recipe, key_paths: list[str] | None) -> list[SigningKey]:
    paths = list(key_paths or [])
    if not paths and recipe.sign.key:
        paths = [recipe.sign.key]
    if not paths:
        raise RecipeError("sign.key", "no signing key: pass --key PRIVATE or set sign.key in the recipe",
                          recipe=str(recipe.path))
    password = os.environ.get("EDGEPACK_KEY_PASSWORD")
    return [load_private_key(p, password.encode() if password else None, kind=RELEASE) for p in paths]


def resolve_output(recipe: Recipe, output: str | os.PathLike[str] | None) -> Path:
    if output is not None:
        return Path(output)
    if recipe.output:
        return Path(recipe.output)
    return Path("dist") / f"{recipe.name}-{recipe.version}.edgepkg"


def run_passes(ctx: BuildContext, names: list[str] | None = None) -> None:
    timings: dict[str, float] = {}
    model_name = model_label(ctx)
    for name in names or PIPELINE:
        step = base.get_pass(name)
        if not step.applies(ctx):
            continue
        ctx.progress(f"{name} ...")
        started = time.perf_counter()
        with ort_host.in_pass(name, model=model_name):  # names the pass in onnxruntime crash messages
            if step.guard is None:
                step.run(ctx)
            else:
                run_guarded(step, ctx)
        timings[name] = round(time.perf_counter() - started, 3)
        if ctx.model is not None:  # artifact_size names the passes that grew the model
            ctx.model_sizes[name] = ctx.model.ByteSize()
    ctx.report["timings_s"] = timings


def assemble_manifest(ctx: BuildContext) -> dict[str, Any]:
    """The manifest, written from the typed facts the passes left in ``ctx``: the one place."""
    model = ctx.require_model()
    if ctx.runtime is None:
        raise RuntimeError("no runtime requirement: the runtime_compat pass must run last")
    model_section: dict[str, Any] = {
        "path": MODEL_MEMBER,
        "opsets": dict(ctx.runtime.opsets),
        "ir_version": int(model.ir_version),
        "min_onnxruntime": ctx.runtime.min_onnxruntime,
        "precision": ctx.precision(),
    }
    if ctx.runtime.opset is not None:  # absent for an ai.onnx.ml-only model
        model_section["opset"] = ctx.runtime.opset
    if ctx.ort_member is not None:
        model_section["ort_path"] = ctx.ort_member
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "name": ctx.recipe.name,
        "version": ctx.recipe.version,
        "created": reproducible.created(reproducible.source_date_epoch(os.environ)),
        "model": model_section,
        "inputs": manifest_inputs(ctx.inputs, ctx.recipe.inputs),
        "outputs": manifest_outputs(ctx.outputs, ctx.recipe.outputs),
        "preprocess": ctx.preprocess.to_json(),
        "postprocess": ctx.postprocess.to_json(),
        "targets": {t: {"providers": list(profile_providers(t))} for t in ctx.recipe.targets},
        "tools": tool_versions(),
        "report": REPORT_NAME,
    }
    if ctx.recipe.description is not None:
        manifest["description"] = ctx.recipe.description
    if ctx.golden is not None:
        manifest["golden"] = ctx.golden.to_json()
    if ctx.golden_stream is not None:
        manifest["golden_stream"] = ctx.golden_stream.to_json()
    return manifest


def build(
    recipe: Recipe,
    *,
    key_paths: list[str] | None = None,
    output: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
) -> BuildResult:
    """Build a signed artifact from a validated recipe. Raises EdgepackError subclasses."""
    keys = resolve_signing_keys(recipe, key_paths)  # fail on a bad key before any long work
    epoch = reproducible.source_date_epoch(os.environ)  # and on a bad SOURCE_DATE_EPOCH
    target = resolve_output(recipe, output)
    workdir = Path(tempfile.mkdtemp(prefix="edgepack-build-"))
    ort_host.prestart()  # the onnxruntime worker starts while the first passes run
    try:
        ctx = BuildContext(recipe=recipe, workdir=workdir, progress=progress or (lambda message: None))
        run_passes(ctx)
        ctx.files[MODEL_MEMBER] = ctx.model_bytes()
        report = {
            "name": recipe.name,
            "version": recipe.version,
            "passes": {k: v for k, v in ctx.report.items() if k != "timings_s"},
            "timings_s": ctx.report.get("timings_s", {}),
            "warnings": ctx.warnings,
            "tools": tool_versions(),
        }
        shipped = report if epoch is None else reproducible.without_clock(report)  # byte-identical rebuilds
        ctx.files[REPORT_NAME] = json.dumps(shipped, indent=2, sort_keys=True, default=float).encode() + b"\n"
        manifest_bytes = write_artifact(target, assemble_manifest(ctx), ctx.files, keys)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        ort_host.release_sessions()  # the worker stays for the next build; this build's sessions go
    return BuildResult(output=target, manifest=parse_manifest(manifest_bytes), report=report,
                       warnings=list(ctx.warnings))
