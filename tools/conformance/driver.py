"""Run onnx's backend test suite over bare onnxruntime and over Edgepack, in the same run.

The cases are those of ``onnx.backend.test.BackendTest`` (the node tests the onnx wheel
defines, its shipped ``simple``, ``pytorch-converted`` and ``pytorch-operator`` models and the
``light`` CNNs) whose inputs and outputs are plain tensors. Every case runs first on bare
onnxruntime; a case that passes there runs again through Edgepack (build, verify, agent load
with smoke test, predict), so the set of tests onnxruntime fails is computed here, never kept
as a list.

Cases run in worker processes forked from a fork server that loaded the node test cases, the
runner and the packager once (no interpreter or CLI start-up per model). onnxruntime can kill a process
(SIGFPE, SIGSEGV): the worker dies, the case is recorded as a crash naming the signal and a new
worker takes the next case. A case that runs past ``timeout`` is killed the same way.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import os
import re
import resource
import shutil
import signal
import tempfile
import time
import unittest
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from tools.conformance.backends import BareOrtBackend, StageFailure, Workspace, edgepack_backend

# Suite parts in report order: (onnx loader kind, runner category, our name).
PARTS = (
    ("node", "NodeModel", "node"),
    ("simple", "SimpleModel", "simple"),
    ("pytorch-converted", "PyTorchConvertedModel", "pytorch-converted"),
    ("pytorch-operator", "PyTorchOperatorModel", "pytorch-operator"),
    ("real", "RealModel", "light"),
)
LIGHT_PREFIX = "onnx/backend/test/data/light/"
DEFAULT_TIMEOUT_S = 420.0


@dataclass(frozen=True)
class Case:
    part: str  # one of the PARTS names
    category: str  # the runner's category (test case class OnnxBackend<category>Test)
    name: str  # the runner's test method, e.g. test_abs_cpu


@dataclass(frozen=True)
class Outcome:
    case: Case
    backend: str
    status: str  # pass | fail | error | skip | crash | timeout
    message: str
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self.case), "backend": self.backend, "status": self.status, "message": self.message,
                "seconds": round(self.seconds, 3)}


# ----------------------------------------------------------------------------- the cases


def _is_plain(model: onnx.ModelProto) -> bool:
    """Plain tensor inputs and outputs only (no sequences, maps, optionals)."""
    return all(v.type.HasField("tensor_type") for v in [*model.graph.input, *model.graph.output])


def _load_case_model(test: Any) -> onnx.ModelProto | None:
    if test.model is not None:
        return test.model
    if test.model_dir is not None:
        return onnx.load(os.path.join(test.model_dir, "model.onnx"))
    if test.url and test.url.startswith(LIGHT_PREFIX):
        return onnx.load(os.path.join(os.path.dirname(os.path.dirname(onnx.__file__)), test.url))
    return None  # a "real" model that would need a download: not part of the suite


def list_cases() -> list[Case]:
    """Every plain-tensor CPU case of the runner, in suite order."""
    from onnx.backend.test.loader import load_model_tests

    cases = []
    for kind, category, part in PARTS:
        with warnings.catch_warnings():  # onnx computes node test outputs, some on purpose inf
            warnings.simplefilter("ignore", RuntimeWarning)
            tests = load_model_tests(kind=kind)
        for test in sorted(tests, key=lambda t: t.name):
            model = _load_case_model(test)
            if model is not None and _is_plain(model):
                cases.append(Case(part, category, f"{test.name}_cpu"))
    return cases


@functools.cache
def runner_classes(backend: type[onnx.backend.base.Backend]) -> dict[str, type[unittest.TestCase]]:
    """onnx's runner over ``backend``: runner category -> its unittest.TestCase class."""
    import onnx.backend.test

    with warnings.catch_warnings():  # onnx computes node test outputs, some on purpose inf
        warnings.simplefilter("ignore", RuntimeWarning)
        runner = onnx.backend.test.BackendTest(backend, __name__)
    return {name.removeprefix("OnnxBackend").removesuffix("Test"): cls for name, cls in runner.test_cases.items()}


