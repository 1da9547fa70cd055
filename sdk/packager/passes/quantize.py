"""Accuracy-gated quantization that finds a working model: candidates cheapest first (the plan
is :mod:`sdk.packager.quant_search`), each judged on validation data by the task's metric and
timed against fp32 side by side; the first that keeps the budget and is faster ships, else the
build ships fp32 and says why in one line.

Pitfalls handled (measured on real models with onnxruntime 1.31-1.32 on x86):
- ``quantize_dynamic`` with defaults turns every Conv into ConvInteger, 1.5-5x *slower* on
  CPU: dynamic mode quantizes MatMul/Gemm only, unless the recipe names Conv explicitly.
- per-channel QDQ on opset < 13 gives graphs that do not load: the opset is upgraded first.
- ``quant_pre_process`` (shape inference, needs sympy) fails on some graphs: fall back to the
  model as it is rather than fail the build.
- accuracy collapse: a detector's boxes (pixels) and scores ([0, 1]) joined by one Concat share
  one uint8 scale, and every score rounds to 0 or one step while the whole-tensor cosine stays
  at 0.998. Candidates are judged by the validate pass's :func:`judge` (detection recall and
  precision, per-step sequence agreement, top-1, each raw output on its own), and the search
  keeps the head, wide-range Concats and the tensors that lose most signal
  (:mod:`sdk.packager.quant_sensitivity`, measured in the worker on calibration data) float.
- int8 slower than fp32 (small models, x86 without VNNI): not shipped unless the recipe lowers
  ``quantize.min_speedup``; latency is the host CPU provider's, the proxy for the target's.
- dynamic int8 that quantized nothing is still fp32: the manifest's precision counts the
  quantized nodes of the graph instead of trusting the mode.

Every onnxruntime session (pre-processing, calibration, activation capture, validation runs,
timing) runs in the onnxruntime worker (:mod:`sdk.packager.ort_host`); the functions the worker
runs for this pass are in :mod:`sdk.packager.quant_worker`.

A stateful model on stream data (``role: state`` inputs, audio files) is calibrated on the state
the fp32 model carries over each file's frames, and every candidate is judged free-running,
carrying its own state as the agent does (:mod:`sdk.packager.sequences`).
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from edgepack_core.targets import CPU, PROFILES
from sdk.errors import BuildError, OrtCrashError, RecipeError
from sdk.packager import quant_search as plan
from sdk.packager import quant_sensitivity as sensitivity
from sdk.packager.data import (
    Samples,
    carried_feeds,
    context_options,
    load_samples,
    synthetic_options,
    synthetic_samples,
)
from sdk.packager.onnx_graph import default_opset
from sdk.packager.options import given, option
from sdk.packager.ort_host import call_in_worker, measure_latency
from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.passes.fp16 import FP16_MAX, _to_fp16_graph  # the fp16 pass's own conversion
from sdk.packager.passes.io_spec import settle_apply_sigmoid
from sdk.packager.passes.validate import checked_outputs, judge, state_report
from sdk.packager.quant_facts import quant_facts
from sdk.packager.quant_search import Candidate, QuantConfig
from sdk.packager.quant_worker import (  # noqa: F401  (the worker's functions keep this import path)
    pre_process_in_folder,
    profile_activations,
    quantize_in_folder,
    quantize_once,
)
from sdk.packager.sequences import calibration_feeds, run_samples
from sdk.packager.sources import DATA_SOURCE_SCHEMA, DataSource

WORKER = "sdk.packager.quant_worker"  # the functions the pass runs in the onnxruntime worker
# A graph without int8 nodes (quant_facts) is fp32, whatever mode made it (dynamic
# quantization of a model without MatMul/Gemm changes nothing).
QUANTIZABLE = ("Conv", "Gemm", "MatMul")
# Side-by-side timing of each candidate against fp32: alternating blocks of about 30 ms (3 to
# 200 runs), 7 rounds (the speed gate's interval, quant_search.speed_call).
LATENCY_ROUNDS, LATENCY_BLOCK_S, LATENCY_MIN_RUNS, LATENCY_MAX_RUNS = 7, 0.03, 3, 200
LATENCY_THREADS = 1
# Calibration samples the activation capture runs (both models keep every intermediate tensor
# of one sample in memory at a time).
PROFILE_SAMPLES = 16
CPUINFO = Path("/proc/cpuinfo")
MAX_CPUINFO_BYTES = 1 << 20


def read_cpu_flags(path: Path = CPUINFO) -> frozenset[str]:
    """The build host's CPU flags (empty where /proc/cpuinfo does not exist: no VNNI assumed)."""
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_CPUINFO_BYTES).decode("ascii", "replace")
    except OSError:
        return frozenset()
    return plan.parse_cpu_flags(text)


