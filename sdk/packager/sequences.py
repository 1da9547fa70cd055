"""Stateful models on stream data, run as the agent runs them.

The agent feeds a model's ``role: state`` inputs from the outputs of the stream's previous call
(init on its first), so on a device a state carries every error of the frames before it. A
check that feeds every frame the init state (zeros) never sees that: a quantized recurrence
with a slightly wrong gain agrees with fp32 on each frame from zeros and drifts away from it
over a file's frames. And static int8 calibration fed only zeros for a state input measures a
range of 0 for it, so the quantized model cannot represent any real state.

So where the samples are sequences (an ``{audio: DIR}`` source: each WAV file's frames, in
order; :attr:`sdk.packager.data.Samples.sequences`) and the model has state inputs:

- :func:`run_samples` runs every model free-running: each carries its own state across the
  frames of each file (the fp32 reference and a candidate alike), and the outputs are compared
  frame by frame;
- :func:`calibration_feeds` gives calibration the state the fp32 model itself produces over
  each file's frames (frame k's state input is the fp32 state output after frame k-1).

Other samples (npz, test data, images, synthetic) stand alone: every one starts from init,
exactly as before.
"""

from __future__ import annotations

import numpy as np

from sdk.packager.data import Feed, Samples, carried_feeds
from sdk.packager.ort_host import run_feeds


def run_samples(model: bytes | str, samples: Samples, *, label: str | None = None) -> list[dict[str, np.ndarray]]:
    """The model's outputs on every sample, in order: free-running over each sequence when the
    samples are sequential (the state the model itself computed carried from frame to frame),
    each sample on its own otherwise."""
    if not samples.sequential:
        return run_feeds(model, samples.feeds, label=label)
    return run_feeds(model, samples.feeds, label=label, carry=samples.carry, resets=samples.starts())


def calibration_feeds(model: bytes | str, samples: Samples, *, label: str | None = None) -> list[Feed]:
    """The feeds static calibration should see: with sequential samples, each frame's state
    inputs set to the state ``model`` (the fp32 one) carries into it over the file's frames;
    the samples' own feeds otherwise (no model run)."""
    if not samples.sequential:
        return list(samples.feeds)
    return carried_feeds(samples, run_samples(model, samples, label=label))
