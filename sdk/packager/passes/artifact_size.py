"""The ``artifact_size`` pass: the shipped model members against the model the user gave
(``sdk.packager.artifact_size``); too large is a warning naming why, in the signed report."""

from __future__ import annotations

from sdk.packager.artifact_size import MODEL_ONNX, SIZE_RATIO, growth_by_pass, size_findings
from sdk.packager.passes.base import BuildContext, Pass, register


@register
class ArtifactSizePass(Pass):
    """Runs last: every member is made (the model member is the model as it stands);
    reports only a model beyond the limit, with its warnings."""

    name = "artifact_size"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.original is not None

    def run(self, ctx: BuildContext) -> None:
        assert ctx.original is not None
        original = ctx.original.ByteSize()
        members = {name: len(data) for name, data in ctx.files.items()}
        members[MODEL_ONNX] = ctx.require_model().ByteSize()
        findings = size_findings(original, members, growth=growth_by_pass(ctx.model_sizes))
        if not findings:
            return
        for finding in findings:
            ctx.warn(f"artifact_size: {finding}")
        model_bytes = sum(size for name, size in members.items() if name.startswith("model/"))
        ctx.report[self.name] = {
            "model_bytes": original,
            "shipped_model_bytes": model_bytes,
            "ratio": round(model_bytes / max(original, 1), 3),
            "limit": SIZE_RATIO,
            "within": False,
        }
