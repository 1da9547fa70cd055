"""Run one call beside the caller, for ``edgepack-agent predict``'s cold start.

predict verifies and extracts the artifact while it imports onnxruntime, numpy and the
runtime. Two ways to run the verification beside the imports:

- :class:`OnThread`: a thread. Verification spends most of its time in zlib and sha256,
  which release the GIL, but a thread coming back from C waits up to the interpreter's switch
  interval (5 ms) for the GIL while the importing thread runs Python: beside busy imports a
  35-44 ms walk took 110-180 ms (BENCHMARKS.md, "Cold start"), most of it on the answer's
  critical path.
- :class:`Forked`: a forked copy of this process, which holds no GIL of ours and runs on the
  other core (a Raspberry Pi and a Jetson have four). It verifies and extracts into the
  caller's private temporary folder, then hands back the value (a pickle through a pipe only
  the two processes hold: the same program, not outside data) or the error it raised. A child
  that dies without an answer (a signal, the OOM killer) is one error naming how it ended.

Forking is safe only while no thread of ours exists (a forked copy of a process with threads
holds their locks in whatever state they were), so predict forks before onnxruntime is imported
and its thread pools made, and only when it is the program itself; called in-process (tests,
embedding) it uses the thread. numpy is already loaded then (the verifier's modules need it):
OpenBLAS shuts its pool down across a fork through its own atfork handler, and the child never
calls BLAS.
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Callable
from typing import Any

from device_agent.errors import BackgroundError

# The answer is a verified artifact's manifest and paths: a few kB. A child writing more is not
# the program this module forked; the cap keeps a broken child from filling the parent's memory.
MAX_ANSWER_BYTES = 64 * 1024 * 1024


class OnThread:
    """One call on its own thread; :meth:`result` joins it and returns its value or raises its
    error."""

    def __init__(self, call: Callable[..., Any], *args: Any) -> None:
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call, args), name="verify", daemon=True)
        self._thread.start()

    def _run(self, call: Callable[..., Any], args: tuple[Any, ...]) -> None:
        try:
            self._value = call(*args)
        except BaseException as err:  # handed to the caller by result()
            self._error = err

    def wait(self) -> None:
        """Until the call has ended (it may still be writing into the caller's folders)."""
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class Forked:
    """One call in a forked child; :meth:`result` waits for it and returns its value or raises
    the error it raised. Create it before any thread exists in this process."""

    def __init__(self, call: Callable[..., Any], *args: Any) -> None:
        read_end, write_end = os.pipe()
        try:
            self._pid = os.fork()
        except OSError:
            os.close(read_end)
            os.close(write_end)
            raise
        if self._pid == 0:  # the child: never returns
            os.close(read_end)
            _child(write_end, call, args)
        os.close(write_end)
        self._read_end = read_end
        self._answer: tuple[bool, Any] | None = None

    def wait(self) -> None:
        """Until the child has ended and its answer is read."""
        if self._answer is not None:
            return
        try:
            data = _read_bounded(self._read_end)
        finally:
            os.close(self._read_end)
            _, status = os.waitpid(self._pid, 0)
        self._answer = _decode(data, status)

    def result(self) -> Any:
        self.wait()
        assert self._answer is not None
        ok, value = self._answer
        if not ok:
            raise value
        return value


def beside(call: Callable[..., Any], *args: Any, fork: bool) -> Forked | OnThread:
    """``call(*args)`` in a forked child when ``fork`` (and the system can fork now), else on a
    thread: a fork refused for want of memory or processes (EAGAIN, ENOMEM) still verifies."""
    if fork:
        try:
            return Forked(call, *args)
        except OSError:
            pass
    return OnThread(call, *args)


def _child(write_end: int, call: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Run the call, write ``(ok, value or error)`` and end without the interpreter's teardown
    (no atexit handler, no flush of buffers the parent also holds)."""
    code = 0
    try:
        try:
            answer: tuple[bool, Any] = (True, call(*args))
        except BaseException as err:  # handed to the parent, which raises it
            answer = (False, _portable(err))
        data = _pickled(answer)
        view = memoryview(data)
        while view:
            view = view[os.write(write_end, view):]
    except BaseException:
        code = 70  # EX_SOFTWARE: the parent reports the exit status
    finally:
        os._exit(code)


_MAX_CAUSES = 8
"""Causes carried back with an error (``raise ... from err``), for ``-v``; deeper ones are dropped."""


def _pickled(answer: tuple[bool, Any]) -> bytes:
    """The answer's bytes. An error whose cause does not pickle goes without its cause; one
    that does not pickle itself (or a value) becomes a BackgroundError keeping its line."""
    tries = [answer] if answer[0] else [answer, (False, answer[1][:3])]
    problem: Exception | None = None
    for attempt in tries:
        try:
            return pickle.dumps(attempt, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as err:  # something that does not pickle: try the next, then keep its line
            problem = err
    line = f"{answer[1][0].__name__}: {answer[1][1]}" if not answer[0] else f"unpicklable answer: {problem}"
    return pickle.dumps((False, _portable(BackgroundError(line))))


def _portable(err: BaseException, depth: int = 0) -> tuple[Any, ...]:
    """An error as its class, arguments, attributes and (taken apart the same way) its cause:
    pickling the error itself calls its ``__init__`` again with ``args`` only, which fails for
    errors with required keyword arguments, and drops ``__cause__``."""
    cause = err.__cause__ if depth < _MAX_CAUSES else None
    return type(err), err.args, dict(vars(err)), None if cause is None else _portable(cause, depth + 1)


def _rebuilt(portable: Any) -> BaseException:
    """The error :func:`_portable` took apart, without calling its ``__init__``."""
    cls, args, state, *cause = portable
    if not (isinstance(cls, type) and issubclass(cls, BaseException) and isinstance(args, tuple)
            and isinstance(state, dict)):
        return BackgroundError("the verifying process's answer is garbled")
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    if cause and isinstance(cause[0], tuple) and len(cause[0]) == 4:
        err.__cause__ = _rebuilt(cause[0])
    return err


def _read_bounded(fd: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > MAX_ANSWER_BYTES:
            raise BackgroundError(f"the verifying process answered more than {MAX_ANSWER_BYTES} bytes")
        chunks.append(chunk)


def _decode(data: bytes, status: int) -> tuple[bool, Any]:
    """The child's answer, or the one error that says how it ended without one. Pure."""
    if not data:
        if os.WIFSIGNALED(status):
            return False, BackgroundError(f"the verifying process was killed by signal {os.WTERMSIG(status)}")
        return False, BackgroundError(f"the verifying process exited with status {os.waitstatus_to_exitcode(status)} "
                                      "without an answer")
    try:
        answer = pickle.loads(data)  # our own forked copy, through our own pipe
    except Exception as err:
        return False, BackgroundError(f"the verifying process's answer is garbled ({type(err).__name__})")
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], bool)):
        return False, BackgroundError("the verifying process's answer is garbled")
    if answer[0]:
        return answer
    if not (isinstance(answer[1], tuple) and len(answer[1]) in (3, 4)):
        return False, BackgroundError("the verifying process's answer is garbled")
    return False, _rebuilt(answer[1])
