"""Probes for the health window: the model's golden samples replayed through the live service.

Apart from :mod:`device_agent.updates.health`, which stays pure: this reads the samples from
the store and runs them, the same path users' requests take."""

from __future__ import annotations

import numpy as np

from device_agent.runtime import InferenceService, LoadedModel
from device_agent.smoke import compare_outputs
from device_agent.updates.health import Probes
from edgepack_core.errors import EdgepackError

MAX_PROBES = 16
"""Golden samples replayed at most, whatever the manifest holds."""


def probe(service: InferenceService, model: LoadedModel) -> Probes:
    """Replay the first :data:`MAX_PROBES` golden samples of ``model`` through ``service``."""
    golden = model.manifest.golden
    samples = list(golden.get("samples", []))[:MAX_PROBES]
    rtol, atol = float(golden.get("rtol", 1e-3)), float(golden.get("atol", 1e-4))
    failed, first = 0, ""
    for index, sample in enumerate(samples):
        try:
            with np.load(model.root / sample["inputs"], allow_pickle=False) as archive:
                inputs = {name: archive[name] for name in archive.files}
            with np.load(model.root / sample["outputs"], allow_pickle=False) as archive:
                expected = {name: archive[name] for name in archive.files}
            result = service.predict_tensors(inputs, postprocess=True)
            problem, _ = compare_outputs(result.outputs, expected, model.manifest.outputs, rtol=rtol, atol=atol)
        except (EdgepackError, OSError, ValueError) as err:
            problem = f"probe {index} failed: {str(err)[:200]}"
        if problem:
            failed += 1
            first = first or f"sample {index}: {problem}"
    return Probes(sent=len(samples), failed=failed, first_problem=first)
