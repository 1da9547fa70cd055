"""Audio for ``preprocess: {kind: audio}``: WAV decoding, mono mix, resampling, framing.

Pure functions over bytes and numpy arrays (numpy and the standard library only, so a device
needs no scipy). Every WAV header field is bounded before anything is allocated: at most
``MAX_CHANNELS`` channels, a sample rate within ``[MIN_RATE, MAX_RATE]``, a data chunk of at
most ``max_bytes`` (and never more than the bytes actually present).

Decoding: PCM 16 and 32 bit through the standard library's ``wave`` (after our own header
checks); PCM 8 and 24 bit, IEEE float 32/64 (format 3) and WAVE_FORMAT_EXTENSIBLE (0xFFFE, its
sub-format GUID naming PCM or float) through the bounded RIFF parser below. Samples become
float32 in [-1, 1) (PCM divided by 2^(bits-1); 8-bit PCM is unsigned, centred on 128).

Mono: the mean of the channels.

Resampling: linear interpolation at output instants ``k * rate_in / rate_out`` (``np.interp``),
output length ``floor((n - 1) * rate_out / rate_in) + 1`` (no instant past the last input
sample, so nothing is extrapolated). Its error on a sine of frequency ``f`` and
amplitude ``A`` is at most ``A * (pi * f / rate_in) ** 2 / 2`` (the linear-interpolation bound
``h^2/8 * max|x''|``), e.g. 4.9e-4 for 440 Hz at 44.1 kHz; tests/test_audio.py pins it. No
anti-alias filter is applied when downsampling: content above the new Nyquist folds back, so
record or export at the model's rate where that matters.

Framing: frame ``i`` holds samples ``[i*hop, i*hop + frame)`` with ``context`` samples before
``i*hop`` prepended (zeros before the first sample), so each frame is ``context + frame`` long.
``last_frame="pad"`` (the default): the last partial frame is padded with zeros and a clip
shorter than one frame gives one frame; ``"drop"``: only whole frames are cut (what a model's
own windowing code usually computes), and a clip shorter than one frame is refused.

Values: :func:`to_values` multiplies by ``scale`` (32768: int16 magnitudes) and casts; integer
dtypes are rounded to nearest and clipped to their range.

Growth is bounded before allocation: at most ``MAX_SAMPLES`` samples after resampling and
``MAX_FRAME_VALUES`` values in all frames of one file.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from io import BytesIO

import numpy as np

from edgepack_core.errors import PreprocessError

MAX_CHANNELS = 8
MIN_RATE = 1000
MAX_RATE = 384_000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # ~5.8 min of 48 kHz stereo float32
MAX_CHUNKS = 64  # RIFF chunks walked before giving up (a file of empty chunks is hostile)
# After decoding, what a small body may grow into is bounded too: upsampling a 1 kHz file to
# 384 kHz multiplies it by 384, and overlapping frames (hop < frame) by frame/hop.
MAX_SAMPLES = 1 << 24  # resampled mono samples (17 min at 16 kHz; 64 MiB of float32)
MAX_FRAME_VALUES = 1 << 25  # floats in all frames of one file together (128 MiB)

_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
# The tail shared by the KSDATAFORMAT_SUBTYPE GUIDs; the first two bytes hold the format tag.
_GUID_TAIL = bytes.fromhex("000000001000800000aa00389b71")


@dataclass(frozen=True)
class WavFormat:
    """The checked ``fmt `` chunk: format tag (1 PCM, 3 float), channels, rate, bits."""

    tag: int
    channels: int
    rate: int
    bits: int
    extensible: bool = False


def _fail(problem: str) -> PreprocessError:
    return PreprocessError(f"not a WAV file this agent reads: {problem}")


def _parse_fmt(body: bytes) -> WavFormat:
    if len(body) < 16:
        raise _fail(f"fmt chunk of {len(body)} bytes (needs 16)")
    tag, channels, rate, _byte_rate, block, bits = struct.unpack("<HHIIHH", body[:16])
    extensible = tag == _EXTENSIBLE
    if extensible:
        if len(body) < 40:
            raise _fail("WAVE_FORMAT_EXTENSIBLE fmt chunk shorter than 40 bytes")
        guid = body[24:40]
        if guid[4:] != _GUID_TAIL[2:] or guid[2:4] != b"\x00\x00":
            raise _fail("WAVE_FORMAT_EXTENSIBLE with an unknown sub-format")
        tag = struct.unpack("<H", guid[:2])[0]
    if tag not in (_PCM, _FLOAT):
        raise _fail(f"format tag {tag} (PCM and IEEE float only)")
    if not 1 <= channels <= MAX_CHANNELS:
        raise _fail(f"{channels} channels (1 to {MAX_CHANNELS})")
    if not MIN_RATE <= rate <= MAX_RATE:
        raise _fail(f"sample rate {rate} (within {MIN_RATE}..{MAX_RATE})")
    allowed = (8, 16, 24, 32) if tag == _PCM else (32, 64)
    if bits not in allowed:
        raise _fail(f"{bits}-bit {'PCM' if tag == _PCM else 'float'} samples")
    if block != channels * bits // 8:
        raise _fail(f"block align {block} for {channels} channel(s) of {bits} bits")
    return WavFormat(tag, channels, rate, bits, extensible)


def parse_wav_header(data: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[WavFormat, int, int]:
    """Walk the RIFF chunks of ``data``: the checked format and the (offset, length) of the data
    chunk, bounded by ``max_bytes`` and by the bytes present (a truncated last chunk is cut to
    whole sample frames, as players do). Pure."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise _fail("no RIFF/WAVE header")
    offset, fmt = 12, None
    for _ in range(MAX_CHUNKS):
        if offset + 8 > len(data):
            break
        chunk_id, size = data[offset:offset + 4], struct.unpack("<I", data[offset + 4:offset + 8])[0]
        body_start = offset + 8
        if chunk_id == b"fmt ":
            if size > 1024 or body_start + size > len(data):
                raise _fail(f"fmt chunk of {size} bytes")
            fmt = _parse_fmt(data[body_start:body_start + size])
        elif chunk_id == b"data":
            if fmt is None:
                raise _fail("data chunk before the fmt chunk")
            length = min(size, len(data) - body_start)
            if length > max_bytes:
                raise _fail(f"{length} bytes of samples, over the limit of {max_bytes}")
            block = fmt.channels * fmt.bits // 8
            return fmt, body_start, length - length % block
        offset = body_start + size + (size & 1)
    raise _fail("no fmt and data chunks" if fmt is None else "no data chunk")


