"""The ``load`` pass and the ``model`` section's options (``ModelOptions``)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from sdk.errors import ModelError
from sdk.packager.onnx_graph import (
    drop_initializer_inputs,
)
from sdk.packager.options import option
from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.passes.export_pytorch import PytorchOptions


@dataclass(frozen=True)
class ModelOptions:
    """``model``: read by load, check, convert_opset and shape_inference (``pytorch``: export_pytorch)."""

    DESCRIPTION = "Exactly one of path (an .onnx file) or pytorch (export a torch.nn.Module)."

    path: str | None = option(None, minLength=1)
    convert_opset: int | None = option(
        None,
        description="convert the model to this default-domain opset first; "
        "the result is validated against the original",
        minimum=1,
    )
    strict_check: bool = option(False, description="onnx.checker findings become errors instead of warnings")
    pytorch: PytorchOptions | None = None


@register
class LoadPass(Pass):
    """Load the ONNX file named by the recipe (a PyTorch export section is handled by the
    ``export_pytorch`` pass, which runs first and leaves ``ctx.model`` set)."""

    name = "load"

    def run(self, ctx: BuildContext) -> None:
        if ctx.model is None:
            path = str(ctx.recipe.model.path)
            try:
                ctx.model = onnx.load(path)
            except Exception as err:  # onnx raises DecodeError, OSError, ValueError...
                raise ModelError(path, f"cannot be loaded as ONNX ({type(err).__name__}: {err})") from err
        dropped = drop_initializer_inputs(ctx.model)
        # The reference validation runs is the original as the packaged model holds it: its
        # initializers constant. onnxruntime folds (BatchNorm into Conv, constants) only what
        # no caller can override, so an original that still lists them as inputs would be
        # computed differently from its own packaged form: like is compared with like.
        ctx.original = onnx.ModelProto()
        ctx.original.CopyFrom(ctx.model)
        size = ctx.model.ByteSize()
        ctx.report[self.name] = {
            "bytes": size,
            "nodes": len(ctx.model.graph.node),
            "ir_version": ctx.model.ir_version,
            "initializer_inputs_dropped": len(dropped),
        }
