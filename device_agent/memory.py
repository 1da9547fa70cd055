"""Giving back the pages only start-up touched, once the agent serves (agent.yaml ``memory:``).

Making the first onnxruntime session registers every CPU kernel: about 15 MiB of onnxruntime's
library is read once for that and never again for a small model, and importing numpy, the
verification of the store and the smoke tests leave more such pages. They are clean pages of
shared libraries, so the kernel would drop them under memory pressure anyway; until then they
count in the agent's RSS and crowd the page cache of a 512 MB device. ``MADV_PAGEOUT``
(Linux 5.4) asks the kernel to reclaim them now: what the agent still runs faults back in from
the file on first use (the working set), the rest stays out. The advice never changes what a
page holds (it is not ``MADV_DONTNEED``): a page written since it was mapped is written back or
kept, never lost, and pages another process maps too are left alone by the kernel.

The choice of mappings is a pure function of ``/proc/self/maps`` (:func:`releasable`); the
advice is the I/O (:func:`release_startup_pages`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("edgepack.agent.memory")

MADV_PAGEOUT = 21  # linux/mman-common.h; Linux 5.4 and later
MAPS = Path("/proc/self/maps")
STATUS = Path("/proc/self/status")
MAX_MAPS_BYTES = 4 * 1024 * 1024  # a process with ~40,000 mappings; ours has a few hundred

MEMORY_CONFIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "description": 'what the agent gives back to the kernel once it serves (docs/agent.md, "Memory")',
    "properties": {"release_startup_pages": {"type": "boolean"}},
}


@dataclass(frozen=True)
class MemorySettings:
    """agent.yaml ``memory:``. ``release_startup_pages``: after start and after each model is
    activated, advise the kernel to reclaim the shared libraries' pages start-up touched."""

    release_startup_pages: bool = True


@dataclass(frozen=True)
class Region:
    """One line of ``/proc/self/maps``: an address range, its permissions and what it maps."""

    start: int
    end: int
    perms: str
    path: str

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Released:
    """What one release did: how many regions were advised, RSS before and after (KiB), and
    why nothing was done where the kernel or platform cannot (``unsupported``: "" when done)."""

    regions: int
    rss_before_kib: int
    rss_after_kib: int
    unsupported: str = ""


def parse_maps(text: str) -> tuple[Region, ...]:
    """The regions of a ``/proc/PID/maps`` text; a line that is not a mapping is skipped."""
    regions = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 5 or "-" not in fields[0]:
            continue
        low, _, high = fields[0].partition("-")
        try:
            start, end = int(low, 16), int(high, 16)
        except ValueError:
            continue
        regions.append(Region(start, end, fields[1], fields[5].strip() if len(fields) > 5 else ""))
    return tuple(regions)


def is_shared_object(path: str) -> bool:
    """A shared library or extension module (``libx.so``, ``libx.so.6``, ``_x.abi3.so``), by name."""
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".so") or ".so." in name


def releasable(regions: Iterable[Region]) -> tuple[Region, ...]:
    """The regions whose pages may be given back: a shared object's code and read-only data
    (never a writable region: what start-up wrote there is the process's state, and it is not
    file pages; never the heap, stacks, anonymous memory or a deleted file)."""
    return tuple(
        region
        for region in regions
        if region.path.startswith("/")
        and not region.path.endswith(" (deleted)")
        and "w" not in region.perms
        and is_shared_object(region.path)
        and region.size > 0
    )


def _status_kib(status_text: str, field: str) -> int:
    """One ``kB`` field of a ``/proc/PID/status`` text (0 when absent)."""
    for line in status_text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def rss_kib(status_text: str) -> int:
    """``VmRSS`` of a ``/proc/PID/status`` text, in KiB (0 when absent)."""
    return _status_kib(status_text, "VmRSS")


@dataclass(frozen=True)
class MemoryReading:
    """The agent's resident memory now (bytes): all of it, its own (anonymous) and the pages of
    files it maps (libraries: the kernel can drop and re-read them), and what the last release
    gave back (None: none made, or turned off)."""

    rss: int
    anonymous: int
    file: int
    released: Released | None

    def to_json(self) -> dict[str, Any]:
        given_back = self.released
        doc: dict[str, Any] = {"rss_bytes": self.rss, "anonymous_bytes": self.anonymous, "file_bytes": self.file}
        if given_back is None:
            doc["release"] = "off"
        elif given_back.unsupported:
            doc["release"] = f"unsupported: {given_back.unsupported}"
        else:
            doc["release"] = "on"
            doc["released_bytes"] = max(given_back.rss_before_kib - given_back.rss_after_kib, 0) * 1024
        return doc


def memory_reading(status_text: str, released: Released | None) -> MemoryReading:
    """The reading of a ``/proc/PID/status`` text. Pure."""
    return MemoryReading(
        rss_kib(status_text) * 1024,
        _status_kib(status_text, "RssAnon") * 1024,
        _status_kib(status_text, "RssFile") * 1024,
        released,
    )


def read_memory(released: Released | None) -> MemoryReading | None:
    """This process's :class:`MemoryReading` (None off Linux)."""
    if not STATUS.exists():
        return None
    return memory_reading(_read(STATUS), released)


def _read(path: Path) -> str:
    with path.open("rb") as source:
        return source.read(MAX_MAPS_BYTES).decode("utf-8", "replace")


def _madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    advise = libc.madvise
    advise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advise.restype = ctypes.c_int
    return advise


def release_startup_pages() -> Released:
    """Advise the kernel to reclaim the pages of every :func:`releasable` region now. On a
    kernel without ``MADV_PAGEOUT`` (before 5.4) or off Linux, nothing is done and
    ``unsupported`` says why."""
    if not sys.platform.startswith("linux") or not MAPS.exists():
        return Released(0, 0, 0, unsupported="not Linux: no /proc/self/maps")
    before = rss_kib(_read(STATUS))
    advise = _madvise()
    regions = releasable(parse_maps(_read(MAPS)))
    advised = failed_unknown = 0
    for region in regions:
        if advise(region.start, region.size, MADV_PAGEOUT) == 0:
            advised += 1
        elif ctypes.get_errno() == errno.EINVAL:
            failed_unknown += 1
        # ENOMEM: the region went away meanwhile (a library unloaded); the others still count
    if advised == 0 and failed_unknown:
        return Released(0, before, before, unsupported="the kernel has no MADV_PAGEOUT (Linux 5.4 and later)")
    return Released(advised, before, rss_kib(_read(STATUS)))


def release_if_enabled(settings: MemorySettings, when: str) -> Released | None:
    """:func:`release_startup_pages` when ``memory.release_startup_pages`` is on, logged with
    ``when`` (e.g. "after start")."""
    if not settings.release_startup_pages:
        return None
    released = release_startup_pages()
    if released.unsupported:
        log.info("start-up pages kept %s: %s", when, released.unsupported)
    else:
        log.info(
            "start-up pages given back %s: %d regions, RSS %.1f -> %.1f MiB",
            when,
            released.regions,
            released.rss_before_kib / 1024,
            released.rss_after_kib / 1024,
        )
    return released
