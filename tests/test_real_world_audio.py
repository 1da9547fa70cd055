"""Audio inputs without graph edits (issue 23, item 6): a model taking ``[B, N, 1]`` or
``[B, 1, N]`` int16-scale floats builds with the recipe a user writes (``layout``, ``scale:
32768``) and the agent answers like bare onnxruntime on the same samples; ``last_frame: pad |
drop`` at its boundaries; ``hop > frame`` refused unless declared; a WAV of another rate
resampled, or refused naming both rates when resampling is off, at build and on the device;
the host's data sources and the device's requests give the same tensors."""

from __future__ import annotations

import io
import json
import tarfile
import urllib.error
import urllib.request
import wave
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from device_agent.errors import BadRequest
from device_agent.feeds import input_feed
from device_agent.http.server import ApiServer
from device_agent.prediction import Audio
from device_agent.runtime import InferenceService, load_model
from edgepack_core import audio
from edgepack_core.artifact import extract_artifact
from edgepack_core.errors import PreprocessError, SchemaError
from edgepack_core.manifest import TensorSpec
from edgepack_core.preprocess import Preprocessor
from edgepack_core.preprocess_spec import normalize_preprocess, parse_preprocess
from edgepack_core.signing import TrustStore, load_public_key
from sdk.errors import RecipeError
from sdk.packager.data import load_samples
from sdk.packager.declared import audio_frame_problem, gaps_problem, model_rate_problem
from sdk.recipe import load_recipe
from tests.conftest import run_cli
from tests.real_world_audio import FRAME, RATE, build_quality, quality_model, rate_model, tone
from tests.real_world_declared import build_recipe
from tools.demos.vad import write_wav


@pytest.fixture(scope="module")
def built(tmp_path_factory, keypair):
    """The two layouts built once: [B, N, 1] validated on 16 kHz clips and a 44.1 kHz one
    (resampled by default), [B, 1, N] with ``resample: false`` and ``last_frame: drop``."""
    folder = tmp_path_factory.mktemp("audio-layouts")
    trust = TrustStore([load_public_key(keypair[1])])
    artifacts = {
        "BN1": build_quality(folder / "bn1", keypair[0], "BN1", with_44k=True),
        "B1N": build_quality(folder / "b1n", keypair[0], "B1N", ", resample: false, last_frame: drop"),
    }
    models = {}
    for layout, path in artifacts.items():
        bundle = extract_artifact(path, folder / f"x-{layout}", trust)
        models[layout] = load_model(bundle.root, bundle.manifest)
    return folder, models


def _int16_frames(path: Path, drop: bool) -> np.ndarray:
    """The reference, read without Edgepack: the PCM16 values as floats, cut in frames of FRAME."""
    with wave.open(str(path), "rb") as reader:
        assert reader.getframerate() == RATE
        values = np.frombuffer(reader.readframes(reader.getnframes()), "<i2").astype(np.float32)
    count = values.size // FRAME if drop else -(-values.size // FRAME)
    padded = np.zeros(count * FRAME, np.float32)
    padded[: min(values.size, padded.size)] = values[: padded.size]
    return padded.reshape(count, FRAME)


def _bare(folder: Path, layout: str, frames: np.ndarray) -> np.ndarray:
    """Bare onnxruntime on the original model, frame by frame in the model's layout."""
    session = ort.InferenceSession(
        str(quality_model(folder / "original.onnx", layout)), providers=["CPUExecutionProvider"]
    )
    shape = (1, FRAME, 1) if layout == "BN1" else (1, 1, FRAME)
    return np.stack([session.run(None, {"audio": frame.reshape(shape)})[0] for frame in frames])


@pytest.mark.parametrize(("layout", "drop"), [("BN1", False), ("B1N", True)])
def test_an_int16_scale_model_of_either_channel_layout_builds_and_answers_like_bare_onnxruntime(
    built, tmp_path, layout, drop
):
    _, models = built
    clip = write_wav(tmp_path / "talk.wav", tone(0.11, RATE, 5), RATE)  # 1760 samples: 4 whole frames + 160
    answer = InferenceService(models[layout]).predict(clip.read_bytes())
    reference = _bare(tmp_path, layout, _int16_frames(clip, drop))
    assert answer.outputs["scores"].shape == (4 if drop else 5, 1, 2)
    np.testing.assert_allclose(answer.outputs["scores"], reference, rtol=1e-5, atol=1e-5)
    # The scale matters to this model: [-1, 1) samples would answer something else.
    assert not np.allclose(_bare(tmp_path, layout, _int16_frames(clip, drop) / 32768), reference, atol=1e-3)


