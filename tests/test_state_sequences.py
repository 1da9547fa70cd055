"""Stateful models judged and calibrated as the agent runs them: the frames of a WAV file in
order, the state carried from one call to the next (sdk/packager/sequences.py).

Real onnxruntime throughout, on models built here with onnx.helper and the VAD demo
(tools/demos/vad.py): calibration sees the state the fp32 model carries (not zeros); a
candidate whose recurrence has a slightly different gain agrees with fp32 on every frame
started from zeros and drifts over a file's frames, and the free-running check refuses it
(validation, an fp16 build, and the quantization search's judgement), while the same data as
stand-alone samples (npz) is judged frame by frame from init, as before."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from sdk.errors import ValidationFailed
from sdk.packager import ort_host, sequences
from sdk.packager.data import load_samples
from sdk.packager.ort_host import run_feeds
from sdk.packager.passes import quantize
from sdk.packager.passes.base import BuildContext
from sdk.packager.passes.validate import judge
from sdk.packager.pipeline import build, run_passes
from sdk.packager.quant_search import Candidate
from sdk.packager.sources import DataSource
from sdk.packager.task_metrics import evaluate
from sdk.recipe import recipe_from_dict
from tools.demos.vad import CONTEXT, FRAME, HIDDEN, SAMPLE_RATE, build_vad, reference_step, write_wav

WIDTH = 64  # frame samples of the recurrence model (no context)
AUDIO = {"kind": "audio", "sample_rate": SAMPLE_RATE, "frame": WIDTH, "hop": WIDTH}
STATE = {"role": "state", "output": "stateN", "init": "zeros"}


def _recurrence(path: Path, gain: float) -> Path:
    """stateN = gain * state + input; output = 0.5 * stateN. From a zero state every gain gives
    the same output (the input); carried over frames, a different gain drifts."""
    nodes = [helper.make_node("Mul", ["state", "gain"], ["held"]),
             helper.make_node("Add", ["held", "input"], ["stateN"]),
             helper.make_node("Mul", ["stateN", "half"], ["output"])]  # an output another node reads
    spec = [1, WIDTH]
    graph = helper.make_graph(nodes, "recurrence",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, spec),
                               helper.make_tensor_value_info("state", TensorProto.FLOAT, spec)],
                              [helper.make_tensor_value_info("output", TensorProto.FLOAT, spec),
                               helper.make_tensor_value_info("stateN", TensorProto.FLOAT, spec)],
                              [numpy_helper.from_array(np.float32([gain]), "gain"),
                               numpy_helper.from_array(np.float32([0.5]), "half")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _clips(folder: Path) -> Path:
    """Two 0.5 s clips with a DC offset (so a carried state builds up): 125 frames each."""
    t = np.arange(SAMPLE_RATE // 2) / SAMPLE_RATE
    write_wav(folder / "a.wav", 0.3 + 0.2 * np.sin(2 * np.pi * 300 * t), SAMPLE_RATE, encoding="float32")
    write_wav(folder / "b.wav", 0.25 + 0.1 * np.sin(2 * np.pi * 120 * t), SAMPLE_RATE, encoding="float32")
    return folder


def _doc(**sections) -> dict:
    return {"name": "rec", "version": "1.0.0", "model": {"path": "ref.onnx"},
            "inputs": {"input": {"role": "audio"}, "state": STATE}, "preprocess": AUDIO,
            "postprocess": {"kind": "raw"}, "validate": {"data": {"audio": "clips"}}, **sections}


@pytest.fixture
def recurrence(tmp_path) -> Path:
    """ref.onnx (gain 0.9), cand.onnx (gain 0.92) and clips/ in tmp_path."""
    _recurrence(tmp_path / "ref.onnx", 0.9)
    _recurrence(tmp_path / "cand.onnx", 0.92)
    _clips(tmp_path / "clips")
    return tmp_path


def _context(folder: Path, doc: dict) -> BuildContext:
    """A build context after the passes that read the model's inputs and outputs."""
    ctx = BuildContext(recipe=recipe_from_dict(doc, folder), workdir=folder)
    run_passes(ctx, ["load", "check", "io_spec"])
    return ctx


