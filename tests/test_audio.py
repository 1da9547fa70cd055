"""Audio preprocessing: WAV decoding of every supported encoding, bounded headers (attacks named
after themselves), mono mix, resampling within its documented error bound, framing with
context, and the ``kind: audio`` spec."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from edgepack_core import audio
from edgepack_core.errors import PreprocessError, SchemaError
from edgepack_core.preprocess import Preprocessor
from edgepack_core.preprocess_spec import normalize_preprocess
from tools.demos.vad import write_wav

RNG = np.random.default_rng(7)
CLIP = np.clip(RNG.standard_normal((300, 2)) * 0.3, -0.99, 0.99)


def _bytes(tmp_path, samples, rate=16000, **kwargs) -> bytes:
    return write_wav(tmp_path / "a.wav", samples, rate, **kwargs).read_bytes()


@pytest.mark.parametrize(("encoding", "extensible", "tolerance"), [
    ("pcm8", False, 1 / 128), ("pcm16", False, 1 / 2**15), ("pcm24", False, 1 / 2**23),
    ("pcm32", False, 1e-7), ("float32", False, 1e-7), ("float64", False, 1e-7),
    ("pcm16", True, 1 / 2**15), ("pcm24", True, 1 / 2**23), ("float32", True, 1e-7),
])
def test_every_encoding_decodes_to_the_written_samples(tmp_path, encoding, extensible, tolerance):
    samples, rate = audio.decode_wav(_bytes(tmp_path, CLIP, 22050, encoding=encoding, extensible=extensible))
    assert rate == 22050 and samples.shape == CLIP.shape and samples.dtype == np.float32
    assert np.abs(samples - CLIP).max() <= tolerance


def test_pcm24_negative_full_scale_and_sign_extension(tmp_path):
    values = np.array([-1.0, -0.5, 0.0, 0.5, 1 - 2**-23])
    samples, _ = audio.decode_wav(_bytes(tmp_path, values, encoding="pcm24"))
    assert samples[:, 0].tolist() == pytest.approx(values.tolist(), abs=2**-23)


def test_stereo_is_mixed_to_mono_as_the_mean_of_the_channels(tmp_path):
    samples, _ = audio.decode_wav(_bytes(tmp_path, CLIP, encoding="float32"))
    assert np.allclose(audio.to_mono(samples), CLIP.mean(axis=1), atol=1e-7)


def _header(channels=1, rate=16000, bits=16, tag=1, data_size=None, payload=b"\0\0" * 4) -> bytes:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    size = len(payload) if data_size is None else data_size
    body = b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", size) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"channels": 9, "payload": b"\0" * 18}, "9 channels"),
    ({"channels": 0}, "0 channels"),
    ({"rate": 999}, "sample rate 999"),
    ({"rate": 384_001}, "sample rate 384001"),
    ({"bits": 12}, "12-bit"),
    ({"tag": 2}, "format tag 2"),
    ({"tag": 3, "bits": 16}, "16-bit float"),
])
def test_header_fields_out_of_bounds_are_refused(kwargs, message):
    with pytest.raises(PreprocessError, match=message):
        audio.decode_wav(_header(**kwargs))


def test_header_bounds_are_inclusive():
    for rate in (audio.MIN_RATE, audio.MAX_RATE):
        assert audio.decode_wav(_header(rate=rate))[1] == rate
    assert audio.decode_wav(_header(channels=8, payload=b"\0" * 16))[0].shape == (1, 8)


def test_wav_data_size_lie_allocates_only_what_is_there():
    """A header claiming 4 GiB of samples over 8 real bytes: read 4 samples, allocate nothing more."""
    samples, _ = audio.decode_wav(_header(data_size=0xFFFFFFF0, payload=b"\x00\x40" * 4))
    assert samples.shape == (4, 1) and np.allclose(samples, 0.5)


def test_wav_over_the_data_cap_is_refused_before_decoding():
    with pytest.raises(PreprocessError, match="over the limit of 8"):
        audio.decode_wav(_header(payload=b"\0" * 16), max_bytes=8)
    assert audio.decode_wav(_header(payload=b"\0" * 8), max_bytes=8)[0].shape == (4, 1)


def test_wav_chunk_flood_is_bounded():
    """Thousands of empty chunks before the data: refused after MAX_CHUNKS, never walked to the end."""
    flood = b"junk" + struct.pack("<I", 0)
    head = _header()
    data = head[:12] + flood * 10_000 + head[12:]
    with pytest.raises(PreprocessError, match="no fmt and data chunks"):
        audio.decode_wav(data)


def test_wav_fmt_chunk_size_lie_is_refused():
    data = bytearray(_header())
    data[16:20] = struct.pack("<I", 1 << 30)
    with pytest.raises(PreprocessError, match="fmt chunk"):
        audio.decode_wav(bytes(data))


def test_upsampling_bomb_is_refused_before_allocating(monkeypatch):
    """A small low-rate body resampled to a high model rate must not grow without bound."""
    monkeypatch.setattr(audio, "MAX_SAMPLES", 1000)
    assert audio.resample(np.zeros(100, np.float32), 1000, 10000).size == 991  # (100 - 1) * 10 + 1
    with pytest.raises(PreprocessError, match="over the limit of 1000"):
        audio.resample(np.zeros(101, np.float32), 1000, 10000)  # 1001 samples


def test_overlapping_frames_bomb_is_refused_before_allocating(monkeypatch):
    """hop 1 with frame 512 would copy every sample 512 times."""
    monkeypatch.setattr(audio, "MAX_FRAME_VALUES", 10 * 8)
    assert audio.cut_frames(np.zeros(13, np.float32), frame=4, hop=1, context=4).shape == (10, 8)
    with pytest.raises(PreprocessError, match="over the limit of 80"):
        audio.cut_frames(np.zeros(14, np.float32), frame=4, hop=1, context=4)


@pytest.mark.parametrize("data", [b"", b"RIFF", b"RIFX" + b"\0" * 40, b"\x89PNG\r\n\x1a\n" + b"\0" * 40])
def test_non_wav_bytes_are_one_clear_error(data):
    with pytest.raises(PreprocessError, match="not a WAV file"):
        audio.decode_wav(data)


def test_float_wav_with_nan_is_refused(tmp_path):
    data = _bytes(tmp_path, np.array([0.0, np.nan, 0.1]), encoding="float32")
    with pytest.raises(PreprocessError, match="NaN"):
        audio.decode_wav(data)


@pytest.mark.parametrize(("rate_in", "rate_out", "freq"), [(44100, 16000, 440.0), (8000, 16000, 300.0),
                                                            (48000, 16000, 1000.0)])
def test_linear_resampling_error_on_a_sine_is_within_the_documented_bound(rate_in, rate_out, freq):
    seconds = 0.25
    n = int(rate_in * seconds)
    source = np.sin(2 * np.pi * freq * np.arange(n) / rate_in)
    out = audio.resample(source.astype(np.float32), rate_in, rate_out)
    assert out.size == (n - 1) * rate_out // rate_in + 1
    reference = np.sin(2 * np.pi * freq * np.arange(out.size) / rate_out)
    bound = (np.pi * freq / rate_in) ** 2 / 2 + 1e-6  # + float32 rounding
    error = np.abs(out - reference).max()
    assert error <= bound
    if rate_in % rate_out:  # an integer ratio samples exactly on input samples: no error to bound
        assert error > bound / 20  # the bound is tight enough to mean something


def test_resampling_to_the_same_rate_is_the_identity():
    x = RNG.standard_normal(100).astype(np.float32)
    assert np.array_equal(audio.resample(x, 16000, 16000), x)


def test_frames_carry_context_of_the_previous_frame_and_zeros_before_the_first():
    x = np.arange(1, 11, dtype=np.float32)  # 10 samples
    frames = audio.cut_frames(x, frame=4, hop=4, context=2)
    assert frames.tolist() == [[0, 0, 1, 2, 3, 4], [3, 4, 5, 6, 7, 8], [7, 8, 9, 10, 0, 0]]


def test_frame_count_boundaries():
    assert [audio.frame_count(n, 4, 4) for n in (0, 1, 4, 5, 8, 9)] == [1, 1, 1, 2, 2, 3]
    assert [audio.frame_count(n, 4, 2) for n in (4, 5, 6, 7)] == [1, 2, 2, 3]
    frames = audio.cut_frames(np.arange(1, 7, dtype=np.float32), frame=4, hop=2, context=0)
    assert frames.tolist() == [[1, 2, 3, 4], [3, 4, 5, 6]]


def test_audio_spec_is_normalised_with_every_default_written_out():
    spec = normalize_preprocess({"kind": "audio", "sample_rate": 16000, "frame": 512})
    assert spec == {"kind": "audio", "version": 1, "sample_rate": 16000, "frame": 512, "hop": 512, "context": 0,
                    "dtype": "float32", "batch": True}
    assert normalize_preprocess(spec) == spec


@pytest.mark.parametrize(("spec", "key"), [
    ({"kind": "audio", "frame": 512}, "sample_rate"),
    ({"kind": "audio", "sample_rate": 16000, "frame": 0}, "frame"),
    ({"kind": "audio", "sample_rate": 999, "frame": 4}, "sample_rate"),
    ({"kind": "audio", "sample_rate": 16000, "frame": 4, "mean": [0.5]}, "mean"),
    ({"kind": "audio", "sample_rate": 16000, "frame": 4, "dtype": "int8"}, "dtype"),
    ({"kind": "image", "frame": 4}, "frame"),
])
def test_bad_audio_specs_name_the_key(spec, key):
    with pytest.raises(SchemaError, match=key):
        normalize_preprocess(spec, path="preprocess")


def test_preprocessor_turns_a_stereo_44k_file_into_model_ready_frames(tmp_path):
    t = np.arange(4410) / 44100  # 0.1 s
    stereo = np.stack([np.sin(2 * np.pi * 200 * t), np.zeros_like(t)], axis=1) * 0.5
    path = write_wav(tmp_path / "s.wav", stereo, 44100, encoding="pcm24")
    pre = Preprocessor({"kind": "audio", "sample_rate": 16000, "frame": 512, "context": 64})
    frames = pre.from_path(path)
    mono = audio.resample(stereo.mean(axis=1).astype(np.float32), 44100, 16000)
    assert frames.shape == (4, 1, 576) and frames.dtype == np.float32  # 1600 samples -> 4 frames
    assert np.allclose(frames[1, 0, 64:], mono[512:1024], atol=1e-6)
    assert np.allclose(frames[1, 0, :64], mono[448:512], atol=1e-6)
    assert not frames[0, 0, :64].any()
    flat = Preprocessor({"kind": "audio", "sample_rate": 16000, "frame": 512, "batch": False}).from_path(path)
    assert flat.shape == (4, 512)


def test_image_preprocessor_refuses_audio_and_audio_refuses_images(tmp_path):
    path = write_wav(tmp_path / "s.wav", np.zeros(10), 16000)
    with pytest.raises(PreprocessError, match="not audio"):
        Preprocessor({"kind": "image"}).from_audio_bytes(path.read_bytes())
    with pytest.raises(PreprocessError, match="not a WAV file"):
        Preprocessor({"kind": "audio", "sample_rate": 16000, "frame": 4}).from_audio_bytes(b"\x89PNG....")
