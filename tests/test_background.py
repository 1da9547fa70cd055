"""predict's verification beside its imports: a forked child (device_agent/background.py) hands
back the value or the very error it raised, and a child that ends without an answer is one
error naming how. The forking cases run in a fresh interpreter (pytest's own process may hold
threads, which a fork must not copy); the decoding of the child's answer is pure."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest

from device_agent import background
from device_agent.background import BackgroundError, OnThread
from edgepack_core.errors import ArtifactError


def run_program(body: str) -> subprocess.CompletedProcess:
    program = "import os, sys, signal\nfrom device_agent.background import Forked\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False)


def test_forked_child_hands_back_its_value_and_runs_in_another_process():
    done = run_program("""
        value = Forked(lambda n: (os.getpid(), list(range(n))), 5).result()
        print(value[0] != os.getpid(), value[1])
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True [0, 1, 2, 3, 4]\n"


def test_forked_child_error_is_raised_in_the_parent_with_its_type_and_fields():
    done = run_program("""
        from edgepack_core.errors import ArtifactError
        def refuse():
            raise ArtifactError("member model.onnx: sha256 mismatch", artifact="a.edgepkg")
        try:
            Forked(refuse).result()
        except ArtifactError as err:
            print(type(err).__name__, err.artifact, err, err.exit_code)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "ArtifactError a.edgepkg member model.onnx: sha256 mismatch 1\n"


def test_forked_child_killed_by_a_signal_is_one_error_naming_it():
    done = run_program("""
        from device_agent.background import BackgroundError
        try:
            Forked(lambda: os.kill(os.getpid(), signal.SIGKILL)).result()
        except BackgroundError as err:
            print(err)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"the verifying process was killed by signal {int(signal.SIGKILL)}\n"


def test_forked_child_that_exits_without_an_answer_is_one_error_with_its_status():
    done = run_program("""
        from device_agent.background import BackgroundError
        try:
            Forked(lambda: os._exit(3)).result()
        except BackgroundError as err:
            print(err)
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "the verifying process exited with status 3 without an answer\n"


def test_forked_child_runs_no_teardown_of_the_parent():
    """The child ends with os._exit: the parent's atexit handlers and buffered output are the
    parent's alone (written once, not once per process)."""
    done = run_program("""
        import atexit
        atexit.register(lambda: print("teardown", file=sys.stderr))
        sys.stdout.write("buffered before the fork ")
        Forked(lambda: None).result()
        print("done")
    """)
    assert done.returncode == 0
    assert done.stdout == "buffered before the fork done\n"
    assert done.stderr == "teardown\n"


def test_an_answer_over_the_cap_is_refused_not_read_whole(monkeypatch):
    read_end, write_end = os.pipe()
    monkeypatch.setattr(background, "MAX_ANSWER_BYTES", 1000)
    os.write(write_end, b"x" * 1001)
    os.close(write_end)
    with pytest.raises(BackgroundError, match="more than 1000 bytes"):
        background._read_bounded(read_end)
    os.close(read_end)


def test_an_answer_at_the_cap_is_read():
    read_end, write_end = os.pipe()
    os.write(write_end, b"y" * 1000)
    os.close(write_end)
    original = background.MAX_ANSWER_BYTES
    try:
        background.MAX_ANSWER_BYTES = 1000
        assert background._read_bounded(read_end) == b"y" * 1000
    finally:
        background.MAX_ANSWER_BYTES = original
        os.close(read_end)


@pytest.mark.parametrize("data", [b"\x80\x05garbage", pickle.dumps("not a pair"), pickle.dumps(("yes", 1)),
                                  pickle.dumps((True, 1, 2))])
def test_a_garbled_answer_is_one_error(data):
    ok, error = background._decode(data, 0)
    assert ok is False and isinstance(error, BackgroundError)
    assert "garbled" in str(error)


class NeedsKeyword(ArtifactError):
    def __init__(self, message: str, *, member: str) -> None:
        super().__init__(message, artifact="a.edgepkg")
        self.member = member


def test_a_well_formed_answer_is_taken_as_sent():
    assert background._decode(pickle.dumps((True, {"a": 1})), 0) == (True, {"a": 1})
    sent = background._portable(NeedsKeyword("model.onnx: sha256 differs", member="model.onnx"))
    ok, error = background._decode(pickle.dumps((False, sent)), 0)
    assert ok is False and type(error) is NeedsKeyword
    assert (str(error), error.member, error.artifact, error.exit_code) == ("model.onnx: sha256 differs",
                                                                          "model.onnx", "a.edgepkg", 1)


@pytest.mark.parametrize("sent", [(False, ("not a class", (), {})), (False, (dict, (), {})),
                                  (False, (ArtifactError, "args", {})), (False, (ArtifactError, (), []))])
def test_an_error_answer_that_is_no_error_is_garbled(sent):
    ok, error = background._decode(pickle.dumps(sent), 0)
    assert ok is False and type(error) is BackgroundError and "garbled" in str(error)


def test_a_refused_fork_verifies_on_a_thread_and_leaks_no_descriptor(monkeypatch):
    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    made: list[int] = []
    real_pipe = os.pipe

    def recording_pipe() -> tuple[int, int]:
        ends = real_pipe()
        made.extend(ends)
        return ends

    monkeypatch.setattr(os, "fork", no_fork)
    monkeypatch.setattr(os, "pipe", recording_pipe)
    runner = background.beside(lambda a: a * 2, 21, fork=True)
    assert isinstance(runner, OnThread) and runner.result() == 42
    assert len(made) == 2
    for fd in made:  # both ends closed (a later open may reuse the number: fstat right away)
        with pytest.raises(OSError):
            os.fstat(fd)


def test_without_fork_the_call_runs_on_a_thread_of_this_process():
    runner = background.beside(os.getpid, fork=False)
    assert isinstance(runner, OnThread) and runner.result() == os.getpid()


def test_on_thread_hands_back_the_value_or_the_error():
    assert OnThread(lambda a, b: a + b, 2, 3).result() == 5
    with pytest.raises(ArtifactError, match="bad"):
        OnThread(lambda: (_ for _ in ()).throw(ArtifactError("bad"))).result()


def test_an_error_comes_back_with_its_cause_and_one_whose_cause_does_not_pickle_without_it():
    """The forked call's error keeps its ``raise ... from`` cause (what ``edgepack-agent -v``
    prints); a cause that cannot cross the pipe is left behind, never the error itself."""
    try:
        try:
            raise ValueError("Unable to load PEM file")
        except ValueError as err:
            raise NeedsKeyword("key.pub: not a PEM public key", member="key.pub") from err
    except NeedsKeyword as caught:
        sent = caught
    ok, error = background._decode(background._pickled((False, background._portable(sent))), 0)
    assert ok is False and type(error) is NeedsKeyword and error.member == "key.pub"
    assert type(error.__cause__) is ValueError and str(error.__cause__) == "Unable to load PEM file"
    sent.__cause__ = ValueError(lambda: None)  # a cause that does not pickle
    ok, error = background._decode(background._pickled((False, background._portable(sent))), 0)
    assert type(error) is NeedsKeyword and error.__cause__ is None and str(error) == "key.pub: not a PEM public key"
