"""Rejected versions: what this device refused to keep, remembered per model name.

A version that fails admission (verification included), its smoke test or its health window is
recorded here (name, version, artifact sha256, stage, reason, time), in ``<store>/rejected.json``,
replaced atomically and read back at every start. The record is what stops the two incidents of
issue 24: a rollback never goes to a rejected version (``ModelStore.rollback_target``), and the
version rules of admission compare against versions the device really held (passed their health
window, or the first install), never against a rejected one, so a failed 2.0.0 does not block 1.3.0
on a device running 1.1.0, and re-running the same failed artifact needs no ``force_downgrade``.

The device does not refuse a rejected artifact by itself: a deploy command that names it is an
order someone gave (signed, with ``operator_keys``), and it runs admission, the smoke test and the
health window again; a rejection can be the moment's (a window spoiled by a load spike), and a
device that refused on its own would need a new build to recover. Not re-sending a rejected
artifact is the fleet server's job: the published state lists the records (:func:`for_state`), and
the server marks (device, artifact) rejected and never re-targets it automatically. A version that
later passes its health window is forgotten here (:func:`forget`).

Bounded: the newest :data:`MAX_PER_NAME` records of a name, :data:`MAX_RECORDS` in all (a full
ledger drops the oldest record of the name holding the most, so a flood of refusals under other
names cannot push out a model's real rejection); reasons cut to :data:`MAX_REASON_CHARS`; the file
read at most :data:`MAX_FILE_BYTES`. Everything above :class:`RejectedLedger` is pure.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from device_agent.errors import StoreError
from edgepack_core.fsutil import atomic_write
from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.protocol.rejected import MAX_REJECTED, RejectedRef
from edgepack_core.protocol.rejected import REJECTION_STAGES as STAGES
from edgepack_core.versions import VERSION_PATTERN

log = logging.getLogger("edgepack.agent.store")

FILE_NAME = "rejected.json"
MAX_PER_NAME = 32
MAX_RECORDS = 128
MAX_REASON_CHARS = 300
MAX_IN_STATE = MAX_REJECTED  # records the published state carries (the newest)
MAX_FILE_BYTES = 256 * 1024
INSTALLED_STAGES = frozenset({"smoke_test", "health_window"})
_SHA_CHARS = frozenset("0123456789abcdef")
_VERSION = re.compile(VERSION_PATTERN)


RejectedVersion = RejectedRef
"""One version this device refused to keep: the protocol's own record (the state message carries
it as is). ``sha256`` is the artifact's (the .edgepkg the command named), the key the fleet server
marks; ``stage`` one of :data:`STAGES`."""


def record(name: str, version: str, sha256: str, stage: str, reason: str, ts: float) -> RejectedVersion:
    """A record with its reason cut to the bound; ValueError for a field no record may hold. Pure."""
    found = _parse_record(
        {
            "name": name,
            "version": version,
            "sha256": sha256,
            "stage": stage,
            "reason": reason[:MAX_REASON_CHARS],
            "ts": ts,
        }
    )
    if found is None:
        raise ValueError(f"not a rejected-version record: {name[:80]!r} {version[:80]!r} {stage!r}")
    return found


def _is_sha(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and set(value) <= _SHA_CHARS


def _parse_record(doc: Any) -> RejectedVersion | None:
    """One record from its JSON form, or None when any field is missing or out of bounds. Pure."""
    if not isinstance(doc, Mapping):
        return None
    name, version, sha, stage, reason, ts = (doc.get(k) for k in ("name", "version", "sha256", "stage", "reason", "ts"))
    if not (
        is_valid_id(name)
        and isinstance(version, str)
        and len(version) <= 128
        and _VERSION.match(version)
        and _is_sha(sha)
        and stage in STAGES
    ):
        return None
    if not isinstance(reason, str) or isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts >= 0:
        return None
    return RejectedVersion(str(name), version, str(sha), str(stage), reason[:MAX_REASON_CHARS], float(ts))


def add(records: Iterable[RejectedVersion], new: RejectedVersion) -> tuple[RejectedVersion, ...]:
    """``records`` with ``new`` appended (replacing an older record of the same artifact, name and
    version), then bounded: :data:`MAX_PER_NAME` per name and :data:`MAX_RECORDS` in all, dropping
    the oldest of the name that holds the most. Oldest first. Pure."""
    kept = [r for r in records if (r.name, r.version, r.sha256) != (new.name, new.version, new.sha256)]
    kept.append(new)
    return _bounded(kept)


def _bounded(records: list[RejectedVersion]) -> tuple[RejectedVersion, ...]:
    kept = sorted(records, key=lambda r: r.ts)
    while True:
        per_name = Counter(r.name for r in kept)
        name, held = per_name.most_common(1)[0] if per_name else ("", 0)
        if held <= MAX_PER_NAME and len(kept) <= MAX_RECORDS:
            return tuple(kept)
        kept.remove(next(r for r in kept if r.name == name))


def forget(records: Iterable[RejectedVersion], name: str, version: str) -> tuple[RejectedVersion, ...]:
    """``records`` without those of ``name`` ``version``: it passed its health window. Pure."""
    return tuple(r for r in records if (r.name, r.version) != (name, version))


def find(records: Iterable[RejectedVersion], name: str, version: str) -> RejectedVersion | None:
    """The newest record of ``name`` ``version`` from a stage after installation (smoke test,
    health window), or None. Pure. Only those speak about a model the store can hold: an
    artifact refused at admission was never extracted, and the same version may be installed
    and sound (a deploy of the previous version without ``force_downgrade`` is refused, and
    that must not make the previous version unfit to roll back to)."""
    found = [r for r in records if (r.name, r.version) == (name, version) and r.stage in INSTALLED_STAGES]
    return found[-1] if found else None


def for_state(records: Iterable[RejectedVersion]) -> list[dict[str, Any]]:
    """The newest :data:`MAX_IN_STATE` records as the state message carries them, newest first. Pure."""
    newest = sorted(records, key=lambda r: r.ts, reverse=True)[:MAX_IN_STATE]
    return [r.to_json() for r in newest]


def parse(data: bytes) -> tuple[tuple[RejectedVersion, ...], str | None]:
    """``rejected.json`` bytes into (records, problem). A damaged file yields no records and says
    why (the agent logs it and starts a new ledger); invalid entries are skipped. Pure."""
    if len(data) > MAX_FILE_BYTES:
        return (), f"{FILE_NAME} is larger than {MAX_FILE_BYTES} bytes"
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return (), f"{FILE_NAME} is not JSON"
    entries = doc.get("rejected") if isinstance(doc, dict) else None
    if not isinstance(entries, list):
        return (), f"{FILE_NAME} holds no list of rejected versions"
    parsed = [_parse_record(entry) for entry in entries[: MAX_RECORDS * 2]]
    return _bounded([r for r in parsed if r is not None]), None


def encode(records: Iterable[RejectedVersion]) -> bytes:
    """The file's bytes. Pure."""
    return json.dumps({"rejected": [r.to_json() for r in records]}).encode() + b"\n"


