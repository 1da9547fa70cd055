"""Chunked artifact transfer over MQTT, the host's sending side: answers each device's chunk
requests (``edgepack.xfer/1``) with frames read from the file by offset.

Why ranges from the file and not the file in memory: an artifact may be hundreds of
megabytes and the operator's workstation serves many devices at once; each request names at
most 256 chunks (:data:`~edgepack_core.protocol.codec.MAX_REQUEST_CHUNKS`), so the memory
one request costs is bounded by the chunk size, whatever the artifact's size. Only the
devices of the rollout are answered.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from pathlib import Path

from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.codec import chunk_count, chunk_span, encode_chunk, parse_request
from edgepack_core.protocol.ids import validate_id
from edgepack_core.protocol.topics import Topics


class XferSender:
    """Answers chunk requests for one transfer; :meth:`close` stops it and closes the file."""

    def __init__(self, transport: MqttTransport, topics: Topics, artifact: Path, transfer_id: str,
                 chunk_size: int, devices: Iterable[str] | None = None) -> None:
        self.transport = transport
        self.topics = topics
        self.transfer_id = validate_id(transfer_id, "transfer id")
        self.chunk_size = chunk_size
        self.devices = None if devices is None else frozenset(devices)
        self._fd = os.open(artifact, os.O_RDONLY)
        self.size = os.fstat(self._fd).st_size
        self.chunks = chunk_count(self.size, chunk_size)
        self.sent = 0
        self._lock = threading.Lock()
        self._filter = f"{topics.root}/dev/+/xfer/{self.transfer_id}/req"
        transport.subscribe(self._filter, 1, self._on_request)

    def read_chunk(self, index: int) -> bytes:
        """Chunk ``index`` read from the file at its offset (``os.pread``: no shared file position)."""
        offset, length = chunk_span(index, self.size, self.chunk_size)
        with self._lock:
            if self._fd < 0:
                raise ValueError("the sender is closed")
            data = os.pread(self._fd, length, offset)
        if len(data) != length:
            raise OSError(f"the artifact shrank while being sent (chunk {index})")
        return data

    def _on_request(self, message: Incoming) -> None:
        parsed = self.topics.parse(message.topic)
        if parsed is None or parsed.device is None or parsed.rest != (self.transfer_id, "req"):
            return
        if self.devices is not None and parsed.device not in self.devices:
            return
        data_topic = self.topics.xfer(parsed.device, self.transfer_id, "data")
        for index in parse_request(message.payload, self.chunks):
            try:
                frame = encode_chunk(index, self.read_chunk(index))
            except ValueError:  # closed meanwhile
                return
            self.transport.publish(data_topic, frame, qos=1)
            self.sent += 1

    def close(self) -> None:
        self.transport.unsubscribe(self._filter)
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
