"""Reading ``.edgepkg`` artifacts: verify first, then stream every member through its hash.

The rules (docs/architecture.md, "The artifact format"), in the order they apply:

1. The archive file is at most ``limits.max_archive_bytes`` on disk. It is one gzip, xz or
   bzip2 stream (or a plain tar); any byte after that stream's trailer is refused, so nothing
   can hide behind the archive (a second tar appended, a second compressed stream, garbage),
   nor in a gzip header's extra field or comment (``check_gzip_header``).
2. Tar headers are parsed here, by a small bounded parser over 512-byte blocks, never by
   ``tarfile``: ``tarfile`` reads a PAX (``x``) or GNU long-name (``L``) header's declared
   size whole before the caller sees a member, so a 4 MB gzip declaring a 1 GiB PAX header
   cost 3 GB of memory before the signature was checked. Only ustar headers are accepted,
   each optionally preceded by one PAX header of at most ``MAX_EXTENDED_HEADER_BYTES``; GNU
   long-name/long-link headers, global PAX headers, base-256 numbers and bad checksums are
   refused.
2a. Every byte is signed or refused. The signature covers manifest.json, which covers each
   member's name, size and contents; nothing covers the rest of a tar header, the zero padding
   that fills a member's last block, or a PAX header. So each of those must be exactly what
   Edgepack's writer (``sdk.artifact_writer``: ``tarfile``, PAX format, fixed metadata) puts
   there: mode 0644, uid/gid 0, mtime 0, no link name, user or group name, prefix or device
   numbers, the ustar magic, a PAX header only for a name that does not fit the ustar field
   (non-ASCII or over 100 characters) holding the one ``path`` record, and zeros in every
   padding byte. Anything else is an :class:`UnsignedBytesError` naming the member and field.
3. The first member is manifest.json (at most ``max_manifest_bytes``), the second
   manifest.sig; both small regular files. The signature over the exact manifest bytes must
   verify against the trust store before the manifest is even parsed, and manifest.sig must be
   laid out byte for byte as the writer lays it out (``signing.check_signature_layout``).
4. Every later member must be a regular file (no symlink, hardlink, device, fifo or
   directory), have a safe relative name listed in the manifest, appear once, and have the
   declared size (within ``max_member_bytes``) and sha256. The total of all members is
   bounded too (decompression bombs).
5. Every file the manifest lists must be present.
6. After the end-of-archive marker (two zero blocks) only zero padding may follow, at most
   ``MAX_TRAILING_PADDING`` bytes of it.

Extraction goes into a hidden staging directory beside the destination and is renamed into
place only when everything has verified; on any failure the staging directory is removed, so
nothing is ever left half-extracted. ``verify_artifact`` runs the same walk without writing.
"""

from __future__ import annotations

import bz2
import hashlib
import lzma
import os
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

from edgepack_core.errors import (
    ArtifactError,
    IntegrityError,
    LimitExceededError,
    MissingSignatureError,
    TruncatedArchiveError,
    UnsafeMemberError,
    UnsignedBytesError,
)
from edgepack_core.fsutil import fsync_dir
from edgepack_core.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, parse_manifest
from edgepack_core.signing import MAX_SIGNATURE_BYTES, TrustStore, check_signature_layout
from edgepack_core.tar_headers import (
    BLOCK,
    DEVICE_TYPES,
    GNU_TYPES,
    HARDLINK_TYPE,
    MAX_TRAILING_PADDING,
    PAX_GLOBAL_TYPE,
    PAX_HEADER_MODE,
    PAX_HEADER_NAME,
    PAX_TYPE,
    REGULAR_TYPES,
    SYMLINK_TYPE,
    ZERO_BLOCK,
    MemberHeader,
    check_extended_header,
    check_writer_fields,
    check_writer_header,
    padding,
    parse_header,
    pax_fields,
    writer_fields,
)

_CHUNK = 1 << 20
_RAW_CHUNK = 64 << 10

_ZLIB_TYPE = type(zlib.decompressobj())


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


# --------------------------------------------------------------------------- pure header rules


def check_member_header(member: MemberHeader, expected: Manifest, seen: set[str], limits: Limits) -> None:
    """Decide whether a tar header is acceptable. Pure: looks at the header and manifest only."""
    name = member.name
    if member.type in (SYMLINK_TYPE, HARDLINK_TYPE):
        kind = "symlink" if member.type == SYMLINK_TYPE else "hardlink"
        raise UnsafeMemberError(name, f"{kind} to {member.linkname!r} (links are never extracted)")
    if member.type in DEVICE_TYPES:
        raise UnsafeMemberError(name, "device or fifo member")
    if member.type not in REGULAR_TYPES:
        raise UnsafeMemberError(name, "not a regular file")
    # A leading "/" shows up as an empty first part.
    if "\\" in name or any(part in ("..", ".", "") for part in name.split("/")):
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