def _pcm24(raw: bytes) -> np.ndarray:
    bytes3 = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
    value = bytes3[:, 0] | (bytes3[:, 1] << 8) | (bytes3[:, 2] << 16)
    return np.where(value >= 1 << 23, value - (1 << 24), value)


def _samples(fmt: WavFormat, raw: bytes) -> np.ndarray:
    """Interleaved sample values as float32 in [-1, 1)."""
    if fmt.tag == _FLOAT:
        values = np.frombuffer(raw, dtype="<f4" if fmt.bits == 32 else "<f8").astype(np.float32)
        if not np.isfinite(values).all():
            raise PreprocessError("the WAV file holds NaN or infinite samples")
        return values
    if fmt.bits == 8:
        return (np.frombuffer(raw, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    if fmt.bits == 24:
        return (_pcm24(raw).astype(np.float64) / float(1 << 23)).astype(np.float32)
    dtype = "<i2" if fmt.bits == 16 else "<i4"
    return (np.frombuffer(raw, dtype=dtype).astype(np.float64) / float(1 << (fmt.bits - 1))).astype(np.float32)


def _read_with_wave(data: bytes, fmt: WavFormat) -> bytes:
    """PCM 16/32: the standard library's reader, after our header checks bounded everything."""
    import wave  # imported when a WAV file is decoded: an agent serving images never does

    try:
        with wave.open(BytesIO(data), "rb") as reader:
            if (reader.getnchannels(), reader.getframerate(), reader.getsampwidth() * 8) != \
                    (fmt.channels, fmt.rate, fmt.bits):
                raise _fail("the wave module reads a different format")
            return reader.readframes(reader.getnframes())
    except (wave.Error, EOFError, struct.error) as err:
        raise _fail(str(err)) from err


def decode_wav(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[np.ndarray, int]:
    """WAV bytes -> (samples as float32 of shape [frames, channels], sample rate)."""
    fmt, start, length = parse_wav_header(data, max_bytes)
    plain_pcm = fmt.tag == _PCM and fmt.bits in (16, 32) and not fmt.extensible
    raw = _read_with_wave(data, fmt)[:length] if plain_pcm else data[start:start + length]
    values = _samples(fmt, raw)
    return values.reshape(-1, fmt.channels), fmt.rate


def to_mono(samples: np.ndarray) -> np.ndarray:
    """[frames, channels] -> [frames], the mean of the channels (float32)."""
    return samples.mean(axis=1, dtype=np.float64).astype(np.float32) if samples.ndim == 2 else samples


def resample(samples: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Linear-interpolation resampling of mono ``samples`` (see the module docs for its error)."""
    if rate_in == rate_out or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    count = ((samples.size - 1) * rate_out) // rate_in + 1
    if count > MAX_SAMPLES:
        raise PreprocessError(f"{samples.size} samples at {rate_in} Hz resample to {count} at {rate_out} Hz, "
                              f"over the limit of {MAX_SAMPLES}")
    positions = np.arange(count, dtype=np.float64) * (rate_in / rate_out)
    resampled: np.ndarray = np.interp(positions, np.arange(samples.size, dtype=np.float64), samples)
    return resampled.astype(np.float32)


def frame_count(samples: int, frame: int, hop: int, last_frame: str = "pad") -> int:
    """How many frames ``samples`` samples give. ``pad``: at least one, the last may be padded;
    ``drop``: whole frames only (0 for a clip shorter than one frame). Pure."""
    if last_frame == "drop":
        return 0 if samples < frame else 1 + (samples - frame) // hop
    if samples <= frame:
        return 1
    return 1 + -(-(samples - frame) // hop)


def check_rate(rate: int, sample_rate: int, *, resample: bool) -> None:
    """A file's rate against the model's: refused when they differ and resampling is off. Pure."""
    if rate != sample_rate and not resample:
        raise PreprocessError(f"the WAV file is {rate} Hz but the model takes {sample_rate} Hz and resampling is "
                              f"off (preprocess.resample: false): send {sample_rate} Hz audio")


def to_values(frames: np.ndarray, scale: float, dtype: str) -> np.ndarray:
    """Float32 frames in [-1, 1) -> ``frames * scale`` as ``dtype`` (integers rounded to nearest
    and clipped to the dtype's range)."""
    values = frames * np.float32(scale) if scale != 1.0 else frames
    kind = np.dtype(dtype)
    if kind.kind == "i":
        info = np.iinfo(kind)
        rounded: np.ndarray = np.clip(np.rint(values), info.min, info.max).astype(kind)
        return rounded
    return values.astype(kind, copy=False)


def cut_frames(samples: np.ndarray, frame: int, hop: int, context: int, last_frame: str = "pad") -> np.ndarray:
    """Mono samples -> [n_frames, context + frame] float32 (see the module docs)."""
    count = frame_count(samples.size, frame, hop, last_frame)
    if count == 0:
        raise PreprocessError(f"a clip of {samples.size} samples is shorter than one frame of {frame} and "
                              f"last_frame: drop drops it: send at least {frame} samples")
    if count * (context + frame) > MAX_FRAME_VALUES:
        raise PreprocessError(f"{samples.size} samples cut into {count} frames of {context + frame} would hold "
                              f"{count * (context + frame)} values, over the limit of {MAX_FRAME_VALUES}")
    total = context + (count - 1) * hop + frame
    padded = np.zeros(total, dtype=np.float32)
    padded[context:context + samples.size] = samples[:total - context]
    starts = np.arange(count) * hop
    index = starts[:, None] + np.arange(context + frame)[None, :]
    frames: np.ndarray = padded[index]
    return frames
