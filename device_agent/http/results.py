"""The JSON shape of a prediction: the ``predict --json`` object that ``/predict`` answers
(docs/agent.md, "One-shot predict"), decided here and nowhere else; the runtime returns a typed
``PredictResult``. Pure (no web framework: the one-shot ``predict`` prints the same object)."""

from __future__ import annotations

from typing import Any

from device_agent.prediction import PredictResult


def includes_outputs(result: PredictResult, outputs: bool | None) -> bool:
    """Whether the answer carries the raw outputs: as asked, else when there is no task result
    (``postprocess: raw``, or postprocessing skipped): a detector's raw head is about 1 MB of
    JSON per image that the result already says."""
    return result.result is None if outputs is None else outputs


def prediction_json(result: PredictResult, *, outputs: bool | None = None) -> dict[str, Any]:
    """The answer object: model, provider and fallbacks, the raw outputs when
    :func:`includes_outputs`, the task result, for a detector the geometry that maps
    model-input pixels to the original image's, ``non_finite_outputs`` when outputs the recipe
    allows to (``allow_non_finite``) hold NaN/inf (absent otherwise), and the latency."""
    model = result.model
    answer: dict[str, Any] = {
        "model": {"name": model.manifest.name, "version": model.manifest.version},
        "provider": model.provider,
        "provider_fallbacks": model.fallbacks_json(),
    }
    if includes_outputs(result, outputs):
        answer["outputs"] = {name: value.tolist() for name, value in result.outputs.items()}
    answer["result"] = result.result
    if result.geometry is not None and model.postprocessor.kind == "detection":
        answer["geometry"] = result.geometry
    if result.non_finite:
        answer["non_finite_outputs"] = list(result.non_finite)
    answer["latency_ms"] = latency_ms(result)
    return answer


def latency_ms(result: PredictResult) -> float:
    return round(result.latency_s * 1000, 3)


def npz_headers(result: PredictResult) -> dict[str, str]:
    """What an npz answer (the exact outputs only) says of its model, provider, latency and
    allowed outputs holding NaN/inf (comma-separated, only when any do)."""
    manifest = result.model.manifest
    headers = {"X-Edgepack-Model": f"{manifest.name} {manifest.version}", "X-Edgepack-Provider": result.model.provider,
               "X-Edgepack-Latency-Ms": str(latency_ms(result))}
    if result.non_finite:
        headers["X-Edgepack-Non-Finite-Outputs"] = ",".join(result.non_finite)
    return headers
