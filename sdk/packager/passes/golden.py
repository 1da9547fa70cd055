"""Golden samples: a few inputs and the packaged model's outputs, for the device smoke test.

A sample whose outputs hold NaN/inf or nothing at all is never signed (the build fails,
naming the sample and the output): a NaN out is almost always a broken model or made-up
input, and an empty output proves nothing. The exceptions are answers the user declared: NaN/inf
in an output the recipe declares ``outputs.NAME.allow_non_finite`` (the agent serves those,
flagged; anywhere else a NaN/inf answer is its 500 ``non_finite_output``, so a golden sample
carrying one would fail every health-window probe), and an empty output that test data's own
expected outputs (``output_*.pb``) state (a reduction over an empty axis); the device's smoke
test compares those position by position.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from edgepack_core.tensor_compare import same_non_finite
from sdk.errors import BuildError, ContractError, RecipeError
from sdk.packager.data import Samples, context_options, load_samples
from sdk.packager.options import option
from sdk.packager.ort_host import run_feeds
from sdk.packager.output_contract import real_contract
from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.sources import DATA_SOURCE_SCHEMA, DataSource

DEFAULT_COUNT = 4
# fp32 on another CPU (arm64 vs x86, other SIMD paths) agrees to ~1e-5; quantized and fp16
# models round differently across kernels and accelerators, so they get a looser default.
DEFAULT_TOLERANCE = {"fp32": (1e-3, 1e-4), "reduced": (1e-2, 5e-2)}


def storable(array: np.ndarray) -> np.ndarray:
    """An array npz can store and ``np.load(allow_pickle=False)`` can read back: strings
    (onnxruntime returns them as object arrays) become fixed-width unicode."""
    if array.dtype.kind in "OS":
        return np.vectorize(lambda v: v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v),
                            otypes=[str])(array) if array.size else array.astype(str)
    return array


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """An .npz of ``arrays``, written member by member: ``np.savez(**arrays)`` would take an
    input named ``file`` (or ``allow_pickle``) as its own argument."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, value in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, storable(np.asarray(value)), allow_pickle=False)
    return buffer.getvalue()


def declared_by_expectation(value: np.ndarray, want: np.ndarray | None) -> bool:
    """True when the test data's expected output says exactly this empty or non-finite answer. Pure."""
    if want is None or value.shape != want.shape:
        return False
    if value.size == 0:
        return True
    return value.dtype.kind in "fc" and want.dtype.kind in "fc" and same_non_finite(value, want)


def unsignable_output(outputs: Mapping[str, np.ndarray], expected: Mapping[str, np.ndarray] | None = None,
                      allowed: frozenset[str] = frozenset()) -> tuple[str, str] | None:
    """(output, why) for the first output a golden sample must not carry, else None. ``allowed``:
    the outputs the recipe declares ``allow_non_finite``. Pure."""
    for name, value in outputs.items():
        if value.size == 0:
            if declared_by_expectation(value, (expected or {}).get(name)):
                continue
            return name, f"is empty (shape {list(value.shape)})"
        if value.dtype.kind in "fc" and name not in allowed and not np.all(np.isfinite(value)):
            bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
            stated = " (as the test data expects)" if declared_by_expectation(value, (expected or {}).get(name)) else ""
            return name, (f"holds {bad} non-finite value(s) (NaN/inf){stated}; where they are answers by design, "
                          f"declare outputs.{name}.allow_non_finite: true (the agent refuses them otherwise)")
    return None


@dataclass(frozen=True)
class GoldenOptions:
    """``golden``: the golden pass's samples and the smoke test's tolerances (None: by the
    precision and the targets)."""

    count: int = option(DEFAULT_COUNT, description="how many golden samples", minimum=1, maximum=64)
    data: DataSource | None = option(None, schema=DATA_SOURCE_SCHEMA, parse=DataSource.from_json)
    rtol: float | None = option(None, description="the smoke test's relative tolerance", minimum=0)
    atol: float | None = option(None, description="the smoke test's absolute tolerance", minimum=0)


@dataclass(frozen=True)
class GoldenSample:
    """One golden sample: the members holding its inputs and the packaged model's outputs."""

    inputs: str
    outputs: str


@dataclass(frozen=True)
class GoldenSet:
    """The golden pass's result: the samples the device's smoke test runs, and its tolerances."""

    samples: tuple[GoldenSample, ...]
    rtol: float
    atol: float

    def to_json(self) -> dict[str, Any]:
        """The manifest's ``golden`` section."""
        return {"samples": [{"inputs": s.inputs, "outputs": s.outputs} for s in self.samples],
                "rtol": self.rtol, "atol": self.atol}


