"""Validation of every build: the packaged model against the original on N samples, and a
target compatibility report. A missed threshold fails the build unless the recipe says
``validate.allow_failure: true``."""

from __future__ import annotations

from typing import Any

from edgepack_core.targets import PROFILES
from sdk.errors import ValidationFailed
from sdk.packager.data import load_samples, synthetic_samples
from sdk.packager.metrics import Budget, compare
from sdk.packager.ort_host import run_feeds
from sdk.packager.passes.base import BuildContext, Pass, register

DEFAULT_SAMPLES = 64


@register
class ValidatePass(Pass):
    name = "validate"
    section = "validate"

    def run(self, ctx: BuildContext) -> None:
        options = self.options(ctx)
        limit = int(options.get("samples", DEFAULT_SAMPLES))
        source = options.get("data") or ctx.recipe.section("quantize").get("calibration")
        if source:
            samples = load_samples(source, ctx.preprocess, ctx.inputs, key="validate.data", limit=limit)
        else:
            samples = synthetic_samples(min(limit, 16), ctx.preprocess, ctx.inputs, seed=7)
        assert ctx.original is not None
        reference = run_feeds(ctx.original.SerializeToString(), samples.feeds)
        candidate = run_feeds(ctx.model_bytes(), samples.feeds)
        result = compare(reference, candidate, output=ctx.postprocess.get("output"), labels=samples.labels)
        precision = ctx.manifest_extra.get("precision", "fp32")
        # An fp32 build must reproduce the original closely whatever the recipe says; the
        # recipe's budget is for lossy builds (quantized, fp16).
        budget = Budget.from_recipe(options, samples.labels is not None) if (options or precision != "fp32") \
            else Budget(metric="max_abs", max_abs=1e-3)
        met, why = budget.check(result)
        report: dict[str, Any] = {**result.to_json(), "precision": precision, "metric": budget.metric,
                                  "budget_met": met, "summary": why, "source": "data" if source else "synthetic"}
        ctx.report[self.name] = report
        ctx.progress(f"validate: {why}")
        if not met:
            if options.get("allow_failure"):
                ctx.warn(f"validation missed its budget but allow_failure is set: {why}")
                return
            value = {"top1": result.accuracy_drop, "agreement": 1 - result.top1_agreement,
                     "max_abs": result.max_abs_diff}.get(budget.metric, result.cosine)
            raise ValidationFailed(budget.metric, float(value or 0.0), 0.0,
                                   f"the packaged model misses the accuracy budget: {why}")


@register
class TargetReportPass(Pass):
    """For every target, the ops its accelerator cannot run; for android/apple, onnxruntime's
    own NNAPI/CoreML partitioning check."""

    name = "target_report"

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        report: dict[str, Any] = {}
        for target in ctx.recipe.targets:
            entry: dict[str, Any] = {"providers": list(PROFILES[target])}
            checker = {"android": "nnapi", "apple": "coreml"}.get(target)
            if checker is not None:
                try:
                    from onnxruntime.tools.mobile_helpers import usability_checker as usability

                    if checker == "nnapi":
                        info = usability.check_nnapi_partitions(model, require_fixed_input_sizes=True)
                    else:
                        info = usability.check_coreml_partitions(model, True, "coreml_supported_mlprogram_ops.md")
                    entry.update({
                        "accelerated_nodes": info.num_supported_nodes, "nodes": info.num_nodes,
                        "partitions": info.num_partitions, "unsupported_ops": sorted(info.unsupported_ops),
                    })
                    if info.unsupported_ops or info.num_partitions > 1:
                        ctx.warn(f"target {target}: {checker.upper()} runs {info.num_supported_nodes} of "
                                 f"{info.num_nodes} nodes in {info.num_partitions} partition(s); unsupported ops: "
                                 f"{', '.join(sorted(info.unsupported_ops)) or 'none'}")
                except Exception as err:  # the checker is a tool script: report, do not fail the build
                    entry["check_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            else:
                entry["unsupported_ops"] = []  # the CPU provider runs every default-domain op
            report[target] = entry
        ctx.report[self.name] = report