def test_the_host_and_the_device_give_identical_tensors_for_the_same_wav(built, keypair):
    folder, models = built
    recipe = load_recipe(folder / "bn1" / "quality-bn1.yaml")
    assert recipe.validate.data is not None
    model = models["BN1"]
    samples = load_samples(recipe.validate.data, recipe.preprocess, model.manifest.inputs, key="validate.data")
    clips = sorted((folder / "bn1" / "clips").glob("*.wav"))
    device = [input_feed(model, Audio(path.read_bytes()))["audio"] for path in clips]
    host = [feed["audio"] for feed in samples.feeds]
    assert len(host) == sum(len(frames) for frames in device) == 4 + 5 + 4  # the 44.1 kHz clip: 1600 samples
    for got, want in zip(host, [frame for frames in device for frame in frames], strict=True):
        assert got.dtype == want.dtype == np.float32 and got.shape == want.shape == (1, FRAME, 1)
        assert np.array_equal(got, want)


def test_a_44k_wav_sent_to_a_16k_model_is_resampled_on_the_device(built, tmp_path):
    _, models = built
    clip = write_wav(tmp_path / "44k.wav", tone(0.1, 44100, 2), 44100)
    answer = InferenceService(models["BN1"]).predict(clip.read_bytes())
    decoded, rate = audio.decode_wav(clip.read_bytes())
    resampled = audio.resample(decoded[:, 0], rate, RATE)
    assert resampled.size == 1600 and answer.outputs["scores"].shape == (4, 1, 2)
    reference = _bare(tmp_path, "BN1", resampled.reshape(4, FRAME) * 32768)
    np.testing.assert_allclose(answer.outputs["scores"], reference, rtol=1e-5, atol=1e-5)


def test_a_44k_validation_wav_for_a_16k_model_is_resampled_at_build_and_said_so(built):
    folder, _ = built
    with tarfile.open(folder / "bn1" / "quality-bn1.edgepkg") as tar:
        report = json.loads(tar.extractfile("report.json").read())
    assert report["passes"]["validate"]["resampled"] == {"to": RATE, "count": 1, "files": {"c-44k.wav": 44100}}
    assert any("c-44k.wav (44100 Hz)" in warning and "16000 Hz" in warning for warning in report["warnings"])


def test_a_44k_wav_sent_to_a_16k_model_without_resampling_is_a_400_naming_both_rates(built, tmp_path, keypair):
    folder, models = built
    clip = write_wav(tmp_path / "44k.wav", tone(0.1, 44100, 2), 44100)
    service = InferenceService(models["B1N"])
    with pytest.raises(BadRequest, match=r"44100 Hz.*16000 Hz") as caught:
        service.predict(clip.read_bytes())
    assert caught.value.kind == "bad_audio"
    server = ApiServer(("127.0.0.1", 0), service).start()
    try:
        request = urllib.request.Request(
            f"http://127.0.0.1:{server.port}/predict", data=clip.read_bytes(), headers={"Content-Type": "audio/wav"}
        )
        with pytest.raises(urllib.error.HTTPError) as http:
            urllib.request.urlopen(request, timeout=30)
        assert http.value.code == 400
        error = json.loads(http.value.read())["error"]
        assert error["kind"] == "bad_audio" and "44100 Hz" in error["message"] and "16000 Hz" in error["message"]
    finally:
        server.stop()
    assert service.stats.snapshot()["requests"]["server_error"] == 0
    cli = run_cli(
        "edgepack-agent",
        "predict",
        "--artifact",
        str(folder / "b1n" / "quality-b1n.edgepkg"),
        "--trust",
        str(keypair[1]),
        "--input",
        str(clip),
    )
    assert cli.returncode == 1 and cli.stderr.count("\n") == 1
    assert "44100 Hz" in cli.stderr and "16000 Hz" in cli.stderr
    ok = write_wav(tmp_path / "16k.wav", tone(0.1, RATE, 2), RATE)
    assert service.predict(ok.read_bytes()).outputs["scores"].shape == (4, 1, 2)


