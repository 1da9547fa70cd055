"""The ``ort_optimize`` pass: onnxruntime's offline graph optimization, kept only when the
optimized graph reproduces its input (``check_optimized``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from edgepack_core.manifest import TensorSpec
from sdk.errors import BuildError
from sdk.packager import ort_host
from sdk.packager.data import Feed
from sdk.packager.onnx_graph import prune_opset_imports
from sdk.packager.passes.base import BuildContext, Pass, model_label, register
from sdk.packager.quant_facts import int8_weight_bytes
from sdk.packager.self_check import MADE_UP, check_feeds

# Targets whose providers share one CPU family, so "extended" offline optimizations (fusions
# written for the CPU execution provider) stay valid on every one of them.
_CPU_ONLY_TARGETS = {"x86"}


@register
class OrtOptimizePass(Pass):
    """onnxruntime's offline graph optimization (constant folding, redundant node removal,
    fusions). Level ``basic`` by default, because higher levels may produce nodes only one
    execution provider runs; ``extended`` only when every target runs the CPU provider alone.
    The result must prove itself (``check_optimized``): an optimizer bug or an IR-3 leftover
    would otherwise ship a broken graph, while the unoptimized one is always right (onnxruntime
    optimizes again when the device loads it). Unused opset imports the save adds are pruned."""

    name = "ort_optimize"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.optimize.graph_pass(ctx.recipe.optimize.constant_folding)

    def level(self, ctx: BuildContext) -> str:
        requested = ctx.recipe.optimize.level
        portable = set(ctx.recipe.targets) <= _CPU_ONLY_TARGETS
        if requested in ("extended", "all") and not portable:
            ctx.warn(
                f"optimize.level {requested} is not portable across targets {', '.join(ctx.recipe.targets)}; "
                "using basic"
            )
            return "basic"
        # A build that quantizes stays at basic unless asked: extended fusions make com.microsoft
        # ops (FusedConv) that onnxruntime.quantization leaves float, and the device's onnxruntime
        # applies them (and the QDQ fusions) when it loads the model anyway.
        quantizes = ctx.recipe.quantize.mode != "none"
        return requested or ("extended" if portable and not quantizes else "basic")

    def run(self, ctx: BuildContext) -> None:
        level = self.level(ctx)
        model = ctx.require_model()
        before = len(model.graph.node)
        report: dict[str, Any] = {"level": level, "nodes_before": before}
        feeds = check_feeds(ctx, CHECK_SAMPLES)
        report["checked_on"] = feeds[1]
        optimized, problem = self._optimize(ctx, level, (), feeds)
        if optimized is not None and problem is None and folds_quantized_weights(model, optimized):
            # Constant folding made float weights of int8 ones (Cast/Mul of an int8 initializer):
            # 4x the bytes and no longer int8. Optimize again without it; the device's
            # onnxruntime may still fold them in memory when it loads the model, the file stays small.
            optimized, problem = self._optimize(ctx, level, (CONSTANT_FOLDING,), feeds)
            report["quantized_weights_kept"] = True
            report["disabled"] = [CONSTANT_FOLDING]
        if problem is not None or optimized is None:
            ctx.warn(f"ort_optimize: kept the unoptimized graph: {problem}")
            ctx.report[self.name] = {**report, "applied": False, "reason": problem}
            return
        ctx.model = optimized
        ctx.report[self.name] = {**report, "applied": True, "nodes_after": len(optimized.graph.node)}

    @staticmethod
    def _optimize(ctx: BuildContext, level: str, disabled: tuple[str, ...], feeds: tuple[list[Feed], str]
                  ) -> tuple[onnx.ModelProto | None, str | None]:
        """The optimized graph and why it must not ship (None when proven)."""
        try:
            optimized = onnx.load_from_string(ort_host.optimize_offline(ctx.model_bytes(), level,
                                                                        label=model_label(ctx), disabled=disabled))
        except BuildError as err:  # the optimizer failed (or crashed): the graph itself may still run
            return None, f"onnxruntime's optimizer failed: {err.problem}"
        prune_opset_imports(optimized)
        return optimized, check_optimized(ctx.require_model(), optimized, ctx.inputs, *feeds)


CONSTANT_FOLDING = "ConstantFolding"


def folds_quantized_weights(original: onnx.ModelProto, optimized: onnx.ModelProto) -> bool:
    """Whether the optimizer turned int8 weights into float ones: fewer int8 weight bytes after."""
    return int8_weight_bytes(optimized) < int8_weight_bytes(original)


# The optimizer's result must reproduce its input graph on made-up inputs within these bounds
# (fusions reorder float arithmetic; anything beyond this is a broken rewrite, not rounding).
CHECK_SAMPLES = 3


CHECK_RTOL, CHECK_ATOL = 1e-3, 1e-4


def dangling_inputs(model: onnx.ModelProto, fed: set[str]) -> list[str]:
    """Graph inputs nobody feeds and no initializer gives, and node inputs no one produces."""
    graph = model.graph
    known = fed | {i.name for i in graph.initializer} | {""}
    missing = [i.name for i in graph.input if i.name not in known]
    produced = known | {i.name for i in graph.input} | {o for n in graph.node for o in n.output}
    missing += sorted({name for n in graph.node for name in n.input if name not in produced})
    return missing


def probe_feeds(inputs: list[TensorSpec], count: int, seed: int = 11) -> list[dict[str, np.ndarray]]:
    """Made-up inputs for comparing two forms of one graph (never for accuracy claims): floats in
    [0, 1), integers 0 (a valid index on any non-empty axis), False, "a"; named dims of size 1."""
    rng = np.random.default_rng(seed)
    feeds = []
    for _ in range(count):
        feed: dict[str, np.ndarray] = {}
        for spec in inputs:
            shape = tuple(d if isinstance(d, int) else 1 for d in spec.shape)
            if spec.dtype == "string":
                feed[spec.name] = np.full(shape, "a", dtype=object)
            elif spec.dtype == "bfloat16":
                raise ValueError(f"input {spec.name} is bfloat16, which numpy cannot make")
            elif np.dtype(spec.dtype).kind == "f":
                feed[spec.name] = rng.random(shape).astype(spec.dtype)
            else:
                feed[spec.name] = np.zeros(shape, dtype=spec.dtype)
        feeds.append(feed)
    return feeds


def outputs_differ(reference: dict[str, np.ndarray], candidate: dict[str, np.ndarray]) -> str | None:
    """The first output where ``candidate`` departs from ``reference``, or None. Pure."""
    for name, want in reference.items():
        got = candidate.get(name)
        if got is None:
            return f"output {name} is missing"
        want, got = np.asarray(want), np.asarray(got)
        if want.shape != got.shape or want.dtype != got.dtype:
            return f"output {name} is {got.dtype}{list(got.shape)}, was {want.dtype}{list(want.shape)}"
        if want.dtype.kind in "fc":
            if not np.allclose(got, want, rtol=CHECK_RTOL, atol=CHECK_ATOL, equal_nan=True):
                worst = float(np.nanmax(np.abs(got.astype(np.float64) - want.astype(np.float64)), initial=0.0))
                return f"output {name} differs by up to {worst:.3g} (rtol {CHECK_RTOL}, atol {CHECK_ATOL})"
        elif not np.array_equal(got, want):
            return f"output {name} differs"
    return None


def check_optimized(original: onnx.ModelProto, optimized: onnx.ModelProto, inputs: list[TensorSpec],
                    feeds: list[dict[str, np.ndarray]] | None = None, checked_on: str = MADE_UP) -> str | None:
    """Why the optimized graph must not replace the original (one line), or None when it is
    proven: every input fed or initialised, and the same outputs on ``feeds`` (the recipe's
    validation data; made-up inputs when None)."""
    missing = dangling_inputs(optimized, {spec.name for spec in inputs})
    if missing:
        return f"the optimized graph reads {', '.join(missing[:3])}, which nothing feeds or initialises"
    if [o.name for o in optimized.graph.output] != [o.name for o in original.graph.output]:
        return "the optimized graph's outputs differ from the original's"
    try:
        feeds = probe_feeds(inputs, CHECK_SAMPLES) if feeds is None else feeds
        if not feeds:
            raise ValueError("no inputs numpy can make")
        reference = ort_host.run_feeds(original.SerializeToString(), feeds)
    except (BuildError, ValueError) as err:
        return f"it could not be compared with the original on {checked_on} ({err})"
    try:
        candidate = ort_host.run_feeds(optimized.SerializeToString(), feeds)
    except BuildError as err:
        return f"onnxruntime cannot run it ({err})"
    for index, (want, got) in enumerate(zip(reference, candidate, strict=True)):
        problem = outputs_differ(want, got)
        if problem is not None:
            return f"{problem} on sample {index} of the {checked_on}"
    return None
