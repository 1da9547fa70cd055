"""The ``target_report`` pass: for every target, the ops its accelerator cannot run."""

from __future__ import annotations

from typing import Any

from edgepack_core.targets import PROFILES
from sdk.packager.passes.base import BuildContext, Pass, register


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
                    entry.update(
                        {
                            "accelerated_nodes": info.num_supported_nodes,
                            "nodes": info.num_nodes,
                            "partitions": info.num_partitions,
                            "unsupported_ops": sorted(info.unsupported_ops),
                        }
                    )
                    if info.unsupported_ops or info.num_partitions > 1:
                        ctx.warn(
                            f"target {target}: {checker.upper()} runs {info.num_supported_nodes} of "
                            f"{info.num_nodes} nodes in {info.num_partitions} partition(s); unsupported ops: "
                            f"{', '.join(sorted(info.unsupported_ops)) or 'none'}"
                        )
                except Exception as err:  # the checker is a tool script: report, do not fail the build
                    entry["check_error"] = f"{type(err).__name__}: {str(err)[:200]}"
            else:
                entry["unsupported_ops"] = []  # the CPU provider runs every default-domain op
            report[target] = entry
        ctx.report[self.name] = report
