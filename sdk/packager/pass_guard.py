"""The guard around graph passes: after a pass that rewrites the graph (``Pass.guard``), the full
onnx.checker (subgraphs included) runs and the outputs are compared with the graph before it on
the recipe's real validation data (made-up inputs only without any). A pass that breaks the
graph, or moves an output of a lossless rewrite beyond tolerance, is undone with one warning
naming it: the graph before it is always right, so the build goes on instead of failing."""

from __future__ import annotations

import numpy as np
import onnx

from sdk.errors import BuildError
from sdk.packager import ort_host
from sdk.packager.data import Feed
from sdk.packager.onnx_graph import checker_text
from sdk.packager.passes.base import BuildContext, Pass
from sdk.packager.passes.ort_optimize import CHECK_SAMPLES, outputs_differ
from sdk.packager.self_check import check_feeds


def checker_finding(model: onnx.ModelProto) -> str | None:
    """onnx.checker's full check (shape inference and subgraphs included): its finding, or None.
    A model over protobuf's 2 GiB cannot be checked in memory: None (nothing found)."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
        return checker_text(err)
    except ValueError:
        return None
    return None


def _outputs(model: onnx.ModelProto, feeds: list[Feed]) -> list[dict[str, np.ndarray]]:
    return ort_host.run_feeds(model.SerializeToString(), feeds)


def pass_problem(
    before: onnx.ModelProto, after: onnx.ModelProto, feeds: list[Feed], checked_on: str, lossless: bool
) -> str | None:
    """Why ``after`` must not replace ``before`` (one line), or None. A finding ``before``
    already had, or data ``before`` cannot run, is not the pass's doing."""
    finding = checker_finding(after)
    if finding is not None and checker_finding(before) is None:
        return f"onnx.checker refuses the result: {finding}"
    if not feeds:
        return None
    try:
        reference = _outputs(before, feeds)
    except BuildError:
        return None
    try:
        candidate = _outputs(after, feeds)
    except BuildError as err:
        return f"onnxruntime cannot run the result on the {checked_on}: {err.problem}"
    if not lossless:
        return None
    for index, (want, got) in enumerate(zip(reference, candidate, strict=True)):
        problem = outputs_differ(want, got)
        if problem is not None:
            return f"{problem} on sample {index} of the {checked_on}"
    return None


def run_guarded(step: Pass, ctx: BuildContext) -> None:
    """Run ``step``; undo it with one warning naming it when :func:`pass_problem` finds one."""
    before = onnx.ModelProto()
    before.CopyFrom(ctx.require_model())
    saved = (ctx.lossy, list(ctx.inputs), list(ctx.outputs))
    step.run(ctx)
    after = ctx.require_model()
    if after.SerializeToString() == before.SerializeToString():
        return
    feeds, checked_on = check_feeds(ctx, CHECK_SAMPLES)
    problem = pass_problem(before, after, feeds, checked_on, lossless=step.guard == "lossless")
    if problem is None:
        return
    ctx.model = before
    ctx.lossy, ctx.inputs, ctx.outputs = saved
    ctx.warn(f"{step.name}: skipped, the graph before it ships: {problem}")
    ctx.report[step.name] = {**ctx.report.get(step.name, {}), "applied": False, "skipped": problem}
