"""Accuracy-gated quantization: a model is quantized only if it meets the recipe's budget, and
the packager says whether the result is faster here.

Pitfalls handled (measured on real models with onnxruntime 1.31 on x86):
- ``quantize_dynamic`` with defaults turns every Conv into ConvInteger, 1.5-5x *slower* on
  CPU: dynamic mode quantizes MatMul/Gemm only, unless the recipe names Conv explicitly.
- per-channel QDQ on opset < 13 gives graphs that do not load: the opset is upgraded first.
- ``quant_pre_process`` (shape inference, needs sympy) fails on some graphs: fall back to the
  model as it is rather than fail the build.
- accuracy collapse: every candidate is judged on validation data by the task's metric (the
  validate pass's :func:`judge`: detection recall/precision, per-step sequence agreement,
  classifier top-1, each raw output on its own; one cosine over a YOLO head stays at 0.998
  while every score collapsed); when the budget is missed, other calibration methods,
  per-channel and excluding the most sensitive layers are tried; if nothing meets it the
  build ships fp32 with a warning, never a broken model.
- dynamic int8 that quantized nothing is still fp32: the manifest's precision counts the
  quantized nodes of the graph instead of trusting the mode.
"""

from __future__ import annotations

import contextlib
import fnmatch
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from sdk.errors import BuildError, RecipeError
from sdk.packager.data import Samples, context_options, load_samples, synthetic_samples
from sdk.packager.metrics import Evaluation
from sdk.packager.ort_host import OrtCrashError, call_in_worker, measure_latency, run_feeds
from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.passes.model_checks import default_opset
from sdk.packager.passes.validate import checked_outputs, judge

QUANTIZABLE = ("Conv", "Gemm", "MatMul")
# Nodes that hold integer arithmetic or quantized tensors: a graph with none of them is fp32,
# whatever mode made it (dynamic quantization of a model without MatMul/Gemm changes nothing).
QUANTIZED_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "ConvInteger")
CANDIDATE_LATENCY_RUNS = 10


@dataclass(frozen=True)
class QuantConfig:
    mode: str                      # dynamic | static
    method: str = "minmax"         # minmax | entropy | percentile
    per_channel: bool = True
    activation_type: str = "uint8"
    weight_type: str = "int8"
    reduce_range: bool = False
    symmetric_activations: bool = False
    symmetric_weights: bool = True
    op_types: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "method": self.method, "per_channel": self.per_channel,
                "activation_type": self.activation_type, "weight_type": self.weight_type,
                "reduce_range": self.reduce_range, "excluded_nodes": list(self.exclude)}


# Presets: the types and range each runtime handles best.
PRESETS: dict[str, dict[str, Any]] = {
    # ARM NEON int8 kernels take u8 activations with s8 weights at full range.
    "arm64": {"activation_type": "uint8", "weight_type": "int8", "reduce_range": False},
    # AVX2 without VNNI: u8*s8 products can saturate 16-bit accumulators; 7-bit weights avoid it.
    "x86-avx2": {"activation_type": "uint8", "weight_type": "int8", "reduce_range": True},
    # VNNI accumulates in 32 bits: full range.
    "x86-vnni": {"activation_type": "uint8", "weight_type": "int8", "reduce_range": False},
    # TensorRT wants symmetric s8 QDQ for activations and weights.
    "tensorrt": {"activation_type": "int8", "weight_type": "int8", "reduce_range": False,
                 "symmetric_activations": True, "symmetric_weights": True, "per_channel": True},
}


def base_config(options: dict[str, Any]) -> QuantConfig:
    preset = PRESETS.get(options.get("preset", "x86-avx2"), {})
    config = QuantConfig(mode=options["mode"], **{k: v for k, v in preset.items() if k in QuantConfig.__annotations__})
    overrides: dict[str, Any] = {}
    for key, field_name in (("method", "method"), ("per_channel", "per_channel"), ("reduce_range", "reduce_range"),
                            ("symmetric_activations", "symmetric_activations"),
                            ("symmetric_weights", "symmetric_weights")):
        if key in options:
            overrides[field_name] = options[key]
    if "op_types" in options:
        overrides["op_types"] = tuple(options["op_types"])
    if "exclude_nodes" in options:
        overrides["exclude"] = tuple(options["exclude_nodes"])
    return replace(config, **overrides)


