"""What the quantize pass (:mod:`sdk.packager.passes.quantize`) runs inside the onnxruntime
worker (:mod:`sdk.packager.ort_host`), where sessions are created: onnxruntime.quantization's
pre-processing and quantization (with calibration) in the build's own temp folder, and the
activation capture the search plans from. Split out of the pass's module, which re-exports
these names under their old import path.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from edgepack_core.targets import CPU
from sdk.packager import quant_sensitivity as sensitivity
from sdk.packager.quant_search import QuantConfig


class _Reader:
    """onnxruntime CalibrationDataReader over model-ready feeds."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]) -> None:
        self._iter: Iterator[dict[str, np.ndarray]] = iter(feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._iter, None)


@contextlib.contextmanager
def _working_directory(folder: Path) -> Iterator[None]:
    """onnxruntime's quantization tools drop temp files (sym_shape_infer_temp.onnx, *.data) in
    the current directory: run them inside the build's own temp folder."""
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def quantize_once(model_path: Path, out_path: Path, config: QuantConfig, calibration: list[dict[str, np.ndarray]]
                  ) -> Path:
    from onnxruntime.quantization import (
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    types = {"int8": QuantType.QInt8, "uint8": QuantType.QUInt8}
    extra = {"ActivationSymmetric": config.symmetric_activations, "WeightSymmetric": config.symmetric_weights}
    if config.mode == "dynamic":
        quantize_dynamic(model_path, out_path, op_types_to_quantize=list(config.op_types or ("MatMul", "Gemm")),
                         per_channel=config.per_channel, reduce_range=config.reduce_range,
                         weight_type=types[config.weight_type], nodes_to_exclude=list(config.exclude),
                         extra_options=extra)
    else:
        methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
                   "percentile": CalibrationMethod.Percentile}
        quantize_static(model_path, out_path, _Reader(calibration), quant_format=QuantFormat.QDQ,
                        op_types_to_quantize=list(config.op_types) or None, per_channel=config.per_channel,
                        reduce_range=config.reduce_range, activation_type=types[config.activation_type],
                        weight_type=types[config.weight_type], nodes_to_exclude=list(config.exclude),
                        calibrate_method=methods[config.method], extra_options=extra)
    return out_path


def quantize_in_folder(folder: Path, model_path: Path, out_path: Path, config: QuantConfig,
                       calibration: list[dict[str, np.ndarray]]) -> Path:
    """:func:`quantize_once` with ``folder`` as the working directory. Runs inside the
    onnxruntime worker (calibration creates sessions), where changing directory touches no
    other thread of the build."""
    with _working_directory(folder):
        return quantize_once(model_path, out_path, config, calibration)


def pre_process_in_folder(folder: Path, raw: Path, prepared: Path) -> str | None:
    """onnxruntime's quantization pre-processing (it optimizes with a session: runs inside the
    worker). None when done, else why it was skipped: symbolic shape inference fails on some
    graphs, and the model is then quantized as it is."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    try:
        with _working_directory(folder):
            quant_pre_process(str(raw), str(prepared), auto_merge=True, skip_symbolic_shape=False)
    except Exception as err:  # a tool script's untyped failure: recorded in the report
        return f"{type(err).__name__}: {str(err)[:200]}"
    return None


def profile_activations(fp32_path: Path, qdq_path: Path | None, feeds: list[dict[str, np.ndarray]]
                        ) -> dict[str, Any]:
    """Runs in the worker: every float intermediate tensor's range in the fp32 model and, given
    a QDQ model, each quantized activation's own rounding error (its fp32 value against the same
    value through that tensor's scale and zero point), sample by sample so only one sample's
    tensors are held at a time. ``{"ranges": {tensor: (low, high)}, "errors": {tensor: ErrorTally}}``."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every tensor
    options.log_severity_level = 4
    fp32 = onnx.load(fp32_path)
    session = ort.InferenceSession(sensitivity.with_outputs(fp32, sensitivity.float_tensors(fp32.graph))
                                   .SerializeToString(), options, providers=[CPU])
    params = sensitivity.activation_quantization(onnx.load(qdq_path).graph) if qdq_path is not None else {}
    names = [o.name for o in session.get_outputs()]
    ranges: dict[str, tuple[float, float]] = {}
    errors: dict[str, sensitivity.ErrorTally] = {}
    for feed in feeds:
        values = dict(zip(names, session.run(names, feed), strict=True))
        values.update(feed)  # graph inputs are quantized too
        for name, value in values.items():
            if not (isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.size):
                continue
            low, high = float(np.nanmin(value)), float(np.nanmax(value))
            known = ranges.get(name, (low, high))
            ranges[name] = (min(known[0], low), max(known[1], high))
            if name in params:
                errors.setdefault(name, sensitivity.ErrorTally()).add(value, params[name].round_trip(value))
    return {"ranges": ranges, "errors": errors}