@dataclass(frozen=True)
class QuantizeOptions:
    """``quantize``: the quantize pass's request and its search budget. A setting left None
    comes from the preset."""

    mode: Literal["none", "dynamic", "static"] = option("none", description="dynamic: MatMul/Gemm weights; static: "
                                                        "QDQ calibrated on quantize.calibration")
    calibration: DataSource | None = option(None, schema=DATA_SOURCE_SCHEMA, parse=DataSource.from_json)
    method: Literal["minmax", "entropy", "percentile"] | None = option(None, description="static calibration method")
    per_channel: bool | None = option(None, description="per-channel weight scales")
    symmetric_activations: bool | None = option(None, description="symmetric activation ranges")
    symmetric_weights: bool | None = option(None, description="symmetric weight ranges")
    reduce_range: bool | None = option(None, description="7-bit weights (AVX2 without VNNI)")
    preset: Literal["arm64", "x86-avx2", "x86-vnni", "tensorrt"] | None = option(
        None, description="activation/weight types for the target's runtime; default: derived from targets "
        "(rpi/android/apple arm64, jetson tensorrt, x86 x86-vnni when the build host has VNNI, else x86-avx2)")
    op_types: tuple[str, ...] | None = option(None, description="the op types to quantize")
    exclude_nodes: tuple[str, ...] | None = option(None, description="nodes kept in float: names or glob patterns "
                                                   "(fnmatch); a pattern that matches no node is refused",
                                                   items={"minLength": 1})
    search: bool = option(True, description="false: try the requested settings only, no search")
    min_speedup: float = option(plan.DEFAULT_MIN_SPEEDUP, description="an int8 candidate ships only when fp32 "
                                "latency / its latency (host CPU provider, one thread) is above this; 0 ships any "
                                "speed", minimum=0)
    max_candidates: int = option(plan.DEFAULT_MAX_CANDIDATES, description="the most candidates the search builds "
                                 "and judges", minimum=1, maximum=50)
    max_search_s: float = option(plan.DEFAULT_MAX_SEARCH_S, description="no new candidate starts after this many "
                                 "seconds of search", exclusiveMinimum=0)


def base_config(options: QuantizeOptions, preset: str) -> QuantConfig:
    """The requested settings: the preset's types, then the recipe's own keys over them."""
    fields = QuantConfig.__annotations__
    config = QuantConfig(mode=options.mode, **{k: v for k, v in plan.PRESETS[preset].items() if k in fields})
    overrides: dict[str, Any] = {key: getattr(options, key) for key in (
        "method", "per_channel", "reduce_range", "symmetric_activations", "symmetric_weights")
        if getattr(options, key) is not None}
    if options.op_types is not None:
        overrides["op_types"] = options.op_types
    if options.exclude_nodes is not None:
        overrides["exclude"] = options.exclude_nodes
    return replace(config, **overrides)


def quantized_nodes(model: onnx.ModelProto) -> int:
    """How many nodes of the graph (subgraphs included) compute or carry int8: QDQ pairs,
    integer MatMul/Conv, every QLinear* op (``quant_facts``, which also labels the manifest)."""
    return sum(quant_facts(model).int8_nodes.values())


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


def _ensure_names(model: onnx.ModelProto) -> bool:
    """Name every unnamed node (exclusions name nodes); whether any was renamed."""
    renamed = False
    for index, node in enumerate(model.graph.node):
        if not node.name:
            node.name = f"{node.op_type}_{index}"
            renamed = True
    return renamed


def _rounds(timing: float | Sequence[float]) -> tuple[float, ...]:
    """One model's timing rounds; a single figure (a test's seam) is one round."""
    return (float(timing),) if isinstance(timing, (int, float)) else tuple(float(t) for t in timing)


