"""Bounded decoding of request bodies: every body is checked against limits and the model's
input specs *before* anything is allocated, inflated or parsed.

What a hostile client could otherwise do with one request, and what stops it here:

- an ``.npz`` is a zip: a 1.5 MB body can inflate to gigabytes. The zip's directory is read
  first, entry by entry (member count at most the model's inputs, and no more entries than
  declared: ``zipfile`` alone reads all it finds), then each member's ``.npy`` header (a few
  hundred inflated bytes) is checked against the input's dtype and shape, the member's declared
  size must be exactly what that header implies, and the sum of every member's bytes must fit
  ``max_decoded_bytes``; only then is the member inflated, exactly that many bytes (CRC checked).
- an ``.npy`` declaring shape ``(2**40,)`` must carry its bytes in the body: the header is
  checked against the spec and the body's length before numpy allocates anything.
- deeply nested JSON: its depth is measured by a vectorised scan (strings and escapes
  respected) before ``json.loads`` recurses; JSON bodies have their own, smaller size limit
  (``max_json_bytes``) because Python objects take about 8x the bytes of their text.
- a 47 kB PNG of 7000x7000 pixels decodes to 147 MB: the image header (read without decoding)
  is checked against ``max_image_pixels`` and the format against a short list; decodes at
  once are bounded by a semaphore (``ImageGate``).
- a 505 kB progressive JPEG of thousands of tiny scans costs minutes of CPU (each scan is a
  pass over the whole image): its markers are walked first and more than 100 scans refused
  (``edgepack_core.jpeg_scans``).

Pure functions of bytes and specs (plus Pillow's header reader); the HTTP layer maps the
``BadRequest`` they raise to its answer.
"""

from __future__ import annotations

import ast
import io
import json
import os
import struct
import sys
import threading
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from device_agent.errors import BadRequest
from device_agent.smoke import shape_matches
from edgepack_core import jpeg_scans
from edgepack_core.errors import PreprocessError

InputSpecs = Mapping[str, tuple[np.dtype, tuple[int | str, ...]]]

MIB = 1024 * 1024
DEFAULT_MAX_BODY_BYTES = 16 * MIB
DEFAULT_MAX_JSON_BYTES = 4 * MIB
DEFAULT_MAX_DECODED_BYTES = 64 * MIB
# A tensor with symbolic dims (a batch) costs the model's activations for every row it carries,
# many times the tensor itself: such a tensor is bounded apart (at least one row always fits).
DEFAULT_MAX_BATCH_BYTES = 4 * MIB
# Raw output tensors answered as JSON: about 30 bytes of Python objects and 20 of text a value.
DEFAULT_MAX_JSON_OUTPUT_BYTES = 1 * MIB
# Deepest JSON document accepted: a tensor of rank 32 (numpy 1.x's limit) inside the request's
# wrapping objects. Far below what makes json.loads or numpy recurse into trouble.
MAX_JSON_DEPTH = 40
# numpy's own header limit (numpy >= 1.24 refuses longer headers the same way)
MAX_NPY_HEADER_BYTES = 10_000
# Pillow formats an image body may be in; others (EPS, PSD, ICNS, ...) are refused unread.
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "GIF", "TIFF", "PPM")
# The cap on image pixels is sized for the device: at most 1/128 of its memory per decoded image
# (RGBA at 4 bytes a pixel is then 1/32), never under a 1080p frame, never over 4096x4096.
MIN_IMAGE_PIXELS = 1920 * 1080
MAX_IMAGE_PIXELS = 4096 * 4096
MEMORY_PER_PIXEL = 128


