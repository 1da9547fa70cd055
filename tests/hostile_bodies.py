"""Hostile HTTP request bodies, built small and fast (no gigabyte is ever allocated to make them);
shared by tests/test_http_attacks.py and tools/bench/hostile_http_memory.py."""

from __future__ import annotations

import io
import re
import struct
import zlib

import numpy as np

MIB = 1 << 20


def npy_header(shape: tuple[int, ...], descr: str = "<f4", fortran: bool = False) -> bytes:
    """The bytes of an .npy header (format 1.0) declaring ``shape`` of ``descr``."""
    text = f"{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {tuple(shape)!r}, }}"
    text += " " * (63 - (10 + len(text)) % 64) + "\n"  # numpy pads the header to 64 bytes
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")


def npy_declaring(shape: tuple[int, ...], descr: str = "<f4", data: bytes = b"") -> bytes:
    """An .npy body whose header declares ``shape`` but carries only ``data``."""
    return npy_header(shape, descr) + data


def _zip(name: str, compressed: bytes, crc: int, size: int, method: int = 8) -> bytes:
    """A one-member zip archive around already compressed data (as np.savez lays it out)."""
    filename = name.encode()
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, 0x21, crc, len(compressed), size,
                        len(filename), 0) + filename
    central = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0, 0x21, crc, len(compressed), size,
                          len(filename), 0, 0, 0, 0, 0, 0) + filename
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(central), len(local) + len(compressed), 0)
    return local + compressed + central + end


def npz_zip_bomb(shape: tuple[int, ...] = (112_000_000, 4), name: str = "x", *, corrupt_tail: bool = False) -> bytes:
    """An .npz whose one member inflates to ``shape`` float32 zeros (1.79 GB by default) from
    about 1.7 MB: deflate blocks of 1 MiB of zeros, each ended by a full flush, are identical, so
    one is compressed and repeated. ``corrupt_tail``: everything after the first MiB of inflated
    data is garbage, so a server that inflated the member would fail on it, not on its header."""
    header = npy_header(shape)
    size = len(header) + int(np.prod(shape)) * 4
    start = header + bytes(min(MIB, size) - len(header))
    blocks, rest = divmod(size - len(start), MIB)
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = compressor.compress(start) + compressor.flush(zlib.Z_FULL_FLUSH)
    block = compressor.compress(bytes(MIB)) + compressor.flush(zlib.Z_FULL_FLUSH) if blocks else b""
    tail = compressor.compress(bytes(rest)) + compressor.flush()
    crc, zeros = zlib.crc32(start), bytes(MIB)
    for _ in range(blocks):
        crc = zlib.crc32(zeros, crc)
    crc = zlib.crc32(bytes(rest), crc)
    body = first + (b"\xff" * (len(block) * blocks + len(tail)) if corrupt_tail else block * blocks + tail)
    return _zip(f"{name}.npy", body, crc, size)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_pixel_bomb(width: int = 7000, height: int = 7000) -> bytes:
    """A valid gray PNG of ``width`` x ``height`` black pixels: 47 kB for 7000x7000 (49 Mpx)."""
    compressor = zlib.compressobj(9)
    row = bytes(1 + width)  # filter byte 0, then the pixels
    data = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">2I5B", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b"")


def deep_json(depth: int, inner: bytes = b"1") -> bytes:
    """``{"inputs": {"x": [[...[1]...]]}}`` with ``depth`` levels of nesting in all."""
    arrays = max(depth - 2, 0)
    return b'{"inputs": {"x": ' + b"[" * arrays + inner + b"]" * arrays + b"}}"


def npz_with_directory_entries(entries: int, declared: int = 1, name: str = "x") -> bytes:
    """An .npz of one stored member (``name``: float32 [1, 4] ones) whose central directory holds
    ``entries`` copies of its entry while its end record declares ``declared``: 300,000 entries
    are 14 MB that ``zipfile`` alone would read whole (it trusts the directory's size, not its count)."""
    data = npy_header((1, 4)) + np.ones((1, 4), np.float32).tobytes()
    filename, crc = f"{name}.npy".encode(), zlib.crc32(data)
    local = struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, 0, 0, 0x21, crc, len(data), len(data),
                        len(filename), 0) + filename
    entry = struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, 0, 0, 0x21, crc, len(data), len(data),
                        len(filename), 0, 0, 0, 0, 0, 0) + filename
    directory = entry * entries
    end = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, declared, declared, len(directory), len(local) + len(data), 0)
    return local + data + directory + end


_NEXT_MARKER = re.compile(rb"\xff[^\x00\xd0-\xd7\xff]")


def _jpeg_segments(data: bytes) -> list[tuple[int, int, int]]:
    """(start, marker, end) of each segment of a JPEG, a scan's entropy-coded data included."""
    segments, position = [], 2
    while position < len(data):
        marker = data[position + 1]
        end = position + 2 if marker == 0xD9 else position + 2 + int.from_bytes(data[position + 2:position + 4], "big")
        if marker == 0xDA:
            end = _NEXT_MARKER.search(data, end).start()
        segments.append((position, marker, end))
        position = end
    return segments


def jpeg_scan_bomb(size: int = 2048, scans: int = 2000) -> bytes:
    """A valid gray progressive JPEG of ``size`` x ``size`` pixels with ``scans`` scans: Pillow's
    own file, its last scan (an AC band of end-of-band runs, 39 bytes with its Huffman table)
    repeated before the end. libjpeg warns about the progression and decodes every scan, each a
    pass over every block: 2,000 scans of 2048x2048 are 94 kB and about 5 s of CPU."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("L", (size, size), 128).save(buffer, "JPEG", progressive=True, quality=90)
    data = buffer.getvalue()
    segments = _jpeg_segments(data)
    found = [i for i, (_, marker, _) in enumerate(segments) if marker == 0xDA]
    last = found[-1]
    start = segments[last - 1][0] if segments[last - 1][1] == 0xC4 else segments[last][0]
    unit, end = data[start:segments[last][2]], segments[-1][0]
    assert scans >= len(found)
    return data[:end] + unit * (scans - len(found)) + data[end:]