def quantized_nodes(model: onnx.ModelProto) -> int:
    """How many nodes of the graph (subgraphs included) compute or carry int8: QDQ pairs,
    integer MatMul/Conv and every QLinear* op."""
    count = 0
    graphs = [model.graph]
    while graphs:
        graph = graphs.pop()
        for node in graph.node:
            count += node.op_type in QUANTIZED_OPS or node.op_type.startswith("QLinear")
            for attr in node.attribute:
                graphs.extend([attr.g] if attr.type == onnx.AttributeProto.GRAPH else attr.graphs)
    return count


def expand_exclusions(patterns: tuple[str, ...], names: list[str], *, recipe: str = "") -> tuple[str, ...]:
    """Node names matched by ``exclude_nodes`` glob patterns (fnmatch: ``*``, ``?``, ``[..]``;
    a plain name matches itself). A pattern matching no node is refused naming it: a misspelt
    name used to be ignored, and the layer it meant to protect was quantized anyway."""
    matched: list[str] = []
    for pattern in patterns:
        hits = [name for name in names if fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            raise RecipeError("quantize.exclude_nodes", f"{pattern!r} matches no node of the model "
                              f"(edgepack inspect --nodes lists them; {len(names)} nodes, e.g. "
                              f"{', '.join(names[:3]) or 'none'})", recipe=recipe)
        matched.extend(hits)
    return tuple(sorted(set(matched)))


def weight_sensitivity(model: onnx.ModelProto) -> list[tuple[str, float]]:
    """Nodes ranked by the relative error int8 per-tensor rounding puts on their weights:
    a cheap proxy for which layers suffer most from quantization (the first conv on raw
    pixels and wide-range classifier layers usually top it)."""
    inits = {i.name: i for i in model.graph.initializer}
    scores = []
    for node in model.graph.node:
        if node.op_type not in QUANTIZABLE or len(node.input) < 2 or node.input[1] not in inits:
            continue
        weight = numpy_helper.to_array(inits[node.input[1]]).astype(np.float64)
        scale = np.abs(weight).max() / 127 or 1.0
        error = np.linalg.norm(weight - np.round(weight / scale) * scale) / (np.linalg.norm(weight) or 1.0)
        scores.append((node.name, float(error)))
    return sorted(scores, key=lambda item: -item[1])


class _Reader:
    """onnxruntime CalibrationDataReader over model-ready feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._iter: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._iter, None)


@contextlib.contextmanager
def _working_directory(folder: Path) -> Iterator[None]:
    """onnxruntime's quantization tools drop temp files (sym_shape_infer_temp.onnx, *.data) in
    the current directory: run them inside the build's own temp folder."""
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def _ensure_names(model: onnx.ModelProto) -> None:
    for index, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{index}"


def quantize_once(model_path: Path, out_path: Path, config: QuantConfig, calibration: list[dict[str, np.ndarray]]
                  ) -> Path:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    types = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
    extra = {"ActivationSymmetric": config.symmetric_activations, "WeightSymmetric": config.symmetric_weights}
    if config.mode == "dynamic":
        quantize_dynamic(model_path, out_path, op_types_to_quantize=list(config.op_types or ("MatMul", "Gemm")),
                         per_channel=config.per_channel, reduce_range=config.reduce_range,
                         weight_type=types[config.weight_type], nodes_to_exclude=list(config.exclude),
                         extra_options=extra)
    else:
        methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                   "percentile": CalibrationMethod.Percentile}
        quantize_static(model_path, out_path, _Reader(calibration), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=list(config.op_types) or None, per_channel=config.per_channel,
                        reduce_range=config.reduce_range, activation_type=types[config.activation_type],
                        weight_type=types[config.weight_type], nodes_to_exclude=list(config.exclude),
                        calibrate_method=methods[config.method], extra_options=extra)
    return out_path


def quantize_in_folder(folder: Path, model_path: Path, out_path: Path, config: QuantConfig,
                       calibration: list[dict[str, np.ndarray]]) -> Path:
    """:func:`quantize_once` with ``folder`` as the working directory. Runs inside the
    onnxruntime worker (calibration creates sessions), where changing directory touches no
    other thread of the build."""
    with _working_directory(folder):
        return quantize_once(model_path, out_path, config, calibration)


