"""onnxruntime on the host: every session of a build lives in one worker process.

A build creates onnxruntime sessions to validate, calibrate, make golden samples and measure.
A kernel that dies by a signal (SIGFPE, SIGSEGV, an abort, the out-of-memory killer) would take
``edgepack build`` with it and print nothing. So sessions live in a child process
(:mod:`sdk.packager.ort_worker`), started once and reused by every pass of a build and by every
later build of the same process (the conformance driver runs thousands); the child caches
sessions by model hash. When the child dies, the call that was running raises
:class:`OrtCrashError` naming the pass, the model, the sample and the signal, and the next call
starts a fresh child.

The pass name comes from :func:`in_pass` (the pipeline wraps each pass in it); the model's name
from :func:`in_pass`'s ``model`` or a call's ``label``.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

try:
    import fcntl
except ImportError:  # not on Windows
    fcntl = None  # type: ignore[assignment]

from sdk.errors import BuildError, OrtCrashError
from sdk.packager.ort_worker import read_message, write_message

__all__ = ["ModelIO", "OrtWorker", "call_in_worker", "describe", "in_pass", "measure_latency", "optimize_offline",
           "prestart", "release_sessions", "run_feeds", "set_verbose", "shutdown", "worker"]

_PASS: contextvars.ContextVar[str] = contextvars.ContextVar("edgepack_ort_pass", default="onnxruntime")
_MODEL: contextvars.ContextVar[str] = contextvars.ContextVar("edgepack_ort_model", default="")
_ROOT = Path(__file__).resolve().parents[2]
@contextlib.contextmanager
def in_pass(name: str, *, model: str | None = None) -> Iterator[None]:
    """Name the pass (and optionally the model) that crash and error messages mention."""
    pass_token = _PASS.set(name)
    model_token = _MODEL.set(model) if model is not None else None
    try:
        yield
    finally:
        _PASS.reset(pass_token)
        if model_token is not None:
            _MODEL.reset(model_token)


def _model_label(key: str, label: str | None) -> str:
    name = label or _MODEL.get() or "the model"
    return f"{name} (sha256 {key[:12]})" if not key.startswith("path:") else name


class OrtWorker:
    """One onnxruntime worker process and the pipe to it. Thread-safe; restarts after a death."""

    def __init__(self, *, verbose: bool = False) -> None:
        self.verbose = verbose
        self._proc: subprocess.Popen[bytes] | None = None
        self._owner = os.getpid()
        self._lock = threading.RLock()
        self._greeted = False
        self.starts = 0

    # -- process -------------------------------------------------------------------------------
    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH", "")) if p)
        env.setdefault("PYTHONWARNINGS", "default" if self.verbose else "ignore")
        args = [sys.executable, "-m", "sdk.packager.ort_worker", "--parent", str(os.getpid()),
                *(["--verbose"] if self.verbose else [])]
        try:  # the parent's working directory, so relative paths mean the same on both sides
            proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=None if self.verbose else subprocess.DEVNULL, env=env)
        except OSError as err:
            raise BuildError(_PASS.get(), f"cannot start the onnxruntime worker ({sys.executable}): "
                                          f"{err.strerror or err}") from err
        for stream in (proc.stdin, proc.stdout):
            _widen_pipe(stream)
        self._proc, self._owner, self._greeted = proc, os.getpid(), False
        self.starts += 1
        return proc

    def prestart(self) -> None:
        """Start the process now without waiting for it, so its start-up (importing
        onnxruntime) overlaps the work before the first session is needed."""
        with self._lock:
            self._process()

    def _process(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is None or self._owner != os.getpid() or proc.poll() is not None:
            if proc is not None and self._owner == os.getpid():
                self._reap(proc)
            return self._start()
        return proc

    def _reap(self, proc: subprocess.Popen[bytes]) -> int | None:
        for stream in (proc.stdin, proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()
        finally:
            if self._proc is proc:
                self._proc = None

    def close(self) -> None:
        """Stop the worker (it exits when its pipe closes); the next call starts a new one."""
        with self._lock:
            proc = self._proc
            if proc is not None and self._owner == os.getpid():
                with contextlib.suppress(OSError):
                    assert proc.stdin is not None
                    write_message(proc.stdin, {"op": "shutdown"})
                self._reap(proc)
            self._proc = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    # -- requests ------------------------------------------------------------------------------
    def _receive(self, proc: subprocess.Popen[bytes], pass_name: str, model: str, doing: str) -> Any:
        try:
            assert proc.stdout is not None
            answer = read_message(proc.stdout)
        except (EOFError, ConnectionError):  # the worker died mid-message (not a signal's exception here)
            answer = None
        if answer is None:
            raise OrtCrashError(pass_name, model, doing, self._reap(proc))
        return answer

    def request(self, message: dict[str, Any], *, model: str, doing: str, progress: str = "") -> tuple[Any, ...]:
        """Send one request and return the worker's answer tuple; a death raises OrtCrashError.
        ``progress`` (e.g. ``"sample {}"``) names what a ``("progress", n)`` message started,
        so a crash after it is named by it."""
        pass_name = _PASS.get()
        with self._lock:
            proc = self._process()
            try:
                if not self._greeted:
                    self._receive(proc, pass_name, "the onnxruntime worker", "start-up")
                    self._greeted = True
                try:
                    assert proc.stdin is not None
                    write_message(proc.stdin, message)
                except ConnectionError as err:  # BrokenPipeError: the worker is gone
                    raise OrtCrashError(pass_name, model, doing, self._reap(proc)) from err
                answer: tuple[Any, ...] = self._receive(proc, pass_name, model, doing)
                while answer[0] == "progress":
                    doing = progress.format(answer[1]) if progress else doing
                    answer = self._receive(proc, pass_name, model, doing)
            except OrtCrashError:
                raise
            except BaseException:
                # Interrupted mid-message (Ctrl-C, a timeout signal in a driver): the pipe may hold
                # half a request or a late answer, so only a fresh worker is a safe state.
                proc.kill()
                self._reap(proc)
                raise
            return answer

    def call(self, message: dict[str, Any], *, model: str, doing: str, progress: str = "") -> Any:
        """A request whose error answers become :class:`BuildError` for the current pass."""
        answer = self.request(message, model=model, doing=doing, progress=progress)
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "missing":
            return _MISSING
        if len(answer) > 3 and progress:
            doing = progress.format(answer[3])
        raise BuildError(_PASS.get(), f"{answer[2]} [{doing} of {model}]" if answer[1] == "ort" else answer[2])

    def session_call(self, model: bytes | str, message: dict[str, Any], *, threads: int = 0, label: str | None,
                     doing: str, key: str | None = None, progress: str = "") -> Any:
        """A request on a cached session; loads the model first when the worker lacks it.
        ``key`` (from :func:`model_key`) saves re-hashing a large model on every call."""
        key = key or model_key(model, threads)
        name = _model_label(key, label)
        with self._lock:
            result = self.call({**message, "key": key}, model=name, doing=doing, progress=progress)
            if result is _MISSING:
                source = model if isinstance(model, bytes) else str(Path(model).resolve())
                self.call({"op": "load", "key": key, "model": source, "threads": threads}, model=name,
                          doing="session creation")
                result = self.call({**message, "key": key}, model=name, doing=doing, progress=progress)
            return result


_MISSING = object()
_PIPE_BYTES = 1 << 20
_CHUNK_BYTES = 64 << 20


def _widen_pipe(stream: Any) -> None:
    """Ask Linux for a 1 MiB pipe buffer (default 64 KiB): a 600 KB image tensor then crosses
    in one write instead of ten context switches. Best effort; other systems keep the default."""
    setsize = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    if stream is None or setsize is None:
        return
    with contextlib.suppress(OSError):
        fcntl.fcntl(stream.fileno(), setsize, _PIPE_BYTES)


def model_key(model: bytes | str | os.PathLike[str], threads: int = 0) -> str:
    """The cache key of a model's session in the worker: content hash for bytes; resolved path,
    size and mtime for a file (so external data files next to it keep working)."""
    if isinstance(model, bytes):
        digest = hashlib.sha256(model).hexdigest()
    else:
        path = Path(model).resolve()
        try:
            stat = path.stat()
        except OSError as err:
            raise BuildError(_PASS.get(), f"cannot read model {path}: {err.strerror}") from err
        digest = f"path:{path}:{stat.st_size}:{stat.st_mtime_ns}"
    return f"{digest}:t{threads}"


# -- the process-wide worker ------------------------------------------------------------------

_WORKER: OrtWorker | None = None
_VERBOSE = False
_GLOBAL_LOCK = threading.Lock()


def worker() -> OrtWorker:
    """The worker shared by every build of this process (stopped at exit)."""
    global _WORKER
    with _GLOBAL_LOCK:
        if _WORKER is None or _WORKER.verbose != _VERBOSE:
            if _WORKER is not None:
                _WORKER.close()
            _WORKER = OrtWorker(verbose=_VERBOSE)
        return _WORKER


def prestart() -> None:
    """Start the shared worker in the background (a build calls this first)."""
    worker().prestart()


def set_verbose(verbose: bool) -> None:
    """``-v``: let onnxruntime's own log lines and the worker's stderr reach the terminal."""
    global _VERBOSE
    _VERBOSE = bool(verbose)


def shutdown() -> None:
    """Stop the shared worker (registered with atexit; safe to call any time)."""
    global _WORKER
    with _GLOBAL_LOCK:
        if _WORKER is not None:
            _WORKER.close()
            _WORKER = None


atexit.register(shutdown)


def release_sessions(models: Sequence[bytes | str] | None = None) -> None:
    """Free cached sessions in the worker (all of them by default); the worker keeps running."""
    if _WORKER is None or _WORKER.pid is None:
        return
    keys = None if models is None else [model_key(m) for m in models]
    with contextlib.suppress(OrtCrashError):  # a worker that died holds no sessions: done either way
        _WORKER.call({"op": "release", "keys": keys}, model="cached sessions", doing="release")


# -- what the passes call ---------------------------------------------------------------------

@dataclass(frozen=True)
class ModelIO:
    """A model's inputs and outputs as onnxruntime sees them: name, type string
    (``tensor(float)``) and shape (int, symbolic name, or None)."""

    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]


def describe(model: bytes | str, *, label: str | None = None, key: str | None = None) -> ModelIO:
    """Inputs and outputs of the model's session in the worker (creating it if needed)."""
    info = worker().session_call(model, {"op": "describe"}, label=label, doing="session creation", key=key)
    return ModelIO(info["inputs"], info["outputs"])


