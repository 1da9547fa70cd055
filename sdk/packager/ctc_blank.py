"""A CTC ``blank`` checked against the output it names (pure decisions).

Why: greedy CTC decoding drops the blank and collapses repeats, so a wrong blank index decodes
every validation string wrong without a word. Two checks: the blank must index the class axis
(the last one in both layouts), and it must behave as a blank on the validation data. The
rule, robust to any charset: a CTC model emits its blank on most frames (between and around
characters), so when the declared blank is the argmax of no frame at all while one other class
is the argmax of at least half of all frames, that class is the likely blank and the
declaration is refused naming it (judged on at least MIN_FRAMES frames). A model that emits a
character on most frames but the blank on some is left alone."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DOMINANT_SHARE = 0.5  # a class that is the argmax of at least this share of frames acts as the blank
MIN_FRAMES = 32  # fewer validation frames are no evidence of which class is the blank


def blank_range_problem(blank: int, classes: int, output: str) -> str | None:
    """The blank must index ``output``'s class axis of ``classes`` entries."""
    if 0 <= blank < classes:
        return None
    return f"blank {blank} is outside the class axis of output {output} ({classes} classes: 0..{classes - 1})"


def argmax_counts(outputs: Sequence[np.ndarray]) -> np.ndarray:
    """Per class, on how many frames (rows along the last axis) it is the argmax."""
    classes = int(np.shape(outputs[0])[-1])
    counts = np.zeros(classes, np.int64)
    for output in outputs:
        frames = np.asarray(output).reshape(-1, classes)
        counts += np.bincount(np.argmax(frames, axis=1), minlength=classes)[:classes]
    return counts


def likely_blank_problem(blank: int, outputs: Sequence[np.ndarray], output: str) -> str | None:
    """Refusal naming the likely blank, by the module's rule; None when ``blank`` may be it."""
    if not outputs or any(np.shape(o)[-1] != np.shape(outputs[0])[-1] for o in outputs):
        return None
    counts = argmax_counts(outputs)
    frames = int(counts.sum())
    if frames < MIN_FRAMES or not 0 <= blank < counts.size or counts[blank] > 0:
        return None
    rival = int(np.argmax(counts))
    if counts[rival] < DOMINANT_SHARE * frames:
        return None
    return (f"blank {blank} is the argmax of none of the {frames} frames of output {output} on the validation "
            f"data, while class {rival} is the argmax of {int(counts[rival])} of them, as a CTC blank is: "
            f"declare blank: {rival}")