def _audio_samples(ctx: BuildContext, folder: Path):
    declared = ctx.recipe.inputs
    return load_samples(DataSource("audio", str(folder)), ctx.preprocess, ctx.inputs, key="validate.data",
                        declared=declared, outputs=ctx.outputs)


# ---------------------------------------------------------------- calibration


@pytest.fixture(scope="module")
def vad(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("vad")
    build_vad(folder)
    return folder


def _vad_doc(**sections) -> dict:
    return {"name": "vad", "version": "1.0.0", "model": {"path": "model.onnx"},
            "inputs": {"input": {"role": "audio"}, "state": STATE, "sr": {"role": "constant", "value": SAMPLE_RATE}},
            "preprocess": {"kind": "audio", "sample_rate": SAMPLE_RATE, "frame": FRAME, "hop": FRAME,
                           "context": CONTEXT},
            "postprocess": {"kind": "raw"}, "validate": {"data": {"audio": "audio"}}, **sections}


def _vad_context(vad: Path) -> BuildContext:
    return _context(vad, _vad_doc())


def test_calibration_of_a_stateful_model_on_audio_carries_the_fp32_state_over_each_file(vad):
    ctx = _vad_context(vad)
    samples = _audio_samples(ctx, vad / "audio")
    assert samples.sequential and samples.carry == {"state": "stateN"} and len(samples.sequences) == 3
    feeds = sequences.calibration_feeds(str(vad / "model.onnx"), samples)
    assert len(feeds) == len(samples)
    starts = samples.starts()
    # Frame k's state is the fp32 model's stateN after frame k-1 (an independent numpy run
    # here); the first frame of each file starts from zeros.
    state = np.zeros((2, 1, HIDDEN), np.float32)
    for feed, start in zip(feeds, starts, strict=True):
        if start:
            state = np.zeros((2, 1, HIDDEN), np.float32)
        np.testing.assert_allclose(feed["state"], state, atol=1e-5)
        _, state = reference_step(feed["input"], state)
    assert sum(starts) == 3 and all(not np.any(feed["state"]) for feed, s in zip(feeds, starts, strict=True) if s)
    # The ranges calibration measures: zeros before, the real state now.
    zero = quantize.profile_activations(vad / "model.onnx", None, samples.feeds)["ranges"]["state"]
    carried = quantize.profile_activations(vad / "model.onnx", None, feeds)["ranges"]["state"]
    assert zero == (0.0, 0.0)
    assert carried[0] < -0.1 and carried[1] > 0.1


def _input_scale(model: onnx.ModelProto, name: str) -> float:
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == name)
    return float(inits[node.input[1]])


def test_static_int8_of_a_stateful_model_quantizes_its_state_on_the_carried_range(vad, tmp_path):
    ctx = _vad_context(vad)
    samples = _audio_samples(ctx, vad / "audio")
    config = quantize.QuantConfig(mode="static", per_channel=False)
    scales = {}
    for name, feeds in (("zeros", samples.feeds),
                        ("carried", sequences.calibration_feeds(str(vad / "model.onnx"), samples))):
        out = quantize.quantize_once(vad / "model.onnx", tmp_path / f"{name}.onnx", config, feeds)
        scales[name] = _input_scale(onnx.load(out), "state")
    # uint8 over [min(0, low), max(0, high)]: the carried state of a tanh spans most of [-1, 1];
    # fed zeros only, the range is empty (onnxruntime then takes scale 1.0: one step is the
    # whole state's range, and every real state rounds to 0 or +-1).
    assert 0.2 / 255 < scales["carried"] <= 2.0 / 255
    assert scales["zeros"] > 50 * scales["carried"]


