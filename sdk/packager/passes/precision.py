"""The ``precision`` pass: what a model that came quantized holds in int8 and in float
(``quant_facts``), so a manifest's ``int8`` comes with its split (``int8``, or ``mixed`` with the
float ops named). A build's own int8 is described by the quantize pass's report instead."""

from __future__ import annotations

from sdk.packager.passes.base import BuildContext, Pass, register
from sdk.packager.quant_facts import quant_facts


@register
class PrecisionPass(Pass):
    """Records, for a graph quantized before the build, its int8/float split."""

    name = "precision"

    def applies(self, ctx: BuildContext) -> bool:
        return ctx.lossy is None

    def run(self, ctx: BuildContext) -> None:
        facts = quant_facts(ctx.require_model())
        if facts.precision is not None:
            ctx.report[self.name] = {**facts.to_json(), "quantized_by": "the model"}
