"""Reproducible builds: with ``SOURCE_DATE_EPOCH`` set (https://reproducible-builds.org), two
builds of one recipe, data and key give byte-identical artifacts. Pure: no files, no clock.

The artifact's bytes hold three things a clock decides: the manifest's ``created`` (pinned to
the epoch), the tar and gzip headers (always mtime 0, fixed order: ``sdk.artifact_writer``), and
the build report's timings. With the epoch set, the report inside the artifact leaves the
timings out (:func:`without_clock`); the build's own result (``edgepack build --json``) keeps
them. Without it, the artifact records the real time and timings. Decisions a clock makes are
not undone here: the quantize speed gate's interval keeps them stable (``quant_search``), and a
bounded ``quantize.max_search_s`` can stop a search at a different candidate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from sdk.errors import RecipeError

# Report keys whose values are this machine's clock: per-pass and per-candidate durations,
# latencies and their ratios.
CLOCK_KEYS = frozenset({"timings_s", "seconds", "search_s", "speedup", "speedup_interval"})
# Clock figures inside report sentences ("0.238 ms", "(1.38x fp32)").
CLOCK_TEXT = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?\s*(?:ms\b|x\b)")
CLOCK_MARK = "<clock>"
MAX_EPOCH = 253402300799  # 9999-12-31T23:59:59Z


def source_date_epoch(environ: Mapping[str, str]) -> int | None:
    """``SOURCE_DATE_EPOCH`` as whole seconds since 1970, None when unset or empty; a value
    that is not one is refused (usage error) rather than silently ignored."""
    raw = environ.get("SOURCE_DATE_EPOCH", "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) > MAX_EPOCH:
        raise RecipeError("SOURCE_DATE_EPOCH", f"must be whole seconds since 1970-01-01 UTC, got {raw[:40]!r}")
    return int(raw)


def created(epoch: int | None, now: datetime | None = None) -> str:
    """The manifest's ``created``: the epoch when set, else ``now`` (UTC), to the second."""
    moment = datetime.fromtimestamp(epoch, timezone.utc) if epoch is not None else now or datetime.now(timezone.utc)
    return moment.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def is_clock_key(key: str) -> bool:
    return key in CLOCK_KEYS or key.endswith("_ms")


def without_clock(value: Any) -> Any:
    """A report value with the clock's figures taken out: clock keys dropped, figures in
    sentences replaced by ``<clock>``."""
    if isinstance(value, dict):
        return {k: without_clock(v) for k, v in value.items() if not is_clock_key(k)}
    if isinstance(value, list):
        return [without_clock(v) for v in value]
    if isinstance(value, str):
        return CLOCK_TEXT.sub(CLOCK_MARK, value)
    return value