def run_feeds(model: bytes | str, feeds: Sequence[dict[str, np.ndarray]], *, label: str | None = None,
              carry: Mapping[str, str] | None = None, resets: Sequence[bool] | None = None
              ) -> list[dict[str, np.ndarray]]:
    """Run each feed through the model in the worker; output dicts by name, in feed order.

    ``carry`` (state input -> output) with ``resets`` (per feed: True where a stream starts,
    from the feed's own state values) runs the feeds as streams, as the agent does: every other
    feed's state inputs are the carried outputs of the feed before it, the model's own, so a
    lossy model's error accumulates through its state as it would on a device. The worker
    carries the state within a request; across requests (large data is split) it is carried
    here."""
    host, key = worker(), model_key(model)
    names = [o["name"] for o in describe(model, label=label, key=key).outputs]
    carry = dict(carry or {})
    flags = list(resets) if resets is not None else [True] * len(feeds)
    results: list[dict[str, np.ndarray]] = []
    for first, chunk in _chunks(feeds):
        message: dict[str, Any] = {"op": "run_many", "feeds": chunk, "first": first}
        if carry:
            message.update(carry=carry, resets=flags[first:first + len(chunk)])
            if results and not flags[first]:  # a stream that goes on from the request before
                chunk[0] = {**chunk[0], **{name: results[-1][output] for name, output in carry.items()}}
        batch = host.session_call(model, message, label=label, doing=f"sample {first}", progress="sample {}", key=key)
        results.extend(dict(zip(names, values, strict=True)) for values in batch)
    return results


