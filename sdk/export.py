"""Export a ``torch.nn.Module`` to ONNX the way users should and often do not.

What it takes care of: eval mode is forced (dropout and BatchNorm statistics otherwise leak
training behaviour into the graph), the batch axis is dynamic, opset 17 by default, and the
exported model is checked against PyTorch's own outputs on the same input (max abs diff at
most 1e-5 for fp32) before anything else happens. torch stays optional: without it the
caller gets one clear error.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sdk.errors import BuildError, RecipeError

DEFAULT_OPSET = 17
MAX_ABS_DIFF = 1e-5


def _torch() -> Any:
    try:
        import torch
    except ImportError as err:
        raise BuildError("export_pytorch", "PyTorch is not installed: pip install torch (a CPU build is enough), "
                                           "or give model.path to an .onnx file") from err
    return torch


def load_factory(spec: str) -> Any:
    """``package.module:callable`` -> the callable."""
    module_name, _, attribute = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
        return getattr(module, attribute)
    except (ImportError, AttributeError) as err:
        raise RecipeError("model.pytorch.factory", f"cannot import {spec}: {err}") from err


def export_pytorch(module: Any, input_shape: Sequence[int], path: Path, *, opset: int = DEFAULT_OPSET,
                   input_name: str = "input", output_names: Sequence[str] = ("output",),
                   dynamic_batch: bool = True, seed: int = 0) -> dict[str, Any]:
    """Export ``module`` to ``path``; return a report with the check against PyTorch."""
    torch = _torch()
    import onnxruntime as ort

    module.eval()
    generator = torch.Generator().manual_seed(seed)
    example = torch.randn(*input_shape, generator=generator)
    axes = {input_name: {0: "batch"}, **{name: {0: "batch"} for name in output_names}} if dynamic_batch else None
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        expected = module(example)
        try:
            torch.onnx.export(module, (example,), str(path), opset_version=opset, input_names=[input_name],
                              output_names=list(output_names), dynamic_axes=axes, dynamo=False)
        except Exception as err:  # torch.onnx raises many unrelated types
            raise BuildError("export_pytorch", f"torch.onnx.export failed: {str(err).splitlines()[0]}") from err
    expected_list = [expected] if not isinstance(expected, (tuple, list)) else list(expected)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {input_name: example.numpy()})
    worst = max(float(np.max(np.abs(g - e.numpy()))) for g, e in zip(got, expected_list, strict=True))
    if worst > MAX_ABS_DIFF:
        raise BuildError("export_pytorch", f"the exported model differs from PyTorch by {worst:.3g} "
                                           f"(limit {MAX_ABS_DIFF:g})")
    if dynamic_batch and input_shape[0] == 1:
        batch = torch.randn(2, *input_shape[1:], generator=generator)
        with torch.no_grad():
            reference = module(batch)
        reference = reference[0] if isinstance(reference, (tuple, list)) else reference
        second = session.run(None, {input_name: batch.numpy()})[0]
        if second.shape[0] != 2 or float(np.max(np.abs(second - reference.numpy()))) > MAX_ABS_DIFF:
            raise BuildError("export_pytorch", "the exported model does not handle a batch of 2")
    return {"opset": opset, "max_abs_diff_vs_torch": worst, "torch": torch.__version__, "dynamic_batch": dynamic_batch}
