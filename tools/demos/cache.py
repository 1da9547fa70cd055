"""A cache of built demos keyed by the builder's source, so trained models are trained once.

The torch demos train for seconds to a minute; the test session, ``tools/build_demos.py`` and
the oldest-onnxruntime check all want the same files. A build lands in
``<cache>/<name>-<key>/`` where ``key`` hashes the builder's source files and the versions
that change its result (torch, numpy, Pillow: the font renderer); any edit to a builder makes
a new key, so a stale model is never reused. ``<cache>`` is ``$EDGEPACK_DEMO_CACHE``, else
``.cache/demos`` in the checkout (git-ignored); ``EDGEPACK_DEMO_CACHE=off`` builds every time.

A build is written to a temporary folder beside its final place and renamed into it, so a
build killed half-way never leaves a folder that looks complete.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import multiprocessing
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
MARKER = ".complete"


def cache_root() -> Path | None:
    """The cache folder, or None when caching is off."""
    setting = os.environ.get("EDGEPACK_DEMO_CACHE", "")
    if setting.lower() in ("off", "0", "no", "false"):
        return None
    return Path(setting) if setting else ROOT / ".cache" / "demos"


def source_key(sources: Sequence[Path], extra: Sequence[str] = ()) -> str:
    """16 hex digits over the sources' bytes (in order) and ``extra`` strings."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode() + b"\0" + Path(path).read_bytes() + b"\0")
    for item in extra:
        digest.update(item.encode() + b"\0")
    return digest.hexdigest()[:16]


def library_versions() -> list[str]:
    """Versions that change what a trained demo comes out as."""
    import numpy
    import PIL

    versions = [f"numpy={numpy.__version__.split('.')[0]}", f"pillow={PIL.__version__}"]
    try:
        import torch

        versions.append(f"torch={torch.__version__}")
    except ImportError:
        versions.append("torch=none")
    return versions


def ensure_entry(name: str, build: Callable[[Path], Path], sources: Sequence[Path]) -> Path | None:
    """The cache folder holding ``name`` built from ``sources``, built now if missing; None when
    caching is off."""
    root = cache_root()
    if root is None:
        return None
    entry = root / f"{name}-{source_key(sources, library_versions())}"
    if not (entry / MARKER).exists():
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            model = build(scratch)
            (scratch / MARKER).write_text(str(model.relative_to(scratch)) + "\n")
            try:
                scratch.rename(entry)
            except OSError:  # another process finished the same build first: keep its copy
                if not (entry / MARKER).exists():
                    raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return entry


def cached_build(name: str, build: Callable[[Path], Path], out: Path, sources: Sequence[Path]) -> Path:
    """Build ``name`` with ``build(folder) -> model path`` into ``out``, through the cache.

    Returns the model path under ``out`` (the same relative path ``build`` returned)."""
    out = Path(out)
    entry = ensure_entry(name, build, sources)
    if entry is None:
        return build(out)
    relative = (entry / MARKER).read_text().strip()
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(entry, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(MARKER))
    return out / relative


@dataclass(frozen=True)
class CachedDemo:
    """A demo builder bound to its name and source files: call it with an output folder."""

    name: str
    build: Callable[[Path], Path]
    sources: tuple[Path, ...]

    def __call__(self, out: Path) -> Path:
        return cached_build(self.name, self.build, out, self.sources)

    def cached(self) -> bool:
        root = cache_root()
        key = source_key(self.sources, library_versions())
        return root is not None and (root / f"{self.name}-{key}" / MARKER).exists()

    def fill(self) -> None:
        """Build into the cache only (what a worker process does)."""
        ensure_entry(self.name, self.build, self.sources)


def fill_in_parallel(demos: Sequence[CachedDemo], workers: int) -> None:
    """Build the demos the cache lacks, ``workers`` at a time in fresh processes (each trains
    single-threaded, so two cores train two demos at once and the weights stay the same)."""
    missing = [demo for demo in demos if not demo.cached()]
    if cache_root() is None or len(missing) < 2 or workers < 2:
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process holding torch/onnxruntime threads
    with concurrent.futures.ProcessPoolExecutor(min(workers, len(missing)), mp_context=context) as pool:
        for future in [pool.submit(demo.fill) for demo in missing]:  # in order: the long ones are listed first
            future.result()
