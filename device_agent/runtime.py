"""The agent runtime: a loaded model (one session, its pre/postprocessing) and the thread-safe
inference service with hot-swap.

Hot path: ``InferenceService.predict_tensors`` validates names, dtypes and shapes against
tables computed once at load time, then calls ``session.run(output_names, feed, run_options)`` directly
(the plain ``run`` costs 6-8 µs per call here; the Python wrapper of ``run_with_ort_values``
costs ~48 µs, so it is not used). Each request takes a reference to the model that is active
when it starts and finishes on it; ``swap`` replaces that reference atomically, so requests in
flight during a swap complete on the old session and new ones start on the new session, with
none failing. The old session is freed when its last request drops its reference.
"""

from __future__ import annotations

import contextlib
import logging
import platform
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, overload

import numpy as np

from device_agent.errors import BadRequest, InferenceError, NoModelError, NonFiniteOutput
from device_agent.feeds import BatchFeed, Frames, batch_feed, batch_refusal, input_feed, input_of
from device_agent.finiteness import Finiteness, judge_outputs, non_finite_counts
from device_agent.prediction import PredictRequest, PredictResult, Tensors
from device_agent.providers import ModelTraits, choose_providers, create_session
from device_agent.report_card import build_card, golden_feeds, node_providers, profile_prefix
from device_agent.request_stats import RequestStats
from device_agent.run_failures import batch_symbols, judge_run_failure
from device_agent.smoke import SmokeReport, run_smoke_test
from device_agent.streams import DEFAULT_MAX_STREAMS, DEFAULT_STREAM_IDLE_S, StreamTable
from edgepack_core.errors import InvalidNameError, PostprocessError, RuntimeTooOldError
from edgepack_core.manifest import Manifest
from edgepack_core.ort_compat import runtime_refusal
from edgepack_core.ort_workarounds import disabled_optimizers
from edgepack_core.postprocess import Postprocessor, load_charset, load_labels
from edgepack_core.preprocess import Preprocessor
from edgepack_core.protocol.report_card import ReportCard
from edgepack_core.targets import CPU

log = logging.getLogger("edgepack.agent.runtime")

_DTYPES = {"float32": np.float32, "float16": np.float16, "float64": np.float64, "int8": np.int8,
           "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16, "int32": np.int32, "uint32": np.uint32,
           "int64": np.int64, "uint64": np.uint64, "bool": np.bool_, "string": np.object_}