def _chunks(feeds: Sequence[dict[str, np.ndarray]]) -> Iterator[tuple[int, list[dict[str, np.ndarray]]]]:
    """Feeds in requests of at most ``_CHUNK_BYTES`` (at least one feed each), with the index
    of each request's first feed: few round trips, and a bounded message size."""
    chunk: list[dict[str, np.ndarray]] = []
    first = size = 0
    for index, feed in enumerate(feeds):
        nbytes = sum(int(getattr(v, "nbytes", 0)) for v in feed.values())
        if chunk and size + nbytes > _CHUNK_BYTES:
            yield first, chunk
            chunk, first, size = [], index, 0
        chunk.append(feed)
        size += nbytes
    if chunk:
        yield first, chunk


def measure_latency(model: bytes | str, feed: dict[str, np.ndarray], *, runs: int, warmup: int = 3,
                    threads: int = 0, label: str | None = None) -> list[float]:
    """Seconds per run, timed inside the worker next to the session."""
    times: list[float] = worker().session_call(model, {"op": "bench", "feed": feed, "runs": runs, "warmup": warmup},
                                               threads=threads, label=label, doing="the benchmark runs")
    return times


def optimize_offline(model_bytes: bytes, level: str, *, label: str | None = None,
                     disabled: tuple[str, ...] = ()) -> bytes:
    """onnxruntime's offline graph optimization (level disable|basic|extended|all), run in the
    worker, without the optimizers named in ``disabled`` (``ConstantFolding``); the optimized
    model's bytes. Failures raise BuildError for the current pass."""
    key = hashlib.sha256(model_bytes).hexdigest()
    name = _model_label(key, label)
    request = {"op": "optimize", "model": model_bytes, "level": level, "disabled": list(disabled)}
    optimized: bytes = worker().call(request, model=name, doing="graph optimization")
    return optimized


def call_in_worker(target: str, *args: Any, label: str | None = None, doing: str = "a call", **kwargs: Any) -> Any:
    """Run ``module:function`` (in this package) inside the worker: for library code that
    creates onnxruntime sessions itself, such as onnxruntime.quantization's calibration."""
    name = label or _MODEL.get() or "the model"
    return worker().call({"op": "call", "target": target, "args": args, "kwargs": kwargs}, model=name, doing=doing)
