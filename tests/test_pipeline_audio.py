"""A pipeline on audio: a WAV file made in the test (silence and a tone, half a second each
block, so every answer is known) read by PyAV in blocks of 0.5 s, through a real packaged audio
classifier (energy -> "tone" or "silence", a topk model), with a `count` rule and a
`confidence` rule on its labels: the events are exactly the ones the waveform implies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from device_agent.pipelines.checks import StageContract, check_models
from device_agent.pipelines.runner import PipelineRunner
from device_agent.pipelines.sources import AUDIO_BLOCK_S
from device_agent.pipelines.spec import parse_pipelines
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.test_pipeline_rtsp import Recording
from tools.demos.vad import write_wav

RATE = 16000
BLOCK = int(RATE * AUDIO_BLOCK_S)  # one model frame per block the reader hands over
LABELS = ("tone", "silence")
SCRIPT = "SSTTSSTT"  # 0.5 s blocks: S silence, T a 440 Hz tone at amplitude 0.5


def tone_classifier(path: Path, frame: int) -> Path:
    """logits [batch, 2] = [40 * mean(x^2) - 1, 0]: a tone of amplitude 0.5 (energy 0.125) scores
    'tone' 0.98; silence scores 'silence' 0.73 (softmax of [-1, 0])."""
    nodes = [helper.make_node("Mul", ["input", "input"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["energy"], axes=[1], keepdims=1),
             helper.make_node("Mul", ["energy", "gain"], ["scaled"]),
             helper.make_node("Sub", ["scaled", "one"], ["tone"]),
             helper.make_node("Mul", ["energy", "zero"], ["silence"]),
             helper.make_node("Concat", ["tone", "silence"], ["logits"], axis=1)]
    graph = helper.make_graph(
        nodes, "tone", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", frame])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor(name, TensorProto.FLOAT, [], [value]) for name, value in
         (("gain", 40.0), ("one", 1.0), ("zero", 0.0))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def block(kind: str) -> np.ndarray:
    t = np.arange(BLOCK) / RATE
    return 0.5 * np.sin(2 * np.pi * 440 * t) if kind == "T" else np.zeros(BLOCK)


@pytest.fixture(scope="module", params=[BLOCK, BLOCK // 5], ids=["one-frame-a-block", "five-frames-a-block"])
def classifier(request, tmp_path_factory, keypair) -> InferenceService:
    """The classifier packaged with model frames of a whole block, or of a fifth of one (the
    agent then answers each of a block's five frames, and each is one object of that block)."""
    frame = request.param
    folder = tmp_path_factory.mktemp("tone")
    tone_classifier(folder / "tone.onnx", frame)
    (folder / "labels.txt").write_text("\n".join(LABELS) + "\n")
    for kind in "ST":
        write_wav(folder / "audio" / f"{kind}.wav", block(kind), RATE)
    recipe = folder / "tone.yaml"
    recipe.write_text(
        "name: tone\nversion: 1.0.0\nmodel: {path: tone.onnx}\n"
        f"preprocess: {{kind: audio, sample_rate: {RATE}, frame: {frame}, hop: {frame}}}\n"
        "postprocess: {kind: topk, k: 1, labels: labels.txt}\n"
        "validate: {data: {audio: audio/}}\ngolden: {count: 2, data: {audio: audio/}}\ntargets: [x86, rpi]\n")
    build(load_recipe(recipe), key_paths=[str(keypair[0])], output=folder / "tone.edgepkg")
    verified = extract_artifact(folder / "tone.edgepkg", folder / "model", TrustStore.from_paths([keypair[1]]))
    return InferenceService(load_model(verified.root, verified.manifest))


def expected(script: str = SCRIPT) -> list[tuple[int, str, str, str | None]]:
    """(block, rule, kind, label): `loud` goes above 0 tones on each first T and back to normal on
    each first S after one; `quiet` reports each silent block (its best label, 0.73 in [0.5, 0.9))."""
    out: list[tuple[int, str, str, str | None]] = []
    for index, kind in enumerate(script):
        before = script[index - 1] if index else "S"
        if kind == "T" and before == "S":
            out.append((index, "loud", "count_above", None))
        if kind == "S" and before == "T":
            out.append((index, "loud", "count_normal", None))
        if kind == "S":
            out.append((index, "quiet", "confidence", "silence"))
    return out


def document(wav: Path) -> dict[str, Any]:
    return {"name": "doorbell", "source": {"audio": str(wav), "policy": "every"}, "stages": [{"model": "tone"}],
            "rules": [{"count": "loud", "classes": ["tone"], "above": 0},
                      {"confidence": "quiet", "classes": ["silence"], "low": 0.5, "high": 0.9}]}


def test_a_wav_through_an_audio_model_gives_the_events_its_waveform_implies(classifier, tmp_path):
    wav = write_wav(tmp_path / "doorbell.wav", np.concatenate([block(kind) for kind in SCRIPT]), RATE)
    (spec,) = parse_pipelines([document(wav)])
    check_models(spec, {"tone": StageContract("audio", "topk", LABELS)})  # what the agent checks first
    recording = Recording()
    runner = PipelineRunner(spec, "pi-07", lambda name: classifier, [recording])
    runner.start()
    assert runner.finished.wait(60)
    runner.stop()
    got = [(e["frame"], e["rule"], e["kind"], e.get("label")) for e in recording.events
           if not e["kind"].startswith("source_")]
    assert got == expected()
    assert [e["ts"] for e in recording.events if e["rule"] == "loud"] == [1.0, 2.0, 3.0]
    assert runner.counters.frames == len(SCRIPT) and runner.counters.stage_errors == 0


def test_an_audio_model_refuses_a_video_source_and_a_label_it_does_not_have(tmp_path):
    from device_agent.errors import PipelineRefused

    contracts = {"tone": StageContract("audio", "topk", LABELS)}
    (video,) = parse_pipelines([{**document(tmp_path / "x.wav"), "source": {"file": "clip.mp4"}}])
    with pytest.raises(PipelineRefused, match="audio"):
        check_models(video, contracts)
    wrong = document(tmp_path / "x.wav")
    wrong["rules"][0]["classes"] = ["doorbell"]
    (labelled,) = parse_pipelines([wrong])
    with pytest.raises(PipelineRefused, match="doorbell"):
        check_models(labelled, contracts)
