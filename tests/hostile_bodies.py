"""Hostile HTTP request bodies, built small and fast (no gigabyte is ever allocated to make them);
shared by tests/test_http_attacks.py and tools/bench/hostile_http_memory.py."""

from __future__ import annotations

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
