"""Execution provider choice (pure) and session creation down the chain (I/O).

``choose_providers`` is a pure function of (profile, the providers this onnxruntime build has,
the model, the onnxruntime version): the ordered choices, each with its options, and the ones
it skipped with the reason. ``create_session`` walks the choices. For choice *i* onnxruntime is
given the whole remaining chain, each provider with its options (``[TensorRT, CUDA, CPU]``,
then ``[CUDA, CPU]``, then ``[CPU]``), so nodes TensorRT cannot take run on CUDA, not the CPU.

onnxruntime does not raise when a provider cannot be created: a missing library is one log
line on stderr and the provider is left out of the session, and an error while creating one
prints "EP Error ... Falling back to [...]" on stdout and retries without it (without the
options, too). So a session counts only if ``get_providers()`` starts with the provider asked
for; otherwise that provider failed, with onnxruntime's own line as the reason (both streams
are captured while an accelerator's session is created), and the next choice is tried. A
choice whose session cannot reproduce the golden samples (``check``: TensorRT in fp16 beyond
the artifact's tolerances, an engine that fails to build on the first run) fails the same way.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from device_agent.errors import ProviderError, SmokeTestError
from edgepack_core.targets import CPU, PROFILES

log = logging.getLogger("edgepack.agent.providers")

TENSORRT = "TensorrtExecutionProvider"
CUDA = "CUDAExecutionProvider"
XNNPACK = "XnnpackExecutionProvider"
NNAPI = "NnapiExecutionProvider"
COREML = "CoreMLExecutionProvider"

# Providers that compile the model into something worth keeping on disk (an engine, a compiled
# model): their options name a cache directory, keyed by model, onnxruntime and device.
CACHING_PROVIDERS = frozenset({TENSORRT, COREML})
# TensorRT's optimisation profile for a model whose only dynamic dim is the batch: engines for
# batches 1..TENSORRT_MAX_BATCH are built once, at activation, instead of per new batch size
# while serving (a rebuild takes minutes on a Jetson).
TENSORRT_MAX_BATCH = 8
REASON_CHARS = 400


class ModelTraits(NamedTuple):
    """What about a model affects provider choice."""

    precision: str = "fp32"  # fp32 | fp16 | int8
    static_shapes: bool = False
    targets: Sequence[str] = ()
    # Every graph input as (name, declared shape; symbolic dims are strings).
    inputs: tuple[tuple[str, tuple[int | str, ...]], ...] = ()


DEFAULT_TRAITS = ModelTraits()


class ProviderChoice(NamedTuple):
    name: str
    options: Mapping[str, str] = {}  # a NamedTuple default: shared, never mutated


class ProviderPlan(NamedTuple):
    """The providers to try in order, and those skipped with a reason."""

    choices: list[ProviderChoice]
    skipped: list[tuple[str, str]]

    def chain(self, start: int) -> list[tuple[str, dict[str, str]]]:
        """The ``providers`` argument for choice ``start``: it and every later choice, each with
        its options; CPU always ends it."""
        chain = [(choice.name, dict(choice.options)) for choice in self.choices[start:]]
        if not chain or chain[-1][0] != CPU:
            chain.append((CPU, {}))
        return chain

    @property
    def needs_cache(self) -> bool:
        return any(choice.name in CACHING_PROVIDERS for choice in self.choices)


_SHORT_NAMES = {TENSORRT: "TensorRT", CUDA: "CUDA", XNNPACK: "XNNPACK", NNAPI: "NNAPI", COREML: "CoreML", CPU: "CPU"}


def short_name(provider: str) -> str:
    """``CUDAExecutionProvider`` -> ``CUDA`` (for one-line reasons)."""
    return _SHORT_NAMES.get(provider) or provider.removesuffix("ExecutionProvider") or provider


def ort_version_tuple(version: str) -> tuple[int, int]:
    """``"1.16.3"`` -> ``(1, 16)``; anything unreadable counts as the oldest supported (1.16)."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else (1, 16)


def tensorrt_profile(inputs: Sequence[tuple[str, Sequence[int | str]]],
                     max_batch: int = TENSORRT_MAX_BATCH) -> dict[str, str]:
    """TensorRT's explicit shape profile (``trt_profile_{min,opt,max}_shapes``, onnxruntime
    1.16+) when every dynamic dim of every input is the leading (batch) one; ``{}`` otherwise
    (static models need none; other dynamic dims are built for the shapes the golden samples
    and the requests bring). Pure."""
    dynamic = [(name, list(shape)) for name, shape in inputs if any(isinstance(d, str) for d in shape)]
    if not dynamic:
        return {}
    for name, shape in dynamic:
        if any(isinstance(d, str) for d in shape[1:]) or not name or re.search(r"[:,\s]", name):
            return {}

    def spec(batch: int) -> str:
        return ",".join(f"{name}:{'x'.join([str(batch), *(str(d) for d in shape[1:])])}" for name, shape in dynamic)

    return {"trt_profile_min_shapes": spec(1), "trt_profile_opt_shapes": spec(1),
            "trt_profile_max_shapes": spec(max_batch)}