def test_a_44k_validation_wav_for_a_16k_model_without_resampling_is_refused_at_build_naming_both_rates(
    tmp_path, keypair
):
    with pytest.raises(RecipeError) as caught:
        build_quality(tmp_path, keypair[0], "BN1", ", resample: false", with_44k=True)
    assert caught.value.key == "validate.data.audio"
    assert "c-44k.wav" in caught.value.problem and "44100 Hz" in caught.value.problem
    assert "16000 Hz" in caught.value.problem and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("layout", "declared", "key", "fits"),
    [
        ("BN1", "[B, N]", "preprocess.layout", "[B, N, 1]"),
        ("BN1", "[B, 1, N]", "preprocess.layout", "[B, N, 1]"),
        ("B1N", "[B, N, 1]", "preprocess.layout", "[B, 1, N]"),
    ],
)
def test_an_audio_layout_that_does_not_fit_the_model_is_refused_at_build_naming_the_one_that_does(
    tmp_path, keypair, layout, declared, key, fits
):
    with pytest.raises(RecipeError) as caught:
        build_quality(tmp_path, keypair[0], layout, declared=declared)
    assert caught.value.key == key and f"declare layout: {fits}" in caught.value.problem
    assert "input audio" in caught.value.problem and "\n" not in str(caught.value)


def test_an_audio_dtype_that_does_not_fit_the_model_is_refused_at_build(tmp_path, keypair):
    with pytest.raises(RecipeError) as caught:
        build_quality(tmp_path, keypair[0], "BN1", ", dtype: int16")
    assert caught.value.key == "preprocess.dtype"
    assert "int16" in caught.value.problem and "float32" in caught.value.problem


MODEL = TensorSpec("audio", "float32", ("batch", 400, 1))


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"layout": ["B", "N", 1]}, None),
        ({"layout": ["B", "N", 1], "frame": 336, "context": 64}, None),  # context + frame is what counts
        ({"layout": ["B", "N", 1], "frame": 399}, "preprocess.frame"),
        ({"layout": ["B", "N", 1], "frame": 401}, "preprocess.frame"),
        ({"layout": ["B", "N"]}, "preprocess.layout"),
        ({"layout": ["B", "N", 1], "batch": False}, "preprocess.layout"),
        ({"layout": ["B", "N"], "batch": False}, "preprocess.layout"),
    ],
)
def test_the_audio_frame_rule_at_its_boundaries(spec, problem):
    parsed = parse_preprocess({"kind": "audio", "sample_rate": RATE, "frame": 400, **spec})
    found = audio_frame_problem(parsed, MODEL)
    assert (found[0] if found else None) == problem
    fixed_batch = TensorSpec("audio", "float32", (10, 400, 1))
    assert (
        audio_frame_problem(
            parse_preprocess({"kind": "audio", "sample_rate": RATE, "frame": 400, "layout": ["B", "N", 1]}), fixed_batch
        )
        is not None
    )
    unbatched = TensorSpec("audio", "float32", (400, 1))
    assert (
        audio_frame_problem(
            parse_preprocess(
                {"kind": "audio", "sample_rate": RATE, "frame": 400, "batch": False, "layout": ["B", "N", 1]}
            ),
            unbatched,
        )
        is None
    )


