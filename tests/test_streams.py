"""Stateful audio models end to end: input roles in the recipe and manifest, the stream table's
bounds, and the VAD-style demo built -> verified -> served through the CLI (a whole WAV, stacked
frames), the Python API (streams) and HTTP (stream header), each checked against an independent
numpy reference that runs the same frames and carries the state."""

from __future__ import annotations

import http.client
import io
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from device_agent.config import check_config
from device_agent.errors import BadRequest
from device_agent.http.server import ApiServer
from device_agent.runtime import InferenceService, load_model
from device_agent.streams import StreamTable
from edgepack_core import audio
from edgepack_core.artifact import extract_artifact
from edgepack_core.protocol.ids import InvalidNameError
from edgepack_core.signing import TrustStore, load_public_key
from sdk.errors import RecipeError
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.conftest import run_cli
from tools.demos.vad import CONTEXT, FRAME, SAMPLE_RATE, build_vad, reference_step, write_wav

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "vad.yaml"


# ---------------------------------------------------------------- the stream table (pure)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _touch(table: StreamTable, stream: str, value: float, sha: str = "a") -> float:
    """Run one 'call': return the state it started from, leave ``value`` behind."""
    with table.hold(stream, sha, {"s": np.zeros(1)}) as state:
        before = float(state["s"][0])
        state["s"] = np.array([value])
    return before


def test_streams_carry_state_and_reset_forgets_it():
    table = StreamTable(4, 60)
    assert _touch(table, "a", 1.0) == 0.0
    assert _touch(table, "a", 2.0) == 1.0
    assert _touch(table, "b", 5.0) == 0.0  # another stream has its own state
    assert table.reset("a") is True and table.reset("a") is False
    assert _touch(table, "a", 3.0) == 0.0
    assert _touch(table, None, 9.0) == 0.0 and _touch(table, None, 9.0) == 0.0  # no stream: always init


def test_stream_table_keeps_at_most_max_streams_dropping_the_least_recently_used():
    table = StreamTable(2, 60)
    _touch(table, "a", 1.0)
    _touch(table, "b", 2.0)
    _touch(table, "a", 1.5)  # a is now the most recent
    _touch(table, "c", 3.0)  # the third stream drops b
    assert len(table) == 2 and "b" not in table and "a" in table
    assert _touch(table, "b", 0.0) == 0.0


def test_stream_idle_expiry_boundary():
    clock = Clock()
    table = StreamTable(8, 10, clock=clock)
    _touch(table, "a", 1.0)
    clock.now = 9.999
    assert _touch(table, "a", 2.0) == 1.0  # just under the idle limit: kept
    clock.now = 9.999 + 10
    assert _touch(table, "a", 3.0) == 0.0  # exactly idle_s unused: forgotten


def test_a_stream_restarts_from_init_after_the_model_changes():
    table = StreamTable(4, 60)
    _touch(table, "a", 1.0, sha="old")
    assert _touch(table, "a", 2.0, sha="new") == 0.0


def test_a_failed_call_leaves_the_stream_state_as_it_was():
    table = StreamTable(4, 60)
    _touch(table, "a", 1.0)
    with pytest.raises(RuntimeError), table.hold("a", "a", {"s": np.zeros(1)}) as state:
        state["s"] = np.array([7.0])
        raise RuntimeError("inference failed")
    assert _touch(table, "a", 2.0) == 1.0


@pytest.mark.parametrize("stream", ["", "a/b", "x" * 500, "a+b", "#"])
def test_stream_id_injection_is_refused(stream):
    with pytest.raises(InvalidNameError):
        StreamTable.check_id(stream)


def test_agent_yaml_stream_limits_default_and_are_bounded(tmp_path):
    base = {"device_id": "d1", "store": "s", "trust": ["t.pub"]}
    config = check_config(base, tmp_path / "agent.yaml")
    assert (config.api.max_streams, config.api.stream_idle_s) == (64, 300.0)
    config = check_config({**base, "api": {"max_streams": 3, "stream_idle_s": 1.5}}, tmp_path / "agent.yaml")
    assert (config.api.max_streams, config.api.stream_idle_s) == (3, 1.5)
    for bad in ({"max_streams": 0}, {"stream_idle_s": 0}, {"max_streams": 10**9}):
        with pytest.raises(Exception, match=f"api.{next(iter(bad))}"):
            check_config({**base, "api": bad}, tmp_path / "agent.yaml")


# ---------------------------------------------------------------- recipes


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """The demo model and WAV clips with recipes/vad.yaml, its paths pointing into the folder."""
    folder = tmp_path_factory.mktemp("vad")
    build_vad(folder / "demo" / "vad")
    (folder / "vad.yaml").write_text(RECIPE.read_text().replace("../demo/", "demo/"))
    return folder


