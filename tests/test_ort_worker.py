"""The onnxruntime worker: one process for every session of a build, crashes named in one line.

Crashes are real: a model whose STFT kernel divides by zero (frame_length 0) kills onnxruntime
with SIGFPE; the other signals come from the worker killing itself with the real signal
(``EDGEPACK_TEST_FAULT=ort-worker:SIGNAL``, edgepack_core.faults), as a segfault, an abort or the OOM killer would.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgepack_core import faults
from sdk.errors import BuildError, OrtCrashError
from sdk.packager import ort_host, ort_worker
from sdk.packager.ort_host import in_pass, run_feeds
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.conftest import run_cli


def stft_model(frame_step: int = 8, frame_length: int = 16) -> onnx.ModelProto:
    """STFT over a [1, 128, 1] signal. frame_length 0 is a real SIGFPE in onnxruntime 1.32's
    kernel; frame_step 0 is an ordinary onnxruntime error (with an error log line)."""
    node = helper.make_node("STFT", ["signal", "frame_step", "", "frame_length"], ["out"])
    graph = helper.make_graph(
        [node], "stft", [helper.make_tensor_value_info("signal", TensorProto.FLOAT, [1, 128, 1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", "frames", "bins", "parts"])],
        initializer=[helper.make_tensor("frame_step", TensorProto.INT64, [], [frame_step]),
                     helper.make_tensor("frame_length", TensorProto.INT64, [], [frame_length])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def relu_model(width: int = 3, *, name: str = "relu") -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [width])
    model = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], name, [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


SIGNAL_FEED = {"signal": np.linspace(-1, 1, 128, dtype=np.float32).reshape(1, 128, 1)}


@pytest.fixture
def fresh_worker():
    """A worker started for this test (env changes reach it), stopped afterwards."""
    ort_host.shutdown()
    yield
    ort_host.shutdown()


def test_a_real_sigfpe_becomes_one_line_naming_pass_model_sample_and_signal_then_the_worker_restarts():
    host = ort_host.worker()
    good = relu_model().SerializeToString()
    assert run_feeds(good, [{"x": np.array([-1, 0, 2], np.float32)}])[0]["y"].tolist() == [0, 0, 2]
    first_pid, starts = host.pid, host.starts
    feeds = [SIGNAL_FEED, SIGNAL_FEED]
    with in_pass("validate", model="stft.onnx"), pytest.raises(OrtCrashError) as caught:
        run_feeds(stft_model(frame_length=0).SerializeToString(), feeds)
    err = caught.value
    message = str(err)
    assert err.signal_name == "SIGFPE" and err.returncode == -signal.SIGFPE
    assert message.startswith("validate: onnxruntime crashed with SIGFPE")
    assert "sample 0 of stft.onnx" in message and "\n" not in message
    assert err.exit_code == 1
    # The next use starts a fresh worker and works.
    assert run_feeds(good, [{"x": np.array([3, -3, 1], np.float32)}])[0]["y"].tolist() == [3, 0, 1]
    assert host.starts == starts + 1 and host.pid not in (None, first_pid)


def test_sessions_are_cached_by_model_hash_and_reused_across_calls():
    host = ort_host.worker()
    model = relu_model(5, name="cached").SerializeToString()
    run_feeds(model, [{"x": np.ones(5, np.float32)}])
    pid, starts = host.pid, host.starts
    key = ort_host.model_key(model)
    for _ in range(3):
        run_feeds(model, [{"x": np.ones(5, np.float32)}] * 4)
    state = host.call({"op": "ping"}, model="-", doing="ping")
    assert state["pid"] == pid and host.starts == starts
    assert state["sessions"].count(key) == 1


def test_session_cache_is_bounded_and_an_evicted_model_reloads():
    host = ort_host.worker()
    models = [relu_model(width, name=f"m{width}").SerializeToString()
              for width in range(1, ort_worker.MAX_SESSIONS + 4)]
    for width, model in enumerate(models, start=1):
        run_feeds(model, [{"x": np.ones(width, np.float32)}])
    cached = host.call({"op": "ping"}, model="-", doing="ping")["sessions"]
    assert len(cached) == ort_worker.MAX_SESSIONS
    assert ort_host.model_key(models[0]) not in cached
    assert run_feeds(models[0], [{"x": np.array([-2], np.float32)}])[0]["y"].tolist() == [0]
    ort_host.release_sessions()
    assert host.call({"op": "ping"}, model="-", doing="ping")["sessions"] == []


def test_an_onnxruntime_error_keeps_the_line_that_says_what_is_wrong():
    with in_pass("golden", model="relu.onnx"), pytest.raises(BuildError) as caught:
        run_feeds(relu_model(3).SerializeToString(), [{"x": np.ones(1, np.float32)}])
    message = str(caught.value)
    assert "index: 0 Got: 1 Expected: 3" in message
    assert message.startswith("golden: inference failed:") and "\n" not in message
    assert "sample 0 of relu.onnx" in message
    assert not isinstance(caught.value, OrtCrashError)


def test_ort_message_drops_only_the_status_prefix_and_blank_lines():
    err = RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: x\n"
                       "\n index: 0 Got: 1 Expected: 3\n Please fix either the inputs/outputs or the model.\n")
    assert ort_worker.ort_message(err) == ("Got invalid dimensions for input: x index: 0 Got: 1 Expected: 3 "
                                           "Please fix either the inputs/outputs or the model.")
    assert ort_worker.ort_message(RuntimeError("plain")) == "plain"
    assert ort_worker.ort_message(ValueError()) == "ValueError"
    assert ort_worker.ort_message(RuntimeError("x" * 5000)).endswith(" …")


def test_offline_optimization_runs_in_the_worker_and_returns_a_loadable_model():
    model = relu_model(4).SerializeToString()
    optimized = ort_host.optimize_offline(model, "extended")
    assert run_feeds(optimized, [{"x": np.array([-1, 1, -2, 2], np.float32)}])[0]["y"].tolist() == [0, 1, 0, 2]
    with in_pass("ort_optimize"), pytest.raises(BuildError, match=r"^ort_optimize: .*(?i:protobuf|parse|load)"):
        ort_host.optimize_offline(b"not a model", "basic")


def test_call_in_worker_refuses_targets_outside_the_package():
    with pytest.raises(BuildError, match="refused call target"):
        ort_host.call_in_worker("os:getcwd")


@pytest.mark.parametrize("name", ["SIGSEGV", "SIGABRT", "SIGKILL"])
def test_every_crash_signal_is_named(name, monkeypatch, fresh_worker):
    monkeypatch.setenv(faults.ENV, f"ort-worker:{name}")
    with in_pass("golden", model="relu.onnx"), pytest.raises(OrtCrashError) as caught:
        run_feeds(relu_model().SerializeToString(), [{"x": np.ones(3, np.float32)}])
    assert caught.value.signal_name == name
    assert str(caught.value).startswith(f"golden: onnxruntime crashed with {name}")
    if name == "SIGKILL":
        assert "out-of-memory" in str(caught.value)


def _crash_project(folder: Path, model: onnx.ModelProto, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    np.savez(folder / "data.npz", **SIGNAL_FEED)
    recipe = folder / "recipe.yaml"
    recipe.write_text("name: crash\nversion: 1.0.0\nmodel: {path: model.onnx}\npostprocess: {kind: raw}\n"
                      f"validate: {{data: {{npz: data.npz}}}}\ntargets: [x86]\n{extra}")
    return recipe


def test_edgepack_build_killed_by_sigfpe_exits_1_with_one_line(tmp_path, keypair):
    recipe = _crash_project(tmp_path, stft_model(frame_length=0))
    result = run_cli("edgepack", "build", str(recipe), "--key", str(keypair[0]), "-o", str(tmp_path / "a.edgepkg"))
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert "SIGFPE" in lines[0] and "model.onnx" in lines[0] and "sample 0" in lines[0]
    assert lines[0].startswith("edgepack: error: validate: onnxruntime crashed")
    assert not (tmp_path / "a.edgepkg").exists()


def test_quantization_runs_inside_the_worker(tmp_path, keypair, monkeypatch, fresh_worker):
    """Calibration sessions are the worker's: a crash there is named as the quantize pass's."""
    x = helper.make_tensor_value_info("signal", TensorProto.FLOAT, [1, 128, 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 128, 4])
    weight = helper.make_tensor("w", TensorProto.FLOAT, [1, 4], [0.5, -1.0, 2.0, 0.25])
    model = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["signal", "w"], ["y"])], "mm", [x], [y],
                                                [weight]), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    recipe = _crash_project(tmp_path, model, "quantize: {mode: static, calibration: {npz: data.npz}}\n")
    monkeypatch.setenv(faults.ENV, "ort-worker:SIGSEGV")
    with pytest.raises(OrtCrashError) as caught:
        build(load_recipe(recipe), key_paths=[str(keypair[0])], output=tmp_path / "q.edgepkg")
    assert str(caught.value).startswith("quantize: onnxruntime crashed with SIGSEGV")
    assert "quantization pre-processing" in str(caught.value)


@pytest.mark.parametrize("name", ["SIGSEGV", "SIGABRT"])
def test_edgepack_bench_crash_is_one_line_without_traceback(tmp_path, name, monkeypatch):
    onnx.save(relu_model(), tmp_path / "relu.onnx")
    monkeypatch.setenv(faults.ENV, f"ort-worker:{name}")
    result = run_cli("edgepack", "bench", str(tmp_path / "relu.onnx"), "--runs", "2")
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert f"bench: onnxruntime crashed with {name}" in result.stderr and "relu.onnx" in result.stderr


def test_onnxruntime_log_lines_reach_the_terminal_only_with_verbose(tmp_path):
    onnx.save(stft_model(frame_step=0), tmp_path / "stft.onnx")
    quiet = run_cli("edgepack", "bench", str(tmp_path / "stft.onnx"), "--runs", "1")
    assert quiet.returncode == 1
    assert quiet.stderr.strip().count("\n") == 0, quiet.stderr
    assert "frame_step must be greater than zero" in quiet.stderr and "[E:onnxruntime" not in quiet.stderr
    for args in (("-v", "bench", str(tmp_path / "stft.onnx")), ("bench", "-v", str(tmp_path / "stft.onnx"))):
        loud = run_cli("edgepack", *args, "--runs", "1")
        assert loud.returncode == 1
        assert "E:onnxruntime" in loud.stderr and "frame_step must be greater than zero" in loud.stderr


def test_edgepack_build_verbose_shows_onnxruntime_log_lines(tmp_path, keypair):
    recipe = _crash_project(tmp_path, stft_model(frame_step=0))
    args = ("build", str(recipe), "--key", str(keypair[0]), "-o", str(tmp_path / "a.edgepkg"))
    quiet = run_cli("edgepack", *args)
    assert quiet.returncode == 1 and quiet.stderr.strip().count("\n") == 0, quiet.stderr
    assert "frame_step must be greater than zero" in quiet.stderr and "E:onnxruntime" not in quiet.stderr
    loud = run_cli("edgepack", *args, "-v")
    assert loud.returncode == 1 and "E:onnxruntime" in loud.stderr
    assert loud.stderr.strip().splitlines()[-1].startswith("edgepack: error: validate: inference failed")


def test_a_call_interrupted_mid_answer_leaves_no_stale_answer_behind():
    """A driver's timeout signal can interrupt a request; the late answer must never be read
    as the answer to the next request, so the worker is replaced."""
    host = ort_host.worker()
    model = relu_model(3, name="interrupted").SerializeToString()
    run_feeds(model, [{"x": np.ones(3, np.float32)}])
    pid = host.pid

    def expire(signum, frame):
        raise TimeoutError("driver timeout")

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(TimeoutError):
            ort_host.measure_latency(model, {"x": np.ones(3, np.float32)}, runs=10**8)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert run_feeds(model, [{"x": np.array([-1, 5, -7], np.float32)}])[0]["y"].tolist() == [0, 5, 0]
    assert host.pid not in (None, pid)


def test_a_killed_build_leaves_no_worker_behind_even_mid_kernel(tmp_path):
    """The parent dies by SIGKILL while the worker is busy (it never reads its closed pipe):
    the worker notices it is orphaned and exits."""
    script = tmp_path / "parent.py"
    script.write_text(  # queue a practically endless benchmark, say the worker's pid, wait to be killed
        "import numpy as np, sys, threading\n"
        "from sdk.packager import ort_host\n"
        "from sdk.packager.ort_worker import write_message\n"
        "model = open(sys.argv[1], 'rb').read()\n"
        "host = ort_host.worker()\n"
        "ort_host.describe(model)\n"
        "write_message(host._proc.stdin, {'op': 'bench', 'key': ort_host.model_key(model), 'runs': 10**9,\n"
        "                                 'feed': {'x': np.ones(3, np.float32)}})\n"
        "print(host.pid, flush=True)\n"
        "threading.Event().wait()\n")
    onnx.save(relu_model(), tmp_path / "relu.onnx")
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path / "relu.onnx")], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).resolve().parent.parent)
    worker_pid = int(parent.stdout.readline())
    exited = os.pidfd_open(worker_pid)  # becomes readable when the worker exits
    try:
        assert select.select([exited], [], [], 0)[0] == []
        parent.kill()
        parent.wait()
        assert select.select([exited], [], [], 30)[0] == [exited]
    finally:
        os.close(exited)


def test_a_build_frees_its_sessions_but_keeps_the_worker(tmp_path, keypair):
    recipe = _crash_project(tmp_path, stft_model())
    build(load_recipe(recipe), key_paths=[str(keypair[0])], output=tmp_path / "one.edgepkg")
    host = ort_host.worker()
    pid = host.pid
    assert pid is not None and host.call({"op": "ping"}, model="-", doing="ping")["sessions"] == []
    build(load_recipe(recipe), key_paths=[str(keypair[0])], output=tmp_path / "two.edgepkg")
    assert host.pid == pid  # one worker across builds


def stft_inputs_model() -> onnx.ModelProto:
    """STFT whose frame_step and frame_length are inputs: a feed decides whether it runs,
    fails (frame_step 0) or kills onnxruntime with SIGFPE (frame_length 0)."""
    node = helper.make_node("STFT", ["signal", "frame_step", "", "frame_length"], ["out"])
    graph = helper.make_graph(
        [node], "stft_inputs",
        [helper.make_tensor_value_info("signal", TensorProto.FLOAT, [1, 128, 1]),
         helper.make_tensor_value_info("frame_step", TensorProto.INT64, []),
         helper.make_tensor_value_info("frame_length", TensorProto.INT64, [])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["n", "frames", "bins", "parts"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _stft_feed(step: int, length: int) -> dict[str, np.ndarray]:
    return {**SIGNAL_FEED, "frame_step": np.array(step, np.int64), "frame_length": np.array(length, np.int64)}


def test_the_crash_and_the_error_name_the_sample_that_caused_them():
    model = stft_inputs_model().SerializeToString()
    with in_pass("validate", model="stft.onnx"):
        outputs = run_feeds(model, [_stft_feed(8, 16), _stft_feed(4, 16)])
        assert [o["out"].shape[1] for o in outputs] == [15, 29]  # (128 - 16) / step + 1 frames
        with pytest.raises(OrtCrashError, match=r"SIGFPE .* on sample 2 of stft.onnx"):
            run_feeds(model, [_stft_feed(8, 16), _stft_feed(8, 16), _stft_feed(8, 0), _stft_feed(8, 16)])
        with pytest.raises(BuildError, match=r"frame_step must be greater than zero\. \[sample 1 of stft.onnx"):
            run_feeds(model, [_stft_feed(8, 16), _stft_feed(0, 16), _stft_feed(8, 16)])


def test_feeds_travel_in_bounded_chunks_numbered_from_their_first_sample(monkeypatch):
    monkeypatch.setattr(ort_host, "_CHUNK_BYTES", 100)
    feeds = [{"x": np.zeros(n, np.uint8)} for n in (60, 40, 1, 100, 200, 0)]
    chunks = list(ort_host._chunks(feeds))
    assert [(first, [int(f["x"].size) for f in chunk]) for first, chunk in chunks] == [
        (0, [60, 40]), (2, [1]), (3, [100]), (4, [200]), (5, [0])]
    assert list(ort_host._chunks([])) == []
    model = relu_model(2).SerializeToString()
    many = [{"x": np.array([i, -i], np.float32)} for i in range(30)]  # 8 bytes each: 4 chunks of <= 12
    monkeypatch.setattr(ort_host, "_CHUNK_BYTES", 96)
    assert [o["y"].tolist() for o in run_feeds(model, many)] == [[i, 0] for i in range(30)]