@dataclass
class LoadedModel:
    """One model ready to serve: its verified directory, manifest and session."""

    root: Path
    manifest: Manifest
    session: Any
    provider: str
    fallbacks: list[tuple[str, str]]
    preprocessor: Preprocessor
    postprocessor: Postprocessor
    smoke: SmokeReport | None = None
    output_names: list[str] = field(default_factory=list)
    input_specs: dict[str, tuple[np.dtype, tuple[int | str, ...]]] = field(default_factory=dict)
    # Inputs the manifest declares ``role: constant``: fed on every call, never asked of callers.
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    # Inputs the manifest declares ``allow_non_finite``: NaN/inf there is data, not a malformed request.
    non_finite_inputs: frozenset[str] = frozenset()
    # Outputs the manifest declares ``allow_non_finite``: NaN/inf there is served, flagged; in any
    # other output it is the model's failure (500 ``non_finite_output``: device_agent/finiteness.py).
    non_finite_outputs: frozenset[str] = frozenset()
    # Inputs the manifest declares ``role: state``: input name -> (the output carried into it,
    # its init value). Fed by the agent (per stream), never asked of callers.
    states: dict[str, tuple[str, np.ndarray]] = field(default_factory=dict)
    # What onnxruntime registered in the session, in order; ``provider`` is the first.
    session_providers: tuple[str, ...] = ()
    # Seconds the warm-up took on this session (golden samples, or zeros on an accelerator
    # without them): where TensorRT builds its engine, before the model is swapped in.
    warmup_s: float | None = None
    # Where the provider keeps its compiled engine/model (None: nothing to keep).
    cache_dir: Path | None = None
    # onnxruntime's RunOptions for every call: its own log of a failed kernel off (the error is
    # raised with the same text and judged by run_failures.py), so a client's wrong-size input
    # writes no log line and the CLI's error stays one line. None (tests' fake sessions): defaults.
    run_options: Any = None
    # What this device measured of the model at activation (device_agent/report_card.py); None
    # where the load did not ask for one (the CLI's one-shot predict).
    report_card: ReportCard | None = None

    @property
    def init_state(self) -> dict[str, np.ndarray]:
        return {name: init for name, (_, init) in self.states.items()}

    @property
    def audio_input(self) -> str | None:
        if self.preprocessor.kind != "audio":
            return None
        return self.manifest.preprocess.input or next(iter(self.input_specs), None)

    @property
    def label(self) -> str:
        return f"{self.manifest.name} {self.manifest.version}"

    @property
    def image_input(self) -> str | None:
        if self.preprocessor.kind != "image":
            return None
        return self.manifest.preprocess.input or self.manifest.inputs[0].name

    def run(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.states:  # a golden sample may leave a state input out: it starts from init
            feed = {**self.init_state, **feed}
        if self.constants:
            feed = {**feed, **self.constants}
        return dict(zip(self.output_names, self.session.run(self.output_names, feed, self.run_options), strict=True))

    def describe(self) -> dict[str, Any]:
        """The model and the provider really serving it, each fallback with its reason
        (``/healthz``, the published state)."""
        return {"name": self.manifest.name, "version": self.manifest.version, "sha256": self.manifest.model_sha256,
                "provider": self.provider, "provider_fallbacks": self.fallbacks_json(),
                "session_providers": list(self.session_providers),
                "warmup_ms": None if self.warmup_s is None else round(self.warmup_s * 1000, 3)}

    def fallbacks_json(self) -> list[dict[str, str]]:
        return [{"provider": p, "reason": r} for p, r in self.fallbacks]

    @property
    def proven_shapes(self) -> tuple[dict[str, tuple[int, ...]], ...]:
        """The input shapes the golden samples ran at load (none without a smoke test)."""
        return self.smoke.input_shapes if self.smoke is not None else ()


def feed_shapes(feed: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """The shapes of one session call's feed: a frame's for audio frames, a row's for a batch."""
    if isinstance(feed, Frames):
        return {feed.name: tuple(feed[feed.name].shape[1:])}
    if isinstance(feed, BatchFeed):
        return {name: (1, *np.shape(value)[1:]) for name, value in feed.items()}
    return {name: tuple(np.shape(value)) for name, value in feed.items()}


def constant_inputs(manifest: Manifest) -> dict[str, np.ndarray]:
    """The inputs the manifest declares ``role: constant``, as arrays of their dtype."""
    constants: dict[str, np.ndarray] = {}
    for spec in manifest.raw["inputs"]:
        if spec.get("role") == "constant":
            dtype = str if spec["dtype"] == "string" else _DTYPES.get(spec["dtype"], np.float32)
            constants[spec["name"]] = np.asarray(spec["value"], dtype=dtype)
    return constants


def state_inputs(manifest: Manifest) -> dict[str, tuple[str, np.ndarray]]:
    """The inputs the manifest declares ``role: state``: (carried output, init zeros with
    symbolic dims 1, i.e. a batch of one)."""
    states: dict[str, tuple[str, np.ndarray]] = {}
    for spec in manifest.raw["inputs"]:
        if spec.get("role") == "state":
            shape = tuple(d if isinstance(d, int) else 1 for d in spec["shape"])
            states[spec["name"]] = (spec["output"], np.zeros(shape, dtype=_DTYPES.get(spec["dtype"], np.float32)))
    return states


def model_traits(manifest: Manifest) -> ModelTraits:
    """What of the manifest decides the providers and their options. Pure."""
    return ModelTraits(precision=manifest.raw["model"].get("precision", "fp32"),
                       static_shapes=all(isinstance(d, int) for t in manifest.inputs for d in t.shape),
                       targets=tuple(manifest.targets),
                       inputs=tuple((t.name, tuple(t.shape)) for t in manifest.inputs))


def engine_cache_dir(root: Path, manifest: Manifest, ort_version: str) -> Path:
    """Where TensorRT's engines and CoreML's compiled model for this model live:
    ``<store>/cache/<model directory>/<model hash>-ort<version>-<device>/`` for a model in a
    store (``<store>/models/<model directory>``), so an onnxruntime upgrade or a moved SD card
    never loads a stale engine, and the store removes the whole ``cache/<model directory>``
    with the model (``ModelStore``). Any other extracted directory (``predict``'s temporary
    one) keeps its cache beside it, ``<parent>/cache/<directory>/...``, and loses it with its
    parent. I/O: asks the device's name."""
    from device_agent.providers import cache_key, this_device

    caches = root.parent.parent / "cache" if root.parent.name == "models" else root.parent / "cache"
    return caches / root.name / cache_key(manifest.model_sha256, ort_version, this_device())


def quiet_run_options(ort: Any) -> Any:
    """RunOptions that keep onnxruntime's own log of a failed run quiet (fatal only)."""
    options = ort.RunOptions()
    options.log_severity_level = 4
    return options


def _zeros_feed(model: LoadedModel) -> dict[str, np.ndarray]:
    """A warm-up feed for a model without golden samples: zeros of every input's declared
    shape (symbolic dims 1)."""
    feed = {}
    for name, (dtype, shape) in model.input_specs.items():
        dims = tuple(d if isinstance(d, int) else 1 for d in shape)
        feed[name] = np.full(dims, "", dtype=object) if dtype.kind == "O" else np.zeros(dims, dtype=dtype)
    return feed


def warm_up(model: LoadedModel, *, smoke_test: bool = True,
            run: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]] | None = None) -> SmokeReport | None:
    """Run the golden samples on the model's session (the smoke test; on TensorRT also the
    engine build, so it happens before the swap, not on the first live request). Without
    golden samples, an accelerator runs zeros once (a failure there is logged: the first
    request then pays the build); the CPU provider has nothing to build and skips it. ``run``
    stands in for ``model.run`` (the report card times the first answer through it)."""
    run = run or model.run
    if smoke_test and model.manifest.golden.get("samples"):
        return run_smoke_test(model.root, model.manifest, run)
    if model.provider != CPU:
        try:
            run(_zeros_feed(model))
        except Exception as err:  # zeros are not every model's valid input (indices, lengths)
            log.warning("%s: warm-up with zeros on %s failed (%s); the first request pays the build",
                        model.label, model.provider, str(err).splitlines()[0][:200] if str(err) else type(err).__name__)
    return None


