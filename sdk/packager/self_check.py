"""The inputs a pass checks itself on (ort_optimize's self-check, the graph-pass guard, ...): the
recipe's real validation data whenever it gives some, made-up inputs only when it gives none.

Made-up inputs that set every named dim to 1 a real graph may not run at all (a Reshape to
``[-1, 4]``, a window of 512 samples) or run on a path the real data never takes; the real data
is what the build's validation and the device will see. Without any, the made-up inputs follow
the spec (:func:`sdk.packager.synthetic.synthetic_samples`: an audio frame plus its context, the
image size the resize produces, the recipe's dims, states from init)."""

from __future__ import annotations

import numpy as np

from edgepack_core.errors import PreprocessError
from edgepack_core.manifest import TensorSpec
from sdk.errors import RecipeError
from sdk.packager.data import Feed, context_options, load_samples, synthetic_options
from sdk.packager.passes.base import BuildContext
from sdk.packager.sources import DataSource
from sdk.packager.synthetic import synthetic_samples

REAL = "validation data"
MADE_UP = "made-up inputs"


def real_source(ctx: BuildContext) -> tuple[str, DataSource] | None:
    """The first real data source the recipe gives (validate.data, quantize.calibration,
    golden.data) as (key, source); None when it gives none or only consents to synthetic."""
    recipe = ctx.recipe
    for key, source in (
        ("validate.data", recipe.validate.data),
        ("quantize.calibration", recipe.quantize.calibration),
        ("golden.data", recipe.golden.data),
    ):
        if source is not None and not source.synthetic:
            return key, source
    return None


def made_up_feeds(ctx: BuildContext, count: int) -> list[Feed]:
    """``count`` made-up feeds that follow the recipe's spec and state declarations; none when
    the spec cannot make them (the self-check then says it had nothing to compare on)."""
    try:
        return synthetic_samples(count, ctx.preprocess, ctx.inputs, seed=11, **synthetic_options(ctx)).feeds
    except (RecipeError, PreprocessError, ValueError):
        return []


def check_feeds(
    ctx: BuildContext,
    count: int,
    made_up: list[dict[str, np.ndarray]] | None = None,
    *,
    inputs: list[TensorSpec] | None = None,
) -> tuple[list[dict[str, np.ndarray]], str]:
    """Up to ``count`` feeds of the recipe's real data and ``REAL``; made-up ones (``made_up``,
    else :func:`made_up_feeds`) and ``MADE_UP`` when the recipe gives no real data. Data the
    recipe names but that cannot be read here falls back to them: the validate pass reads it
    again and refuses it with the full message. ``inputs``: the graph's inputs for a pass that
    runs before io_spec (the recipe's preprocessing feeds them)."""
    found = real_source(ctx)
    if found is None:
        return (made_up_feeds(ctx, count) if made_up is None else made_up), MADE_UP
    key, source = found
    try:
        samples = load_samples(
            source,
            ctx.preprocess if inputs is None else ctx.recipe.preprocess,
            ctx.inputs if inputs is None else inputs,
            key=key,
            limit=count,
            **context_options(ctx),
        )
    except (RecipeError, PreprocessError, ValueError):
        samples = None
    feeds = samples.feeds[:count] if samples is not None else []
    if feeds:
        return feeds, REAL
    return (made_up_feeds(ctx, count) if made_up is None else made_up), MADE_UP
