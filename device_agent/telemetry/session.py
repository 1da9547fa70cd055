"""The agent's MQTT connection counter: the mark its birth and last will carry.

The broker stores the last will at CONNECT and may publish it long after (keepalive x 1.5), after
the device reconnected, or to a server that hears it only as a retained message at its next
subscribe. Marking the birth and the will of each connection with one counter lets the fleet
server order them without trusting clocks (a Raspberry Pi has no RTC) or arrival order
(``sdk/fleet_server/liveness.py``). The counter is kept in ``<store>/mqtt_session.json`` so it
only grows across restarts; when the file is lost or unreadable a new random epoch starts, and
the server orders states of different epochs by when it heard them.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from pathlib import Path

from edgepack_core.fsutil import atomic_write
from edgepack_core.protocol.messages import SESSION_EPOCH, SessionMark

log = logging.getLogger(__name__)

MAX_COUNTER_FILE_BYTES = 4096


def _read(path: Path) -> SessionMark | None:
    """The stored mark, or None when missing, too big or malformed (a new epoch then starts)."""
    try:
        with path.open("rb") as handle:
            raw = handle.read(MAX_COUNTER_FILE_BYTES + 1)
        doc = json.loads(raw) if len(raw) <= MAX_COUNTER_FILE_BYTES else None
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    epoch, n = doc.get("epoch"), doc.get("n")
    if not isinstance(epoch, str) or not SESSION_EPOCH.fullmatch(epoch):
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2**62 - 1:
        return None
    return SessionMark(epoch, n)


class ConnectionCounter:
    """Counts connection attempts; :meth:`advance` before each CONNECT (the will is built then),
    :attr:`current` for the births and the clean stop of that connection."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._mark = _read(path) or SessionMark(secrets.token_hex(8), 0)

    @property
    def current(self) -> SessionMark:
        with self._lock:
            return self._mark

    def advance(self) -> SessionMark:
        """The next connection's mark, written before it is used so a restart never reuses it.
        When the write fails (a full disk), the counter moves to a fresh epoch kept in memory:
        the file's epoch then never sees a mark the file does not cover, so a restart that reads
        it still counts above everything the server saw of that epoch."""
        with self._lock:
            mark = SessionMark(self._mark.epoch, self._mark.n + 1)
            try:
                atomic_write(self.path, json.dumps(mark.to_json()).encode(), mode=0o600)
            except OSError as err:
                log.warning("could not record the MQTT connection counter in %s: %s", self.path, err)
                mark = SessionMark(secrets.token_hex(8), 1)
            self._mark = mark
            return mark