def load_model(root: Path, manifest: Manifest, *, profile: str = "x86", threads: int = 0,
               smoke_test: bool = True, factory: Callable[..., Any] | None = None,
               report_card: bool = False) -> LoadedModel:
    """Create the session with the best provider that works, warmed up on the golden samples.

    Each provider choice gets a session and the golden smoke test on that same session (no
    second session): a provider onnxruntime silently left out, or whose outputs miss the golden
    samples, counts as failing and the next one is tried (``create_session``). The returned
    model is ready: a TensorRT engine is built (and cached) before anyone swaps it in.
    ``factory`` stands in for ``onnxruntime.InferenceSession`` in tests. ``report_card``: measure
    the model's report card on this device (``device_agent/report_card.py``; the daemon's loads).
    """
    import onnxruntime as ort

    load_started = time.perf_counter()

    refusal = runtime_refusal(f"{manifest.name} {manifest.version}",
                              str(manifest.raw["model"].get("min_onnxruntime", "0")), ort.__version__)
    if refusal is not None:  # before any session: an old runtime's load error names neither version
        raise RuntimeTooOldError(refusal)
    traits = model_traits(manifest)
    available = ort.get_available_providers()
    plan = choose_providers(profile, available, traits, threads=threads, ort_version=ort.__version__)
    cache_dir = None
    if plan.needs_cache:  # only then is the device's identity worth asking for (nvidia-smi)
        cache_dir = engine_cache_dir(root, manifest, ort.__version__)
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:  # a store gone read-only still serves: the engine is built, not kept
            log.warning("%s %s: no engine cache (%s cannot be created: %s)", manifest.name, manifest.version,
                        cache_dir, err.strerror or err)
            cache_dir = None
        plan = choose_providers(profile, available, traits, threads=threads, cache_dir=cache_dir,
                                ort_version=ort.__version__)
    constants = constant_inputs(manifest)
    states = state_inputs(manifest)
    labels = None
    post = manifest.postprocess
    if post.labels:
        labels = load_labels((root / post.labels).read_text(encoding="utf-8"))
    charset = None
    if post.charset:
        charset = load_charset((root / post.charset).read_text(encoding="utf-8"), append_space=post.append_space)
    template = LoadedModel(
        root=root, manifest=manifest, session=None, provider="", fallbacks=[],
        preprocessor=Preprocessor(manifest.preprocess), postprocessor=Postprocessor(post, labels, charset),
        input_specs={t.name: (np.dtype(_DTYPES.get(t.dtype, np.float32)), tuple(t.shape)) for t in manifest.inputs
                     if t.name not in constants and t.name not in states},
        constants=constants, states=states,
        non_finite_inputs=frozenset(s["name"] for s in manifest.raw["inputs"] if s.get("allow_non_finite")),
        non_finite_outputs=frozenset(s["name"] for s in manifest.raw["outputs"] if s.get("allow_non_finite")),
        cache_dir=cache_dir, run_options=quiet_run_options(ort),
    )
    ready: list[LoadedModel] = []
    probe = _CardProbe(report_card)

    def check(session: Any, provider: str) -> None:
        model = replace(template, session=session, provider=provider,
                        output_names=[o.name for o in session.get_outputs()])
        started = time.perf_counter()
        model.smoke = warm_up(model, smoke_test=smoke_test, run=probe.run_of(model))
        model.warmup_s = time.perf_counter() - started
        probe.profiled(session)
        ready[:] = [model]

    disabled = disabled_optimizers(float16=traits.precision == "fp16", machine=platform.machine())
    if disabled:
        log.debug("%s: onnxruntime optimizers off for this fp16 model on %s: %s (microsoft/onnxruntime#28392)",
                  template.label, platform.machine(), ", ".join(disabled))
    with probe.profile_dir() as prefix:
        result = create_session(root / manifest.model_path, plan, threads=threads, factory=factory, check=check,
                                disabled_optimizers=disabled, profile_prefix=prefix)
    model = ready[0]
    model.fallbacks, model.session_providers = result.fallbacks, result.session_providers
    for name, reason in result.fallbacks:
        log.info("%s: not using %s: %s", model.label, name, reason)
    if report_card:
        model.report_card = probe.card(model, smoke_test, load_started)
    return model