def provider_options(name: str, *, threads: int, cache_dir: Path | None, traits: ModelTraits,
                     ort_version: str = "1.16") -> dict[str, str]:
    """Options per provider, chosen for edge devices, named as onnxruntime ``ort_version``
    knows them: an option name a provider does not know makes onnxruntime refuse the provider
    ("Invalid TensorRT EP option"), so nothing newer than the running version is passed."""
    version = ort_version_tuple(ort_version)
    if name == XNNPACK:
        # XNNPACK runs its own thread pool; size it like the CPU pool (0 = onnxruntime default).
        return {"intra_op_num_threads": str(threads)} if threads else {}
    if name == TENSORRT:
        options = {"trt_fp16_enable": "True" if traits.precision != "int8" else "False",
                   "trt_int8_enable": "True" if traits.precision == "int8" else "False"}
        if cache_dir is not None:
            # Building an engine takes minutes on a Jetson; the cache makes restarts and
            # rollbacks fast. 1.16 keeps the timing cache in the engine cache directory.
            options.update({"trt_engine_cache_enable": "True", "trt_engine_cache_path": str(cache_dir / "tensorrt"),
                            "trt_timing_cache_enable": "True"})
        options.update(tensorrt_profile(traits.inputs))
        return options
    if name == CUDA:
        return {"device_id": "0", "cudnn_conv_algo_search": "HEURISTIC"}
    if name == NNAPI:
        # fp16 relaxes precision beyond what golden samples allow; CPU fallback inside NNAPI is
        # slower than onnxruntime's own CPU provider, so let onnxruntime handle those nodes.
        return {"NNAPI_FLAG_CPU_DISABLED": "1"}
    if name == COREML:
        # Key-value CoreML options exist from onnxruntime 1.20 (1.16-1.19 take none from Python
        # and build a NeuralNetwork model); the compiled-model cache from 1.21.
        if version < (1, 20):
            return {}
        options = {"ModelFormat": "MLProgram", "MLComputeUnits": "ALL"}
        if cache_dir is not None and version >= (1, 21):
            options["ModelCacheDirectory"] = str(cache_dir / "coreml")
        return options
    return {}


def choose_providers(
    profile: str,
    available: Sequence[str],
    traits: ModelTraits = DEFAULT_TRAITS,
    *,
    threads: int = 0,
    cache_dir: Path | None = None,
    ort_version: str = "1.16",
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
                                                             traits=traits, ort_version=ort_version)))
    return ProviderPlan(choices, skipped)


# ---------------------------------------------------------------- onnxruntime's own words

# onnxruntime's native log format, and its Python wrapper's warnings ("Specified provider ... is
# not in available provider names"), which the warnings module writes as "...: UserWarning: ...".
_ORT_LOG_LINE = re.compile(r"\[([EWF]):onnxruntime:[^\]]*\]\s*(.*)|(W)arning: (.*)")
_EP_ERROR = re.compile(r"^EP Error:? (.*?)(?: when using \[.*)?$")
_ORT_STATUS = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : (.*)")


def _plain(message: str) -> str:
    """onnxruntime's message without the source location and status code before it."""
    status = _ORT_STATUS.search(message)
    return (status.group(1) if status else message).strip()


def provider_log_reason(text: str, provider: str) -> str:
    """The line of onnxruntime's output that says why ``provider`` is not in the session: its
    Python fallback banner (``EP Error <why> when using [...]``), else the first error or
    warning line (native log or Python warning) naming the provider, else the first error
    line. ``""`` when none. Pure."""
    errors: list[str] = []
    naming: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        banner = _EP_ERROR.match(line)
        if banner and banner.group(1).strip():
            return _plain(banner.group(1))[:REASON_CHARS]
        logged = _ORT_LOG_LINE.search(line)
        if logged is None:
            continue
        message = _plain(logged.group(2) or logged.group(4) or "")
        if short_name(provider).lower() in message.lower() or provider in message:
            naming.append(message)
        if logged.group(1) and logged.group(1) in "EF":
            errors.append(message)
    found = (naming or errors or [""])[0]
    return found[:REASON_CHARS]


def fallback_reason(asked: str, used: Sequence[str], logged: str) -> str:
    """Why a session without ``asked`` at its head counts as ``asked`` failing. Pure."""
    got = "/".join(short_name(p) for p in used) or "nothing"
    reason = f"onnxruntime fell back to {got} for {short_name(asked)}"
    return f"{reason}: {logged}" if logged else f"{reason} (it logged no reason)"