def default_max_image_pixels(total_memory_bytes: int | None = None) -> int:
    """The image pixel cap for a device with this much memory (pure; reads the machine's
    memory when not given)."""
    if total_memory_bytes is None:
        try:
            total_memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            total_memory_bytes = 0
    return max(MIN_IMAGE_PIXELS, min(MAX_IMAGE_PIXELS, total_memory_bytes // MEMORY_PER_PIXEL))


@dataclass(frozen=True)
class BodyLimits:
    """The bounds one request body is decoded under (agent.yaml ``api:``, docs/agent.md)."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    max_decoded_bytes: int = DEFAULT_MAX_DECODED_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS
    max_batch_bytes: int = DEFAULT_MAX_BATCH_BYTES
    max_json_output_bytes: int = DEFAULT_MAX_JSON_OUTPUT_BYTES


def row_bytes(spec: tuple[np.dtype, tuple[int | str, ...]]) -> int | None:
    """The bytes of one row of an input: its shape with every symbolic dim at 1 (pure). None
    for a fully static input (its size is the model's, not the request's)."""
    dtype, shape = spec
    if all(isinstance(dim, int) for dim in shape):
        return None
    count = 1
    for dim in shape:
        count *= dim if isinstance(dim, int) else 1
    return count * dtype.itemsize


def check_batch(name: str, nbytes: int, spec: tuple[np.dtype, tuple[int | str, ...]], limits: BodyLimits) -> None:
    """A tensor of ``nbytes`` for input ``name`` against the batch bound (pure): an input with
    symbolic dims takes at most ``max_batch_bytes``, or one row where a row is larger."""
    row = row_bytes(spec)
    if row is not None and nbytes > max(limits.max_batch_bytes, row):
        raise too_large(f"input {name}", nbytes, max(limits.max_batch_bytes, row),
                        " (api.max_batch_bytes, for an input with symbolic dims: send fewer rows per request)")


def check_json_outputs(nbytes: int, limits: BodyLimits, hint: str) -> None:
    """Raw output tensors of ``nbytes`` before they are encoded as JSON (pure): beyond
    ``max_json_output_bytes`` a 413 that says how to ask for them (``hint``)."""
    if nbytes > limits.max_json_output_bytes:
        raise too_large("raw outputs", nbytes, limits.max_json_output_bytes,
                        f" (api.max_json_output_bytes) to answer as JSON: {hint}")


def too_large(what: str, size: int, limit: int, hint: str = "") -> BadRequest:
    return BadRequest("too_large", f"{what} of {size} bytes is over the limit of {limit}{hint}", http_status=413)


# ---------------------------------------------------------------------------------------- JSON

_BRACKETS = bytes(range(256)).translate(None, b'[]{}"')  # every byte but these five
_QUOTE = ord('"')
_STEP = np.zeros(256, np.int32)  # +1 opens a level, -1 closes one
_STEP[[ord("["), ord("{")]], _STEP[[ord("]"), ord("}")]] = 1, -1
_DEPTH_CHUNK = 1 << 18


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (pure; brackets inside strings
    do not count). Linear and vectorised, in chunks, so megabytes of hostile brackets cost
    milliseconds and a few MiB of temporaries."""
    # Escaped pairs first (left to right, as JSON pairs them): what is left of a backslash can
    # no longer hide a quote. Then only brackets and quotes matter.
    text = bytes(data).replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _BRACKETS)
    depth = deepest = quotes_before = 0
    for start in range(0, len(text), _DEPTH_CHUNK):
        codes = np.frombuffer(text, np.uint8, count=min(_DEPTH_CHUNK, len(text) - start), offset=start)
        quotes = np.cumsum(codes == _QUOTE, dtype=np.int32)
        outside = ((quotes + quotes_before) & 1) == 0
        step = _STEP[codes] * outside
        levels = np.cumsum(step, dtype=np.int64) + depth
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
        quotes_before += int(quotes[-1])
    return deepest


def _bounded_int(text: str) -> int:
    # Python before 3.10.7 parses any number of digits, in quadratic time.
    if len(text) > 40:
        raise ValueError(f"integer of {len(text)} digits")
    return int(text)


_INT_PARSER = int if hasattr(sys, "get_int_max_str_digits") else _bounded_int


def parse_json(data: bytes, limits: BodyLimits) -> Any:
    """A JSON body, bounded: size (413), depth (400), then ``json.loads`` (400 ``bad_json``)."""
    if len(data) > limits.max_json_bytes:
        raise too_large("JSON body", len(data), limits.max_json_bytes,
                        ": send large tensors as application/x-npz (or the v2 binary tensor extension)")
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise BadRequest("bad_json", f"JSON nested {depth} levels deep, over the limit of {MAX_JSON_DEPTH}")
    try:
        return json.loads(data, parse_int=_INT_PARSER)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise BadRequest("bad_json", f"body is not JSON: {str(err)[:200]}") from err


def json_to_feed(specs: InputSpecs, inputs: Any, limits: BodyLimits | None = None) -> dict[str, np.ndarray]:
    """``{"inputs": {name: nested list}}``'s inputs -> arrays of each input's declared dtype. The
    text was bounded by :func:`parse_json`, so the arrays are too (at most 8 bytes a value for
    values that took at least 2 bytes of text); each is then held to the batch bound."""
    limits = limits or BodyLimits()
    if not isinstance(inputs, dict):
        raise BadRequest("bad_input", 'JSON body must be {"inputs": {name: nested list}}')
    feed = {}
    for name, value in inputs.items():
        spec = specs.get(name)
        if spec is None:
            raise BadRequest("unknown_input", f"unknown input {name!r} (inputs: {', '.join(specs)})")
        try:
            feed[name] = np.asarray(value, dtype=spec[0])
        except (ValueError, TypeError, OverflowError) as err:
            raise BadRequest("dtype", f"input {name}: cannot convert to {spec[0].name}: {err}") from err
        check_batch(name, feed[name].nbytes, spec, limits)
    return feed


# ---------------------------------------------------------------------------------------- numpy

NPY_MAGIC = b"\x93NUMPY"
ZIP_MAGIC = b"PK"


@dataclass(frozen=True)
class NpyHeader:
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool
    length: int  # bytes of magic, version and header before the data

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim  # Python ints: a declared (2**40, 2**40) cannot overflow
        return count * self.dtype.itemsize


def _read_exact(stream: Any, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise BadRequest("bad_input", "truncated .npy header")
    return data


def read_npy_header(stream: Any) -> NpyHeader:
    """The header of an ``.npy`` stream, read with bounded reads (never more than
    ``MAX_NPY_HEADER_BYTES`` plus 12 bytes); object dtypes (pickles) refused."""
    prefix = _read_exact(stream, 8)
    if prefix[:6] != NPY_MAGIC or prefix[6] not in (1, 2, 3):
        raise BadRequest("bad_input", "not a .npy array (bad magic or version)")
    width = 2 if prefix[6] == 1 else 4
    (size,) = struct.unpack("<H" if width == 2 else "<I", _read_exact(stream, width))
    if size > MAX_NPY_HEADER_BYTES:
        raise BadRequest("bad_input", f".npy header of {size} bytes is over the limit of {MAX_NPY_HEADER_BYTES}")
    text = _read_exact(stream, size).decode("utf-8" if prefix[6] == 3 else "latin1", errors="replace")
    try:
        fields = ast.literal_eval(text)
        dtype = np.dtype(fields["descr"] if isinstance(fields["descr"], str) else "V")
        shape = tuple(int(d) for d in fields["shape"])
        fortran = bool(fields["fortran_order"])
    except (ValueError, TypeError, SyntaxError, KeyError, MemoryError, RecursionError) as err:
        raise BadRequest("bad_input", "unreadable .npy header") from err
    if dtype.hasobject or dtype.names is not None or dtype.kind == "V" or any(d < 0 for d in shape):
        raise BadRequest("bad_input", f".npy of dtype {dtype} cannot be taken (no pickles, no records)")
    return NpyHeader(dtype, shape, fortran, 8 + width + size)


def _dtype_ok(got: np.dtype, wanted: np.dtype) -> bool:
    # A string input takes numpy's unicode arrays (object arrays need pickles).
    return got == wanted or (wanted.kind == "O" and got.kind == "U")


def check_header(name: str, header: NpyHeader, spec: tuple[np.dtype, tuple[int | str, ...]], budget: int,
                 limits: BodyLimits) -> None:
    """An array header against its input's spec, the bytes left to decode and the batch bound (pure)."""
    dtype, shape = spec
    if not _dtype_ok(header.dtype, dtype):
        raise BadRequest("dtype", f"input {name} must be {dtype.name}, got {header.dtype}")
    if not shape_matches(header.shape, shape):
        raise BadRequest("shape", f"input {name} must have shape {list(shape)}, got {list(header.shape)}")
    if header.nbytes > budget:
        raise too_large(f"input {name}", header.nbytes, budget, " (api.max_decoded_bytes)")
    check_batch(name, header.nbytes, spec, limits)


def _array(data: Any, header: NpyHeader) -> np.ndarray:
    """The array over ``data`` (bytes of exactly ``header.nbytes``), without a copy unless the
    file is in Fortran order."""
    count = header.nbytes // header.dtype.itemsize if header.dtype.itemsize else 0
    flat = np.frombuffer(data, dtype=header.dtype, count=count)
    if header.fortran_order:
        return np.ascontiguousarray(flat.reshape(header.shape[::-1]).T)
    return flat.reshape(header.shape)


def _raw_frame_ok(header: NpyHeader, max_pixels: int) -> bool:
    """An HxW / HxWxC uint8 camera frame for an image model (the preprocessing resizes it)."""
    frame = header.dtype == np.uint8 and (len(header.shape) == 2 or (
        len(header.shape) == 3 and header.shape[2] in (1, 3, 4)))
    if frame and header.shape[0] * header.shape[1] > max_pixels:
        raise BadRequest("image_too_large", f"frame of {header.shape[1]}x{header.shape[0]} pixels is over the "
                         f"limit of {max_pixels} (api.max_image_pixels)", http_status=413)
    return frame


def decode_npy(data: bytes, specs: InputSpecs, limits: BodyLimits, *,
               image_input: str | None = None) -> np.ndarray:
    """One ``.npy`` body for a one-input model (or a raw uint8 frame for an image model)."""
    stream = io.BytesIO(data)
    header = read_npy_header(stream)
    if image_input is not None and _raw_frame_ok(header, limits.max_image_pixels):
        pass  # the preprocessing takes it: bounded by the pixel cap
    elif len(specs) != 1:
        raise BadRequest("bad_input", f"the model has {len(specs)} inputs: send named tensors (.npz or JSON)")
    else:
        name, spec = next(iter(specs.items()))
        check_header(name, header, spec, limits.max_decoded_bytes, limits)
    carried = len(data) - header.length
    if carried != header.nbytes:
        raise BadRequest("bad_input", f".npy declares {list(header.shape)} {header.dtype} = {header.nbytes} bytes "
                         f"but the body carries {carried}")
    return _array(memoryview(data)[header.length:], header)


_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record
_ENTRY = struct.Struct("<4s6H3L5H2L")  # central directory entry, before its name, extra and comment
ZIP64_LOCATOR = b"PK\x06\x07"


def zip_member_count(data: bytes, max_members: int) -> int:
    """The member count of a zip, its central directory walked here entry by entry (pure) before
    ``zipfile`` parses it: ``zipfile`` reads every entry that fits the directory's declared size
    whatever count the end record declares (300,000 of them in 14 MB: 1.3 s and 170 MB), so the
    directory must hold exactly the entries declared, at most ``max_members``, end to end. Zip64
    archives, split archives and data before the archive are refused: no npz of model inputs
    needs them."""
    at = data.rfind(b"PK\x05\x06", max(0, len(data) - _EOCD.size - 65535))
    if at < 0 or len(data) - at < _EOCD.size:
        raise BadRequest("bad_input", "not a readable .npz body (no zip directory)")
    _, disk, cd_disk, on_disk, total, size, offset, _ = _EOCD.unpack_from(data, at)
    if total == 0xFFFF or offset == 0xFFFFFFFF or data[max(0, at - 20):at].startswith(ZIP64_LOCATOR):
        raise BadRequest("bad_input", "zip64 .npz bodies are not accepted")
    if total > max_members:
        raise BadRequest("bad_input", f".npz holds {total} arrays; the model takes {max_members} input(s)")
    if disk or cd_disk or on_disk != total or offset + size != at:
        raise BadRequest("bad_input", "not a readable .npz body (a split zip, or its directory is not where it says)")
    position = offset
    for _ in range(total):
        if position + _ENTRY.size > at or data[position:position + 4] != b"PK\x01\x02":
            raise BadRequest("bad_input", f"the .npz directory holds fewer entries than the {total} it declares")
        fields = _ENTRY.unpack_from(data, position)
        position += _ENTRY.size + fields[10] + fields[11] + fields[12]  # name, extra field, comment
    if position != at:
        raise BadRequest("bad_input", f"the .npz directory holds more than the {total} entries it declares")
    return int(total)


def _member_name(info: zipfile.ZipInfo, specs: InputSpecs, seen: set[str]) -> str:
    name = info.filename[:-4] if info.filename.endswith(".npy") else info.filename
    if name not in specs:
        raise BadRequest("unknown_input", f"unknown input {name!r} (inputs: {', '.join(specs)})")
    if name in seen:
        raise BadRequest("bad_input", f"input {name} appears twice in the .npz")
    if info.flag_bits & 0x1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise BadRequest("bad_input", f"member {name}: only stored or deflated, unencrypted members")
    seen.add(name)
    return name


def decode_npz(data: bytes, specs: InputSpecs, limits: BodyLimits) -> dict[str, np.ndarray]:
    """Named arrays of an ``.npz`` body, each member's header checked against its input's spec
    before it is inflated, and the total inflated bytes bounded (see the module docstring)."""
    zip_member_count(data, len(specs))
    budget = limits.max_decoded_bytes
    feed: dict[str, np.ndarray] = {}
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            seen: set[str] = set()
            for info in archive.infolist():
                name = _member_name(info, specs, seen)
                with archive.open(info) as member:
                    header = read_npy_header(member)
                    check_header(name, header, specs[name], budget, limits)
                    if info.file_size != header.length + header.nbytes:
                        raise BadRequest("bad_input", f"member {name} declares {info.file_size} bytes but its "
                                         f"header implies {header.length + header.nbytes}")
                    payload = member.read(header.nbytes)
                    if len(payload) != header.nbytes or member.read(1):
                        raise BadRequest("bad_input", f"member {name} is truncated")
                budget -= header.nbytes
                feed[name] = _array(payload, header)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, OSError, EOFError, ValueError,
            NotImplementedError, struct.error) as err:  # zipfile's and zlib's zoo for damaged archives
        raise BadRequest("bad_input", f"not a readable .npz body ({type(err).__name__}: {str(err)[:120]})") from err
    return feed


def decode_numpy(data: bytes, specs: InputSpecs, limits: BodyLimits | None = None, *,
                 image_input: str | None = None) -> np.ndarray | dict[str, np.ndarray]:
    """An ``.npy`` (one array) or ``.npz`` (named arrays) body, bounded; by its magic bytes."""
    limits = limits or BodyLimits()
    if bytes(data[:6]) == NPY_MAGIC:
        return decode_npy(data, specs, limits, image_input=image_input)
    if bytes(data[:2]) == ZIP_MAGIC:
        return decode_npz(data, specs, limits)
    raise BadRequest("bad_input", "not a readable .npy/.npz body (bad magic bytes)")


# ---------------------------------------------------------------------------------------- images


def open_image(data: bytes, max_pixels: int) -> Any:
    """An encoded image with only its header read (a ``PIL.Image.Image``, its pixels not yet
    decoded); refuses other formats than ``IMAGE_FORMATS``, more pixels than ``max_pixels`` and
    a JPEG of too many scans. The preprocessing decodes this very image: its header is read once.
    Messages never carry Python object reprs."""
    from PIL import Image

    try:
        jpeg_scans.count_scans(data)
    except PreprocessError as err:
        raise BadRequest("bad_image", str(err)) from err
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError as cause:
        raise BadRequest("image_too_large", "image refused as a decompression bomb", http_status=413) from cause
    except Exception as cause:  # Pillow's plugins raise a zoo (OSError, SyntaxError, struct.error, ...)
        raise BadRequest("bad_image", f"not a readable image (formats: {', '.join(IMAGE_FORMATS)})") from cause
    width, height = image.size
    if width * height > max_pixels:
        image.close()
        raise BadRequest("image_too_large", f"image of {width}x{height} = {width * height} pixels is over the limit "
                         f"of {max_pixels} (api.max_image_pixels)", http_status=413)
    return image


class ImageGate:
    """Image bodies: the header check (:func:`open_image`), then at most ``concurrent`` decodes
    at once (a decoded image is many times its body; workers beyond the gate wait)."""

    def __init__(self, max_pixels: int, concurrent: int) -> None:
        self.max_pixels = max_pixels
        self._slots = threading.BoundedSemaphore(concurrent)

    def open(self, data: bytes) -> Any:
        return open_image(data, self.max_pixels)

    @contextmanager
    def slot(self) -> Iterator[None]:
        with self._slots:
            yield