def test_a_quantized_stateful_build_reports_how_its_state_was_fed(vad, tmp_path, keypair, monkeypatch):
    monkeypatch.setattr(quantize, "time_side_by_side", lambda fp32, candidate, feed: (1e-3, 5e-4))
    doc = _vad_doc(quantize={"mode": "static", "calibration": {"audio": "audio"}, "search": False},
                   validate={"data": {"audio": "audio"}, "outputs": ["output"], "allow_failure": True})
    result = build(recipe_from_dict(doc, vad), key_paths=[str(keypair[0])], output=tmp_path / "v.edgepkg")
    report = result.report["passes"]
    assert report["quantize"]["calibration_state"] == {"fed": "carried", "sequences": 3}
    assert report["quantize"]["validation_state"] == {"fed": "carried", "sequences": 3}
    assert report["validate"]["state"] == {"fed": "carried", "sequences": 3}


def test_calibration_that_is_also_the_validation_data_reuses_the_fp32_run(vad, tmp_path, keypair, monkeypatch):
    """Without validate.data the calibration clips are the validation samples too: the carried
    state calibration needs comes from the fp32 reference run already made (no second run), and
    is the same state a separate run gives."""
    monkeypatch.setattr(quantize, "time_side_by_side", lambda fp32, candidate, feed: (1e-3, 5e-4))
    monkeypatch.setattr(quantize, "calibration_feeds", lambda *a, **k: pytest.fail("a second fp32 run"))
    calibrated: list[list[dict]] = []
    real_data = quantize._Data

    def recording(source, calibration, validation, reference):
        calibrated.append(list(calibration))
        return real_data(source, calibration, validation, reference)

    monkeypatch.setattr(quantize, "_Data", recording)
    doc = _vad_doc(quantize={"mode": "static", "calibration": {"audio": "audio"}, "search": False},
                   validate={"outputs": ["output"], "allow_failure": True})
    result = build(recipe_from_dict(doc, vad), key_paths=[str(keypair[0])], output=tmp_path / "v.edgepkg")
    assert result.report["passes"]["quantize"]["calibration_state"] == {"fed": "carried", "sequences": 3}
    expected = sequences.calibration_feeds(str(vad / "model.onnx"), _audio_samples(_vad_context(vad), vad / "audio"))
    assert calibrated and len(calibrated[0]) == len(expected)
    for got, want in zip(calibrated[0], expected, strict=True):
        np.testing.assert_allclose(got["state"], want["state"], atol=1e-6)


# ---------------------------------------------------------------- free-running judgement


def test_a_drifting_state_is_refused_free_running_and_was_invisible_frame_by_frame(recurrence):
    ctx = _context(recurrence, _doc())
    samples = _audio_samples(ctx, recurrence / "clips")
    assert len(samples) == 250 and samples.sequences == [(0, 125), (125, 250)]
    budget = {"max_abs": 1e-3}
    ref, cand = (str(recurrence / name) for name in ("ref.onnx", "cand.onnx"))
    carried = evaluate(sequences.run_samples(ref, samples), sequences.run_samples(cand, samples),
                       metric="max_abs", outputs=["output"], budget=budget)
    assert not carried.met
    assert carried.worst is not None and carried.worst.output == "output" and carried.worst.value > 0.1
    # The old check: every frame from the zero state. Both models give exactly the input.
    alone = evaluate(run_feeds(ref, samples.feeds), run_feeds(cand, samples.feeds), metric="max_abs",
                     outputs=["output"], budget=budget)
    assert alone.met and alone.worst is not None and alone.worst.value == 0.0


def test_free_running_matches_a_numpy_run_that_carries_the_state(recurrence):
    ctx = _context(recurrence, _doc())
    samples = _audio_samples(ctx, recurrence / "clips")
    outputs = sequences.run_samples(str(recurrence / "cand.onnx"), samples)
    for first, stop in samples.sequences:
        state = np.zeros((1, WIDTH), np.float32)
        for index in range(first, stop):
            state = np.float32(0.92) * state + samples.feeds[index]["input"]
            np.testing.assert_allclose(outputs[index]["output"], 0.5 * state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 4 * 1024])
