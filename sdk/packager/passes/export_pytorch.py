"""The ``export_pytorch`` pass: build the recipe's ``torch.nn.Module`` and export it (sdk.export)."""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from sdk.export import DEFAULT_OPSET
from sdk.packager.options import option
from sdk.packager.passes.base import BuildContext, Pass, register


@dataclass(frozen=True)
class PytorchOptions:
    """``model.pytorch``: the module to export and the graph's signature."""

    factory: str = option(
        description="module:callable returning the nn.Module", pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"
    )
    input_shape: tuple[int, ...] = option(description="the example input's shape", minItems=1, items={"minimum": 1})
    weights: str | None = option(None, description="a state dict (torch.save) loaded into the module", minLength=1)
    input_name: str = option("input", description="the graph's input name")
    output_names: tuple[str, ...] = option(("output",), description="the graph's output names")
    opset: int = option(DEFAULT_OPSET, description="the export's ai.onnx opset", minimum=13, maximum=21)
    dynamic_batch: bool = option(True, description="axis 0 of the input and outputs dynamic")


@register
class ExportPytorchPass(Pass):
    """The recipe's ``model.pytorch`` section: build the module and export it (sdk.export)."""

    name = "export_pytorch"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.model.pytorch is not None

    def run(self, ctx: BuildContext) -> None:
        from sdk.export import export_pytorch, load_factory

        options = ctx.recipe.model.pytorch
        assert options is not None  # applies() said so
        module = load_factory(options.factory)()
        if options.weights:
            import torch

            module.load_state_dict(torch.load(options.weights, map_location="cpu", weights_only=True))
        path = ctx.workdir / "exported.onnx"
        report = export_pytorch(
            module,
            list(options.input_shape),
            path,
            opset=options.opset,
            input_name=options.input_name,
            output_names=list(options.output_names),
            dynamic_batch=options.dynamic_batch,
        )
        ctx.model = onnx.load(path)
        ctx.report[self.name] = report
