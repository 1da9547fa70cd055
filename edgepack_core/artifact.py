"""Reading ``.edgepkg`` artifacts: verify first, then stream every member through its hash.

The rules (docs/architecture.md, "The artifact format"), in the order they apply:

1. The archive file is at most ``limits.max_archive_bytes`` on disk.
2. The first member is manifest.json, the second manifest.sig; both small regular files.
   The signature over the exact manifest bytes must verify against the trust store before
   the manifest is even parsed.
3. Every later member must be a regular file (no symlink, hardlink, device, fifo or
   directory), have a safe relative name listed in the manifest, appear once, and have the
   declared size (within ``max_member_bytes``) and sha256. The total of all members is
   bounded too (decompression bombs).
4. Every file the manifest lists must be present.

Extraction goes into a hidden staging directory beside the destination and is renamed into
place only when everything has verified; on any failure the staging directory is removed, so
nothing is ever left half-extracted. ``verify_artifact`` runs the same walk without writing.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import lzma
import os
import shutil
import tarfile
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from edgepack_core.errors import (
    ArtifactError,
    IntegrityError,
    LimitExceededError,
    MissingSignatureError,
    TruncatedArchiveError,
    UnsafeMemberError,
)
from edgepack_core.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, parse_manifest
from edgepack_core.signing import MAX_SIGNATURE_BYTES, TrustStore

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Limits:
    """Explicit bounds on what a reader accepts. Defaults suit models up to a few hundred MB."""

    max_archive_bytes: int = 2 * 1024**3
    max_member_bytes: int = 2 * 1024**3
    max_total_bytes: int = 4 * 1024**3
    max_members: int = 10_000
    max_manifest_bytes: int = 4 * 1024**2


@dataclass(frozen=True)
class VerifiedArtifact:
    """What a successful verification proves: this manifest, signed by ``key_id``, whose
    files all matched. ``root`` is the extracted directory, or None for a verify-only walk."""

    path: Path
    manifest: Manifest
    manifest_bytes: bytes
    key_id: str
    root: Path | None = None


def check_member_header(member: tarfile.TarInfo, expected: Manifest, seen: set[str], limits: Limits) -> None:
    """Decide whether a tar header is acceptable. Pure: looks at the header and manifest only."""
    name = member.name
    if member.issym() or member.islnk():
        raise UnsafeMemberError(name, f"link to {member.linkname!r} (links are never extracted)")
    if member.ischr() or member.isblk() or member.isfifo() or member.isdev():
        raise UnsafeMemberError(name, "device or fifo member")
    if not member.isfile():
        raise UnsafeMemberError(name, "not a regular file")
    if name.startswith("/") or "\\" in name or any(part in ("..", ".", "") for part in name.split("/")):
        raise UnsafeMemberError(name, "absolute path or path traversal")
    if name in seen or name in (MANIFEST_NAME, SIGNATURE_NAME):
        raise UnsafeMemberError(name, "duplicate member name")
    entry = expected.files.get(name)
    if entry is None:
        raise UnsafeMemberError(name, "file not listed in the signed manifest")
    if member.size > limits.max_member_bytes:
        raise LimitExceededError(f"member {name}", member.size, limits.max_member_bytes)
    if member.size != entry["size"]:
        raise IntegrityError(name, f"size {member.size} differs from the signed size {entry['size']}")


def _read_small(tar: tarfile.TarFile, member: tarfile.TarInfo, limit: int) -> bytes:
    if not member.isfile():
        raise UnsafeMemberError(member.name, "not a regular file")
    if member.size > limit:
        raise LimitExceededError(member.name, member.size, limit)
    stream = tar.extractfile(member)
    assert stream is not None  # regular files always have a stream
    data = stream.read()
    if len(data) != member.size:
        raise TruncatedArchiveError(f"{member.name} is truncated")
    return data


def _copy_hashed(stream: IO[bytes], size: int, sink: IO[bytes] | None) -> str:
    digest = hashlib.sha256()
    remaining = size
    while remaining > 0:
        block = stream.read(min(_CHUNK, remaining))
        if not block:
            raise TruncatedArchiveError("archive ends inside a member")
        digest.update(block)
        if sink is not None:
            sink.write(block)
        remaining -= len(block)
    return digest.hexdigest()


class _Counting:
    """Counts the bytes read through it, to tell a complete tar stream from a cut one."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.count += len(data)
        return data


def _open_decompressed(path: Path) -> IO[bytes]:
    with open(path, "rb") as probe:
        magic = probe.read(6)
    if magic.startswith(b"\x1f\x8b"):
        return gzip.open(path, "rb")
    if magic.startswith(b"\xfd7zXZ\x00"):
        return lzma.open(path, "rb")
    if magic.startswith(b"BZh"):
        return bz2.open(path, "rb")
    return open(path, "rb")


def _members(tar: tarfile.TarFile, limits: Limits) -> Iterator[tarfile.TarInfo]:
    count = 0
    while True:
        member = tar.next()
        if member is None:
            return
        count += 1
        if count > limits.max_members:
            raise LimitExceededError("member count", count, limits.max_members)
        yield member