def _recipe(folder: Path, preprocess: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    quality_model(folder / "quality.onnx", "BN1")
    path = folder / "r.yaml"
    path.write_text(
        f"name: q\nversion: 1.0.0\nmodel: {{path: quality.onnx}}\npreprocess: {preprocess}\n"
        "validate: {data: synthetic}\n"
    )
    return path


def test_a_hop_larger_than_the_frame_is_refused_with_one_line_unless_declared(tmp_path):
    base = f"{{kind: audio, sample_rate: {RATE}, frame: 400, layout: [B, N, 1]"
    with pytest.raises(RecipeError) as caught:
        load_recipe(_recipe(tmp_path, base + ", hop: 401}"))
    assert caught.value.key == "preprocess.hop" and "allow_gaps" in caught.value.problem
    assert "1 samples between frames" in caught.value.problem and "\n" not in str(caught.value)
    assert load_recipe(_recipe(tmp_path, base + ", hop: 400}")).preprocess.hop == 400  # the limit passes
    declared = load_recipe(_recipe(tmp_path, base + ", hop: 401, allow_gaps: true}")).preprocess
    assert declared.allow_gaps and gaps_problem(declared) is None
    wav = write_wav(tmp_path / "x.wav", np.arange(1, 802) / 1000, RATE, encoding="float32")  # 801 samples
    frames = Preprocessor(declared).from_path(wav)
    assert frames.shape == (2, 1, 400, 1)
    assert frames[1, 0, 0, 0] == np.float32(0.402)  # sample 401 (the 402nd) starts frame 1: sample 400 is skipped


def _wav(tmp_path: Path, samples: int) -> bytes:
    return write_wav(tmp_path / f"{samples}.wav", np.linspace(-0.5, 0.5, samples), RATE).read_bytes()


@pytest.mark.parametrize(
    ("frame", "hop", "samples", "pad", "drop"),
    [
        (400, 400, 1200, 3, 3),  # exactly a multiple of hop: no partial frame
        (400, 400, 1201, 4, 3),  # one sample over: pad adds a frame, drop does not
        (400, 200, 1200, 5, 5),
        (400, 200, 1201, 6, 5),
        (400, 400, 400, 1, 1),  # exactly one frame
    ],
)
def test_last_frame_pad_and_drop_at_the_boundaries(tmp_path, frame, hop, samples, pad, drop):
    data = _wav(tmp_path, samples)
    counts = {}
    for last in ("pad", "drop"):
        spec = {"kind": "audio", "sample_rate": RATE, "frame": frame, "hop": hop, "last_frame": last}
        frames = Preprocessor(spec).from_audio_bytes(data)
        counts[last] = len(frames)
        assert audio.frame_count(samples, frame, hop, last) == counts[last]
    assert counts == {"pad": pad, "drop": drop}


def test_a_clip_shorter_than_one_frame_is_one_padded_frame_or_refused_when_dropping(tmp_path):
    data = _wav(tmp_path, 399)
    base = {"kind": "audio", "sample_rate": RATE, "frame": 400}
    assert Preprocessor(base).from_audio_bytes(data).shape == (1, 1, 400)
    with pytest.raises(PreprocessError, match="399 samples is shorter than one frame of 400"):
        Preprocessor({**base, "last_frame": "drop"}).from_audio_bytes(data)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("float32", [-32768.0, -16384.0, 0.0, 16384.0, 32767.0]),
        ("float16", [-32768.0, -16384.0, 0.0, 16384.0, 32768.0]),  # float16 rounds 32767 to 32768
        ("int16", [-32768, -16384, 0, 16384, 32767]),
        ("int32", [-32768, -16384, 0, 16384, 32767]),
    ],
)
def test_scale_and_dtype_give_int16_magnitudes(tmp_path, dtype, expected):
    data = write_wav(tmp_path / "x.wav", np.array([-1.0, -0.5, 0.0, 0.5, 1.0]), RATE).read_bytes()
    spec = {"kind": "audio", "sample_rate": RATE, "frame": 5, "scale": 32768, "dtype": dtype, "batch": False}
    frames = Preprocessor(spec).from_audio_bytes(data)
    assert frames.dtype == np.dtype(dtype) and frames.tolist() == [expected]


def test_an_integer_dtype_clips_a_float_wav_above_full_scale(tmp_path):
    data = write_wav(tmp_path / "x.wav", np.array([1.5, -1.5]), RATE, encoding="float32").read_bytes()
    spec = {"kind": "audio", "sample_rate": RATE, "frame": 2, "scale": 32768, "dtype": "int16", "batch": False}
    assert Preprocessor(spec).from_audio_bytes(data).tolist() == [[32767, -32768]]


def test_the_new_audio_keys_are_written_only_when_used_and_round_trip():
    plain = normalize_preprocess({"kind": "audio", "sample_rate": RATE, "frame": 400})
    assert set(plain) == {"kind", "version", "sample_rate", "frame", "hop", "context", "dtype", "batch"}
    full = normalize_preprocess(
        {
            "kind": "audio",
            "sample_rate": RATE,
            "frame": 400,
            "hop": 800,
            "allow_gaps": True,
            "last_frame": "drop",
            "resample": False,
            "scale": 32768,
            "layout": ["B", 1, "N"],
            "dtype": "float16",
        }
    )
    assert full == {
        "kind": "audio",
        "version": 1,
        "sample_rate": RATE,
        "frame": 400,
        "hop": 800,
        "context": 0,
        "last_frame": "drop",
        "resample": False,
        "allow_gaps": True,
        "scale": 32768.0,
        "layout": ["B", 1, "N"],
        "dtype": "float16",
        "batch": True,
    }
    assert normalize_preprocess(full) == full


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"layout": ["N", "B"]}, "layout"),
        ({"layout": "NCHW"}, "layout"),
        ({"scale": 0}, "scale"),
        ({"last_frame": "keep"}, "last_frame"),
        ({"resample": "yes"}, "resample"),
        ({"dtype": "uint8"}, "dtype"),
        ({"window": "hann"}, "window"),
    ],
)
def test_bad_audio_keys_are_refused_naming_the_key(extra, key):
    with pytest.raises(SchemaError, match=f"preprocess.{key}"):
        normalize_preprocess({"kind": "audio", "sample_rate": RATE, "frame": 400, **extra}, path="preprocess")


