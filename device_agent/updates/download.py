"""HTTP(S) artifact download: streamed to disk in bounded memory, size-limited, resumable with
Range requests, and checked against the sha256 the command carries.

The command's sha256 is not what makes the artifact trusted (the signature check after the
download does that); it makes a corrupt or swapped download fail early and lets a resumed
download prove that its two halves belong together.
"""

from __future__ import annotations

import hashlib
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from device_agent.errors import AgentError

log = logging.getLogger("edgepack.agent.download")

CHUNK = 256 * 1024


class DownloadError(AgentError):
    """The artifact could not be fetched completely and intact."""


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def download(url: str, target: Path, *, size: int, sha256: str, max_bytes: int, attempts: int = 5,
             timeout: float = 30.0, progress: Callable[[int], None] | None = None) -> Path:
    """Fetch ``url`` into ``target``; resume a partial ``target`` with a Range request."""
    if size > max_bytes:
        raise DownloadError(f"artifact of {size} bytes is over the download limit of {max_bytes}")
    partial = target.with_name(target.name + ".part")
    if target.exists() and target.stat().st_size == size and file_sha256(target) == sha256:
        return target
    last_error = ""
    for attempt in range(attempts):
        have = partial.stat().st_size if partial.exists() else 0
        if have > size:
            partial.unlink()
            have = 0
        if have < size:
            request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    if have and response.status != 206:
                        have = 0  # the server ignored Range: start over
                    mode = "ab" if have else "wb"
                    with open(partial, mode) as sink:
                        while block := response.read(CHUNK):
                            have += len(block)
                            if have > size:
                                raise DownloadError(f"server sent more than the declared {size} bytes")
                            sink.write(block)
                            if progress is not None:
                                progress(have)
            except (urllib.error.URLError, OSError, TimeoutError) as err:
                last_error = str(getattr(err, "reason", err))
                log.warning("download attempt %d failed at %d bytes: %s", attempt + 1, have, last_error)
                time.sleep(min(0.2 * 2**attempt, 5.0))
                continue
        if partial.stat().st_size != size:
            last_error = f"got {partial.stat().st_size} of {size} bytes"
            continue
        if file_sha256(partial) != sha256:
            partial.unlink()
            raise DownloadError("downloaded file does not match the command's sha256")
        partial.replace(target)
        return target
    raise DownloadError(f"download failed after {attempts} attempts: {last_error}")