def test_the_state_crosses_the_worker_requests_a_long_file_is_split_into(recurrence, monkeypatch, chunk_bytes):
    """Large data goes to the worker in several requests: the state is carried from the last
    frame of one request into the first of the next (every frame alone, or a few per request),
    to the same outputs as one request, and a new file still starts from init."""
    ctx = _context(recurrence, _doc())
    samples = _audio_samples(ctx, recurrence / "clips")
    whole = sequences.run_samples(str(recurrence / "cand.onnx"), samples)
    monkeypatch.setattr(ort_host, "_CHUNK_BYTES", chunk_bytes)
    split = sequences.run_samples(str(recurrence / "cand.onnx"), samples)
    assert len(split) == len(whole) == len(samples.feeds) and len(samples.sequences) == 2
    for a, b in zip(whole, split, strict=True):
        np.testing.assert_array_equal(a["output"], b["output"])
    second = samples.sequences[1][0]
    np.testing.assert_allclose(split[second]["output"], 0.5 * samples.feeds[second]["input"], rtol=1e-6)


def _fp16_doc(data: dict) -> dict:
    """gain 0.999 becomes 0.99902 in fp16, and an fp16 state holds the accumulated value coarsely:
    frame by frame from zeros the fp16 model is within 1e-3 of fp32, carried over frames it is not."""
    return _doc(optimize={"fp16": True}, validate={"data": data, "outputs": ["output"], "metric": "max_abs"})


def test_an_fp16_build_whose_state_drifts_over_a_file_fails_validation_naming_the_output(tmp_path, keypair):
    _recurrence(tmp_path / "ref.onnx", 0.999)
    _clips(tmp_path / "clips")
    with pytest.raises(ValidationFailed, match=r"output output: max abs diff .*state carried over each file's frames"):
        build(recipe_from_dict(_fp16_doc({"audio": "clips"}), tmp_path), key_paths=[str(keypair[0])],
              output=tmp_path / "a.edgepkg")


def test_stand_alone_samples_still_start_from_init(tmp_path, keypair):
    """npz data is no stream: each sample starts from the zero state, as before, and the same
    fp16 model passes (the frames of the clips, one by one)."""
    _recurrence(tmp_path / "ref.onnx", 0.999)
    _clips(tmp_path / "clips")
    recipe = recipe_from_dict(_fp16_doc({"audio": "clips"}), tmp_path)
    ctx = _context(tmp_path, _fp16_doc({"audio": "clips"}))
    frames = np.stack([feed["input"] for feed in _audio_samples(ctx, tmp_path / "clips").feeds])
    np.savez(tmp_path / "frames.npz", input=frames)
    recipe = recipe_from_dict(_fp16_doc({"npz": "frames.npz"}), tmp_path)
    report = build(recipe, key_paths=[str(keypair[0])], output=tmp_path / "b.edgepkg").report["passes"]["validate"]
    assert report["budget_met"] and report["state"] == {"fed": "init"} and report["precision"] == "fp16"


def test_the_quantization_search_judges_a_candidate_free_running(recurrence, monkeypatch):
    """The search's judgement (``_Search._judge``) on a candidate model: refused over the files'
    frames, by the same metric the validate pass uses."""
    monkeypatch.setattr(quantize, "time_side_by_side", lambda fp32, candidate, feed: (1e-3, 5e-4))
    doc = _doc(validate={"data": {"audio": "clips"}, "outputs": ["output"], "metric": "max_abs"})
    ctx = _context(recurrence, doc)
    samples = _audio_samples(ctx, recurrence / "clips")
    source = recurrence / "ref.onnx"
    data = quantize._Data(source, [], samples, sequences.run_samples(str(source), samples))
    search = quantize._Search(ctx, recurrence, data, quantize.QuantizeOptions())
    candidate = Candidate("int8", "requested", quantize.QuantConfig(mode="static"))
    entry = {**candidate.describe(), "started": time.monotonic(), "quantized_nodes": 1}
    search._judge(candidate, recurrence / "cand.onnx", entry, "1/1")
    assert entry["budget_met"] is False and not entry["ships"] and entry["why"].startswith("output output: max abs")
    # Judged as before (every frame from zeros), the same candidate kept the budget.
    alone = judge(ctx, ctx.recipe.validate, run_feeds(str(source), samples.feeds),
                  run_feeds(str(recurrence / "cand.onnx"), samples.feeds), None)
    assert alone.met