def _recipe(project: Path, **changes) -> Path:
    document = yaml.safe_load((project / "vad.yaml").read_text())
    for key, value in changes.items():
        document[key] = value
    path = project / "variant.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.mark.parametrize(("inputs", "key", "message"), [
    ({"state": {"role": "state"}}, "inputs.state.output", "names the output"),
    ({"state": {"role": "tensor", "output": "stateN"}}, "inputs.state.output", "only an input with role: state"),
    ({"state": {"role": "state", "output": "stateN", "range": [0, 1]}}, "inputs.state.range", "no data"),
    ({"input": {"role": "image"}}, "inputs.input.role", "needs preprocess.kind: image"),
    ({"input": {"role": "audio"}, "sr": {"role": "audio"}}, "inputs.sr.role", "only one input"),
])
def test_input_roles_are_checked_up_front_naming_the_key(project, inputs, key, message):
    with pytest.raises(RecipeError, match=message) as caught:
        load_recipe(_recipe(project, inputs=inputs))
    assert caught.value.key == key


def test_a_state_input_naming_a_missing_or_different_output_fails_the_build(project, keypair):
    for output, message in (("nope", "has no output 'nope'"), ("output", r"output output is float32 \['batch', 1\]")):
        inputs = {"input": {"role": "audio"}, "state": {"role": "state", "output": output},
                  "sr": {"role": "constant", "value": 16000}}
        recipe = load_recipe(_recipe(project, inputs=inputs))
        with pytest.raises(RecipeError, match=message):
            build(recipe, key_paths=[str(keypair[0])], output=project / "bad.edgepkg")


# ---------------------------------------------------------------- end to end