class RejectedLedger:
    """The records of one store, in memory and in ``<store>/rejected.json``.

    Read once at start; every change is written atomically before it is visible to readers. A
    medium that refuses the write raises :class:`StoreError` and the change is kept in memory
    (published, and used by rollbacks and admission) until the agent stops.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self.problem: str | None = None
        self._records = self._read()

    def _read(self) -> tuple[RejectedVersion, ...]:
        try:
            with open(self.path, "rb") as handle:
                data = handle.read(MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return ()
        except OSError as err:
            self.problem = f"{FILE_NAME} is unreadable ({err.strerror or err})"
            log.error("store: %s; starting with no rejected versions", self.problem)
            return ()
        records, self.problem = parse(data)
        if self.problem:
            log.error("store: %s; starting with no rejected versions", self.problem)
        return records

    def records(self) -> tuple[RejectedVersion, ...]:
        return self._records

    def find(self, name: str, version: str) -> RejectedVersion | None:
        return find(self._records, name, version)

    def add(self, new: RejectedVersion) -> None:
        with self._lock:
            self._records = add(self._records, new)
            self._write()

    def forget(self, name: str, version: str) -> None:
        with self._lock:
            if not any((r.name, r.version) == (name, version) for r in self._records):
                return
            self._records = forget(self._records, name, version)
            self._write()

    def _write(self) -> None:
        try:
            atomic_write(self.path, encode(self._records))
        except OSError as err:
            raise StoreError(
                f"{FILE_NAME} cannot be written ({err.strerror or err}); kept in memory until the agent stops"
            ) from err
