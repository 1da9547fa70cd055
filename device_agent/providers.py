"""Execution provider choice (pure) and session creation with fallback (I/O).

``choose_providers`` is a pure function of (profile, the providers this onnxruntime build
has, the model): it returns the ordered list to try, each with its options, and the ones it
skipped with the reason. ``create_session`` walks that list: a provider that fails to create
a session (a missing CUDA library, an op NNAPI cannot take) is logged with the reason and
the next one is tried; CPU always ends the list. What was really used is reported, because
asking onnxruntime for XNNPACK on a build without it silently gives CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from device_agent.errors import ProviderError
from edgepack_core.targets import CPU, PROFILES

log = logging.getLogger("edgepack.agent.providers")

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
XNNPACK = "XnnpackExecutionProvider"
NNAPI = "NnapiExecutionProvider"
COREML = "CoreMLExecutionProvider"


@dataclass(frozen=True)
class ModelTraits:
    """What about a model affects provider choice."""

    precision: str = "fp32"  # fp32 | fp16 | int8
    static_shapes: bool = False
    targets: Sequence[str] = ()


@dataclass(frozen=True)
class ProviderChoice:
    name: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ProviderPlan:
    """The providers to try in order, and those skipped with a reason."""

    choices: list[ProviderChoice]
    skipped: list[tuple[str, str]]


def provider_options(name: str, *, threads: int, cache_dir: Path | None, traits: ModelTraits) -> dict[str, Any]:
    """Options per provider, chosen for edge devices."""
    if name == XNNPACK:
        # XNNPACK runs its own thread pool; size it like the CPU pool (0 = onnxruntime default).
        return {"intra_op_num_threads": str(threads)} if threads else {}
    if name == TENSORRT:
        options: dict[str, Any] = {"trt_fp16_enable": "True" if traits.precision != "int8" else "False",
                                   "trt_int8_enable": "True" if traits.precision == "int8" else "False"}
        if cache_dir is not None:
            # Building a TensorRT engine takes minutes on a Jetson; cache it next to the model.
            options.update({"trt_engine_cache_enable": "True", "trt_engine_cache_path": str(cache_dir / "tensorrt"),
                            "trt_timing_cache_enable": "True"})
        return options
    if name == CUDA:
        return {"device_id": "0", "cudnn_conv_algo_search": "HEURISTIC"}
    if name == NNAPI:
        # fp16 relaxes precision beyond what golden samples allow; CPU fallback inside NNAPI is
        # slower than onnxruntime's own CPU provider, so let onnxruntime handle those nodes.
        return {"NNAPI_FLAG_CPU_DISABLED": "1"}
    if name == COREML:
        options = {"ModelFormat": "MLProgram", "MLComputeUnits": "ALL"}
        if cache_dir is not None:
            options["ModelCacheDirectory"] = str(cache_dir / "coreml")
        return options
    return {}


def choose_providers(
    profile: str,
    available: Sequence[str],
    traits: ModelTraits = ModelTraits(),
    *,
    threads: int = 0,
    cache_dir: Path | None = None,
) -> ProviderPlan:
    """Intersect the profile's ordered list with what this build has. Pure."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}")
    wanted = list(PROFILES[profile])
    if CPU not in wanted:
        wanted.append(CPU)
    choices: list[ProviderChoice] = []
    skipped: list[tuple[str, str]] = []
    for name in wanted:
        if name != CPU and name not in available:
            skipped.append((name, f"{name} is not in this onnxruntime build (has: {', '.join(available)})"))
            continue
        if name in (NNAPI, COREML) and not traits.static_shapes:
            skipped.append((name, f"{name} needs static input shapes and the model has dynamic ones "
                                  "(build it with optimize.fixed_shapes for this target)"))
            continue
        if name == XNNPACK and traits.precision == "int8":
            skipped.append((name, "XNNPACK runs QDQ int8 models slower than the CPU provider's int8 kernels"))
            continue
        choices.append(ProviderChoice(name, provider_options(name, threads=threads, cache_dir=cache_dir,
                                                             traits=traits)))
    return ProviderPlan(choices, skipped)


@dataclass
class SessionResult:
    session: Any
    provider: str
    fallbacks: list[tuple[str, str]]


def session_options(threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    # With two models in one process (active + shadow during an update), spinning pool
    # threads steal each other's cores: measured 1.7-2x slower until spinning is off.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def create_session(model_path: Path, plan: ProviderPlan, *, threads: int = 0,
                   factory: Callable[..., Any] | None = None) -> SessionResult:
    """Create one session, falling back down the plan. Reports the provider really in use.

    ``factory`` defaults to ``onnxruntime.InferenceSession``; tests pass one that fails the way
    a real accelerator does (a CUDA library missing on a Jetson image), which cannot happen here.
    """
    import onnxruntime as ort

    factory = factory or ort.InferenceSession
    fallbacks = list(plan.skipped)
    attempts: list[tuple[str, str]] = []
    for choice in plan.choices:
        providers: list[Any] = [(choice.name, dict(choice.options))]
        if choice.name != CPU:
            providers.append(CPU)  # nodes the accelerator cannot take run on CPU
        try:
            session = factory(str(model_path), session_options(threads), providers=providers)
        except Exception as err:  # onnxruntime raises untyped errors for provider failures
            reason = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
            log.warning("provider %s failed for %s: %s; trying the next", choice.name, model_path.name, reason)
            attempts.append((choice.name, reason))
            fallbacks.append((choice.name, reason))
            continue
        used = session.get_providers()[0]
        if used != choice.name:
            reason = f"onnxruntime did not enable {choice.name}"
            log.warning("%s; using %s", reason, used)
            fallbacks.append((choice.name, reason))
        return SessionResult(session, used, fallbacks)
    raise ProviderError(model_path.name, attempts)
