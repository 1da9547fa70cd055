"""The onnxruntime worker: a child process that owns every onnxruntime session of a build.

Why a separate process: onnxruntime kernels can die by a signal on inputs they do not expect
(integer division by zero in STFT is a SIGFPE, some voice models end in SIGSEGV), and the
out-of-memory killer takes whichever process holds the memory. Inside the build process any of
these ends ``edgepack build`` with no message at all. Here the worker dies instead; the parent
(:mod:`sdk.packager.ort_host`) sees the signal, names the pass, the model and the sample in
one line, and starts a fresh worker the next time one is needed.

Protocol (private, parent <-> own child, never a network peer): each message is an 8-byte
big-endian length followed by a pickle. The parent sends a dict with an ``op``; the worker
answers ``("ok", value)``, ``("missing",)`` when a session key is not (or no longer) cached,
or ``("error", kind, message[, sample])``, after any number of ``("progress", sample)``
messages for a request that runs several samples. The worker's own stdout is moved to its stderr at start so a
stray print from a library can never corrupt the protocol stream.

Sessions are cached by the key the parent computes (sha256 of the model bytes, or path, size
and mtime, plus thread count), least recently used first out, bounded in count and in model
bytes, so thousands of builds in one process stay within memory.

Every session is created with the graph optimizers :mod:`edgepack_core.ort_workarounds` turns
off for the model: on x86-64 a model that holds float16 compute runs without
``NchwcTransformer`` (microsoft/onnxruntime issue 28392, a SIGSEGV while the session is
created). Whether it holds float16 is read from the model itself (:func:`holds_float16`), once
per session and only on x86-64: the build's precision does not describe every model a build
loads (the fp32 reference next to its fp16 conversion, search candidates, a source model that
was float16 already), while the graph does, and the check costs one protobuf parse next to
onnxruntime's own.
"""

from __future__ import annotations

import importlib
import os
import pickle
import platform
import signal
import struct
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any

from edgepack_core import faults
from edgepack_core.ort_workarounds import disabled_optimizers
from sdk.errors import HostError

HEADER = struct.Struct(">Q")
MAX_SESSIONS = 8
MAX_CACHED_BYTES = 1 << 30
# The parent only sends calls into its own package; anything else is refused.
CALLABLE_PREFIX = "sdk."
FLOAT16 = 10  # onnx.TensorProto.FLOAT16


def holds_float16(model: Any) -> bool:
    """Whether an ``onnx.ModelProto`` computes anything in float16: a float16 initializer, graph
    input, output or value_info, a Cast or CastLike to float16, a node attribute that is a float16
    tensor (Constant, ConstantOfShape) or a ``dtype`` of float16, in the main graph, any subgraph
    (If, Loop, Scan) or a model-local function."""
    graphs = [model.graph]
    nodes: list[Any] = [node for function in model.functions for node in function.node]
    while graphs:
        graph = graphs.pop()
        if any(t.data_type == FLOAT16 for t in graph.initializer) or any(
                t.values.data_type == FLOAT16 for t in graph.sparse_initializer):
            return True
        if any(_type_is_float16(v.type) for v in (*graph.input, *graph.output, *graph.value_info)):
            return True
        nodes.extend(graph.node)
        while nodes:
            node = nodes.pop()
            for attribute in node.attribute:
                if (attribute.name in ("to", "dtype") and attribute.i == FLOAT16) or attribute.t.data_type == FLOAT16:
                    return True
                graphs.extend([attribute.g] if attribute.HasField("g") else attribute.graphs)
    return False


def _type_is_float16(value_type: Any) -> bool:
    """A TypeProto of float16 elements: a tensor, or a sequence, optional or map value of them."""
    kind = value_type.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        return bool(getattr(value_type, kind).elem_type == FLOAT16)
    if kind in ("sequence_type", "optional_type"):
        return _type_is_float16(getattr(value_type, kind).elem_type)
    if kind == "map_type":
        return _type_is_float16(value_type.map_type.value_type)
    return False


def session_workarounds(model: bytes | str) -> dict[str, Any]:
    """The keyword arguments of ``InferenceSession`` that work around onnxruntime's bugs for this
    model on this host (``{}`` or ``{"disabled_optimizers": [...]}``). The model is parsed only
    where the answer can depend on it (x86-64); a path's external data is not read."""
    machine = platform.machine()
    if not disabled_optimizers(float16=True, machine=machine):
        return {}
    import onnx

    try:
        proto = (onnx.load_model_from_string(model) if isinstance(model, bytes)
                 else onnx.load_model(model, load_external_data=False))
    except Exception:  # not readable as ONNX here: onnxruntime's own error says why
        return {}
    names = disabled_optimizers(float16=holds_float16(proto), machine=machine)
    return {"disabled_optimizers": list(names)} if names else {}