def check_total(total: int, limits: Limits) -> None:
    """The unpacked size so far must stay within ``max_total_bytes`` (decompression bombs). Pure."""
    if total > limits.max_total_bytes:
        raise LimitExceededError("unpacked artifact", total, limits.max_total_bytes)


# --------------------------------------------------------------------------- streams

GZIP_HEADER = "gzip header"
GZIP_FNAME = 0x08
MAX_GZIP_NAME_BYTES = 255
_GZIP_HEAD_BYTES = 10 + MAX_GZIP_NAME_BYTES + 1


def check_gzip_header(head: bytes) -> None:
    """Refuse gzip header fields that can carry unsigned bytes of any length: FEXTRA and
    FCOMMENT (and FHCRC, FTEXT, reserved bits), which no Edgepack, Python or ``gzip`` writer
    sets; a file name (``gzip`` and ``tarfile`` write one) only up to 255 bytes. ``head``: the
    stream's first bytes, up to ``_GZIP_HEAD_BYTES``. Pure."""
    flags = head[3] if len(head) > 3 else 0
    if flags & ~GZIP_FNAME:
        raise UnsignedBytesError(
            GZIP_HEADER, "flags", f"gzip header flags {flags:#04x}: only FNAME is accepted (FEXTRA, FCOMMENT refused)"
        )
    if flags & GZIP_FNAME and b"\0" not in head[10:_GZIP_HEAD_BYTES]:
        raise UnsignedBytesError(GZIP_HEADER, "FNAME", f"a gzip file name over {MAX_GZIP_NAME_BYTES} bytes")


class _Source:
    """The decompressed bytes of exactly one gzip/xz/bzip2 stream (or a plain file), produced
    on demand in bounded pieces. ``finish`` refuses any byte after the stream's trailer:
    Python's own gzip/lzma/bz2 readers silently read on into a second stream or skip garbage."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        magic = raw.read(_GZIP_HEAD_BYTES)
        raw.seek(0)
        self._dec: Any
        if magic.startswith(b"\x1f\x8b"):
            check_gzip_header(magic)
            self._dec = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif magic.startswith(b"\xfd7zXZ\x00"):
            self._dec = lzma.LZMADecompressor(format=lzma.FORMAT_XZ)
        elif magic.startswith(b"BZh"):
            self._dec = bz2.BZ2Decompressor()
        else:
            self._dec = None

    def read(self, size: int) -> bytes:
        """Up to ``size`` bytes; fewer only at the end of the stream."""
        if self._dec is None:
            return self._raw.read(size)
        pieces: list[bytes] = []
        got = 0
        while got < size and not self._dec.eof:
            piece = self._step(size - got)
            pieces.append(piece)
            got += len(piece)
        return b"".join(pieces)

    def _step(self, want: int) -> bytes:
        dec = self._dec
        if isinstance(dec, _ZLIB_TYPE):
            data = dec.unconsumed_tail or self._raw.read(_RAW_CHUNK)
        else:
            data = self._raw.read(_RAW_CHUNK) if dec.needs_input else b""
        out = dec.decompress(data, want)
        if not out and not data and not dec.eof:
            raise TruncatedArchiveError("the compressed stream ends before its trailer (archive cut off)")
        return bytes(out)

    def finish(self) -> None:
        """Called once everything was read: nothing may follow the compressed stream."""
        if self._dec is not None and (self._dec.unused_data or self._raw.read(1)):
            raise ArtifactError("bytes after the end of the compressed stream (a second archive or garbage)")


class _TarReader:
    """Walks tar members over a :class:`_Source`, one 512-byte header at a time, with every
    size checked before anything is read or allocated."""

    def __init__(self, source: _Source, limits: Limits) -> None:
        self.source = source
        self.limits = limits
        self.count = 0

    def _exact(self, size: int) -> bytes:
        data = self.source.read(size)
        if len(data) != size:
            raise TruncatedArchiveError("archive ends inside a tar header or member")
        return data

    def next(self) -> MemberHeader | None:
        """The next member's header (a PAX ``path`` applied), or None at the end marker. Its own
        block rides along as ``raw`` for :func:`check_writer_header`."""
        fields: dict[str, Any] = {}
        kinds: set[bytes] = set()
        while True:
            block = self.source.read(BLOCK)
            if len(block) < BLOCK:
                raise TruncatedArchiveError("archive ends without the tar end-of-archive marker")
            if block == ZERO_BLOCK:
                if kinds:
                    raise ArtifactError("extended tar header without a member")
                self._end()
                return None
            header = parse_header(block)
            if header.type == PAX_GLOBAL_TYPE:
                raise UnsafeMemberError(header.name, "global PAX header (not accepted)")
            if header.type in GNU_TYPES:
                raise UnsignedBytesError(
                    header.name, "typeflag", "a GNU long-name header (Edgepack writes long names in PAX headers)"
                )
            if header.type != PAX_TYPE:
                break
            check_extended_header(header, kinds)
            kinds.add(header.type)
            fields.update(self._pax(header, block))
        self.count += 1
        if self.count > self.limits.max_members:
            raise LimitExceededError("member count", self.count, self.limits.max_members)
        return replace(header, raw=block, **fields)

    def _pax(self, header: MemberHeader, block: bytes) -> dict[str, Any]:
        """A PAX header's block (as the writer makes it), records and zero padding: the name."""
        check_writer_fields(
            block, PAX_HEADER_NAME, writer_fields(PAX_HEADER_NAME.encode(), header.size, PAX_TYPE, PAX_HEADER_MODE)
        )
        data = self._exact(header.size)
        self._zeropadding(PAX_HEADER_NAME, header.size)
        return pax_fields(data)

    def _zeropadding(self, member: str, size: int) -> None:
        """The rest of a member's last block: zeros, as the writer leaves it, or refused."""
        if self._exact(padding(size)).strip(b"\0"):
            raise UnsignedBytesError(member, "padding", "non-zero bytes in the tar block padding after its data")

    def data(self, member: MemberHeader) -> Iterator[bytes]:
        """A member's bytes in pieces of at most 1 MiB, then its (zero) block padding."""
        remaining = member.size
        while remaining > 0:
            piece = self.source.read(min(_CHUNK, remaining))
            if not piece:
                raise TruncatedArchiveError("archive ends inside a member")
            remaining -= len(piece)
            yield piece
        self._zeropadding(member.name, member.size)

    def _end(self) -> None:
        """After the first zero block: a second one, then nothing but zeros to the end."""
        second = self.source.read(BLOCK)
        if len(second) < BLOCK:
            raise TruncatedArchiveError("archive ends without the tar end-of-archive marker")
        if second != ZERO_BLOCK:
            raise ArtifactError("data after the tar end-of-archive marker (a member after a lone zero block)")
        padding = 0
        while piece := self.source.read(_RAW_CHUNK):
            if piece.strip(b"\0"):
                raise ArtifactError("data after the tar end-of-archive marker (a second archive or garbage)")
            padding += len(piece)
            if padding > MAX_TRAILING_PADDING:
                raise LimitExceededError("zero padding after the end-of-archive marker", padding, MAX_TRAILING_PADDING)
        self.source.finish()