def pre_process_in_folder(folder: Path, raw: Path, prepared: Path) -> str | None:
    """onnxruntime's quantization pre-processing (it optimizes with a session: runs inside the
    worker). None when done, else why it was skipped: symbolic shape inference fails on some
    graphs, and the model is then quantized as it is."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        with _working_directory(folder):
            quant_pre_process(str(raw), str(prepared), auto_merge=True, skip_symbolic_shape=False)
    except Exception as err:  # a tool script's untyped failure: recorded in the report
        return f"{type(err).__name__}: {str(err)[:200]}"
    return None


def median_latency(model: bytes | str, feed: dict[str, np.ndarray], runs: int = 30) -> float:
    return float(np.median(measure_latency(model, feed, runs=runs, warmup=3)))


def _synthetic_options(ctx: BuildContext) -> dict[str, Any]:
    return {k: v for k, v in context_options(ctx).items() if k in ("declared", "graph")}


@register
class QuantizePass(Pass):
    name = "quantize"
    section = "quantize"

    def applies(self, ctx: BuildContext) -> bool:
        return self.options(ctx).get("mode", "none") != "none"

    def _samples(self, ctx: BuildContext, section: str, key: str, limit: int) -> Samples | None:
        source = ctx.recipe.section(section).get(key)
        if not source:
            return None
        return load_samples(source, ctx.preprocess, ctx.inputs, key=f"{section}.{key}", limit=limit,
                            **context_options(ctx))

    def run(self, ctx: BuildContext) -> None:
        options = dict(self.options(ctx))
        config = base_config(options)
        model = ctx.require_model()
        _ensure_names(model)
        validate_options = ctx.recipe.section("validate")
        checked_outputs(ctx, validate_options)  # an unknown validate.outputs name fails before the search
        if config.mode == "dynamic":
            config = self._dynamic_op_types(ctx, model, config)
        folder = ctx.new_tempdir("quantize-")
        source = self._prepare(ctx, model, folder)
        if config.exclude:
            names = [node.name for node in onnx.load(source, load_external_data=False).graph.node]
            config = replace(config, exclude=expand_exclusions(config.exclude, names, recipe=str(ctx.recipe.path)))
        calibration = self._samples(ctx, "quantize", "calibration", 200)
        calib_feeds = calibration.feeds if calibration else []
        validation = self._samples(ctx, "validate", "data", validate_options.get("samples", 200)) \
            or calibration or synthetic_samples(16, ctx.preprocess, ctx.inputs, **_synthetic_options(ctx))
        reference = run_feeds(source.read_bytes(), validation.feeds, label="the fp32 model")
        fp32_latency = median_latency(str(source), validation.feeds[0], runs=CANDIDATE_LATENCY_RUNS)

        candidates = list(self._candidates(config, options, model))
        tried: list[dict[str, Any]] = []
        chosen: tuple[QuantConfig, Path, dict[str, Any]] | None = None
        for index, candidate in enumerate(candidates):
            out = folder / f"candidate-{index}.onnx"
            entry = self._try(ctx, candidate, (index, len(candidates)), folder, source, out, calib_feeds,
                              validation, reference, fp32_latency)
            tried.append(entry)
            if entry.get("budget_met"):
                chosen = (candidate, out, entry)
                break
        report: dict[str, Any] = {"requested": config.describe(), "budget": dict(validate_options),
                                  "candidates": tried, "validation_samples": len(validation),
                                  "latency_fp32_ms": round(fp32_latency * 1000, 4),
                                  "fp32_bytes": source.stat().st_size}
        ctx.report[self.name] = report
        if chosen is None:
            last = tried[-1] if tried else {}
            ctx.warn("quantization could not meet the accuracy budget "
                     f"({last.get('why', last.get('error', 'no candidate'))}); shipping fp32")
            report["applied"] = False
            return
        candidate, path, entry = chosen
        quantized = onnx.load(path)
        if not entry["quantized_nodes"]:
            ctx.warn("quantization changed no node of the graph (nothing it quantizes is there); shipping fp32")
            report["applied"] = False
            return
        speed = {"latency_fp32_ms": round(fp32_latency * 1000, 4), "latency_int8_ms": entry["latency_ms"],
                 "speedup": entry["speedup"]}
        report.update({"applied": True, "chosen": candidate.describe(), **speed, "quantized_bytes": entry["bytes"]})
        if speed["speedup"] < 1.0:
            ctx.warn(f"the quantized model is slower than fp32 on this machine ({speed['speedup']:.2f}x); "
                     "check the target's int8 support before shipping it")
        ctx.model = quantized
        ctx.manifest_extra["precision"] = "int8"

    def _try(self, ctx: BuildContext, candidate: QuantConfig, position: tuple[int, int], folder: Path, source: Path,
             out: Path, calib_feeds: list[dict[str, np.ndarray]], validation: Samples,
             reference: list[dict[str, np.ndarray]], fp32_latency: float) -> dict[str, Any]:
        """Quantize, judge and time one candidate; its report entry. Its verdict line starts
        ``quantize: candidate N/M``, which ``edgepack build`` prints even in a log, so a long
        search shows in CI as it goes (the ``trying`` line only on a terminal)."""
        number = f"{position[0] + 1}/{position[1]}"
        label = f"candidate {position[0] + 1}"
        ctx.progress(f"quantize: trying candidate {number}: {_brief(candidate)} ...")
        try:
            call_in_worker(f"{__name__}:quantize_in_folder", folder, source, out, candidate, calib_feeds,
                           label=label, doing="quantization and calibration")
            outputs = run_feeds(out.read_bytes(), validation.feeds, label=label)
        except OrtCrashError:
            raise  # a crash ends the build with one line naming it; never a skipped candidate
        except BuildError as err:  # onnxruntime.quantization's own errors, reported by the worker
            ctx.progress(f"quantize: candidate {number} failed: {err.problem[:200]}")
            return {**candidate.describe(), "error": err.problem[:300]}
        evaluation: Evaluation = judge(ctx, ctx.recipe.section("validate"), reference, outputs, validation.labels)
        latency = median_latency(str(out), validation.feeds[0], runs=CANDIDATE_LATENCY_RUNS)
        entry = {**candidate.describe(), "metric": evaluation.metric, "task": evaluation.to_json(),
                 "budget_met": evaluation.met, "why": evaluation.summary(), "bytes": out.stat().st_size,
                 "latency_ms": round(latency * 1000, 4),
                 "speedup": round(fp32_latency / latency, 3) if latency else 0.0,
                 "quantized_nodes": quantized_nodes(onnx.load(out, load_external_data=False))}
        verdict = "meets the budget" if evaluation.met else "misses the budget"
        ctx.progress(f"quantize: candidate {number} ({_brief(candidate)}) {verdict}: {evaluation.summary()}; "
                     f"{entry['bytes']:,d} bytes, {entry['latency_ms']:.3g} ms ({entry['speedup']:.2f}x fp32)")
        return entry

    def _dynamic_op_types(self, ctx: BuildContext, model: onnx.ModelProto, config: QuantConfig) -> QuantConfig:
        asked = set(config.op_types)
        if "Conv" in asked:
            ctx.warn("dynamic quantization of Conv makes ConvInteger, which onnxruntime's CPU provider runs "
                     "slower than fp32 and most accelerators do not run: measured before shipping")
            return config
        has_conv = any("Conv" in n.op_type for n in model.graph.node)  # also fused Conv variants
        if has_conv:
            ctx.warn("dynamic quantization leaves Conv layers in fp32 (ConvInteger is slow on CPU); "
                     "use quantize.mode: static for a convolutional model")
        return replace(config, op_types=tuple(asked - {"Conv"}) or ("MatMul", "Gemm"))

    def _prepare(self, ctx: BuildContext, model: onnx.ModelProto, folder: Path) -> Path:
        """Upgrade to opset 13+ (per-channel QDQ needs it), then onnxruntime's pre-processing."""
        if default_opset(model) < 13:
            from onnx import version_converter

            model = version_converter.convert_version(model, 13)
        raw = folder / "fp32.onnx"
        onnx.save(model, raw)
        prepared = folder / "prepared.onnx"
        skipped = call_in_worker(f"{__name__}:pre_process_in_folder", folder, raw, prepared,
                                 doing="quantization pre-processing")
        if skipped is None:
            return prepared
        ctx.report.setdefault("quantize_notes", []).append(f"quant_pre_process skipped: {skipped}")
        return raw

    @staticmethod
    def _candidates(config: QuantConfig, options: dict[str, Any], model: onnx.ModelProto) -> Iterator[QuantConfig]:
        yield config
        if options.get("search", True) is False:
            return
        seen = {config}
        variants: list[QuantConfig] = []
        if config.mode == "static":
            for method in ("minmax", "percentile", "entropy"):
                variants.append(replace(config, method=method))
        variants.append(replace(config, per_channel=not config.per_channel))
        ranked = [name for name, _ in weight_sensitivity(model)]
        for count in (1, 2, 4, 8):
            if 0 < count < len(ranked):  # always leave some layers quantized
                variants.append(replace(config, exclude=tuple(sorted(set(config.exclude) | set(ranked[:count])))))
        for variant in variants:
            if variant not in seen:
                seen.add(variant)
                yield variant


def _brief(config: QuantConfig) -> str:
    """A candidate in a few words for the progress line."""
    parts = [config.mode, config.method if config.mode == "static" else "",
             "per-channel" if config.per_channel else "per-tensor"]
    if config.exclude:
        parts.append(f"{len(config.exclude)} node(s) kept float")
    if config.op_types:
        parts.append("/".join(config.op_types))
    return " ".join(p for p in parts if p)
