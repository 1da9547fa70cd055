"""The ``optimize`` section's options (``OptimizeOptions``), read by the optimization passes.

Their order is fixed by the pipeline: fixed shapes (for accelerators that need them), identity
elimination, BatchNorm folding, onnxruntime's offline graph optimization, then fp16 (after the
folding: an unfolded BatchNorm variance can overflow fp16, measured on a real detector), then
quantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sdk.packager.options import option


@dataclass(frozen=True)
class OptimizeOptions:
    """``optimize``: read by fix_shapes, eliminate_identity, fold_batchnorm, ort_optimize, fp16, ort_format."""

    level: Literal["none", "basic", "extended", "all"] | None = option(
        None,
        description="onnxruntime offline optimization; none also turns the graph clean-ups off (default: "
        "basic, extended when every target is x86 and the build does not quantize)",
    )
    fold_batchnorm: bool = option(True, description="fold BatchNormalization into the Conv before it")
    constant_folding: bool = option(True, description="run onnxruntime's offline optimizer")
    fp16: bool = option(False, description="convert to fp16 keeping fp32 inputs and outputs")
    fixed_shapes: bool | None = option(
        None,
        description="give symbolic input dims size 1 (default: on for "
        "targets whose accelerator needs static shapes: android, apple)",
    )
    ort_format: bool = option(False, description="add the .ort format (model/model.ort) for onnxruntime mobile")

    def graph_pass(self, flag: bool = True) -> bool:
        """Graph clean-ups run unless ``level: none`` or their own flag turns them off."""
        return self.level != "none" and flag