# --------------------------------------------------------------------------- the walk


def _read_small(reader: _TarReader, member: MemberHeader | None, name: str, limit: int) -> bytes:
    if member is None or member.name != name:
        if name == SIGNATURE_NAME:
            raise MissingSignatureError("manifest.sig is missing: the artifact is unsigned")
        raise ArtifactError(f"the first member must be {MANIFEST_NAME}")
    if member.type not in REGULAR_TYPES:
        raise UnsafeMemberError(member.name, "not a regular file")
    if member.size > limit:
        raise LimitExceededError(member.name, member.size, limit)
    check_writer_header(member)
    return b"".join(reader.data(member))


def _copy_hashed(pieces: Iterator[bytes], sink: IO[bytes] | None) -> str:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
        if sink is not None:
            sink.write(piece)
    return digest.hexdigest()


def _file_pieces(stream: IO[bytes], size: int) -> Iterator[bytes]:
    remaining = size
    while remaining > 0:
        piece = stream.read(min(_CHUNK, remaining))
        if not piece:
            raise TruncatedArchiveError("file ends early")
        remaining -= len(piece)
        yield piece


def _walk_members(
    reader: _TarReader, manifest: Manifest, limits: Limits, staging: Path | None, total: int, durable: bool = True
) -> None:
    seen: set[str] = set()
    while (member := reader.next()) is not None:
        check_member_header(member, manifest, seen, limits)
        check_writer_header(member)
        total += member.size
        check_total(total, limits)
        seen.add(member.name)
        if staging is None:
            digest = _copy_hashed(reader.data(member), None)
        else:
            target = staging / member.name
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "xb") as sink:
                digest = _copy_hashed(reader.data(member), sink)
                if durable:
                    sink.flush()
                    os.fsync(sink.fileno())
        if digest != manifest.files[member.name]["sha256"]:
            raise IntegrityError(member.name, "sha256 differs from the signed manifest")
    missing = sorted(set(manifest.files) - seen)
    if missing:
        raise IntegrityError(missing[0], "listed in the manifest but missing from the archive")