def time_side_by_side(fp32: Path, candidate: Path, feed: dict[str, np.ndarray]
                      ) -> tuple[Sequence[float], Sequence[float]]:
    """Seconds per run of the fp32 model and a candidate on the host's CPU provider, one thread
    (a ratio that a busy shared machine's thread scheduling does not swing), measured in the
    worker in alternating blocks of about ``LATENCY_BLOCK_S`` each, ``LATENCY_ROUNDS`` rounds;
    each round's block medians, paired (a load spike on a shared machine hits both of a round),
    for :func:`quant_search.speed_call`. The seam the tests use to play a target where int8 is
    slower or faster (a single figure per model is one round)."""

    def block(model: Path, runs: int, warmup: int = 0) -> float:
        return float(np.median(measure_latency(str(model), feed, runs=runs, warmup=warmup, threads=LATENCY_THREADS)))

    estimate = block(fp32, 3, warmup=1)
    runs = int(min(LATENCY_MAX_RUNS, max(LATENCY_MIN_RUNS, LATENCY_BLOCK_S / max(estimate, 1e-6))))
    block(candidate, 1, warmup=1)
    fp32_blocks, candidate_blocks = [], []
    for _ in range(LATENCY_ROUNDS):
        fp32_blocks.append(block(fp32, runs))
        candidate_blocks.append(block(candidate, runs))
    return fp32_blocks, candidate_blocks


def _state_entries(calibration: Samples | None, validation: Samples) -> dict[str, Any]:
    """The report's ``calibration_state`` and ``validation_state``: how a stateful model's state
    inputs were fed (carried over each file's frames, or init); nothing for a stateless one."""
    entries: dict[str, Any] = {}
    for name, samples in (("calibration", calibration), ("validation", validation)):
        fed = state_report(samples) if samples is not None else {}
        if "state" in fed:
            entries[f"{name}_state"] = fed["state"]
    return entries


def _bar(fraction: float, width: int = 20) -> str:
    filled = round(fraction * width)
    return "[" + "#" * filled + "-" * (width - filled) + f"] {fraction:4.0%}"


@dataclass
class _Data:
    """What every candidate is judged on: fp32 model, calibration feeds, validation samples and
    the fp32 outputs on them."""

    source: Path
    calibration: list[dict[str, np.ndarray]]
    validation: Samples
    reference: list[dict[str, np.ndarray]]


