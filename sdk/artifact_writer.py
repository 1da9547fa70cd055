"""Writing ``.edgepkg`` artifacts (host side only): manifest first, signature second, files after.

The reader (``edgepack_core.artifact``) relies on this order to verify the signature before
it reads any other byte, so the writer is the one place that fixes it. Output is written
through ``edgepack_core.fsutil.atomic_writer``, so a crash never leaves a partial artifact under
the final name.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from edgepack_core.fsutil import atomic_writer
from edgepack_core.manifest import MANIFEST_NAME, SIGNATURE_NAME, canonical_bytes, check_manifest
from edgepack_core.signing import SigningKey, signature_document

# Fixed metadata so the same inputs give byte-identical archives.
_MTIME = 0


def file_entry(data: bytes) -> dict[str, Any]:
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _tar_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = _MTIME
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def write_artifact(
    output: str | os.PathLike[str],
    manifest: Mapping[str, Any],
    files: Mapping[str, bytes],
    keys: list[SigningKey],
    *,
    compress: bool = True,
) -> bytes:
    """Write a signed artifact; ``manifest['files']`` is filled from ``files``. Returns the
    manifest bytes that were signed."""
    document = dict(manifest)
    document["files"] = {name: file_entry(data) for name, data in sorted(files.items())}
    check_manifest(document)
    manifest_bytes = canonical_bytes(document)
    signature = signature_document(manifest_bytes, keys)

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    # An artifact is signed, not secret: 0644.
    with atomic_writer(output, mode=0o644) as raw:
        # gzip with mtime=0 keeps the bytes reproducible.
        sink: Any = gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) if compress else raw
        with tarfile.open(fileobj=sink, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, data in [(MANIFEST_NAME, manifest_bytes), (SIGNATURE_NAME, signature),
                               *sorted(files.items())]:
                tar.addfile(_tar_info(name, len(data)), io.BytesIO(data))
        if compress:
            sink.close()
    return manifest_bytes