Admit = Callable[[Manifest], None]
"""A caller's decision on a signed manifest, taken before any member is read: it returns to let
the walk go on, or raises to refuse the artifact (see :func:`extract_artifact`)."""


def _walk(
    path: Path, trust: TrustStore, limits: Limits, staging: Path | None, durable: bool = True,
    admit: Admit | None = None,
) -> VerifiedArtifact:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no such artifact") from None  # the message names the missing file
    if size > limits.max_archive_bytes:
        raise LimitExceededError("archive", size, limits.max_archive_bytes)
    try:
        # One forward pass, no seeking; reading to the end checks the end-of-archive marker,
        # the padding after it and the compression trailer (CRC and length), so an archive
        # cut off after its last member is refused as well as one with anything appended.
        with open(path, "rb") as raw:
            reader = _TarReader(_Source(raw), limits)
            manifest_bytes = _read_small(reader, reader.next(), MANIFEST_NAME, limits.max_manifest_bytes)
            signature = _read_small(reader, reader.next(), SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
            key = trust.verify(manifest_bytes, signature)
            check_signature_layout(signature)
            manifest = parse_manifest(manifest_bytes)
            if admit is not None:
                admit(manifest)
            _walk_members(reader, manifest, limits, staging, len(manifest_bytes) + len(signature), durable)
            if staging is not None:
                (staging / MANIFEST_NAME).write_bytes(manifest_bytes)
                (staging / SIGNATURE_NAME).write_bytes(signature)
    except (zlib.error, lzma.LZMAError, EOFError) as err:
        raise TruncatedArchiveError(f"not a valid compressed stream ({err or type(err).__name__})") from err
    except OSError as err:
        raise ArtifactError(f"{path}: cannot read or write: {err.strerror or err}") from err
    return VerifiedArtifact(path=path, manifest=manifest, manifest_bytes=manifest_bytes, key_id=key)


def verify_artifact(path: str | os.PathLike[str], trust: TrustStore, limits: Limits | None = None) -> VerifiedArtifact:
    """Verify an artifact completely without writing anything; raise an ArtifactError if refused."""
    path = Path(path)
    try:
        return _walk(path, trust, limits or Limits(), None)
    except ArtifactError as err:
        err.artifact = str(path)
        raise


def extract_artifact(
    path: str | os.PathLike[str],
    dest: str | os.PathLike[str],
    trust: TrustStore,
    limits: Limits | None = None,
    *,
    durable: bool = True,
    admit: Admit | None = None,
) -> VerifiedArtifact:
    """Verify and extract into ``dest`` (which must not exist) atomically.

    All members are written into a staging directory beside ``dest``, fsynced, and the
    directory is renamed to ``dest`` only after every check passed. ``durable=False`` skips
    the fsyncs (not the checks), for a throwaway copy such as ``edgepack-agent predict``'s
    temporary directory: surviving a power cut means nothing there, and on an SD card the
    fsyncs cost more than the rest of the extraction. ``admit`` sees the manifest once its
    signature is verified and before any member is read, so a caller's own refusal (the
    agent's admission of an update) costs no extraction and the artifact is still read once.
    """
    path, dest = Path(path), Path(dest)
    if dest.exists():
        raise ArtifactError(f"{dest} already exists", artifact=str(path))
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        verified = _walk(path, trust, limits or Limits(), staging, durable, admit)
        if durable:
            for directory in sorted({p for p in staging.rglob("*") if p.is_dir()} | {staging}, reverse=True):
                fsync_dir(directory)
        os.rename(staging, dest)
        if durable:
            fsync_dir(dest.parent)
    except BaseException as err:
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, ArtifactError):
            err.artifact = str(path)
        raise
    return VerifiedArtifact(
        path=path,
        manifest=verified.manifest,
        manifest_bytes=verified.manifest_bytes,
        key_id=verified.key_id,
        root=dest,
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
        raise ArtifactError(f"{root}: no {MANIFEST_NAME}") from None  # the message names the missing file
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
                digest = _copy_hashed(_file_pieces(stream, entry["size"]), None)
                if stream.read(1):
                    raise IntegrityError(name, "larger than the signed size")
        except FileNotFoundError:  # from None: the message names the missing file
            raise IntegrityError(name, "missing from the installed copy") from None
        except TruncatedArchiveError as err:
            raise IntegrityError(name, "smaller than the signed size") from err
        if digest != entry["sha256"]:
            raise IntegrityError(name, "sha256 differs from the signed manifest")
    return VerifiedArtifact(path=root, manifest=manifest, manifest_bytes=manifest_bytes, key_id=key, root=root)
