"""Replay protection: every state-changing command id the agent accepted is remembered until the
command expires, on disk, so a command captured off the broker cannot be run again: not after
the job journal dropped it, and not after a restart.

Memory is bounded by the expiry (a command lives at most ``MAX_LIFETIME_S``, checked by the
parser and by the signature scope) and by ``max_ids``: when full, new commands are refused
rather than old ids forgotten early.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from pathlib import Path

from device_agent.errors import AgentError
from device_agent.store import atomic_write

log = logging.getLogger("edgepack.agent.updates")

MAX_IDS = 10_000
MAX_FILE_BYTES = 2 * 1024 * 1024


class ReplayError(AgentError):
    """The id was used before, or the ledger is full or cannot be written."""


def live_ids(ids: dict[str, float], now: float) -> dict[str, float]:
    """The ids whose commands have not expired yet. Pure."""
    return {cid: expires for cid, expires in ids.items() if expires >= now}


class ReplayGuard:
    def __init__(self, path: Path, max_ids: int = MAX_IDS) -> None:
        self.path = Path(path)
        self.max_ids = max_ids
        self._lock = threading.Lock()
        self._ids = self._load()

    def _load(self) -> dict[str, float]:
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
            log.error("replay ledger %s is damaged; starting empty (the job journal still answers duplicates)",
                      self.path)
            return {}
        return {str(k): float(v) for k, v in document.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}

    def seen(self, command_id: str) -> bool:
        with self._lock:
            return command_id in self._ids

    def remember(self, command_id: str, expires_at: float, now: float) -> None:
        """Record ``command_id`` until ``expires_at``; raises ReplayError if it was seen, the
        ledger is full, or it cannot be written (the command must then not run)."""
        with self._lock:
            if command_id in self._ids:
                raise ReplayError(f"command id {command_id} was already used")
            ids = live_ids(self._ids, now)
            if len(ids) >= self.max_ids:
                raise ReplayError(f"{len(ids)} unexpired command ids are remembered, the most allowed; "
                                  "refusing new commands until some expire")
            ids[command_id] = float(expires_at)
            try:
                atomic_write(self.path, json.dumps(ids, separators=(",", ":")).encode())
            except OSError as err:
                raise ReplayError(f"cannot record the command id: {err.strerror}") from None
            self._ids = ids