_CAPTURE_LOCK = threading.Lock()


@contextlib.contextmanager
def capture_provider_log(enabled: bool = True) -> Iterator[io.StringIO]:
    """Collect what onnxruntime says while a session is created: its Python fallback banner
    (``print`` on stdout, kept off stdout so ``predict --json`` stays one JSON object) and its
    Python warnings (recorded every time, not once per place as the warnings module would),
    both logged at WARNING instead, and its native log lines on file descriptor 2, which are
    teed: they still reach stderr as they are written, and a copy (the last 64 KiB) is kept.

    One capture at a time per process (descriptor 2, stdout and the warnings filters are
    process-wide): accelerator sessions are created one after the other, and what other
    threads print or warn meanwhile is logged with onnxruntime's lines, not lost."""
    captured = io.StringIO()
    if not enabled:
        yield captured
        return
    with _CAPTURE_LOCK:
        printed = io.StringIO()
        tee = _StderrTee()
        try:
            with contextlib.redirect_stdout(printed), warnings.catch_warnings(record=True) as warned:
                # every time, not once per place: the second model missing XNNPACK needs its reason too
                warnings.simplefilter("always")
                tee.start()
                try:
                    yield captured
                finally:
                    tee.stop()
        finally:
            said = printed.getvalue().strip().splitlines()
            said += [f"{w.category.__name__}: {w.message}" for w in warned]
            if said:
                log.warning("onnxruntime: %s", " | ".join(said))
            captured.write("\n".join(said) + "\n")
            captured.write(tee.text())


