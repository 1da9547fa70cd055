"""The one atomic file replacement of host and device: a reader, a crash or a power cut sees the
old file or the new one, never a torn one.

The bytes go to a temporary file in the target's own directory (a rename is atomic only within
one file system), which is fsynced, renamed over the target, and then the directory is fsynced so
the rename itself survives a power cut. The file is never wider than its final ``mode`` (0600
unless the caller says otherwise), so a private key is not readable by others even for a moment.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file's bytes, read a MiB at a time (artifacts are too big to read whole)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of ``path`` (a rename or a new file in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(path: str | os.PathLike[str], *, mode: int = 0o600, overwrite: bool = True) -> Iterator[BinaryIO]:
    """Yield a binary file whose bytes replace ``path`` atomically when the block ends cleanly.

    If the block raises, ``path`` is untouched and the temporary file is removed. With
    ``overwrite=False`` an existing ``path`` is never replaced: :class:`FileExistsError`, even if
    the file appeared while the block ran (the temporary file is hard-linked, not renamed).
    """
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)  # from mkstemp's 0600 to exactly ``mode``
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path)
            tmp.unlink()
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def staged_path(path: str | os.PathLike[str], *, mode: int = 0o600) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` for another program or library to write (a
    database backup, a dump); when the block ends cleanly it is synced and renamed over ``path``,
    else removed, so ``path`` is never left half-written."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, mode)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike[str], data: bytes, *, mode: int = 0o600, overwrite: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see :func:`atomic_writer`)."""
    with atomic_writer(path, mode=mode, overwrite=overwrite) as handle:
        handle.write(data)
