"""The ``check`` pass: onnx.checker, its findings warnings unless ``model.strict_check``."""

from __future__ import annotations

import onnx

from sdk.errors import BuildError, ModelError
from sdk.packager import ort_host
from sdk.packager.onnx_graph import (
    checker_text,
)
from sdk.packager.passes.base import BuildContext, Pass, model_label, register


@register
class CheckPass(Pass):
    """onnx.checker over the whole model (full_check also runs strict shape inference). A finding
    onnxruntime tolerates (it creates a session on the model) is a warning, because onnxruntime is
    what runs the artifact; ``model.strict_check: true`` makes every finding an error."""

    name = "check"

    def run(self, ctx: BuildContext) -> None:
        label = model_label(ctx)
        try:
            onnx.checker.check_model(ctx.require_model(), full_check=True)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as err:
            finding = checker_text(err)
            if ctx.recipe.model.strict_check:
                raise ModelError(label, f"onnx.checker refused it (model.strict_check is on): {finding}") from err
            try:
                ort_host.describe(ctx.model_bytes(), label=label)
            except BuildError as ort_err:
                raise ModelError(
                    label, f"onnx.checker refused it ({finding}) and onnxruntime cannot load it ({ort_err.problem})"
                ) from ort_err
            ctx.warn(
                f"onnx.checker: {finding} (onnxruntime loads {label}; model.strict_check: true makes this an error)"
            )
            ctx.report[self.name] = {"ok": False, "finding": finding, "onnxruntime_loads": True}
            return
        ctx.report[self.name] = {"ok": True}