class _StderrTee:
    """Route file descriptor 2 through a pipe whose reader writes every byte on to the real
    stderr at once and keeps a bounded copy."""

    KEEP = 64 * 1024

    def __init__(self) -> None:
        self._kept = bytearray()
        self._saved: int | None = None
        self._reader: threading.Thread | None = None
        self._read_end: int | None = None

    def start(self) -> None:
        try:
            sys.stderr.flush()
            read_end, write_end = os.pipe()
            self._saved = os.dup(2)
            os.dup2(write_end, 2)
            os.close(write_end)
        except OSError as err:  # no descriptor 2 (a daemon with closed stdio): nothing to tee
            log.debug("cannot capture onnxruntime's log: %s", err)
            self._saved = None
            return
        self._read_end = read_end
        self._reader = threading.Thread(target=self._pump, name="ort-log-tee", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self._read_end is not None and self._saved is not None
        while chunk := os.read(self._read_end, 65536):
            with contextlib.suppress(OSError):
                os.write(self._saved, chunk)
            self._kept += chunk
            del self._kept[:-self.KEEP]

    def stop(self) -> None:
        if self._saved is None:
            return
        with contextlib.suppress(ValueError, OSError):
            sys.stderr.flush()
        os.dup2(self._saved, 2)  # closes the pipe's last write end: the reader sees EOF
        if self._reader is not None:
            self._reader.join(timeout=5)
        if self._read_end is not None and (self._reader is None or not self._reader.is_alive()):
            os.close(self._read_end)
        os.close(self._saved)
        self._saved = None

    def text(self) -> str:
        return bytes(self._kept).decode("utf-8", "replace")


# ---------------------------------------------------------------- sessions


class SessionResult(NamedTuple):
    session: Any
    provider: str
    fallbacks: list[tuple[str, str]]
    # What onnxruntime registered in the session, in order (the provider used first).
    session_providers: tuple[str, ...] = ()


def session_options(threads: int, profile_prefix: str | None = None) -> Any:
    """``profile_prefix``: profile the session into files of that prefix (the report card reads
    which provider ran each node, then ends the profile: ``device_agent/report_card.py``)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    if threads:
        options.intra_op_num_threads = threads
    # With two models in one process (active + shadow during an update), spinning pool
    # threads steal each other's cores: measured 1.7-2x slower until spinning is off.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.add_session_config_entry("session.inter_op.allow_spinning", "0")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:REASON_CHARS] if text else type(err).__name__


def create_session(model_path: Path, plan: ProviderPlan, *, threads: int = 0,
                   factory: Callable[..., Any] | None = None,
                   check: Callable[[Any, str], None] | None = None,
                   disabled_optimizers: Sequence[str] = (), profile_prefix: str | None = None) -> SessionResult:
    """Create one session, walking down the plan; report the provider really used and why
    every earlier choice was not.

    ``disabled_optimizers`` (``edgepack_core.ort_workarounds.disabled_optimizers`` for the
    model and this machine) go to every choice's session alike: onnxruntime registers the CPU
    provider behind every accelerator, and the optimizers it names rewrite the CPU's nodes.

    ``factory`` defaults to ``onnxruntime.InferenceSession``; tests pass one that behaves as a
    Jetson's onnxruntime does (which cannot exist here). ``check(session, provider)`` runs on
    each session that has its provider (the golden smoke test, which is also the warm-up that
    builds TensorRT's engine): a ``SmokeTestError`` there fails that choice, except on the last
    one, where it is the model's failure and is raised.
    """
    if factory is None:
        import onnxruntime as ort

        factory = ort.InferenceSession
    fallbacks = list(plan.skipped)
    attempts: list[tuple[str, str]] = []
    options = None
    # Only when there is something to turn off, so a stand-in factory need not know the keyword.
    workarounds = {"disabled_optimizers": list(disabled_optimizers)} if disabled_optimizers else {}
    for index, choice in enumerate(plan.choices):
        last = index == len(plan.choices) - 1
        options = options or session_options(threads, profile_prefix)
        accelerator = choice.name != CPU
        with capture_provider_log(accelerator) as said:
            try:
                session = factory(str(model_path), options, providers=plan.chain(index), **workarounds)
            except Exception as err:  # onnxruntime raises untyped errors for provider failures
                session, reason = None, _first_line(err)
        if session is not None:
            used = list(session.get_providers())
            if accelerator and (not used or used[0] != choice.name):
                session, reason = None, fallback_reason(choice.name, used, provider_log_reason(said.getvalue(),
                                                                                              choice.name))
        if session is not None and check is not None:
            try:
                check(session, choice.name)
            except SmokeTestError as err:
                if last:
                    raise
                session, reason = None, f"its outputs missed the golden samples: {err.problem}"
        if session is None:
            log.warning("provider %s failed for %s: %s; trying the next", choice.name, model_path.name, reason)
            attempts.append((choice.name, reason))
            fallbacks.append((choice.name, reason))
            continue
        return SessionResult(session, used[0] if used else choice.name, fallbacks, tuple(used))
    raise ProviderError(model_path.name, attempts)


# ---------------------------------------------------------------- engine cache key


def device_label(*, gpu: str = "", jetson_model: str = "", l4t_release: str = "", node: str = "",
                 system: str = "", machine: str = "") -> str:
    """What an engine or compiled model is specific to, in a few words: the GPU (name and
    compute capability) when known, the Jetson module and its L4T release, else the host and
    platform. Pure."""
    parts = [p for p in (gpu, jetson_model, l4t_release) if p]
    if not parts:
        parts = [p for p in (node, system, machine) if p]
    return " ".join(parts) or "unknown-device"


def cache_key(model_sha256: str, ort_version: str, device: str) -> str:
    """A directory name for one model's compiled artifacts on one onnxruntime and one device.
    Only ``[a-z0-9._-]``, at most 120 characters; changes when any of the three does. Pure."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", device.lower()).strip("-.")[:60] or "device"
    version = re.sub(r"[^0-9a-z.]+", "", ort_version.lower())[:20] or "unknown"
    device_hash = hashlib.sha256(device.encode()).hexdigest()[:8]  # two devices whose slugs collide
    return f"{model_sha256[:16]}-ort{version}-{slug}-{device_hash}"


def _read_text(path: str, limit: int = 256) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode("utf-8", "replace").replace("\x00", "").strip()
    except OSError:
        return ""


def nvidia_gpu() -> str:
    """``"<name> sm_<cc>"`` of GPU 0 from nvidia-smi, ``""`` without one (or on a Jetson, whose
    nvidia-smi may not answer)."""
    import shutil
    import subprocess

    binary = shutil.which("nvidia-smi")
    if binary is None:
        return ""
    for query in ("name,compute_cap", "name"):
        try:
            done = subprocess.run([binary, f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                                  text=True, timeout=10, check=False, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        first = done.stdout.strip().splitlines()[0].strip() if done.returncode == 0 and done.stdout.strip() else ""
        if first:
            name, _, capability = first.partition(",")
            return f"{name.strip()} sm_{capability.strip().replace('.', '')}" if capability.strip() else name.strip()
    return ""


@functools.lru_cache(maxsize=1)
def this_device() -> str:
    """:func:`device_label` of this machine (I/O: nvidia-smi, the device tree, /etc), asked once
    per process."""
    import platform

    release = _read_text("/etc/nv_tegra_release").splitlines()
    l4t = ""
    if release:
        match = re.search(r"R(\d+)\s*\(release\),\s*REVISION:\s*([\d.]+)", release[0])
        l4t = f"L4T R{match.group(1)}.{match.group(2)}" if match else release[0][:40]
    model = _read_text("/proc/device-tree/model")
    return device_label(gpu=nvidia_gpu(), jetson_model=model if "jetson" in model.lower() else "",
                        l4t_release=l4t, node=platform.node(), system=platform.system(),
                        machine=platform.machine())