def read_message(stream: IO[bytes]) -> Any:
    """One framed message, or None at a clean end of stream (the other side closed)."""
    header = _read_exactly(stream, HEADER.size)
    if header is None:
        return None
    (length,) = HEADER.unpack(header)
    body = _read_exactly(stream, length)
    if body is None:
        raise EOFError(f"stream ended inside a {length}-byte message")
    return pickle.loads(body)


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    chunks, left = [], size
    while left:
        chunk = stream.read(left)
        if not chunk:
            if left == size:
                return None
            raise EOFError("stream ended inside a message")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def write_message(stream: IO[bytes], message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(HEADER.pack(len(body)) + body)
    stream.flush()


def ort_message(err: BaseException) -> str:
    """Every line of onnxruntime's text that says what is wrong, joined on one line.

    onnxruntime puts the useful part on later lines (``index: 0 Got: 1 Expected: 3``); only the
    ``[ONNXRuntimeError] : 2 : INVALID_ARGUMENT :`` prefix and blank lines are dropped."""
    text = str(err) or type(err).__name__
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if lines and lines[0].startswith("[ONNXRuntimeError]"):
        parts = lines[0].split(" : ", 3)
        lines[0] = parts[3] if len(parts) == 4 else lines[0]
    message = " ".join(lines)
    return message if len(message) <= 4000 else message[:4000] + " …"


class _Missing(HostError):
    """The session key is not cached (never loaded, or evicted): the parent loads and retries."""


class Worker:
    """The request handler; one per worker process."""

    def __init__(self, verbose: bool) -> None:
        import onnxruntime as ort

        self.ort = ort
        # Severity 4 (fatal only) keeps onnxruntime's own log lines off the terminal; -v shows
        # warnings and errors.
        self.severity = 2 if verbose else 4
        ort.set_default_logger_severity(self.severity)
        self.sessions: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self.answers: IO[bytes] | None = None  # the answer stream, for progress messages

    def handle(self, request: dict[str, Any]) -> tuple[Any, ...]:
        op = request.get("op")
        handler = getattr(self, f"op_{op}", None)
        if handler is None:
            return ("error", "protocol", f"unknown op {op!r}")
        try:
            return handler(request)
        except _Missing:
            return ("missing",)

    # -- sessions ----------------------------------------------------------------------------
    def _options(self, threads: int) -> Any:
        options = self.ort.SessionOptions()
        options.log_severity_level = self.severity
        if threads:
            options.intra_op_num_threads = threads
        return options

    def op_load(self, request: dict[str, Any]) -> tuple[Any, ...]:
        key, model, threads = request["key"], request["model"], int(request.get("threads", 0))
        try:
            session = self.ort.InferenceSession(model, self._options(threads), providers=["CPUExecutionProvider"],
                                                **session_workarounds(model))
        except Exception as err:  # onnxruntime raises its own untyped exceptions
            return ("error", "ort", f"cannot create a session: {ort_message(err)}")
        size = len(model) if isinstance(model, bytes) else _file_size(model)
        self.sessions[key] = (session, size)
        self._evict()
        return ("ok", _describe(session))

    def _evict(self) -> None:
        while len(self.sessions) > MAX_SESSIONS or (
                len(self.sessions) > 1 and sum(size for _, size in self.sessions.values()) > MAX_CACHED_BYTES):
            self.sessions.popitem(last=False)

    def _session(self, key: str) -> Any:
        if key not in self.sessions:
            raise _Missing(key)
        self.sessions.move_to_end(key)
        return self.sessions[key][0]

    def op_describe(self, request: dict[str, Any]) -> tuple[Any, ...]:
        return ("ok", _describe(self._session(request["key"])))

    def op_run_many(self, request: dict[str, Any]) -> tuple[Any, ...]:
        """Several samples in one request. Before each, a ``("progress", index)`` message tells
        the parent which sample is running (a crash is named by it) without waiting for the
        parent: the samples run back to back, whatever the parent's scheduling.

        With ``carry`` (state input -> output) and ``resets`` (one flag per feed), a feed whose
        flag is false gets the carried outputs of the feed before it in place of its own state
        inputs, as the agent runs a stream's frames: the state crosses no pipe per frame."""
        session = self._session(request["key"])
        names = [o.name for o in session.get_outputs()]
        first = int(request.get("first", 0))
        carry = request.get("carry") or {}
        missing = sorted(output for output in carry.values() if output not in names)
        if missing:
            return ("error", "ort", f"the model has no output {', '.join(missing)} to carry into its state", first)
        slots = {name: names.index(output) for name, output in carry.items()}
        resets = request.get("resets") or [True] * len(request["feeds"])
        results: list[Any] = []
        for index, (feed, reset) in enumerate(zip(request["feeds"], resets, strict=True), start=first):
            if self.answers is not None:
                write_message(self.answers, ("progress", index))
            faults.point("ort-worker")
            if slots and results and not reset:
                feed = {**feed, **{name: results[-1][slot] for name, slot in slots.items()}}
            try:
                results.append(session.run(names, feed))
            except Exception as err:
                return ("error", "ort", f"inference failed: {ort_message(err)}", index)
        return ("ok", results)

    def op_bench(self, request: dict[str, Any]) -> tuple[Any, ...]:
        """Latencies measured here, next to the session, so the pipe never enters the timing."""
        session = self._session(request["key"])
        faults.point("ort-worker")
        feed, names = request["feed"], [o.name for o in session.get_outputs()]
        times = []
        try:
            for _ in range(int(request.get("warmup", 0))):
                session.run(names, feed)
            for _ in range(int(request["runs"])):
                started = time.perf_counter()
                session.run(names, feed)
                times.append(time.perf_counter() - started)
        except Exception as err:
            return ("error", "ort", f"inference failed: {ort_message(err)}")
        return ("ok", times)

    def op_release(self, request: dict[str, Any]) -> tuple[Any, ...]:
        keys = request.get("keys")
        for key in list(self.sessions) if keys is None else keys:
            self.sessions.pop(key, None)
        return ("ok", len(self.sessions))

    def op_ping(self, request: dict[str, Any]) -> tuple[Any, ...]:
        return ("ok", {"pid": os.getpid(), "sessions": list(self.sessions), "onnxruntime": self.ort.__version__})

    # -- whole-model jobs ----------------------------------------------------------------------
    def op_optimize(self, request: dict[str, Any]) -> tuple[Any, ...]:
        """onnxruntime's offline graph optimization: the optimized model's bytes."""
        ort, level = self.ort, request["level"]
        options = self._options(0)
        options.graph_optimization_level = {
            "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}[level]
        with tempfile.TemporaryDirectory(prefix="edgepack-ort-opt-") as folder:
            target = Path(folder) / "optimized.onnx"
            options.optimized_model_filepath = str(target)
            workarounds = session_workarounds(request["model"])
            disabled = sorted({*workarounds.pop("disabled_optimizers", ()), *request.get("disabled", ())})
            try:
                ort.InferenceSession(request["model"], options, providers=["CPUExecutionProvider"],
                                     **workarounds, **({"disabled_optimizers": disabled} if disabled else {}))
            except Exception as err:
                return ("error", "ort", ort_message(err))
            return ("ok", target.read_bytes())

    def op_call(self, request: dict[str, Any]) -> tuple[Any, ...]:
        """Run one function of this package here (quantization and its calibration sessions)."""
        target = request["target"]
        module_name, _, function_name = target.partition(":")
        if not module_name.startswith(CALLABLE_PREFIX) or not function_name:
            return ("error", "protocol", f"refused call target {target!r}")
        function = getattr(importlib.import_module(module_name), function_name)
        faults.point("ort-worker")
        try:
            return ("ok", function(*request.get("args", ()), **request.get("kwargs", {})))
        except Exception as err:  # reported to the parent, which raises a typed error
            return ("error", "python", f"{type(err).__name__}: {ort_message(err)}")


def _file_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _describe(session: Any) -> dict[str, list[dict[str, Any]]]:
    def spec(value: Any) -> dict[str, Any]:
        shape = value.shape if isinstance(value.shape, list) else []
        return {"name": value.name, "type": value.type, "shape": [d if isinstance(d, int) else d or None
                                                                   for d in shape]}

    return {"inputs": [spec(i) for i in session.get_inputs()], "outputs": [spec(o) for o in session.get_outputs()]}


def _exit_when_orphaned(parent: int, period_s: float = 1.0) -> None:
    """Leave when the parent is gone, even in the middle of a kernel that never returns (a
    closed pipe is only noticed between requests): a killed build leaves no worker behind."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(3)

    threading.Thread(target=watch, name="edgepack-orphan-watch", daemon=True).start()


def serve(verbose: bool, parent: int | None = None) -> int:
    """The worker's loop: read requests until the parent closes the pipe."""
    # Ctrl-C reaches the whole process group; the parent decides what it means and closes us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_when_orphaned(parent or os.getppid())
    requests = sys.stdin.buffer
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    worker = Worker(verbose)
    worker.answers = answers
    write_message(answers, ("ok", {"pid": os.getpid(), "onnxruntime": worker.ort.__version__}))
    while True:
        request = read_message(requests)
        if request is None or request.get("op") == "shutdown":
            return 0
        try:
            answer = worker.handle(request)
        except Exception as err:  # a bug in a handler: report it rather than die silently
            answer = ("error", "python", f"{type(err).__name__}: {err}")
        write_message(answers, answer)


def _parent_argument(argv: list[str]) -> int | None:
    return int(argv[argv.index("--parent") + 1]) if "--parent" in argv[:-1] else None


if __name__ == "__main__":
    sys.exit(serve(verbose="--verbose" in sys.argv[1:], parent=_parent_argument(sys.argv[1:])))
