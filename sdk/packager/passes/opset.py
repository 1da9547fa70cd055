"""The ``opset`` pass: refuse operator domains and opsets no onnxruntime release runs."""

from __future__ import annotations

from edgepack_core.errors import RuntimeTooOld
from edgepack_core.ort_compat import (
    DEFAULT_DOMAIN,
    GUARANTEED_MIN_OPSET,
    SUPPORTED_DOMAINS,
    normalize_domain,
    unsupported_domains,
)
from sdk.errors import ModelError
from sdk.packager.onnx_graph import (
    opset_versions,
    used_op_types,
)
from sdk.packager.passes.base import BuildContext, Pass, model_label, register
from sdk.packager.passes.runtime_compat import graph_requirement


@register
class OpsetPass(Pass):
    """The operator domains and opsets onnxruntime runs: ai.onnx, ai.onnx.ml and com.microsoft,
    any opset a known onnxruntime release runs (the build host's included). The artifact's real
    minimum onnxruntime is computed at the end of the build (``runtime_compat``)."""

    name = "opset"

    def run(self, ctx: BuildContext) -> None:
        model = ctx.require_model()
        label = model_label(ctx)
        local = {normalize_domain(f.domain) for f in model.functions}
        custom = {d: op for d, op in sorted(used_op_types(model)) if d not in local}
        foreign = [d for d in unsupported_domains(custom) if d not in local]
        if foreign:
            uses = ", ".join(f"{custom[d]} ({d})" for d in foreign)
            raise ModelError(
                label,
                f"uses custom operators {uses}: a stock onnxruntime runs only the domains "
                f"{', '.join(sorted(SUPPORTED_DOMAINS))}",
            )
        opsets = opset_versions(model)
        if not opsets:
            raise ModelError(label, "imports no opset")
        try:
            version, reason = graph_requirement(model)
        except RuntimeTooOld as err:
            raise ModelError(label, str(err)) from err
        default = opsets.get(DEFAULT_DOMAIN)
        if default is not None and default < GUARANTEED_MIN_OPSET:
            ctx.warn(
                f"{label} uses ai.onnx opset {default}; onnxruntime guarantees opsets {GUARANTEED_MIN_OPSET} and later"
            )
        ctx.report[self.name] = {"opsets": opsets, "min_onnxruntime": version, "reason": reason}
