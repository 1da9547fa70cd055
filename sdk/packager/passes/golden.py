"""Golden samples: a few inputs and the packaged model's outputs, for the device smoke test."""

from __future__ import annotations

import io

import numpy as np

from sdk.packager.data import Samples, load_samples, synthetic_samples
from sdk.packager.ort_host import run_feeds
from sdk.packager.passes.base import BuildContext, Pass, register

DEFAULT_COUNT = 4
# fp32 on another CPU (arm64 vs x86, other SIMD paths) agrees to ~1e-5; quantized and fp16
# models round differently across kernels and accelerators, so they get a looser default.
DEFAULT_TOLERANCE = {"fp32": (1e-3, 1e-4), "reduced": (1e-2, 5e-2)}


def npz_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


@register
class GoldenPass(Pass):
    """Run the final model on a few inputs; store inputs and outputs in the artifact."""

    name = "golden"
    section = "golden"

    def run(self, ctx: BuildContext) -> None:
        options = self.options(ctx)
        count = int(options.get("count", DEFAULT_COUNT))
        samples = self._inputs(ctx, count)
        outputs = run_feeds(ctx.model_bytes(), samples.feeds)
        precision = ctx.manifest_extra.get("precision", "fp32")
        # A Jetson runs fp32 models as TensorRT fp16 engines: its smoke test needs the looser
        # tolerance, as quantized models do.
        reduced = precision != "fp32" or "jetson" in ctx.recipe.targets
        rtol, atol = DEFAULT_TOLERANCE["reduced" if reduced else "fp32"]
        entries = []
        for n, (feed, result) in enumerate(zip(samples.feeds, outputs, strict=True)):
            in_name, out_name = f"golden/{n:03d}.inputs.npz", f"golden/{n:03d}.outputs.npz"
            ctx.files[in_name] = npz_bytes(feed)
            ctx.files[out_name] = npz_bytes(result)
            for name, value in result.items():
                if not np.all(np.isfinite(value)):
                    ctx.warn(f"golden sample {n}: output {name} is not finite")
            entries.append({"inputs": in_name, "outputs": out_name})
        ctx.manifest_extra["golden"] = {
            "samples": entries,
            "rtol": float(options.get("rtol", rtol)),
            "atol": float(options.get("atol", atol)),
        }
        ctx.report[self.name] = {"count": len(entries), "source": self._source_name(ctx)}

    @staticmethod
    def _source_name(ctx: BuildContext) -> str:
        for section, key in (("golden", "data"), ("validate", "data"), ("quantize", "calibration")):
            if key in ctx.recipe.section(section):
                return f"{section}.{key}"
        return "synthetic"

    def _inputs(self, ctx: BuildContext, count: int) -> Samples:
        for section, key in (("golden", "data"), ("validate", "data"), ("quantize", "calibration")):
            source = ctx.recipe.section(section).get(key)
            if source:
                return load_samples(source, ctx.preprocess, ctx.inputs, key=f"{section}.{key}", limit=count)
        return synthetic_samples(count, ctx.preprocess, ctx.inputs)