@pytest.mark.parametrize("extra", [{"layout": ["B", "N", 1]}, {"last_frame": "pad"}, {"allow_gaps": True}])
def test_audio_only_keys_are_refused_on_an_image_spec(extra):
    with pytest.raises(SchemaError, match=f"preprocess.{next(iter(extra))}"):
        normalize_preprocess({"kind": "image", **extra}, path="preprocess")


def test_made_up_validation_audio_follows_the_layout_and_scale(tmp_path, keypair):
    """``validate: {data: synthetic}`` on a [B, N, 1] int16-scale model: the made-up frames are
    cut by the same code, so they have the model's shape and scale."""
    quality_model(tmp_path / "quality.onnx", "BN1")
    artifact = build_recipe(
        tmp_path,
        keypair[0],
        "made-up",
        "model: {path: quality.onnx}\n"
        f"preprocess: {{kind: audio, sample_rate: {RATE}, frame: {FRAME}, layout: [B, N, 1], scale: 32768, "
        "last_frame: drop}\npostprocess: {kind: raw}\nvalidate: {data: synthetic}\n",
    )
    with tarfile.open(artifact) as tar:
        golden = np.load(io.BytesIO(tar.extractfile("golden/000.inputs.npz").read()))["audio"]
    assert golden.shape == (1, FRAME, 1) and np.abs(golden).max() > 1000  # int16 magnitudes, not [-1, 1)


@pytest.mark.parametrize(
    ("constant", "metadata", "rate", "problem"),
    [
        ("sr: {role: constant, value: 16000}", None, 8000, "constant input sr is 16000"),
        ("sr: {role: constant, value: 16000}", None, 16000, None),
        ("sr: {role: constant, value: 8000}", "8000", 16000, "constant input sr is 8000"),
        ("sr: {role: constant, value: 16000}", "8000", 16000, "metadata property sample_rate is 8000"),
    ],
)
def test_a_sample_rate_unlike_the_one_the_model_states_is_refused_at_build(
    tmp_path, keypair, constant, metadata, rate, problem
):
    rate_model(tmp_path / "vad.onnx", metadata)
    body = (
        f"model: {{path: vad.onnx}}\ninputs: {{audio: {{role: audio}}, {constant}}}\n"
        f"preprocess: {{kind: audio, sample_rate: {rate}, frame: {FRAME}}}\npostprocess: {{kind: raw}}\n"
        "validate: {data: synthetic}\n"
    )
    if problem is None:
        assert build_recipe(tmp_path, keypair[0], "vad", body).exists()
        return
    with pytest.raises(RecipeError) as caught:
        build_recipe(tmp_path, keypair[0], "vad", body)
    assert caught.value.key == "preprocess.sample_rate" and problem in caught.value.problem
    assert f"is {rate} but" in caught.value.problem and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("constants", "metadata", "fits"),
    [
        ({"sr": 16000}, {}, True),
        ({"sr": [16000]}, {}, True),
        ({"SR": 16001}, {}, False),
        ({"sampling_rate": 15999}, {}, False),
        ({"speed": 8000}, {}, True),  # not named like a rate: not read
        ({}, {"sample_rate": "16000"}, True),
        ({}, {"sample_rate": "8000"}, False),
        ({}, {"sample_rate": "16 kHz"}, True),  # not a number: not read
        ({"sr": 0.5}, {}, True),
    ],
)
def test_the_model_rate_rule_at_its_boundaries(constants, metadata, fits):
    spec = parse_preprocess({"kind": "audio", "sample_rate": 16000, "frame": 4})
    assert (model_rate_problem(spec, constants, metadata) is None) is fits
    assert model_rate_problem(parse_preprocess({"kind": "tensor"}), constants, metadata) is None
