"""The ``ort_format`` pass: the compact ``.ort`` format next to the .onnx, for onnxruntime mobile."""

from __future__ import annotations

import os
from pathlib import Path

from sdk.errors import BuildError
from sdk.packager.onnx_graph import lower_ir_version, prune_opset_imports
from sdk.packager.passes.base import BuildContext, Pass, register

ORT_MEMBER = "model/model.ort"


@register
class OrtFormatPass(Pass):
    """Add the compact ``.ort`` format next to the .onnx for onnxruntime mobile builds."""

    name = "ort_format"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.recipe.optimize.ort_format

    def run(self, ctx: BuildContext) -> None:
        import subprocess
        import sys

        prune_opset_imports(ctx.require_model())  # the .ort file keeps the imports and IR it is given
        lower_ir_version(ctx.require_model())
        folder = ctx.new_tempdir("ort-format-")
        source = folder / "model.onnx"
        source.write_bytes(ctx.model_bytes())
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "onnxruntime.tools.convert_onnx_models_to_ort",
                str(source),
                "--optimization_style",
                "Fixed",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
            timeout=300,
        )
        produced = sorted(Path(folder).glob("*.ort"))
        if result.returncode != 0 or not produced:
            raise BuildError(self.name, f"ORT format conversion failed: {result.stderr.strip().splitlines()[-1:]}")
        ctx.files[ORT_MEMBER] = produced[0].read_bytes()
        ctx.ort_member = ORT_MEMBER
        ctx.report[self.name] = {"bytes": produced[0].stat().st_size}