def _reference(frames: np.ndarray, state: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Independent numpy run over ``frames`` [n, 1, samples]: stacked outputs, stacked states, last state."""
    state = np.zeros((2, 1, 128), np.float32) if state is None else state
    outputs, states = [], []
    for frame in frames:
        output, state = reference_step(frame, state)
        outputs.append(output)
        states.append(state)
    return np.stack(outputs), np.stack(states), state


def _frames_of(path: Path) -> np.ndarray:
    """The frames a device should cut, computed here with the audio module's parts directly."""
    samples, rate = audio.decode_wav(path.read_bytes())
    mono = audio.resample(audio.to_mono(samples), rate, SAMPLE_RATE)
    return audio.cut_frames(mono, FRAME, FRAME, CONTEXT)[:, None, :]


@pytest.fixture(scope="module")
def artifact(project, keypair) -> Path:
    out = project / "vad.edgepkg"
    built = run_cli("edgepack", "build", str(project / "vad.yaml"), "--key", str(keypair[0]), "-o",
                    str(out), cwd=project)
    assert built.returncode == 0, built.stderr
    verified = run_cli("edgepack", "verify", str(out), "--trust", str(keypair[1]))
    assert verified.returncode == 0 and verified.stdout.startswith("OK"), verified.stderr
    return out


@pytest.fixture(scope="module")
def service(artifact, keypair, tmp_path_factory) -> InferenceService:
    folder = tmp_path_factory.mktemp("agent")
    extracted = extract_artifact(artifact, folder / "x", TrustStore([load_public_key(keypair[1])]))
    model = load_model(folder / "x", extracted.manifest)  # runs the golden smoke test
    assert model.smoke is not None and model.smoke.samples == 4  # it raises when a sample differs
    return InferenceService(model, max_streams=2)


def test_manifest_records_the_roles(service):
    inputs = {spec["name"]: spec for spec in service.model.manifest.raw["inputs"]}
    assert inputs["input"]["role"] == "audio"
    assert (inputs["state"]["role"], inputs["state"]["output"], inputs["state"]["init"]) == ("state", "stateN", "zeros")
    assert inputs["sr"]["role"] == "constant"
    assert service.model.manifest.preprocess.input == "input"
    assert set(service.model.input_specs) == {"input"}  # callers pass only the audio


def test_cli_predict_runs_a_whole_wav_through_the_stateful_model(project, artifact, keypair):
    wav = project / "demo" / "vad" / "audio" / "tone-44k-stereo-pcm24.wav"
    answer = run_cli("edgepack-agent", "predict", "--artifact", str(artifact), "--trust", str(keypair[1]),
                     "--input", str(wav), "--json")
    assert answer.returncode == 0, answer.stderr
    outputs = json.loads(answer.stdout)["outputs"]
    frames = _frames_of(wav)
    want_out, want_states, _ = _reference(frames)
    assert np.asarray(outputs["output"]).shape == (len(frames), 1, 1)
    assert np.allclose(outputs["output"], want_out, atol=1e-5)
    assert np.allclose(outputs["stateN"], want_states, atol=1e-5)
    assert len(frames) == 10 and not np.allclose(want_out[0], want_out[-1])  # the state did change things


def test_cli_predict_refuses_a_broken_wav_in_one_line(project, artifact, keypair):
    bad = project / "bad.wav"
    bad.write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt \x10\x00\x00\x00" + b"\x01\x00\x09\x00" + b"\0" * 12)
    answer = run_cli("edgepack-agent", "predict", "--artifact", str(artifact), "--trust", str(keypair[1]),
                     "--input", str(bad), "--json")
    assert answer.returncode != 0 and "9 channels" in answer.stderr and "Traceback" not in answer.stderr


def test_python_api_streams_carry_state_across_calls(project, service):
    wav = project / "demo" / "vad" / "audio" / "burst-16k-pcm16.wav"
    frames = _frames_of(wav)
    want_out, _, _ = _reference(frames)
    service.reset_stream("mic-1")
    got = [service.predict_tensors({"input": frame}, stream="mic-1").outputs["output"] for frame in frames]
    assert np.allclose(np.stack(got), want_out, atol=1e-5)
    # without a stream every call starts from init
    alone = service.predict_tensors({"input": frames[3]}).outputs["output"]
    assert np.allclose(alone, reference_step(frames[3], np.zeros((2, 1, 128), np.float32))[0], atol=1e-5)
    assert not np.allclose(alone, want_out[3], atol=1e-4)
    # a whole file on a stream continues from the stream's state
    _, _, last = _reference(frames)
    result = service.predict(wav.read_bytes(), content_type="audio/wav", stream="mic-1")
    assert np.allclose(result.outputs["output"], _reference(frames, last)[0], atol=1e-5)
    assert service.reset_stream("mic-1") is True
    with pytest.raises(BadRequest, match="stream"):
        service.predict_tensors({"input": frames[0]}, stream="bad/id")
    with pytest.raises(BadRequest, match="unknown input 'state'"):
        service.predict_tensors({"input": frames[0], "state": np.zeros((2, 1, 128), np.float32)})


def _post(port: int, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/predict", body=body, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def _delete(port: int, path: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("DELETE", path)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def test_http_stream_header_keeps_state_and_delete_resets_it(project, service):
    wav = project / "demo" / "vad" / "audio" / "chirp-8k-float32.wav"
    frames = _frames_of(wav)
    halves = [frames[:6], frames[6:]]
    server = ApiServer(("127.0.0.1", 0), service, max_body_bytes=1 << 20).start()
    try:
        state = None
        for half in halves:  # each half as an npy frame by frame on the stream
            for frame in half:
                buffer = io.BytesIO()
                np.save(buffer, frame)
                status, answer = _post(server.port, buffer.getvalue(),
                                       {"Content-Type": "application/x-npy", "X-Edgepack-Stream": "http-1"})
                assert status == 200, answer
            out, _, state = _reference(half, state)
            assert np.allclose(answer["outputs"]["output"], out[-1], atol=1e-5)
        # a whole WAV on the stream continues; the reset header restarts it first
        status, answer = _post(server.port, wav.read_bytes(), {"Content-Type": "audio/wav",
                                                                "X-Edgepack-Stream": "http-1"})
        assert status == 200 and np.allclose(answer["outputs"]["output"], _reference(frames, state)[0], atol=1e-5)
        status, answer = _post(server.port, wav.read_bytes(), {"Content-Type": "audio/wav",
                                                                "X-Edgepack-Stream": "http-1",
                                                                "X-Edgepack-Stream-Reset": "1"})
        assert status == 200 and np.allclose(answer["outputs"]["output"], _reference(frames)[0], atol=1e-5)
        assert _delete(server.port, "/streams/http-1") == 204
        assert _delete(server.port, "/streams/http-1") == 404
        assert _delete(server.port, "/streams/bad+id") == 400
        status, answer = _post(server.port, b"RIFF", {"Content-Type": "audio/wav"})
        assert status == 400 and answer["error"]["kind"] == "bad_audio"
        status, answer = _post(server.port, wav.read_bytes(), {"Content-Type": "audio/wav",
                                                                "X-Edgepack-Stream": "../x"})
        assert status == 400 and answer["error"]["kind"] == "bad_stream"
    finally:
        server.stop()


def test_http_streams_beyond_the_limit_drop_the_least_recently_used(project, service):
    frames = _frames_of(project / "demo" / "vad" / "audio" / "burst-16k-pcm16.wav")
    first = _reference(frames[5:6])[0][0]
    for stream in ("s1", "s2", "s3"):  # max_streams is 2
        service.predict_tensors({"input": frames[4]}, stream=stream)
    assert "s1" not in service.streams and "s3" in service.streams
    again = service.predict_tensors({"input": frames[5]}, stream="s1").outputs["output"]
    assert np.allclose(again, first, atol=1e-5)  # s1 started over from init


def test_audio_data_source_feeds_every_frame_and_state_from_init(project, artifact):
    import tarfile

    with tarfile.open(artifact) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        with np.load(io.BytesIO(tar.extractfile("golden/000.inputs.npz").read())) as golden:
            inputs = {k: golden[k] for k in golden.files}
    first = sorted((project / "demo" / "vad" / "audio").glob("*.wav"))[0]
    assert np.allclose(inputs["input"], _frames_of(first)[0], atol=1e-7)
    assert not inputs.get("state", np.zeros(1)).any()
    assert len(manifest["golden"]["samples"]) == 4


def test_write_wav_round_trip_is_what_the_demo_data_uses(tmp_path):
    path = write_wav(tmp_path / "x.wav", np.array([0.0, 0.5, -0.5]), 16000)
    assert audio.decode_wav(path.read_bytes())[0][:, 0].tolist() == [0.0, 0.5, -0.5]