def _walk(path: Path, trust: TrustStore, limits: Limits, staging: Path | None) -> VerifiedArtifact:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such artifact") from None
    if size > limits.max_archive_bytes:
        raise LimitExceededError("archive", size, limits.max_archive_bytes)
    try:
        # One forward pass in stream mode, no seeking. The decompressor is opened here rather
        # than by tarfile so that reading to its end checks the gzip/xz/bz2 trailer (CRC and
        # length): a cut-off archive is refused even when the cut is after the last member.
        with _open_decompressed(path) as source, tarfile.open(fileobj=(raw := _Counting(source)), mode="r|") as tar:
            members = _members(tar, limits)
            first = next(members, None)
            if first is None or first.name != MANIFEST_NAME:
                raise ArtifactError(f"the first member must be {MANIFEST_NAME}")
            manifest_bytes = _read_small(tar, first, limits.max_manifest_bytes)
            second = next(members, None)
            if second is None or second.name != SIGNATURE_NAME:
                raise MissingSignatureError("manifest.sig is missing: the artifact is unsigned")
            signature = _read_small(tar, second, MAX_SIGNATURE_BYTES)
            key = trust.verify(manifest_bytes, signature)
            manifest = parse_manifest(manifest_bytes)

            seen: set[str] = set()
            total = len(manifest_bytes) + len(signature)
            for member in members:
                check_member_header(member, manifest, seen, limits)
                total += member.size
                if total > limits.max_total_bytes:
                    raise LimitExceededError("unpacked artifact", total, limits.max_total_bytes)
                seen.add(member.name)
                stream = tar.extractfile(member)
                assert stream is not None
                if staging is None:
                    digest = _copy_hashed(stream, member.size, None)
                else:
                    target = staging / member.name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    with open(target, "xb") as sink:
                        digest = _copy_hashed(stream, member.size, sink)
                        sink.flush()
                        os.fsync(sink.fileno())
                if digest != manifest.files[member.name]["sha256"]:
                    raise IntegrityError(member.name, "sha256 differs from the signed manifest")
            missing = sorted(set(manifest.files) - seen)
            if missing:
                raise IntegrityError(missing[0], "listed in the manifest but missing from the archive")
            while raw.read(_CHUNK):
                pass
            if raw.count < tar.offset + 2 * tarfile.BLOCKSIZE:
                raise TruncatedArchiveError("archive ends without the tar end-of-archive marker")
            if staging is not None:
                (staging / MANIFEST_NAME).write_bytes(manifest_bytes)
                (staging / SIGNATURE_NAME).write_bytes(signature)
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, lzma.LZMAError) as err:
        raise TruncatedArchiveError(f"not a complete tar archive ({err or type(err).__name__})") from None
    except OSError as err:
        raise ArtifactError(f"{path}: cannot read or write: {err.strerror or err}") from None
    return VerifiedArtifact(path=path, manifest=manifest, manifest_bytes=manifest_bytes, key_id=key)


def verify_artifact(path: str | os.PathLike[str], trust: TrustStore, limits: Limits | None = None) -> VerifiedArtifact:
    """Verify an artifact completely without writing anything; raise an ArtifactError if refused."""
    path = Path(path)
    try:
        return _walk(path, trust, limits or Limits(), None)
    except ArtifactError as err:
        err.artifact = str(path)
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def extract_artifact(
    path: str | os.PathLike[str], dest: str | os.PathLike[str], trust: TrustStore, limits: Limits | None = None
) -> VerifiedArtifact:
    """Verify and extract into ``dest`` (which must not exist) atomically.

    All members are written into a staging directory beside ``dest``, fsynced, and the
    directory is renamed to ``dest`` only after every check passed.
    """
    path, dest = Path(path), Path(dest)
    if dest.exists():
        raise ArtifactError(f"{dest} already exists", artifact=str(path))
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        verified = _walk(path, trust, limits or Limits(), staging)
        for directory in sorted({p for p in staging.rglob("*") if p.is_dir()} | {staging}, reverse=True):
            _fsync_dir(directory)
        os.rename(staging, dest)
        _fsync_dir(dest.parent)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, ArtifactError):
            err.artifact = str(path)
        raise
    return VerifiedArtifact(
        path=path, manifest=verified.manifest, manifest_bytes=verified.manifest_bytes,
        key_id=verified.key_id, root=dest,
    )


def read_extracted(root: str | os.PathLike[str], trust: TrustStore) -> VerifiedArtifact:
    """Re-verify an already extracted artifact directory (signature and every file's hash).

    Used by the device's model store at start-up, so a file changed on disk after install
    is caught before it is loaded.
    """
    root = Path(root)
    try:
        manifest_bytes = (root / MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{root}: no {MANIFEST_NAME}") from None
    try:
        signature: bytes | None = (root / SIGNATURE_NAME).read_bytes()
    except FileNotFoundError:
        signature = None
    key = trust.verify(manifest_bytes, signature)
    manifest = parse_manifest(manifest_bytes)
    for name, entry in manifest.files.items():
        file = root / name
        try:
            with open(file, "rb") as stream:
                digest = _copy_hashed(stream, entry["size"], None)
                if stream.read(1):
                    raise IntegrityError(name, "larger than the signed size")
        except FileNotFoundError:
            raise IntegrityError(name, "missing from the installed copy") from None
        except TruncatedArchiveError:
            raise IntegrityError(name, "smaller than the signed size") from None
        if digest != entry["sha256"]:
            raise IntegrityError(name, "sha256 differs from the signed manifest")
    return VerifiedArtifact(path=root, manifest=manifest, manifest_bytes=manifest_bytes, key_id=key, root=root)
