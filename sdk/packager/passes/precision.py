"""The ``precision`` pass: what the final graph holds in int8 and in float (``quant_facts``),
so a manifest's ``int8`` comes with its split (``int8``, or ``mixed`` with the float ops named)."""

from __future__ import annotations

from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.quant_facts import quant_facts


@register
class PrecisionPass(Pass):
    """Records the manifest's precision and, for a quantized graph, its int8/float split."""

    name = "precision"

    def run(self, ctx: BuildContext) -> None:
        facts = quant_facts(ctx.require_model())
        ctx.report[self.name] = {**facts.to_json(), "precision": ctx.precision(),
                                 "quantized_by": "quantize" if ctx.lossy == "int8" else
                                 ("the model" if facts.precision else None)}
