"""Replay protection: every state-changing command id the agent accepted is remembered until the
command expires, so a command captured off the broker cannot be run again: not after the job
journal dropped it, and (signed) not after a restart.

The ledger is kept per sender and command type (a *bucket*), each bounded by
``max_per_bucket``, so no sender can crowd out another, nor one type another:

- **signed** commands (the sender is the operator key id that verified them) are written to
  disk (``<store>/command-ids.json``, atomically) before they run; a full bucket drops its
  expired ids, and if it is still full the command is refused rather than a valid id forgotten
  early (only a key holder can fill it, and forgetting would reopen a replay);
- **unsigned** commands (no ``operator_keys``: anyone on the broker may send any, so a replay
  is no worse than a new command) are remembered in memory only, per type, and a full bucket
  forgets its expired ids first, then its oldest: a stranger's flood of 10,000 unsigned
  commands can neither fill the disk, nor survive a restart, nor get later deploys and
  rollbacks refused. The job journal still answers a redelivered duplicate.

Memory is bounded: (operator keys + 1) x command types x ``max_per_bucket`` ids.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from pathlib import Path

from device_agent.errors import ReplayError
from edgepack_core.fsutil import atomic_write

log = logging.getLogger("edgepack.agent.updates")

MAX_IDS_PER_BUCKET = 1000
MAX_FILE_BYTES = 8 * 1024 * 1024
UNSIGNED = "unsigned"
"""The sender of every command that carries no verified operator signature."""
LEGACY = ("legacy", "legacy")
"""The bucket of ids a ledger without senders (before per-sender buckets) held: still refused
until they expire, never added to."""
_FORMAT = 2

Bucket = dict[str, float]  # command id -> its expiry, in the order the ids were recorded


def live_ids(ids: Bucket, now: float) -> Bucket:
    """The ids whose commands have not expired yet (an id is valid through its expiry). Pure."""
    return {cid: expires for cid, expires in ids.items() if expires >= now}


def make_room(ids: Bucket, now: float, limit: int, *, forget_oldest: bool) -> Bucket | None:
    """``ids`` with room for one more: expired ids dropped first, then (``forget_oldest``) the
    oldest recorded; None when it stays full. Pure."""
    if len(ids) < limit:
        return ids
    ids = live_ids(ids, now)
    if len(ids) < limit:
        return ids
    if not forget_oldest:
        return None
    keep = list(ids.items())[len(ids) - limit + 1 :]
    return dict(keep)


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def parse_ledger(document: object) -> dict[tuple[str, str], Bucket]:
    """The buckets of a ledger file's JSON (unreadable entries skipped; the flat ``{id: expiry}``
    of older agents as the :data:`LEGACY` bucket). Pure."""
    buckets: dict[tuple[str, str], Bucket] = {}
    if isinstance(document, dict) and document.get("format") == _FORMAT and isinstance(document.get("ids"), dict):
        for cid, entry in document["ids"].items():
            if (
                isinstance(entry, list)
                and len(entry) == 3
                and _finite(entry[0])
                and isinstance(entry[1], str)
                and isinstance(entry[2], str)
            ):
                buckets.setdefault((entry[1], entry[2]), {})[str(cid)] = float(entry[0])
    elif isinstance(document, dict):
        legacy = {str(cid): float(v) for cid, v in document.items() if _finite(v)}
        if legacy:
            buckets[LEGACY] = legacy
    return buckets


class ReplayGuard:
    def __init__(self, path: Path, max_per_bucket: int = MAX_IDS_PER_BUCKET) -> None:
        self.path = Path(path)
        self.max_per_bucket = max_per_bucket
        self._lock = threading.Lock()
        self._buckets = self._load()

    def _load(self) -> dict[tuple[str, str], Bucket]:
        try:
            with open(self.path, "rb") as handle:
                data = handle.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as err:
            log.error("replay ledger %s is unreadable (%s); starting empty", self.path, err.strerror)
            return {}
        try:
            document = json.loads(data) if len(data) <= MAX_FILE_BYTES else None
        except (UnicodeDecodeError, ValueError):
            document = None
        if not isinstance(document, dict):
            log.error(
                "replay ledger %s is damaged; starting empty (the job journal still answers duplicates)", self.path
            )
            return {}
        return parse_ledger(document)

    def _holder(self, command_id: str) -> tuple[str, str] | None:
        return next((key for key, ids in self._buckets.items() if command_id in ids), None)

    def seen(self, command_id: str) -> bool:
        with self._lock:
            return self._holder(command_id) is not None

    def count(self, sender: str, kind: str) -> int:
        """How many ids the bucket of ``sender`` and ``kind`` holds (expired ones included)."""
        with self._lock:
            return len(self._buckets.get((sender, kind), {}))

    def remember(
        self, command_id: str, expires_at: float, now: float, *, sender: str = UNSIGNED, kind: str = ""
    ) -> None:
        """Record ``command_id`` of ``kind`` from ``sender`` until ``expires_at``; raises
        ReplayError if it was seen, its signed bucket is full, or it cannot be written (the
        command must then not run)."""
        with self._lock:
            if self._holder(command_id) is not None:
                raise ReplayError(f"command id {command_id} was already used")
            key = (sender, kind)
            bucket = make_room(self._buckets.get(key, {}), now, self.max_per_bucket, forget_oldest=sender == UNSIGNED)
            if bucket is None:
                raise ReplayError(
                    f"{self.max_per_bucket} unexpired {kind} command ids of operator key {sender} are "
                    "remembered, the most allowed; refusing new ones until some expire"
                )
            bucket = {**bucket, command_id: float(expires_at)}
            if sender != UNSIGNED:
                self._write({**self._buckets, key: bucket}, now)
            self._buckets[key] = bucket

    def _write(self, buckets: dict[tuple[str, str], Bucket], now: float) -> None:
        """Persist the signed buckets' unexpired ids (unsigned ones live in memory only)."""
        ids = {
            cid: [expires, sender, kind]
            for (sender, kind), bucket in buckets.items()
            if sender != UNSIGNED
            for cid, expires in bucket.items()
            if expires >= now
        }
        try:
            atomic_write(self.path, json.dumps({"format": _FORMAT, "ids": ids}, separators=(",", ":")).encode())
        except OSError as err:
            raise ReplayError(f"cannot record the command id: {err.strerror}") from err
