"""The artifact store: content-addressed by sha256, filled only with verified artifacts.

An upload is streamed to a temporary file under ``<dir>/.incoming/`` while its size is
counted (over ``max_bytes``: refused with 413 the moment it is exceeded, the file removed),
then verified completely with the release trust store (signature before anything is parsed,
every member and hash: :func:`edgepack_core.artifact.verify_artifact`), and only then moved to
``<dir>/<sha256>.edgepkg`` by an atomic rename (fsynced file and directory). A refused upload
leaves nothing behind. The server never holds a release signing key: it can only store what
a release key signed, and devices verify the same signature again.

A stored file is hashed again before it is served (then again when it changed on disk or
``recheck_s`` passed): a file whose bytes no longer hash to its name (a bad disk, a stray
write) is moved to ``<dir>/.quarantine/`` with a ``.reason`` file beside it and answered
``410 Gone`` with the reason, never served; uploading the artifact again restores it. A full
disk during an upload is ``507`` with the reason, the partial file removed.

Downloads (``GET /artifacts/<sha256>.edgepkg``) take HTTP Range requests, so a device resumes
a cut download; the name must be exactly 64 lowercase hex digits and ``.edgepkg``, so nothing
a client sends becomes a path. With ``--public-url`` the commands point devices to that base
(a CDN or object store holding the same files) instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from edgepack_core.artifact import Limits, verify_artifact
from edgepack_core.errors import ArtifactError
from edgepack_core.fsutil import atomic_write, fsync_dir, sha256_file
from edgepack_core.signing import TrustStore
from sdk.deploy.server import parse_range
from sdk.errors import ApiError
from sdk.fleet_server.disk import private_store_dir

SHA256 = re.compile(r"[0-9a-f]{64}")
FILE_NAME = re.compile(r"([0-9a-f]{64})\.edgepkg")
DEFAULT_MAX_UPLOAD = 1024**3
DEFAULT_RECHECK_S = 3600.0
BLOCK = 256 * 1024
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _no_space(err: OSError, discard: Callable[[], None]) -> ApiError:
    """The 507 for an upload the disk has no room for (the partial file removed first)."""
    discard()
    return ApiError(507, "insufficient_storage", f"no space left for the upload in the artifact store "
                                                 f"({os.strerror(err.errno or errno.ENOSPC)}); nothing was stored: "
                                                 "free space on its disk or give --artifacts another one")


def _guard_space(action: Callable[[], Any], discard: Callable[[], None]) -> Any:
    """Run one write step of an upload; a full disk (ENOSPC, EDQUOT) becomes a 507."""
    try:
        return action()
    except OSError as err:
        if err.errno in _NO_SPACE:
            raise _no_space(err, discard) from err
        raise


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
    model_sha256: str | None = None  # the model file's hash, what a device reports it runs

    def to_row(self, *, actor: str, now: float) -> dict[str, Any]:
        return {"sha256": self.sha256, "name": self.name, "version": self.version, "size": self.size,
                "key_id": self.key_id, "targets": json.dumps(self.targets), "created_at": now, "created_by": actor,
                "model_sha256": self.model_sha256}


class Upload:
    """One upload in progress: :meth:`write` chunks, then :meth:`finish` or :meth:`discard`."""

    def __init__(self, store: ArtifactStore) -> None:
        self.store = store
        self.path = store.incoming / f"upload-{secrets.token_hex(8)}"
        self._handle: IO[bytes] | None = None
        self._handle = _guard_space(lambda: open(self.path, "xb"), self.discard)  # noqa: SIM115  (closed in finish/discard)
        self._digest = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        """Append a chunk; :class:`ApiError` 413 (and the file removed) past the size limit."""
        if self.size + len(chunk) > self.store.max_bytes:
            self.discard()
            raise ApiError(413, "too_large", f"the upload is over the limit of {self.store.max_bytes} bytes")
        handle = self._handle
        assert handle is not None
        _guard_space(lambda: handle.write(chunk), self.discard)
        self._digest.update(chunk)
        self.size += len(chunk)

    def finish(self) -> StoredArtifact:
        """Verify and store (blocking: run it off the event loop). :class:`ApiError` 422 naming
        why the artifact was refused; nothing is kept then."""
        handle = self._handle
        assert handle is not None
        try:
            def flush_to_disk() -> None:
                handle.flush()
                os.fsync(handle.fileno())

            _guard_space(flush_to_disk, self.discard)
        finally:
            handle.close()
            self._handle = None
        try:
            if self.size == 0:
                raise ApiError(422, "refused", "the upload is empty (send the .edgepkg file as the request body)")
            try:
                verified = verify_artifact(self.path, self.store.trust, self.store.limits)
            except ArtifactError as err:
                raise ApiError(422, "refused", f"artifact refused: {err.message}") from err
            sha = self._digest.hexdigest()
            final = self.store.path_of(sha)
            os.replace(self.path, final)  # verified bytes: they also replace a copy damaged on disk
            fsync_dir(final.parent)
            self.store.mark_checked(sha)
            manifest = verified.manifest
            return StoredArtifact(sha, manifest.name, manifest.version, self.size, verified.key_id,
                                  sorted(manifest.targets), final, manifest.model_sha256)
        finally:
            self.path.unlink(missing_ok=True)

    def discard(self) -> None:
        if self._handle is not None:
            with contextlib.suppress(OSError):  # a full disk fails the close's flush too
                self._handle.close()
            self._handle = None
        self.path.unlink(missing_ok=True)


class ArtifactStore:
    """``<dir>/<sha256>.edgepkg`` files, verified with ``trust`` before they get there."""

    def __init__(self, directory: Path, trust: TrustStore, *, max_bytes: int = DEFAULT_MAX_UPLOAD,
                 recheck_s: float = DEFAULT_RECHECK_S) -> None:
        self.directory = Path(directory)
        self.incoming = self.directory / ".incoming"
        self.quarantine = self.directory / ".quarantine"
        private_store_dir(self.directory)  # 0700, or tightened to it
        self.incoming.mkdir(parents=True, exist_ok=True)
        self.recheck_s = recheck_s
        self._checked: dict[str, tuple[tuple[int, ...], float]] = {}  # sha: (stat identity, when hashed)
        self._hashing: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
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

    def count(self) -> int:
        """How many artifacts the store holds (what a database without a fleet would lose)."""
        return sum(1 for path in self.directory.glob("*.edgepkg") if FILE_NAME.fullmatch(path.name))

    # ---------------------------------------------------------------- integrity

    def mark_checked(self, sha256: str) -> None:
        """The file of ``sha256`` was just written from verified bytes: no hashing before serving."""
        with contextlib.suppress(OSError):
            identity = _identity(self.path_of(sha256))
            with self._lock:
                self._checked[sha256] = (identity, time.time())

    def check(self, sha256: str) -> None:
        """Hash the stored file unless it was hashed within ``recheck_s`` and has not changed since;
        one that does not hash to its name is quarantined (:class:`ApiError` 410)."""
        path = self.path_of(sha256)
        with self._lock:
            lock = self._hashing.setdefault(sha256, threading.Lock())
        with lock:  # a hundred devices fetching at once: one hashes, the others wait for its verdict
            try:
                identity = _identity(path)
            except FileNotFoundError:  # quarantined meanwhile by another request
                raise self.gone(sha256) from None  # the message names the missing file
            checked = self._checked.get(sha256)
            if checked is not None and checked[0] == identity and time.time() - checked[1] < self.recheck_s:
                return
            digest = sha256_file(path)
            if digest != sha256:
                self._quarantine(sha256, f"its bytes hash to {digest[:16]}..., not to its name")
                raise self.gone(sha256)
            with self._lock:
                self._checked[sha256] = (identity, time.time())

    def _quarantine(self, sha256: str, reason: str) -> None:
        self.quarantine.mkdir(exist_ok=True)
        note = self.quarantine / f"{sha256}.reason"
        atomic_write(note, f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {reason}\n".encode())
        os.replace(self.path_of(sha256), self.quarantine / f"{sha256}.edgepkg")
        fsync_dir(self.quarantine)
        fsync_dir(self.directory)
        with self._lock:
            self._checked.pop(sha256, None)

    def gone(self, sha256: str) -> ApiError:
        """The 410 of a quarantined artifact, with the reason recorded when it was moved."""
        note = self.quarantine / f"{sha256}.reason"
        with contextlib.suppress(OSError):
            reason = note.read_text(errors="replace").strip()[:300]
            return ApiError(410, "gone", f"artifact {sha256[:12]} was damaged on the server's disk and is "
                                         f"quarantined ({reason}); upload it again to restore it")
        return ApiError(410, "gone", f"artifact {sha256[:12]} was damaged on the server's disk and is quarantined")

    def open_range(self, file_name: str, range_header: str) -> tuple[int, dict[str, str], Iterator[bytes] | None]:
        """(status, headers, body) for ``GET /artifacts/<file_name>``. 404 for a name that is
        not ``<sha256>.edgepkg`` or not stored; 416 for a range past the end."""
        match = FILE_NAME.fullmatch(file_name)
        if match is not None and not self.has(match[1]) and (self.quarantine / file_name).is_file():
            raise self.gone(match[1])
        if match is None or not self.has(match[1]):
            raise ApiError(404, "not_found", "no such artifact")
        self.check(match[1])
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


def _identity(path: Path) -> tuple[int, ...]:
    """What changes when a file is written or replaced (a bad disk changes none of it: hence
    the periodic recheck too)."""
    info = path.stat()
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


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
