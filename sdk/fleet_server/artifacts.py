"""The artifact store: content-addressed by sha256, filled only with verified artifacts.

An upload is streamed to a temporary file under ``<dir>/.incoming/`` while its size is
counted (over ``max_bytes``: refused with 413 the moment it is exceeded, the file removed),
then verified completely with the release trust store (signature before anything is parsed,
every member and hash: :func:`edgepack_core.artifact.verify_artifact`), and only then moved to
``<dir>/<sha256>.edgepkg`` by an atomic rename (fsynced file and directory). A refused upload
leaves nothing behind. The server never holds a release signing key: it can only store what
a release key signed, and devices verify the same signature again.

Downloads (``GET /artifacts/<sha256>.edgepkg``) take HTTP Range requests, so a device resumes
a cut download; the name must be exactly 64 lowercase hex digits and ``.edgepkg``, so nothing
a client sends becomes a path. With ``--public-url`` the commands point devices to that base
(a CDN or object store holding the same files) instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from edgepack_core.artifact import Limits, verify_artifact
from edgepack_core.artifact import _fsync_dir as fsync_dir  # the verifier's own: rename, then fsync the folder
from edgepack_core.errors import ArtifactError
from edgepack_core.signing import TrustStore
from sdk.deploy.server import parse_range
from sdk.errors import ApiError

SHA256 = re.compile(r"[0-9a-f]{64}")
FILE_NAME = re.compile(r"([0-9a-f]{64})\.edgepkg")
DEFAULT_MAX_UPLOAD = 1024**3
BLOCK = 256 * 1024


def check_sha256(value: str) -> str:
    """``value`` if it is 64 lowercase hex digits; :class:`ApiError` 400 otherwise."""
    if not isinstance(value, str) or SHA256.fullmatch(value) is None:
        raise ApiError(400, "invalid", "an artifact is named by its sha256: 64 lowercase hex digits")
    return value


@dataclass(frozen=True)
class StoredArtifact:
    sha256: str
    name: str
    version: str
    size: int
    key_id: str
    targets: list[str]
    path: Path

    def to_row(self, *, actor: str, now: float) -> dict[str, Any]:
        return {"sha256": self.sha256, "name": self.name, "version": self.version, "size": self.size,
                "key_id": self.key_id, "targets": json.dumps(self.targets), "created_at": now, "created_by": actor}


class Upload:
    """One upload in progress: :meth:`write` chunks, then :meth:`finish` or :meth:`discard`."""

    def __init__(self, store: ArtifactStore) -> None:
        self.store = store
        self.path = store.incoming / f"upload-{secrets.token_hex(8)}"
        self._handle: IO[bytes] | None = open(self.path, "xb")  # noqa: SIM115  (closed in finish/discard)
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        """Append a chunk; :class:`ApiError` 413 (and the file removed) past the size limit."""
        if self.size + len(chunk) > self.store.max_bytes:
            self.discard()
            raise ApiError(413, "too_large", f"the upload is over the limit of {self.store.max_bytes} bytes")
        assert self._handle is not None
        self._handle.write(chunk)
        self._digest.update(chunk)
        self.size += len(chunk)

    def finish(self) -> StoredArtifact:
        """Verify and store (blocking: run it off the event loop). :class:`ApiError` 422 naming
        why the artifact was refused; nothing is kept then."""
        assert self._handle is not None
        try:
            self._handle.flush()
            os.fsync(self._handle.fileno())
        finally:
            self._handle.close()
            self._handle = None
        try:
            if self.size == 0:
                raise ApiError(400, "invalid", "the upload is empty (send the .edgepkg file as the request body)")
            try:
                verified = verify_artifact(self.path, self.store.trust, self.store.limits)
            except ArtifactError as err:
                raise ApiError(422, "refused", f"artifact refused: {err.message}") from None
            sha = self._digest.hexdigest()
            final = self.store.path_of(sha)
            if not final.exists():
                os.replace(self.path, final)
                fsync_dir(final.parent)
            manifest = verified.manifest
            return StoredArtifact(sha, manifest.name, manifest.version, self.size, verified.key_id,
                                  sorted(manifest.targets), final)
        finally:
            self.path.unlink(missing_ok=True)

    def discard(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        self.path.unlink(missing_ok=True)


class ArtifactStore:
    """``<dir>/<sha256>.edgepkg`` files, verified with ``trust`` before they get there."""

    def __init__(self, directory: Path, trust: TrustStore, *, max_bytes: int = DEFAULT_MAX_UPLOAD) -> None:
        self.directory = Path(directory)
        self.incoming = self.directory / ".incoming"
        self.incoming.mkdir(parents=True, exist_ok=True)
        self.trust = trust
        self.max_bytes = max_bytes
        self.limits = dataclasses.replace(Limits(), max_archive_bytes=max_bytes,
                                          max_member_bytes=min(Limits().max_member_bytes, max_bytes))
        self._clean_incoming(older_than_s=3600.0)  # another server may share the folder and be uploading

    def _clean_incoming(self, older_than_s: float) -> None:
        """Remove uploads a crash left half-written (they were never verified and never will be)."""
        now = time.time()
        for leftover in self.incoming.glob("upload-*"):
            with contextlib.suppress(OSError):
                if now - leftover.stat().st_mtime >= older_than_s:
                    leftover.unlink()

    def begin_upload(self) -> Upload:
        return Upload(self)

    def path_of(self, sha256: str) -> Path:
        return self.directory / f"{check_sha256(sha256)}.edgepkg"

    def has(self, sha256: str) -> bool:
        return self.path_of(sha256).is_file()

    def open_range(self, file_name: str, range_header: str) -> tuple[int, dict[str, str], Iterator[bytes] | None]:
        """(status, headers, body) for ``GET /artifacts/<file_name>``. 404 for a name that is
        not ``<sha256>.edgepkg`` or not stored; 416 for a range past the end."""
        match = FILE_NAME.fullmatch(file_name)
        if match is None or not self.has(match[1]):
            raise ApiError(404, "not_found", "no such artifact")
        path = self.path_of(match[1])
        size = path.stat().st_size
        span = parse_range(range_header, size)
        if span == "unsatisfiable":
            return 416, {"Content-Range": f"bytes */{size}"}, None
        start, end = span if isinstance(span, tuple) else (0, size - 1)
        headers = {"Accept-Ranges": "bytes", "Content-Length": str(end - start + 1),
                   "Content-Type": "application/octet-stream"}
        if isinstance(span, tuple):
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        return (206 if isinstance(span, tuple) else 200), headers, _read_span(path, start, end - start + 1)


def _read_span(path: Path, start: int, length: int) -> Iterator[bytes]:
    with open(path, "rb") as handle:
        handle.seek(start)
        remaining = length
        while remaining > 0:
            block = handle.read(min(BLOCK, remaining))
            if not block:
                return
            remaining -= len(block)
            yield block
