"""Giving back the pages only start-up touched, once the agent serves (agent.yaml ``memory:``).

Making the first onnxruntime session registers every CPU kernel: about 15 MiB of onnxruntime's
library is read once for that and never again for a small model, and importing numpy, the
verification of the store and the smoke tests leave more such pages. They are clean pages of
shared libraries: the kernel would drop them under memory pressure anyway; until then they
count in the agent's RSS. Two advices, per read-only mapping of a shared object:

- ``MADV_PAGEOUT`` (Linux 5.4) reclaims the pages now, page cache included. The kernel takes it
  only from a process that owns the file or may write it (a root-owned venv under an
  unprivileged agent is neither), and never for a page another process maps too. It never
  changes what a page holds (a private copy is written to swap or kept, never lost).
- ``MADV_DONTNEED`` unmaps the pages from the agent (they stay in the page cache, unmapped: the
  first memory the kernel takes back). Only on a mapping that holds no private copy of a page
  (``Anonymous: 0`` in ``/proc/self/smaps``): a page the loader relocated (RELRO) would be read
  back from the file unrelocated, so such a mapping is never unmapped.

What the agent runs next faults back in (the working set). The choice of mappings is a pure
function of ``/proc/self/smaps`` (:func:`releasable`, :func:`unmappable`); the advice is the I/O
(:func:`release_startup_pages`).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

log = logging.getLogger("edgepack.agent.memory")

MADV_DONTNEED = 4  # linux/mman-common.h
MADV_PAGEOUT = 21  # Linux 5.4 and later
MAPS = Path("/proc/self/maps")
SMAPS = Path("/proc/self/smaps")
STATUS = Path("/proc/self/status")
MAX_MAPS_BYTES = 16 * 1024 * 1024  # smaps of ~40,000 mappings; the agent has a few hundred

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
    """One mapping of ``/proc/self/maps``: an address range, its permissions, what it maps, and
    (from ``smaps``) how much of it is private copies of pages (``Anonymous``, KiB; None: not
    known, from a maps text or an smaps text cut short)."""

    start: int
    end: int
    perms: str
    path: str
    anonymous_kib: int | None = None

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


def _mapping(line: str) -> Region | None:
    """The region a maps (or smaps header) line names; None for any other line."""
    fields = line.split(maxsplit=5)
    if len(fields) < 5 or "-" not in fields[0] or fields[0].endswith(":"):
        return None
    low, _, high = fields[0].partition("-")
    try:
        start, end = int(low, 16), int(high, 16)
    except ValueError:
        return None
    return Region(start, end, fields[1], fields[5].strip() if len(fields) > 5 else "")


def parse_maps(text: str) -> tuple[Region, ...]:
    """The regions of a ``/proc/PID/maps`` or ``smaps`` text, with each one's ``Anonymous`` from
    smaps (None from maps); a line that is neither a mapping nor its ``Anonymous`` is skipped."""
    regions: list[Region] = []
    for line in text.splitlines():
        region = _mapping(line)
        if region is not None:
            regions.append(region)
        elif line.startswith("Anonymous:") and regions:
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                regions[-1] = replace(regions[-1], anonymous_kib=int(fields[1]))
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


def holds_no_private_copy(region: Region) -> bool:
    """Whether every page of ``region`` reads back from its file as it was, so it may also be
    unmapped (``MADV_DONTNEED``); one whose ``Anonymous`` is not known never is."""
    return region.anonymous_kib == 0


def unmappable(regions: Iterable[Region]) -> tuple[Region, ...]:
    """The :func:`releasable` regions that :func:`holds_no_private_copy`."""
    return tuple(region for region in releasable(regions) if holds_no_private_copy(region))


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


def read_rss_bytes(status: Path = STATUS) -> int | None:
    """The ``VmRSS`` of a ``/proc/PID/status`` file, in bytes: the one reader of the agent's
    resident size (telemetry's ``memory_rss_bytes`` and /healthz's ``memory``). None where
    the file or the field is absent."""
    try:
        text = _read(status)
        return rss_kib(text) * 1024 if "\nVmRSS:" in "\n" + text else None
    except (OSError, ValueError, IndexError):
        return None


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
    """Advise the kernel to reclaim the pages of every :func:`releasable` region
    (``MADV_PAGEOUT``; refused by kernels before 5.4 and for files the agent may not write) and
    to unmap those of every :func:`unmappable` one (``MADV_DONTNEED``). ``regions``: how many took
    one advice or both. Off Linux nothing is done and ``unsupported`` says why."""
    if not sys.platform.startswith("linux") or not SMAPS.exists():
        return Released(0, 0, 0, unsupported="not Linux: no /proc/self/smaps")
    before = rss_kib(_read(STATUS))
    advise = _madvise()
    advised = 0
    for region in releasable(parse_maps(_read(SMAPS))):
        # Either may fail alone (EINVAL: no MADV_PAGEOUT; ENOMEM: the library went away meanwhile)
        paged = advise(region.start, region.size, MADV_PAGEOUT) == 0
        unmapped = holds_no_private_copy(region) and advise(region.start, region.size, MADV_DONTNEED) == 0
        advised += paged or unmapped
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