@functools.cache
def _runner_tests() -> dict[tuple[str, str], Any]:
    """The runner's test cases by (category, test method name)."""
    from onnx.backend.test.loader import load_model_tests

    index = {}
    for kind, category, _ in PARTS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            tests = load_model_tests(kind=kind)
        index.update({(category, f"{test.name}_cpu"): test for test in tests})
    return index


def expected_outputs(category: str, name: str) -> list[np.ndarray] | None:
    """The expected outputs of a case's first data set, where the runner itself reads them: in
    memory for node tests, ``test_data_set_0/output_N.pb`` beside the model for the shipped
    models, and in ``$ONNX_MODELS`` for the light models (written there by the runner's first run)."""
    test = _runner_tests().get((category, name))
    if test is None:
        return None
    if test.data_sets:
        return [numpy_helper.to_array(o) if isinstance(o, onnx.TensorProto) else np.asarray(o)
                for o in test.data_sets[0][1]]
    folder = Path(test.model_dir or os.path.join(os.environ.get("ONNX_MODELS", ""), test.model_name))
    files = sorted(folder.glob("test_data_set_0/output_*.pb"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    return [numpy_helper.to_array(onnx.TensorProto.FromString(f.read_bytes())) for f in files] or None


# ----------------------------------------------------------------------------- one test


class _Collect(unittest.TestResult):
    """Keeps the one outcome of a single test method, with the exception's own text."""

    def __init__(self) -> None:
        super().__init__()
        self.outcome: tuple[str, str] = ("error", "the test reported nothing")

    def addSuccess(self, test: unittest.TestCase) -> None:  # unittest's API
        self.outcome = ("pass", "")

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self.outcome = ("skip", reason)

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        self.outcome = ("fail", describe(err[1]))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        self.outcome = ("error", describe(err[1]))


def describe(error: BaseException) -> str:
    """``stage: Type: message`` for Edgepack's stages; the runner's own output comparison is
    stage ``compare``; a bare onnxruntime error is ``Type: message``. Bounded, every line kept."""
    if isinstance(error, StageFailure):
        text = str(error)
    elif isinstance(error, AssertionError):
        text = f"compare: {type(error).__name__}: {str(error).strip()}"
    else:
        text = f"{type(error).__name__}: {str(error).strip()}"
    return text[:2000]


def run_test(test_class: type[unittest.TestCase], name: str) -> tuple[str, str, float]:
    """Run one runner test method; return (status, message, seconds)."""
    collect = _Collect()
    started = time.perf_counter()
    test_class(name).run(collect)
    return (*collect.outcome, time.perf_counter() - started)


# ----------------------------------------------------------------------------- workers


_WORKSPACE: list[Workspace] = []  # this worker process's workspace (set by _serve)


def _current_workspace() -> Workspace:
    return _WORKSPACE[-1]


# The default backends, in order: the first is the reference; each next one runs a case only
# when the one before passed it.
DEFAULT_BACKENDS: dict[str, type[onnx.backend.base.Backend]] = {
    "onnxruntime": BareOrtBackend,
    "edgepack": edgepack_backend(_current_workspace),
}


def warm() -> None:
    """Everything a worker needs, loaded once in the fork server so that each worker (and each
    replacement after a crash) starts in milliseconds: the node test cases, the runner's classes
    for the default backends, the packager and the agent runtime."""
    for backend in DEFAULT_BACKENDS.values():
        runner_classes(backend)
    import device_agent.runtime  # noqa: F401
    import sdk.packager.pipeline  # noqa: F401


def _serve(conn: Connection, backends: dict[str, type[onnx.backend.base.Backend]], root: Path,
           data_source: str) -> None:
    """Worker loop: for each case, the reference backend, then (if it passed) the next."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(4)  # a failing case is reported once, by us
    os.environ["ONNX_MODELS"] = str(root / "onnx-models")  # where the runner writes light-model data
    _WORKSPACE.append(Workspace(root / "edgepack", data_source))
    _WORKSPACE[-1].root.mkdir()
    classes = {name: runner_classes(backend) for name, backend in backends.items()}
    try:
        while (job := conn.recv()) is not None:
            category, name = job
            for backend, suite in classes.items():
                conn.send(("start", backend))  # so the parent knows whom to blame if the process dies
                _WORKSPACE[-1].expected = expected_outputs(category, name)
                outcome = run_test(suite[category], name)
                conn.send((backend, outcome))
                _WORKSPACE[-1].clear_cases()
                if outcome[0] != "pass":
                    break
            conn.send(("done", None))
    finally:
        _stop_build_worker()  # reaped: its CPU time joins this process's children
        with contextlib.suppress(OSError):
            conn.send(("cpu", _cpu_seconds()))


def _cpu_seconds() -> float:
    """CPU time of this process and its reaped children (the packager's onnxruntime worker)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _serve_by_name(conn: Connection, backends: dict[str, type[onnx.backend.base.Backend]] | None, root: Path,
                   data_source: str) -> None:
    """The worker's entry point: ``None`` stands for DEFAULT_BACKENDS (whose Edgepack class is
    made at import time and cannot be pickled by reference)."""
    _serve(conn, backends or DEFAULT_BACKENDS, root, data_source)


def _stop_build_worker() -> None:
    """Stop the packager's onnxruntime worker process, if this process started one (forked
    children do not run atexit handlers)."""
    from sdk.packager import ort_host

    shutdown = getattr(ort_host, "shutdown", None)
    if shutdown is not None:
        shutdown()


def _signal_text(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


@dataclass
class _Worker:
    process: Any
    conn: Connection
    root: Path
    case: Case | None = None
    backend: str = ""
    started: float = 0.0

    def stop(self, kill: bool = False) -> float:
        """Stop the worker; return the CPU seconds it reports (0 when killed)."""
        cpu = 0.0
        if kill and self.process.is_alive():
            self.process.kill()
        elif self.process.is_alive():
            with contextlib.suppress(OSError, EOFError):  # a worker that died just now
                self.conn.send(None)
                if self.conn.poll(60):
                    kind, value = self.conn.recv()
                    cpu = float(value) if kind == "cpu" else 0.0
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.conn.close()
        shutil.rmtree(self.root, ignore_errors=True)
        return cpu


class Pool:
    """Workers that each run one case at a time; a dead or stuck worker is replaced.

    Workers are forked from a fork server (a fresh, single-threaded process that imported
    ``tools.conformance.preload``), never from the caller, which may hold threads and
    onnxruntime state (a pytest process does)."""

    def __init__(self, jobs: int, data_source: str, timeout: float,
                 backends: dict[str, type[onnx.backend.base.Backend]] | None = None) -> None:
        """``backends``: module-level classes, in order (default DEFAULT_BACKENDS)."""
        self.jobs, self.data_source, self.timeout = jobs, data_source, timeout
        self.backends = backends or DEFAULT_BACKENDS
        self.cpu_seconds = 0.0  # reported by the workers that stopped normally
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["tools.conformance.preload"])

    def _spawn(self) -> _Worker:
        root = Path(tempfile.mkdtemp(prefix="edgepack-conformance-"))
        parent, child = self.context.Pipe()
        backends = None if self.backends is DEFAULT_BACKENDS else self.backends
        process = self.context.Process(target=_serve_by_name, args=(child, backends, root, self.data_source),
                                       daemon=True)
        process.start()
        child.close()
        return _Worker(process, parent, root)

    def run(self, cases: Iterable[Case], report: Callable[[Outcome], None]) -> None:
        # Slowest first (the light CNNs take a minute or more to build), so that they overlap
        # with the many small node tests instead of finishing alone at the end.
        pending = sorted(cases, key=lambda c: c.part != "light")[::-1]
        workers = [self._spawn() for _ in range(self.jobs)]
        try:
            while pending or any(w.case for w in workers):
                for worker in workers:
                    if worker.case is None and pending:
                        worker.case, worker.started = pending.pop(), time.monotonic()
                        worker.conn.send((worker.case.category, worker.case.name))
                ready = wait([w.conn for w in workers if w.case], timeout=1.0)
                for index, worker in enumerate(workers):
                    workers[index] = self._step(worker, worker.conn in ready, report)
        finally:
            for worker in workers:
                self.cpu_seconds += worker.stop()

    def _step(self, worker: _Worker, ready: bool, report: Callable[[Outcome], None]) -> _Worker:
        """Handle one worker's news; return the worker to use from now on (a new one after a death)."""
        if worker.case is None:
            return worker
        if ready:
            try:
                backend, outcome = worker.conn.recv()
            except (EOFError, OSError):
                return self._replace(worker, "crash", _signal_text(self._exit(worker)), report)
            if backend == "done":
                worker.case = None
            elif backend == "start":
                worker.backend, worker.started = outcome, time.monotonic()
            else:
                report(Outcome(worker.case, backend, outcome[0], outcome[1], outcome[2]))
            return worker
        if time.monotonic() - worker.started > self.timeout:
            return self._replace(worker, "timeout", f"ran past {self.timeout:.0f} s", report)
        return worker

    @staticmethod
    def _exit(worker: _Worker) -> int | None:
        worker.process.join(10)
        return worker.process.exitcode

    def _replace(self, worker: _Worker, status: str, message: str, report: Callable[[Outcome], None]) -> _Worker:
        """Record the case the worker was on as crashed or timed out; start a new worker."""
        assert worker.case is not None
        report(Outcome(worker.case, worker.backend, status, message, time.monotonic() - worker.started))
        worker.stop(kill=True)
        return self._spawn()


def run_suite(cases: Iterable[Case], *, jobs: int = 2, data_source: str = "test_data",
              timeout: float = DEFAULT_TIMEOUT_S, progress: Callable[[Outcome], None] | None = None,
              backends: dict[str, type[onnx.backend.base.Backend]] | None = None,
              cpu: Callable[[float], None] | None = None) -> list[Outcome]:
    """Run ``cases`` on both backends; return every outcome (Edgepack only where onnxruntime passed)."""
    outcomes: list[Outcome] = []

    def report(outcome: Outcome) -> None:
        outcomes.append(outcome)
        if progress is not None:
            progress(outcome)

    pool = Pool(jobs, data_source, timeout, backends)
    pool.run(cases, report)
    if cpu is not None:
        cpu(pool.cpu_seconds)
    return outcomes


# ----------------------------------------------------------------------------- summaries


@dataclass(frozen=True)
class PartCount:
    part: str
    cases: int
    onnxruntime: int
    edgepack: int

    @property
    def rate(self) -> float:
        return self.edgepack / self.onnxruntime if self.onnxruntime else 1.0


def tally(cases: Iterable[Case], outcomes: Iterable[Outcome]) -> list[PartCount]:
    """Per suite part (and a ``total`` row): cases, bare onnxruntime passes, Edgepack passes."""
    passed = {(o.case, o.backend) for o in outcomes if o.status == "pass"}
    counts: dict[str, list[int]] = {part: [0, 0, 0] for _, _, part in PARTS}
    for case in cases:
        row = counts[case.part]
        row[0] += 1
        row[1] += (case, "onnxruntime") in passed
        row[2] += (case, "onnxruntime") in passed and (case, "edgepack") in passed
    rows = [PartCount(part, *values) for part, values in counts.items() if values[0]]
    rows.append(PartCount("total", *(sum(r[i] for r in counts.values()) for i in range(3))))
    return rows


def failure_key(message: str) -> str:
    """Group failures by cause: the stage and error line with numbers and quoted names blanked."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    head = lines[0] if lines else "(no message)"
    head = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", head)
    head = re.sub(r"\b(input|output|sample) [\w.:/-]+", r"\1 …", head)
    head = re.sub(r"\[[^\]]*\]", "[…]", head)
    head = re.sub(r"\b\d+(\.\d+)?(e-?\d+)?\b", "N", head)
    return head[:200]


@dataclass(frozen=True)
class Category:
    key: str
    count: int
    example: str
    message: str


def categories(outcomes: Iterable[Outcome], backend: str) -> list[Category]:
    """Failure categories of one backend, largest first, each with an example and its message."""
    groups: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        if outcome.backend == backend and outcome.status != "pass":
            groups.setdefault(failure_key(f"{outcome.status}: {outcome.message}"), []).append(outcome)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    return [Category(key, len(items), items[0].case.name, items[0].message) for key, items in ordered]


def status_counts(outcomes: Iterable[Outcome], backend: str) -> Counter[str]:
    return Counter(o.status for o in outcomes if o.backend == backend)