Run = Callable[[Mapping[str, np.ndarray]], dict[str, np.ndarray]]


class _CardProbe:
    """What a load notes for the report card (device_agent/report_card.py) while it happens:
    when the chosen session's first run returned, and which provider ran each of its nodes
    (its profile, ended after the warm-up). Does nothing when the load measures no card."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.first_answer: float | None = None
        self.assignment: dict[str, str] = {}

    @contextlib.contextmanager
    def profile_dir(self) -> Iterator[str | None]:
        """The profile prefix in a temporary directory (removed after the load), or None."""
        if not self.enabled:
            yield None
            return
        with tempfile.TemporaryDirectory(prefix="edgepack-card-") as directory:
            yield profile_prefix(directory)

    def run_of(self, model: LoadedModel) -> Run | None:
        """``model.run`` noting when its first call returned (a new session starts afresh)."""
        if not self.enabled:
            return None
        self.first_answer = None

        def timed(feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
            outputs = model.run(feed)
            if self.first_answer is None:
                self.first_answer = time.perf_counter()
            return outputs

        return timed

    def profiled(self, session: Any) -> None:
        if self.enabled:
            self.assignment = node_providers(session)

    def card(self, model: LoadedModel, smoke_test: bool, load_started: float) -> ReportCard:
        """The card of the model just loaded: latency runs over its golden samples (none when the
        smoke test was off or it has none)."""
        samples = model.manifest.golden.get("samples", []) if smoke_test else []
        first = None if self.first_answer is None else self.first_answer - load_started
        return build_card(model.provider, golden_feeds(model.root, samples), model.run,
                          first_inference_s=first, assignment=self.assignment)


Observer = Callable[[float | None, str | None], None]


# The default of ``InferenceService.max_batch`` (docs/agent.md, "Batches"): on the 2-core
# development machine batches of 4 gave the MobileNet-style demo 1.12-1.18x the images/s of one
# by one in three runs, 8 and 16 no steady gain (0.99-1.21x; BENCHMARKS.md, "Image path"), while
# the input and activations grow with every image (a 640x640 detector: 4.9 MB of input each).
DEFAULT_MAX_BATCH = 4


class InferenceService:
    """Thread-safe predict over the active model, with atomic hot-swap."""

    def __init__(self, model: LoadedModel | None = None, *, max_streams: int = DEFAULT_MAX_STREAMS,
                 stream_idle_s: float = DEFAULT_STREAM_IDLE_S) -> None:
        self._model = model
        self.streams = StreamTable(max_streams, stream_idle_s)
        self._swap_lock = threading.Lock()
        self.stats = RequestStats()
        self.observers: list[Observer] = []  # e.g. telemetry: called with (latency, None) or (None, error kind)

    @property
    def model(self) -> LoadedModel | None:
        return self._model

    def swap(self, new: LoadedModel | None) -> LoadedModel | None:
        """Make ``new`` the active model; return the previous one. Requests in flight finish on
        the model they started with."""
        with self._swap_lock:
            old, self._model = self._model, new
        if new is not None:
            log.info("active model: %s on %s", new.label, new.provider)
        return old

    # ---------------------------------------------------------------- requests

    # The most images one batched session call takes (``predict`` on a list); a longer list runs
    # in chunks of this size, so the tensors and activations of one call stay bounded.
    max_batch: int = DEFAULT_MAX_BATCH

    @overload
    def predict(self, data: list[bytes | np.ndarray] | tuple[bytes | np.ndarray, ...], *,
                content_type: str | None = None, postprocess: bool = True,
                stream: str | None = None) -> list[PredictResult]: ...

    @overload
    def predict(self, data: PredictRequest | bytes | np.ndarray | Mapping[str, np.ndarray], *,
                content_type: str | None = None, postprocess: bool = True,
                stream: str | None = None) -> PredictResult: ...

    def predict(self, data: Any, *, content_type: str | None = None, postprocess: bool = True,
                stream: str | None = None) -> PredictResult | list[PredictResult]:
        """A typed request (``device_agent/prediction.py``: its input told apart by the caller,
        once) -> outputs and result. A library caller may pass the value itself (raw image or
        WAV bytes, an .npy/.npz body, one array, named tensors; told apart here by
        :func:`device_agent.feeds.input_of`), with ``content_type``, ``postprocess`` and
        ``stream``, which apply to such a value only. A WAV input runs frame by frame (state
        carried from frame to frame) and every output comes stacked with a leading frame axis.
        ``stream``: state inputs start from that stream's last state and it keeps the new one;
        without it, from init. A list (or tuple) of images gives a list of results:
        :meth:`predict_batch`."""
        if isinstance(data, (list, tuple)):
            return self.predict_batch(data, content_type=content_type, postprocess=postprocess, stream=stream)
        model = self._model
        if model is None:
            raise NoModelError("no model is active")
        return self._predict_on(model, data, content_type, postprocess, stream)

    def predict_batch(self, items: Sequence[bytes | np.ndarray], *, content_type: str | None = None,
                      postprocess: bool = True, stream: str | None = None) -> list[PredictResult]:
        """Several images (encoded bytes or uint8 arrays, in any mix) -> one result per image, in
        order, each with its own geometry. When the model's image input has a dynamic batch dim
        that its outputs follow (:func:`device_agent.feeds.batch_refusal`), the images are
        preprocessed into one tensor (no stacking copy) and run in one session call per
        ``max_batch`` images; otherwise one by one, as ``predict`` would. Every image counts as
        one request, its latency the share of its session call. A bad image refuses the whole
        list (naming its index) before anything runs."""
        model = self._model
        if model is None:
            raise NoModelError("no model is active")
        items = list(items)
        refusal = batch_refusal(model) if len(items) > 1 else "a single item"
        if refusal is not None:
            log.debug("%s: %d item(s) one by one: %s", model.label, len(items), refusal)
            return [self._predict_on(model, item, content_type, postprocess, stream) for item in items]
        size = max(1, int(self.max_batch))
        results: list[PredictResult] = []
        for start in range(0, len(items), size):
            results += self._run_batch(model, items[start:start + size], content_type, postprocess, stream)
        return results

    def _predict_on(self, model: LoadedModel, data: Any, content_type: str | None, postprocess: bool,
                    stream: str | None) -> PredictResult:
        """One request on ``model``; a client's mistake counted before it is raised."""
        try:
            request = data if isinstance(data, PredictRequest) else \
                PredictRequest(input_of(model, data, content_type), stream, postprocess)
            self._check_stream(request.stream)
            feed = input_feed(model, request.input)
        except BadRequest as err:
            self._fail(err.kind, client=True)
            raise
        return self._run(model, feed, request.postprocess, request.stream)

    def predict_tensors(self, feed: Mapping[str, np.ndarray], *, postprocess: bool = True,
                        stream: str | None = None) -> PredictResult:
        """Named model-ready tensors (no preprocessing): the hot path."""
        return self.predict(PredictRequest(Tensors(feed), stream, postprocess))

    def reset_stream(self, stream: str) -> bool:
        """Forget a stream's state (its next call starts from init); True when it existed."""
        self._check_stream(stream)
        return self.streams.reset(stream)

    @staticmethod
    def _check_stream(stream: str | None) -> None:
        if stream is not None:
            try:
                StreamTable.check_id(stream)
            except InvalidNameError as err:
                raise BadRequest("bad_stream", str(err)) from err

    def _infer(self, model: LoadedModel, feed: Mapping[str, np.ndarray], stream: str | None) -> list[np.ndarray]:
        """One session run, or one per frame of a ``Frames`` feed (outputs stacked), with the
        state inputs fed from ``stream`` (or init) and carried from run to run."""
        names = model.output_names
        if not model.states and not isinstance(feed, Frames):
            return model.session.run(names, {**feed, **model.constants} if model.constants else feed, model.run_options)
        feeds = feed.feeds() if isinstance(feed, Frames) else [feed]
        runs = []
        with self.streams.hold(stream, model.manifest.model_sha256, model.init_state) as state:
            for one in feeds:
                values = model.session.run(names, {**one, **state, **model.constants}, model.run_options)
                outputs = dict(zip(names, values, strict=True))
                for input_name, (output_name, _) in model.states.items():
                    state[input_name] = outputs[output_name]
                runs.append(values)
            answer = runs[0] if not isinstance(feed, Frames) else \
                [np.stack([values[i] for values in runs]) for i in range(len(names))]
            # refused inside the hold: a failed call leaves the stream's state as it was
            self._check_finite(model, dict(zip(names, answer, strict=True)), refused_only=True)
        return answer

    def _run(self, model: LoadedModel, feed: Mapping[str, np.ndarray], postprocess: bool,
             stream: str | None = None) -> PredictResult:
        started = time.perf_counter()
        values = self._session_call(model, lambda: self._infer(model, feed, stream), feed)
        elapsed = time.perf_counter() - started
        return self._finish(model, dict(zip(model.output_names, values, strict=True)),
                            getattr(feed, "geometry", None), elapsed, postprocess)

    def _session_call(self, model: LoadedModel, call: Callable[[], list[np.ndarray]],
                      feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Run ``call``; a failure is the client's (400 ``shape``) or the model's (500
        ``runtime``) as :func:`device_agent.run_failures.judge_run_failure` decides from the
        request's shapes against the declared inputs and the golden samples'."""
        try:
            return call()
        except NonFiniteOutput:  # judged and counted already (a stateful model's answer)
            raise
        except Exception as err:
            declared = {name: shape for name, (_, shape) in model.input_specs.items()}
            batch = batch_symbols(declared, [o.shape for o in model.manifest.outputs])
            verdict = judge_run_failure(str(err), feed_shapes(feed), declared, model.proven_shapes, batch)
            if verdict.client:
                self._fail("shape", client=True)
                raise BadRequest("shape", verdict.message) from err
            self._fail("runtime", client=False)
            raise InferenceError("runtime", verdict.message) from err

    def _finish(self, model: LoadedModel, outputs: dict[str, np.ndarray], geometry: dict[str, Any] | None,
                elapsed: float, postprocess: bool) -> PredictResult:
        """One request's outputs -> its result: finiteness (a NaN/inf where the recipe does not
        allow it is the model's failure), postprocessing, counters."""
        finite = self._check_finite(model, outputs)
        result = None
        if postprocess:
            try:
                result = model.postprocessor(outputs, geometry)
            except PostprocessError as err:
                self._fail("postprocess", client=False)
                raise InferenceError("postprocess", str(err)) from err
        self.stats.ok(elapsed)
        for observer in self.observers:
            observer(elapsed, None)
        return PredictResult(outputs, result, model, elapsed, geometry, non_finite=finite.flagged)

    def _check_finite(self, model: LoadedModel, outputs: dict[str, np.ndarray], *,
                      refused_only: bool = False) -> Finiteness:
        """Judge an answer's NaN/inf (``device_agent/finiteness.py``): counted, and a refused one
        raised as :class:`NonFiniteOutput`. ``refused_only``: act only on a refusal (a flagged
        answer is counted once, when it is finished)."""
        finite = judge_outputs(non_finite_counts(outputs), model.non_finite_outputs)
        if finite.non_finite and not (refused_only and not finite.refused):
            self.stats.count_non_finite()
        if finite.refused:
            self._fail("non_finite_output", client=False)
            raise NonFiniteOutput(dict(finite.refused), {name: outputs[name].size for name in finite.refused})
        return finite

    def _run_batch(self, model: LoadedModel, items: list[Any], content_type: str | None, postprocess: bool,
                   stream: str | None) -> list[PredictResult]:
        """One session call for ``items`` (at most ``max_batch``), its outputs split per image."""
        try:
            self._check_stream(stream)
            feed = batch_feed(model, items, content_type)
        except BadRequest as err:
            self._fail(err.kind, client=True)
            raise
        started = time.perf_counter()
        call = {**feed, **model.constants} if model.constants else dict(feed)
        values = self._session_call(model, lambda: model.session.run(model.output_names, call, model.run_options), feed)
        elapsed = time.perf_counter() - started
        count = len(items)
        if any(np.ndim(v) == 0 or v.shape[0] != count for v in values):
            # The outputs did not follow the batch after all (a symbolic dim that means something
            # else): the answers of one by one are the right ones.
            log.debug("%s: outputs do not follow a batch of %d; one by one", model.label, count)
            return [self._predict_on(model, item, content_type, postprocess, stream) for item in items]
        return [self._finish(model, {name: value[i:i + 1] for name, value in zip(model.output_names, values,
                                                                                 strict=True)},
                             feed.geometries[i], elapsed / count, postprocess) for i in range(count)]

    def _fail(self, kind: str, *, client: bool) -> None:
        self.stats.error(kind, client)
        for observer in self.observers:
            observer(None, kind)