@register
class QuantizePass(Pass):
    name = "quantize"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.quantize.mode != "none"

    @staticmethod
    def _samples(ctx: BuildContext, source: DataSource | None, key: str, limit: int) -> Samples | None:
        if source is None:
            return None
        return load_samples(source, ctx.preprocess, ctx.inputs, key=key, limit=limit, **context_options(ctx))

    @staticmethod
    def _calibration(source: Path, samples: Samples | None, validation: Samples,
                     reference: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """The calibration feeds; on stream data, each state input holds the state the fp32
        model carries into that frame (zeros would give the state a range of 0). When the
        calibration samples are the validation samples, the fp32 run that carried it is the
        reference run already made."""
        if samples is None:
            return []
        if samples is validation:
            return carried_feeds(samples, reference)
        return calibration_feeds(source.read_bytes(), samples, label="the fp32 model (calibration state)")

    @staticmethod
    def _preset(ctx: BuildContext, options: QuantizeOptions) -> tuple[str, str]:
        if options.preset is not None:
            return options.preset, "quantize.preset"
        return plan.preset_for_targets(ctx.recipe.targets, read_cpu_flags())

    def run(self, ctx: BuildContext) -> None:
        facts = quant_facts(ctx.require_model())
        if facts.precision is not None:  # quantizing a quantized graph again adds error, never speed
            nodes = ", ".join(f"{count} {op}" for op, count in facts.int8_nodes.items())
            reason = f"the model is already quantized ({nodes}); it is not quantized again"
            ctx.warn(f"quantize: {reason}")
            ctx.report[self.name] = {"applied": False, "already_quantized": True, "reason": reason}
            return
        self._search(ctx)

    def _search(self, ctx: BuildContext) -> None:
        options = ctx.recipe.quantize
        preset, preset_why = self._preset(ctx, options)
        config = base_config(options, preset)
        model = ctx.require_model()
        _ensure_names(model)
        validate_options = ctx.recipe.validate
        checked_outputs(ctx, validate_options)  # an unknown validate.outputs name fails before the search
        if config.mode == "dynamic":
            config = self._dynamic_op_types(ctx, model, config)
        folder = ctx.new_tempdir("quantize-")
        source = self._prepare(ctx, model, folder)
        graph = onnx.load(source, load_external_data=False).graph
        if config.exclude:
            names = [node.name for node in graph.node]
            config = replace(config, exclude=expand_exclusions(config.exclude, names, recipe=str(ctx.recipe.path)))
        calibration = self._samples(ctx, options.calibration, "quantize.calibration", 200)
        validation = self._samples(ctx, validate_options.data, "validate.data", validate_options.samples or 200) \
            or calibration or synthetic_samples(16, ctx.preprocess, ctx.inputs, **synthetic_options(ctx))
        reference = run_samples(source.read_bytes(), validation, label="the fp32 model")
        settle_apply_sigmoid(ctx, reference)  # a raw YOLO head's candidates judged with the sigmoid it needs
        data = _Data(source, self._calibration(source, calibration, validation, reference), validation, reference)
        search = _Search(ctx, folder, data, options)
        first = Candidate("int8", "requested", config, (("recipe", config.exclude),) if config.exclude else ())
        report: dict[str, Any] = {
            "requested": config.describe(), "preset": preset, "preset_from": preset_why,
            "budget": given(validate_options), "validation_samples": len(validation),
            **_state_entries(calibration, validation),
            "fp32_bytes": source.stat().st_size, "min_speedup": search.min_speedup,
            "latency_on": f"{CPU} on the build host, the proxy for the targets' providers ("
                          + "; ".join(f"{t}: {', '.join(PROFILES[t])}" for t in ctx.recipe.targets) + ")",
            "candidates": search.tried}
        ctx.report[self.name] = report
        chosen = search.run(first, graph, options.search)
        report.update(search.summary())
        if chosen is None:
            reason = plan.fallback_reason(search.tried, search.min_speedup, search.stopped)
            ctx.warn(reason)
            report.update({"applied": False, "reason": reason})
            return
        candidate, path, entry = chosen
        report.update({"applied": True, "chosen": candidate.describe(), "latency_fp32_ms": entry["latency_fp32_ms"],
                       f"latency_{candidate.kind}_ms": entry["latency_ms"], "speedup": entry["speedup"],
                       "quantized_bytes": entry["bytes"], "evidence": entry["evidence"]})
        if entry["speedup"] < 1.0:
            ctx.warn(f"the {candidate.kind} model is slower than fp32 on this machine ({entry['speedup']:.2f}x); "
                     f"shipped because quantize.min_speedup is {search.min_speedup:g}" if candidate.kind == "int8"
                     else f"the fp16 model runs at {entry['speedup']:.2f}x fp32 on this host's CPU, which runs "
                     "fp16 through casts; targets " + ", ".join(ctx.recipe.targets) + " run it natively")
        ctx.model = onnx.load(path)
        ctx.lossy = candidate.kind

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
        return replace(config, op_types=tuple(sorted(asked - {"Conv"})) or ("MatMul", "Gemm"))

    def _prepare(self, ctx: BuildContext, model: onnx.ModelProto, folder: Path) -> Path:
        """Upgrade to opset 13+ (per-channel QDQ needs it), then onnxruntime's pre-processing;
        nodes it leaves unnamed are named (exclusions name nodes)."""
        if default_opset(model) < 13:
            from onnx import version_converter

            model = version_converter.convert_version(model, 13)
        raw = folder / "fp32.onnx"
        onnx.save(model, raw)
        prepared = folder / "prepared.onnx"
        skipped = call_in_worker(f"{WORKER}:pre_process_in_folder", folder, raw, prepared,
                                 doing="quantization pre-processing")
        if skipped is not None:
            ctx.report.setdefault("quantize_notes", []).append(f"quant_pre_process skipped: {skipped}")
            return raw
        loaded = onnx.load(prepared)
        if _ensure_names(loaded):
            onnx.save(loaded, prepared)
        return prepared


class _Search:
    """One build's search: tries candidates in plan order within the budget, records each in
    ``tried`` (the report's ``candidates``), and returns the first that may ship. The first
    candidate's model is built before anything else, the later stages planned from it, and only
    then is it judged: every progress line knows how many candidates there are."""

    def __init__(self, ctx: BuildContext, folder: Path, data: _Data, options: QuantizeOptions) -> None:
        self.ctx, self.folder, self.data = ctx, folder, data
        self.min_speedup = options.min_speedup
        self.max_candidates = options.max_candidates
        self.max_search_s = options.max_search_s
        self.fp16 = plan.fp16_wanted(ctx.recipe.targets, ctx.recipe.optimize.fp16)
        self.tried: list[dict[str, Any]] = []
        self.stopped: str | None = None
        self.facts: dict[str, Any] = {}
        self.started = time.monotonic()
        self.ranges: dict[str, tuple[float, float]] = {}
        self.hopeless: str | None = None  # why no int8 candidate can be shown to keep the budget

    def summary(self) -> dict[str, Any]:
        return {"search_s": round(time.monotonic() - self.started, 3), "stopped": self.stopped,
                "max_candidates": self.max_candidates, "max_search_s": self.max_search_s,
                "sensitivity": self.facts}

    def run(self, first: Candidate, graph: onnx.GraphProto, search: bool
            ) -> tuple[Candidate, Path, dict[str, Any]] | None:
        out, entry = self._make(first)
        queue = plan.later_candidates(first, self._facts(graph, out, entry)) if search else []
        total = min(1 + len(queue), self.max_candidates)
        while True:
            if "error" not in entry:
                self._judge(first, out, entry, f"{len(self.tried)}/{total}")
            if entry.get("ships"):
                return first, out, entry
            if self.hopeless and any(c.kind == "int8" for c in queue):
                queue = [c for c in queue if c.kind != "int8"]
                self.stopped = self.hopeless
            if not queue:
                return None
            stop = plan.search_stop(len(self.tried), time.monotonic() - self.started, self.max_candidates,
                                    self.max_search_s)
            if stop:
                self.stopped = stop
                return None
            first = queue.pop(0)
            out, entry = self._make(first, total)

    def _facts(self, graph: onnx.GraphProto, first_out: Path, first: Mapping[str, Any]) -> plan.GraphFacts:
        """Measure what the later stages are planned from, on the first candidate's model. When
        it quantized nothing, later int8 candidates (subsets of it) would not either."""
        quantized = "error" not in first and bool(first.get("quantized_nodes"))
        if not quantized and not self.fp16:
            return plan.GraphFacts()
        errors = quantized and first.get("mode") == "static"
        feeds = (self.data.calibration or self.data.validation.feeds)[:PROFILE_SAMPLES]
        self.ctx.progress(f"quantize: measuring activation ranges{' and errors' if errors else ''} on "
                          f"{len(feeds)} sample(s) ...")
        profile = call_in_worker(f"{WORKER}:profile_activations", self.data.source, first_out if errors else None,
                                 feeds, doing="activation capture")
        if not quantized:  # ranges for the fp16 overflow check only
            self.ranges = profile["ranges"]
            return plan.GraphFacts(fp16=True)
        self.ranges = profile["ranges"]
        wide = sensitivity.wide_range_concats(graph, self.ranges)
        ranked = sensitivity.rank_tensors(profile["errors"])[:max(plan.ACTIVATION_ERROR_STEPS)]
        head = sensitivity.head_nodes(graph)
        self.facts = {"head": list(head), "wide_range_concats": [{"tensor": t, "ratio": round(r, 1)} for t, r in wide],
                      "activation_error": [{"tensor": t, "sqnr_db": round(s, 2)} for t, s in ranked]}
        keep = {t: sensitivity.keep_float_nodes(graph, t) for t in [*(t for t, _ in ranked), *(t for t, _ in wide)]}
        return plan.GraphFacts(head=head, wide_concats=tuple(t for t, _ in wide), ranked=tuple(t for t, _ in ranked),
                               float_nodes=keep, op_types=frozenset(n.op_type for n in graph.node) & set(QUANTIZABLE),
                               fp16=self.fp16, heavy={n.name: n.op_type for n in graph.node
                                                      if n.op_type in QUANTIZABLE})

    def _step(self, number: str, candidate: Candidate, fraction: float, doing: str) -> None:
        self.ctx.progress(f"quantize: trying candidate {number} {_bar(fraction)} {doing}: {candidate.brief()}")

    def _make(self, candidate: Candidate, total: int | None = None) -> tuple[Path, dict[str, Any]]:
        """Build one candidate's model; its report entry (appended to ``tried``), with an
        ``error`` when it could not be built."""
        index = len(self.tried) + 1
        number = f"{index}/{total}" if total else f"{index}"
        out = self.folder / f"candidate-{index}.onnx"
        entry: dict[str, Any] = {**candidate.describe(), "started": time.monotonic()}
        self.tried.append(entry)
        self._step(number, candidate, 0.0, "quantizing" if candidate.kind == "int8" else "converting")
        try:
            refused = self._build(candidate, out, index)
        except OrtCrashError:
            raise  # a crash ends the build with one line naming it; never a skipped candidate
        except BuildError as err:  # onnxruntime.quantization's own errors, reported by the worker
            refused = err.problem[:300]
        if refused:
            entry.update(error=refused, seconds=round(time.monotonic() - entry.pop("started"), 3))
            self.ctx.progress(f"quantize: candidate {number} ({candidate.brief()}) failed: {refused[:200]}")
            return out, entry
        entry["quantized_nodes"] = quantized_nodes(onnx.load(out, load_external_data=False))
        return out, entry

    def _judge(self, candidate: Candidate, out: Path, entry: dict[str, Any], number: str) -> None:
        """Judge and time a built candidate; its verdict line starts ``quantize: candidate N/M``,
        which ``edgepack build`` prints even in a log, so a long search shows in CI as it goes
        (the bar only on a terminal)."""
        self._step(number, candidate, 0.4, "judging")
        try:
            outputs = run_samples(out.read_bytes(), self.data.validation, label=f"candidate {number}")
        except OrtCrashError:
            raise
        except BuildError as err:  # a quantized graph onnxruntime cannot run
            entry.update(error=err.problem[:300], seconds=round(time.monotonic() - entry.pop("started"), 3))
            self.ctx.progress(f"quantize: candidate {number} ({candidate.brief()}) failed: {err.problem[:200]}")
            return
        evaluation = judge(self.ctx, self.ctx.recipe.validate, self.data.reference, outputs,
                           self.data.validation.labels)
        self._step(number, candidate, 0.7, "timing")
        fp32_rounds, rounds = map(_rounds, time_side_by_side(self.data.source, out, self.data.validation.feeds[0]))
        fp32_s, latency = min(fp32_rounds), min(rounds)
        speed = plan.speed_call(fp32_rounds, rounds, self.min_speedup)
        speedup = speed.speedup
        decision = plan.verdict(candidate.kind, evaluation.met, speed, evaluation.decided)
        if candidate.kind == "int8" and not entry["quantized_nodes"]:
            decision = plan.Verdict(False, evaluation.met, "changed no node of the graph")
        entry.update({"metric": evaluation.metric, "task": evaluation.to_json(), "budget_met": evaluation.met,
                      "why": evaluation.summary(), "decided": evaluation.decided,
                      "evidence": evaluation.evidence_summary(), "bytes": out.stat().st_size,
                      "latency_ms": round(latency * 1000, 4), "latency_fp32_ms": round(fp32_s * 1000, 4),
                      "speedup": speedup, "speedup_interval": [speed.low, speed.high], "speed_call": speed.call,
                      "ships": decision.ships, "verdict": decision.word,
                      "seconds": round(time.monotonic() - entry.pop("started"), 3)})
        self.ctx.progress(f"quantize: candidate {number} ({candidate.brief()}) {decision.word}: "
                          f"{evaluation.summary()}; {entry['bytes']:,d} bytes, {entry['latency_ms']:.3g} ms "
                          f"({speedup:.2f}x fp32)")
        if candidate.kind == "int8":
            self.hopeless = plan.evidence_stop(evaluation.met, [c for s in evaluation.scores for c in s.evidence])

    def _build(self, candidate: Candidate, out: Path, index: int) -> str | None:
        """Write the candidate's model to ``out``; why it was refused, or None."""
        if candidate.config is not None:
            call_in_worker(f"{WORKER}:quantize_in_folder", self.folder, self.data.source, out, candidate.config,
                           self.data.calibration, label=f"candidate {index}", doing="quantization and calibration")
            return None
        model = onnx.load(self.data.source)
        weights = max((float(np.abs(numpy_helper.to_array(i)).max()) for i in model.graph.initializer
                       if i.data_type == TensorProto.FLOAT and i.dims and np.prod(i.dims)), default=0.0)
        activations = max((max(abs(low), abs(high)) for low, high in self.ranges.values()), default=0.0)
        if max(weights, activations) >= FP16_MAX:
            return f"values up to {max(weights, activations):.3g} overflow fp16 (max {FP16_MAX:g})"
        onnx.save(_to_fp16_graph(model), out)
        return None
