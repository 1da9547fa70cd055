"""The quantization search's plan and decisions: which candidates, in which order, for which
target, and whether one may ship. Pure: no onnx, no onnxruntime, no files.

The order is cheapest first, from most of the graph in int8 to least, each stage only when the
one before missed the budget (measured on YOLOv8-style detectors and CTC recognizers, issue 15):

1. the requested settings (static QDQ by default);
2. the same with the output head kept float: the nodes after the last heavy Conv/MatMul/Gemm
   (a detector's decode) and every Concat joining tensors of very different ranges (boxes in
   pixels next to scores in [0, 1]: one uint8 scale rounds every score to 0 or one step);
3. on top of that, the 4, 8, 16 tensors whose quantization loses most signal on the
   calibration data (ranked by ``quant_sensitivity``), each kept float by excluding its producer
   and every consumer (excluding one node leaves its output quantized by the next ones);
4. op-type restricted: static MatMul/Gemm only, static Conv only, dynamic MatMul/Gemm only;
5. fp16, where every target runs it natively (or the recipe sets ``optimize.fp16``).

Calibration-method and per-channel variants were dropped from the automatic search: on the
models measured (``tools/bench/quant_search.py``) none met a budget the stages above missed;
``quantize.method`` / ``per_channel`` still apply to every static candidate.

An int8 candidate ships only when it keeps the accuracy budget *and* runs faster than fp32 by
more than ``quantize.min_speedup`` (default 1.0) on the build host's CPU provider, the proxy for
the target's, judged by :func:`speed_call` on interleaved rounds with an interval and a fixed tie
rule (undecided keeps the float form), so a busy machine does not flip the choice between builds;
fp16 is judged on accuracy alone (the host CPU runs fp16 through casts, which says
nothing of a GPU or NPU that runs it natively).

An int8 candidate's accuracy must also be shown by the data, not only met by its point figures:
each gated figure's 95% interval (:mod:`sdk.packager.evidence`) must clear the budget, else the
build keeps the float form and names how much validation data would decide it. When even a
perfect int8 candidate could not be shown on the data given, the later int8 candidates are not
tried (:func:`evidence_stop`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from sdk.packager.evidence import EvidenceCall, wilson_interval

# Settings each runtime handles best.
PRESETS: dict[str, dict[str, Any]] = {
    # ARM NEON int8 kernels take u8 activations with s8 weights at full range.
    "arm64": {"activation_type": "uint8", "weight_type": "int8", "reduce_range": False},
    # AVX2 without VNNI: u8*s8 products can saturate 16-bit accumulators; 7-bit weights avoid it.
    # s8 activations ran at 0.64x fp32 there (issue 15): u8 activations.
    "x86-avx2": {"activation_type": "uint8", "weight_type": "int8", "reduce_range": True},
    # VNNI accumulates in 32 bits: full range.
    "x86-vnni": {"activation_type": "uint8", "weight_type": "int8", "reduce_range": False},
    # TensorRT wants symmetric s8 QDQ for activations and weights.
    "tensorrt": {"activation_type": "int8", "weight_type": "int8", "reduce_range": False,
                 "symmetric_activations": True, "symmetric_weights": True, "per_channel": True},
}
# The preset of each target's runtime; x86 depends on the CPU (see :func:`x86_preset`).
TARGET_PRESETS: dict[str, str] = {"rpi": "arm64", "android": "arm64", "apple": "arm64", "jetson": "tensorrt"}
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})
# When targets want different presets, one artifact must run right on all of them: TensorRT
# takes only symmetric s8, and AVX2 needs 7-bit weights; full-range u8/s8 is the rest.
_PRESET_PRIORITY = ("tensorrt", "x86-avx2", "arm64", "x86-vnni")
# Targets whose providers run fp16 natively (TensorRT/CUDA, CoreML, NNAPI). A Pi's CPU provider
# and x86's run fp16 graphs through Cast nodes, slower than fp32.
FP16_TARGETS = frozenset({"jetson", "apple", "android"})

ACTIVATION_ERROR_STEPS = (4, 8, 16)
HEAVY_OP_TYPES = ("MatMul", "Gemm")
DEFAULT_MAX_CANDIDATES = 10
DEFAULT_MAX_SEARCH_S = 900.0
DEFAULT_MIN_SPEEDUP = 1.0


@dataclass(frozen=True)
class QuantConfig:
    """The settings of one onnxruntime quantization call."""

    mode: str                      # dynamic | static
    method: str = "minmax"         # minmax | entropy | percentile
    per_channel: bool = True
    activation_type: str = "uint8"
    weight_type: str = "int8"
    reduce_range: bool = False
    symmetric_activations: bool = False
    symmetric_weights: bool = True
    op_types: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def describe(self) -> dict[str, Any]:
        return {"mode": self.mode, "method": self.method, "per_channel": self.per_channel,
                "activation_type": self.activation_type, "weight_type": self.weight_type,
                "reduce_range": self.reduce_range, "op_types": list(self.op_types),
                "excluded_nodes": list(self.exclude)}


@dataclass(frozen=True)
class Candidate:
    """One model the search builds and judges. ``kept_float`` says why nodes stay float:
    ``(reason, names)`` pairs, reason one of ``recipe`` (exclude_nodes), ``head``,
    ``wide-range concat``, ``activation error`` (tensors, worst first)."""

    kind: Literal["int8", "fp16"]
    stage: str                             # requested | float head | activation error | op types | fp16
    config: QuantConfig | None = None      # None for fp16
    kept_float: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def brief(self) -> str:
        """The candidate in a few words for the progress line."""
        if self.config is None:
            return "fp16"
        config = self.config
        parts = [config.mode, config.method if config.mode == "static" else "",
                 "per-channel" if config.per_channel else "per-tensor"]
        if config.op_types:
            parts.append("/".join(config.op_types) + " only")
        words = {"recipe": "{} recipe node(s)", "head": "head", "wide-range concat": "{} wide-range concat(s)",
                 "activation error": "{} worst tensor(s)"}
        floats = [words[reason].format(len(names)) for reason, names in self.kept_float]
        if floats:
            parts.append(", ".join(floats) + " float")
        return " ".join(p for p in parts if p)

    def describe(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": self.kind, "stage": self.stage}
        if self.config is not None:
            doc.update(self.config.describe())
        doc["kept_float"] = {reason: list(names) for reason, names in self.kept_float}
        return doc


@dataclass(frozen=True)
class GraphFacts:
    """What the later stages are planned from, measured after the first candidate.

    ``head``: head node names; ``wide_concats``: Concat output tensors joining very different
    ranges; ``ranked``: quantized tensors, most signal lost first; ``float_nodes``: for each
    of those tensors, the nodes that keep it float (producer and consumers); ``op_types``: the
    quantizable op types the graph has; ``fp16``: whether fp16 is a candidate; ``heavy``: the
    Conv/MatMul/Gemm nodes by name, with their op type (a candidate that keeps all of its op
    types' heavy nodes float quantizes nothing worth having and is not tried)."""

    head: tuple[str, ...] = ()
    wide_concats: tuple[str, ...] = ()
    ranked: tuple[str, ...] = ()
    float_nodes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    op_types: frozenset[str] = frozenset()
    fp16: bool = False
    heavy: Mapping[str, str] = field(default_factory=dict)


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` text (x86 ``flags``, ARM ``Features``)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return frozenset(flags)


def x86_preset(flags: Iterable[str]) -> str:
    """``x86-vnni`` when the CPU has VNNI (AVX512-VNNI or AVX-VNNI), else ``x86-avx2``."""
    return "x86-vnni" if VNNI_FLAGS & set(flags) else "x86-avx2"


def preset_for_targets(targets: Sequence[str], cpu_flags: Iterable[str]) -> tuple[str, str]:
    """The preset for a recipe that names none, and why (one phrase for the report): each
    target's runtime (rpi/android/apple -> arm64, jetson -> tensorrt, x86 -> the build host's
    CPU, VNNI or not); targets that disagree get the one every one of them runs right."""
    flags = frozenset(cpu_flags)
    wanted = {target: TARGET_PRESETS.get(target) or x86_preset(flags) for target in targets or ["x86"]}
    chosen = min(wanted.values(), key=_PRESET_PRIORITY.index)
    parts = [f"{target} -> {preset}" + (" (build host " + ("with" if VNNI_FLAGS & flags else "without") + " VNNI)"
                                        if target == "x86" else "") for target, preset in wanted.items()]
    why = f"derived from targets: {', '.join(parts)}"
    if len(set(wanted.values())) > 1:
        why += f"; {chosen} runs right on all of them"
    return chosen, why


def fp16_wanted(targets: Sequence[str], recipe_fp16: bool) -> bool:
    """fp16 is a candidate when every target runs it natively, or the recipe says so
    (``optimize.fp16: true``)."""
    return recipe_fp16 or (bool(targets) and set(targets) <= FP16_TARGETS)


def _merge(*groups: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted({name for group in groups for name in group}))


def later_candidates(first: Candidate, facts: GraphFacts) -> list[Candidate]:
    """The candidates after ``first`` (the requested settings), in search order, without
    duplicates. Each keeps the recipe's own exclusions; stages after the float head keep it."""
    assert first.config is not None
    base = first.config
    recipe = tuple(base.exclude)
    kept: list[tuple[str, tuple[str, ...]]] = [("recipe", recipe)] if recipe else []
    wide_nodes = _merge(*(facts.float_nodes.get(t, ()) for t in facts.wide_concats))
    if facts.head:
        kept.append(("head", facts.head))
    if facts.wide_concats:
        kept.append(("wide-range concat", facts.wide_concats))
    head_exclude = _merge(recipe, facts.head, wide_nodes)
    plan: list[Candidate] = [Candidate("int8", "float head", replace(base, exclude=head_exclude), tuple(kept))]
    if base.mode == "static":
        # Tensors the float head already keeps float (every node around them excluded) are
        # not counted: each step adds that many more.
        ranked = [t for t in facts.ranked if not set(facts.float_nodes.get(t, ())) <= set(head_exclude)]
        for count in ACTIVATION_ERROR_STEPS:
            if count >= len(ranked):
                break  # some ranked tensors stay quantized, or it is the float-head candidate again
            worst = tuple(ranked[:count])
            exclude = _merge(head_exclude, *(facts.float_nodes.get(t, ()) for t in worst))
            plan.append(Candidate("int8", "activation error", replace(base, exclude=exclude),
                                  (*kept, ("activation error", worst))))
    plan.extend(_op_type_candidates(base, facts, head_exclude, tuple(kept)))
    if facts.fp16:
        plan.append(Candidate("fp16", "fp16"))
    return [c for c in _unique(first, plan) if _quantizes_something(c, facts.heavy)]


def _op_type_candidates(base: QuantConfig, facts: GraphFacts, exclude: tuple[str, ...],
                        kept: tuple[tuple[str, tuple[str, ...]], ...]) -> list[Candidate]:
    """Static MatMul/Gemm only and static Conv only (where the graph has both kinds, else
    they equal an earlier candidate), dynamic MatMul/Gemm only (no calibration at all)."""
    dense = tuple(t for t in HEAVY_OP_TYPES if t in facts.op_types)
    plan: list[Candidate] = []
    if base.mode == "static":
        if dense and "Conv" in facts.op_types:
            plan.append(Candidate("int8", "op types", replace(base, op_types=dense, exclude=exclude), kept))
            plan.append(Candidate("int8", "op types", replace(base, op_types=("Conv",), exclude=exclude), kept))
        if dense:  # onnxruntime's dynamic quantizer takes Gemm only when MatMul is named too
            dynamic = replace(base, mode="dynamic", op_types=HEAVY_OP_TYPES, exclude=exclude, method="minmax")
            plan.append(Candidate("int8", "op types", dynamic, kept))
    return plan


def _quantizes_something(candidate: Candidate, heavy: Mapping[str, str]) -> bool:
    """False for an int8 candidate that keeps every heavy node it could quantize float."""
    if candidate.config is None or not heavy:
        return True
    kinds = set(candidate.config.op_types) or set(heavy.values())
    return any(op in kinds and name not in candidate.config.exclude for name, op in heavy.items())


def _unique(first: Candidate, plan: list[Candidate]) -> list[Candidate]:
    seen = {(first.kind, first.config)}
    unique = []
    for candidate in plan:
        key = (candidate.kind, candidate.config)
        if key not in seen:
            seen.add(key)
            unique.append(candidate)
    return unique


@dataclass(frozen=True)
class Verdict:
    ships: bool
    accuracy_met: bool
    word: str  # meets the budget | misses the budget | is not faster than fp32


@dataclass(frozen=True)
class SpeedCall:
    """The speed gate's call on paired, interleaved timing rounds: ``speedup`` is the median of
    the rounds' fp32/candidate ratios, ``low``/``high`` the lowest and highest ratio (a
    distribution-free interval on the median: with n rounds it holds it with probability
    1 - 2/2**n, 98% for the pass's 7), ``call`` faster | slower | undecided against the line."""

    speedup: float
    low: float
    high: float
    call: Literal["faster", "slower", "undecided"]

    @property
    def faster(self) -> bool:
        """Undecided counts as not faster (the tie rule): int8 ships on speed only when every
        round clears the line, so a gain near ``min_speedup`` keeps the float form in every build."""
        return self.call == "faster"


def speed_call(fp32_s: Sequence[float], candidate_s: Sequence[float], min_speedup: float) -> SpeedCall:
    """Whether a candidate runs faster than fp32 by more than ``min_speedup``, judged on rounds
    timed side by side (round i of each model back to back, so a load spike hits both): "faster"
    only when the interval's lower bound is above the line, "slower" only when its upper bound is
    at or below it, "undecided" in between. A candidate with no time is slower."""
    ratios = sorted(f / c if c > 0 else 0.0 for f, c in zip(fp32_s, candidate_s, strict=True))
    if not ratios:
        return SpeedCall(0.0, 0.0, 0.0, "slower")
    middle = len(ratios) // 2
    median = ratios[middle] if len(ratios) % 2 else (ratios[middle - 1] + ratios[middle]) / 2
    low, high = ratios[0], ratios[-1]
    call: Literal["faster", "slower", "undecided"] = (
        "faster" if low > min_speedup else "slower" if high <= min_speedup else "undecided")
    return SpeedCall(round(median, 3), round(low, 3), round(high, 3), call)


def verdict(kind: str, accuracy_met: bool, speed: SpeedCall, decided: bool = True) -> Verdict:
    """Whether one judged candidate may ship: it keeps the accuracy budget, for int8 with the
    validation data showing it (``decided``: every gated figure's 95% interval clears its limit,
    :mod:`sdk.packager.evidence`), and, for int8, the speed gate calls it faster than fp32 by
    more than ``min_speedup`` (0 lets any speed through)."""
    if not accuracy_met:
        return Verdict(False, False, "misses the budget")
    if kind == "int8" and not decided:
        return Verdict(False, True, "meets the budget on too little validation data to show it")
    if kind == "int8" and not speed.faster:
        why = "is not faster than fp32" if speed.call == "slower" else "is not clearly faster than fp32"
        return Verdict(False, True, f"meets the budget but {why}")
    return Verdict(True, True, "meets the budget")


def fallback_reason(entries: Sequence[Mapping[str, Any]], min_speedup: float, stopped: str | None) -> str:
    """Why the build ships fp32, in one line, from the report entries of the candidates tried."""
    int8 = [e for e in entries if e.get("kind") == "int8" and "error" not in e]
    met = [e for e in int8 if e.get("budget_met") and e.get("quantized_nodes")]
    kept = [e for e in met if e.get("decided", True)]
    if int8 and not any(e.get("quantized_nodes") for e in int8):
        why = "quantization changed no node of the graph (nothing it quantizes is there)"
    elif met and not kept:
        why = f"int8 kept the accuracy budget on too little validation data to show it: {met[0].get('evidence')}"
    elif kept:
        best = max(kept, key=lambda e: e.get("speedup", 0.0))
        why = (f"int8 kept the accuracy budget but was not faster than fp32 on the build host's CPU provider, "
               f"the proxy for the target's (best {best.get('speedup', 0.0):.2f}x, quantize.min_speedup "
               f"{min_speedup:g})")
    else:
        last = entries[-1] if entries else {}
        why = f"quantization could not meet the accuracy budget ({last.get('why', last.get('error', 'no candidate'))})"
    if stopped:
        why += f"; search stopped: {stopped}"
    return why + "; shipping fp32"


def evidence_stop(met: bool, calls: Sequence[EvidenceCall]) -> str | None:
    """Why no later int8 candidate is worth trying after one judged with ``calls``, or None: it
    met the budget (``met``) but the data could not show it, and a Wilson share would stay
    undecided even with every one of its n right. The same data judges every candidate, so a
    later one cannot do better than perfect."""
    if not met:
        return None
    for call in calls:
        if call.decided or call.evidence.method != "wilson":
            continue
        n = call.evidence.n
        low, high = wilson_interval(n, n) if call.side == "at least" else wilson_interval(0, n)
        if (low < call.budget) if call.side == "at least" else (high > call.budget):
            return f"no int8 candidate can show {call.evidence.name} on {n} {call.evidence.unit}"
    return None


def search_stop(tried: int, elapsed_s: float, max_candidates: int, max_search_s: float) -> str | None:
    """Why the search stops before its next candidate, or None. The first always runs."""
    if tried >= max_candidates:
        return f"quantize.max_candidates {max_candidates} reached"
    if tried and elapsed_s >= max_search_s:
        return f"quantize.max_search_s {max_search_s:g} s spent ({elapsed_s:.0f} s)"
    return None
