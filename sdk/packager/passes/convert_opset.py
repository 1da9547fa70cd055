"""The ``convert_opset`` pass: ``model.convert_opset: N`` by onnx.version_converter."""

from __future__ import annotations

import onnx

from sdk.errors import ModelError
from sdk.packager.onnx_graph import (
    checker_text,
    default_opset,
)
from sdk.packager.passes.base import BuildContext, Pass, model_label, register


@register
class ConvertOpsetPass(Pass):
    """``model.convert_opset: N``: onnx.version_converter to opset N, as an explicit step whose
    result the validate pass compares with the original like any other pass's."""

    name = "convert_opset"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.model.convert_opset is not None

    def run(self, ctx: BuildContext) -> None:
        from onnx import version_converter

        label = model_label(ctx)
        target = int(ctx.recipe.model.convert_opset or 0)
        model = ctx.require_model()
        source = default_opset(model)
        if not source:
            raise ModelError(
                label, f"model.convert_opset: {target} converts the ai.onnx opset, which {label} does not import"
            )
        try:
            converted = version_converter.convert_version(model, target)
            onnx.checker.check_model(converted)
        except Exception as err:  # the converter raises RuntimeError, ValidationError, IndexError...
            raise ModelError(
                label, f"onnx.version_converter cannot convert opset {source} to {target}: {checker_text(err)}"
            ) from err
        ctx.model = converted
        ctx.report[self.name] = {"from": source, "to": target}
