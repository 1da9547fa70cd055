"""The artifact's size rule (pure): the model members stay within ``SIZE_RATIO`` of the model
the user gave, else the build warns naming what grew and which pass grew it.

Golden samples and assets are the recipe's own data and are not counted against the model. A
pre-quantized model folded back to float (4x), an ``.ort`` copy next to the ``.onnx`` (2x) or a
lowered preprocessing step are each legitimate only when the build says so.
"""

from __future__ import annotations

from collections.abc import Mapping

SIZE_RATIO = 1.1
# Graph metadata a build adds whatever the model's size (shape inference's value_info, opset
# imports, names): 414 bytes on a 1,379-byte model, which the ratio alone would call a growth.
SIZE_SLACK = 16 * 1024
MODEL_PREFIX = "model/"
MODEL_ONNX = "model/model.onnx"


def growth_by_pass(sizes: Mapping[str, int]) -> dict[str, int]:
    """Bytes each pass added to the model, from the sizes after each pass in order (the
    first pass that loaded the model is the baseline). Only passes that grew it."""
    growth: dict[str, int] = {}
    previous: int | None = None
    for name, size in sizes.items():
        if previous is not None and size > previous:
            growth[name] = size - previous
        previous = size
    return growth


def _onnx_finding(original: int, size: int, growth: Mapping[str, int]) -> str:
    why = ", ".join(f"{name} +{grew:,} bytes" for name, grew in growth.items()) or "no pass grew it alone"
    return (
        f"{MODEL_ONNX} is {size:,} bytes, {size / max(original, 1):.2f}x the model's {original:,} "
        f"(more than {SIZE_RATIO:g}x + {SIZE_SLACK:,}): grown by {why}"
    )


def size_findings(original: int, members: Mapping[str, int], *, growth: Mapping[str, int]) -> list[str]:
    """Warnings for model members (``model/...``) above ``SIZE_RATIO`` x ``original`` bytes
    (plus ``SIZE_SLACK``) in all, each naming why; ``[]`` at or under the limit. ``growth``:
    bytes added per pass."""
    limit = SIZE_RATIO * original + SIZE_SLACK
    model_members = {name: size for name, size in members.items() if name.startswith(MODEL_PREFIX)}
    if sum(model_members.values()) <= limit:
        return []
    findings = []
    size = model_members.get(MODEL_ONNX, 0)
    if size > limit:
        findings.append(_onnx_finding(original, size, growth))
    copies = {name: size for name, size in model_members.items() if name != MODEL_ONNX}
    if copies:
        findings.append(
            f"{', '.join(sorted(copies))} add {sum(copies.values()):,} bytes next to {MODEL_ONNX} "
            f"(the model's {original:,} bytes ship more than once: optimize.ort_format)"
        )
    return findings
