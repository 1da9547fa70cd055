"""Chunked artifact transfer over MQTT, the device's receiving side (the frame format and the
request codec are :mod:`edgepack_core.protocol.codec`, shared with the host's sender).

Pull-based, so a device that reconnects simply asks again for what it lacks:

    device -> {root}/dev/{d}/xfer/{xid}/req    {"schema": "edgepack.xfer/1", "chunks": [i, ...]}
    host   -> {root}/dev/{d}/xfer/{xid}/data   b"EPX1" | index (uint32 BE) | sha256(chunk) | chunk

Each chunk carries its own sha256 (a corrupt chunk is dropped and asked for again); the
whole file is checked against the command's sha256 at the end, and then, like any download,
verified by signature before it is used. Progress survives a restart: chunk data is written
in place and fsynced before the list of received chunks is persisted beside it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from device_agent.errors import TransferError
from edgepack_core.fsutil import atomic_write
from edgepack_core.protocol.codec import chunk_count, decode_chunk, request_payload
from edgepack_core.protocol.topics import Topics

log = logging.getLogger("edgepack.agent.xfer")

WINDOW = 32
PERSIST_EVERY = 16


@dataclass
class XferSpec:
    id: str
    chunk_size: int
    chunks: int


class Receiver:
    """Device side: pulls every chunk of one transfer into ``target``."""

    def __init__(self, transport: Any, topics: Topics, device_id: str, spec: XferSpec, *, size: int,
                 sha256: str, target: Path) -> None:
        if spec.chunks != chunk_count(size, spec.chunk_size):
            raise TransferError(f"transfer {spec.id}: {spec.chunks} chunks of {spec.chunk_size} cannot hold "
                                f"{size} bytes")
        self.transport = transport
        self.spec = spec
        self.size = size
        self.sha256 = sha256
        self.target = target
        self.partial = target.with_name(target.name + ".part")
        self.progress_file = target.with_name(target.name + ".chunks")
        self.data_topic = topics.xfer(device_id, spec.id, "data")
        self.req_topic = topics.xfer(device_id, spec.id, "req")
        self._lock = threading.Lock()
        self._arrived = threading.Event()
        self._received: set[int] = set()
        self._unsynced = 0
        self._handle: IO[bytes] | None = None

    def _load_progress(self) -> None:
        if self.partial.exists() and self.partial.stat().st_size == self.size and self.progress_file.exists():
            try:
                saved = json.loads(self.progress_file.read_text())
                if saved.get("id") == self.spec.id:
                    self._received = {int(i) for i in saved.get("chunks", []) if 0 <= int(i) < self.spec.chunks}
            except (OSError, ValueError):
                self._received = set()
        else:
            with open(self.partial, "wb") as handle:
                handle.truncate(self.size)
            self._received = set()

    def _persist(self) -> None:
        assert self._handle is not None
        self._handle.flush()
        os.fsync(self._handle.fileno())
        atomic_write(self.progress_file, json.dumps({"id": self.spec.id, "chunks": sorted(self._received)}).encode())
        self._unsynced = 0

    def _on_data(self, message: Any) -> None:
        decoded = decode_chunk(message.payload)
        if decoded is None:
            log.warning("transfer %s: dropped a corrupt chunk", self.spec.id)
            return
        index, data = decoded
        expected = min(self.spec.chunk_size, self.size - index * self.spec.chunk_size)
        if index >= self.spec.chunks or len(data) != expected:
            log.warning("transfer %s: dropped chunk %d of wrong size", self.spec.id, index)
            return
        with self._lock:
            if index in self._received or self._handle is None:
                return
            self._handle.seek(index * self.spec.chunk_size)
            self._handle.write(data)
            self._received.add(index)
            self._unsynced += 1
            if self._unsynced >= PERSIST_EVERY:
                self._persist()
        self._arrived.set()

    def run(self, *, timeout: float, progress: Callable[[int], None] | None = None,
            cancelled: Callable[[], bool] = lambda: False) -> Path:
        """Pull all chunks, check the whole-file sha256, move into ``target``."""
        self._load_progress()
        self._handle = open(self.partial, "r+b")  # noqa: SIM115 - closed in the finally below
        self.transport.subscribe(self.data_topic, 1, self._on_data)
        deadline = time.monotonic() + timeout
        in_flight: dict[int, float] = {}
        try:
            while True:
                with self._lock:
                    missing = [i for i in range(self.spec.chunks) if i not in self._received]
                if not missing:
                    break
                if time.monotonic() > deadline or cancelled():
                    raise TransferError(f"transfer {self.spec.id}: {len(missing)} of {self.spec.chunks} chunks "
                                        "missing at the deadline")
                self._request(missing, in_flight)
                self._arrived.wait(0.5)
                self._arrived.clear()
                if progress is not None:
                    progress(len(self._received) * self.spec.chunk_size)
            with self._lock:
                self._persist()
        finally:
            self.transport.unsubscribe(self.data_topic)
            with self._lock:
                self._handle.close()
                self._handle = None
        return self._assembled()

    def _request(self, missing: list[int], in_flight: dict[int, float]) -> None:
        """Ask for the next window of missing chunks; one in flight for 3 s is lost and asked again."""
        now = time.monotonic()
        for index in list(in_flight):
            if index not in missing or now - in_flight[index] > 3.0:  # arrived, or lost: ask again
                in_flight.pop(index)
        wanted = [i for i in missing if i not in in_flight][: max(0, WINDOW - len(in_flight))]
        if wanted and self.transport.connected:
            self.transport.publish(self.req_topic, request_payload(wanted), qos=1)
            for index in wanted:
                in_flight[index] = now

    def _assembled(self) -> Path:
        """The whole file checked against the announced sha256 and moved into ``target``."""
        digest = hashlib.sha256()
        with open(self.partial, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
        if digest.hexdigest() != self.sha256:
            self.partial.unlink(missing_ok=True)
            self.progress_file.unlink(missing_ok=True)
            raise TransferError(f"transfer {self.spec.id}: the assembled file does not match the sha256")
        self.partial.replace(self.target)
        self.progress_file.unlink(missing_ok=True)
        return self.target