def golden_source(ctx: BuildContext) -> tuple[str, DataSource]:
    """The first of golden.data, validate.data, quantize.calibration the recipe gives."""
    recipe = ctx.recipe
    for key, source in (("golden.data", recipe.golden.data), ("validate.data", recipe.validate.data),
                        ("quantize.calibration", recipe.quantize.calibration)):
        if source is not None:
            return key, source
    raise RecipeError("golden.data", "no data for golden samples: give golden.data or validate.data, or write "
                      "validate: {data: synthetic} to consent to made-up inputs", recipe=str(ctx.recipe.path))


def declare_shape(model: onnx.ModelProto, name: str, shape: Sequence[int | str]) -> None:
    """Write ``shape`` as graph output ``name``'s declared shape (dims by value or by name)."""
    info = next(o for o in model.graph.output if o.name == name)
    dims = info.type.tensor_type.shape
    dims.ClearField("dim")
    for dim in shape:
        entry = dims.dim.add()
        if isinstance(dim, str):
            entry.dim_param = dim
        else:
            entry.dim_value = dim


def settle_output_contract(ctx: BuildContext, feeds: Sequence[Mapping[str, np.ndarray]],
                           results: Sequence[Mapping[str, np.ndarray]], stage: str = "golden") -> dict[str, Any]:
    """Make the shipped graph and the manifest declare what the model really returned on
    ``feeds`` (the validate pass's data, then the golden samples): a stale declared shape would
    be refused by every device's smoke test. The report's entry: the repairs, when any."""
    try:
        outputs, repairs = real_contract(ctx.outputs, ctx.inputs, feeds, results)
    except ContractError as err:
        raise BuildError(stage, str(err)) from err
    model = ctx.require_model()
    for repair in repairs:
        declare_shape(model, repair.output, repair.real)
        ctx.warn(f"output {repair.output} is declared {list(repair.declared)} but the model returns "
                 f"{list(repair.real)}: the shipped graph and the manifest declare the real shape")
    ctx.outputs = outputs
    return {"repaired_outputs": [r.to_json() for r in repairs]} if repairs else {}


@register
class GoldenPass(Pass):
    """Run the final model on a few inputs; store inputs and outputs in the artifact."""

    name = "golden"

    def run(self, ctx: BuildContext) -> None:
        options = ctx.recipe.golden
        count = options.count
        key, source = golden_source(ctx)
        samples: Samples = load_samples(source, ctx.preprocess, ctx.inputs, key=key, limit=count,
                                        **context_options(ctx))
        samples.feeds = samples.feeds[:count]
        outputs = run_feeds(ctx.model_bytes(), samples.feeds)
        precision = ctx.precision()
        # A Jetson runs fp32 models as TensorRT fp16 engines: its smoke test needs the looser
        # tolerance, as quantized models do.
        reduced = precision != "fp32" or "jetson" in ctx.recipe.targets
        rtol, atol = DEFAULT_TOLERANCE["reduced" if reduced else "fp32"]
        constants = {name for name, decl in ctx.recipe.inputs.items() if decl.role == "constant"}
        allowed = frozenset(name for name, decl in ctx.recipe.outputs.items() if decl.allow_non_finite)
        entries = []
        for n, (feed, result) in enumerate(zip(samples.feeds, outputs, strict=True)):
            want = samples.expected[n] if samples.expected and n < len(samples.expected) else None
            bad = unsignable_output(result, want, allowed)
            if bad is not None:
                raise BuildError("golden", f"golden sample {samples.name(n)} ({key}): output {bad[0]} {bad[1]}; "
                                 "it would not be signed: give golden data on which the model answers")
            in_name, out_name = f"golden/{n:03d}.inputs.npz", f"golden/{n:03d}.outputs.npz"
            # Constants stay out of the golden inputs: the agent feeds them from the manifest,
            # so the smoke test proves that path too.
            ctx.files[in_name] = npz_bytes({k: v for k, v in feed.items() if k not in constants})
            ctx.files[out_name] = npz_bytes(result)
            entries.append(GoldenSample(in_name, out_name))
        ctx.golden = GoldenSet(tuple(entries), float(rtol if options.rtol is None else options.rtol),
                               float(atol if options.atol is None else options.atol))
        repaired = settle_output_contract(ctx, samples.feeds, outputs)
        ctx.report[self.name] = {"count": len(entries), "source": "synthetic" if source.synthetic else key,
                                 **repaired}
