"""Where a pipeline's events go: MQTT (through the agent's on-disk outbox), a webhook, a JSON-lines
file with rotation, and JPEG snapshots of the frame with its boxes.

Every sink is bounded and none can stop the pipeline: ``emit`` never blocks on the network (the
webhook has its own thread and a bounded queue; a full queue drops the event and counts it), a
file sink rotates at ``max_bytes`` keeping ``keep`` files, and the snapshot folder is trimmed
to ``keep`` files and ``max_bytes``, oldest first. Each sink counts what it sent and dropped.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from device_agent.pipelines.spec import SinkSpec
from edgepack_core.protocol.events import Event

log = logging.getLogger(__name__)

WEBHOOK_QUEUE = 1000
WEBHOOK_TRIES = 3
SNAPSHOT_QUALITY = 80


@dataclass
class SinkCounters:
    sent: int = 0
    dropped: int = 0
    failed: int = 0


class Sink(Protocol):
    counters: SinkCounters
    name: str

    def emit(self, event: Event, image: np.ndarray | None, boxes: Sequence[Sequence[float]]) -> Event: ...

    def close(self) -> None: ...


class MqttSink:
    """Events on ``{root}/dev/{id}/events``, QoS 1, handed to the outbox (``publish``), so an
    outage keeps them on disk like telemetry."""

    name = "mqtt"

    def __init__(self, publish: Callable[[Event], None]) -> None:
        self._publish = publish
        self.counters = SinkCounters()

    def emit(self, event: Event, image: np.ndarray | None, boxes: Sequence[Sequence[float]]) -> Event:
        try:
            self._publish(event)
            self.counters.sent += 1
        except OSError as err:  # the outbox's disk: counted, the pipeline goes on
            self.counters.failed += 1
            log.warning("event not queued for MQTT: %s", err)
        return event

    def close(self) -> None:
        return None


class FileSink:
    """JSON lines appended to ``path``; past ``max_bytes`` the file becomes ``path.1`` (and
    ``path.1`` ``path.2``..., ``keep`` files at most)."""

    name = "file"

    def __init__(self, path: Path, max_bytes: int, keep: int) -> None:
        self.path, self.max_bytes, self.keep = path, max_bytes, keep
        self.counters = SinkCounters()
        path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def emit(self, event: Event, image: np.ndarray | None, boxes: Sequence[Sequence[float]]) -> Event:
        line = event.to_payload() + b"\n"
        with self._lock:
            try:
                if self.path.exists() and self.path.stat().st_size + len(line) > self.max_bytes:
                    self._rotate()
                with open(self.path, "ab") as handle:
                    handle.write(line)
                self.counters.sent += 1
            except OSError as err:
                self.counters.failed += 1
                log.warning("event not written to %s: %s", self.path, err)
        return event

    def _rotate(self) -> None:
        for index in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{index}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{index + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))  # the oldest (.keep) was replaced above

    def close(self) -> None:
        return None


class WebhookSink:
    """POSTs each event as JSON from its own thread: a slow or dead receiver costs the pipeline
    nothing; ``WEBHOOK_TRIES`` tries per event, then it is counted as failed."""

    name = "webhook"

    def __init__(self, url: str, timeout_s: float) -> None:
        self.url, self.timeout_s = url, timeout_s
        self.counters = SinkCounters()
        self._queue: queue.Queue[Event | None] = queue.Queue(WEBHOOK_QUEUE)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="events-webhook", daemon=True)
        self._thread.start()

    def emit(self, event: Event, image: np.ndarray | None, boxes: Sequence[Sequence[float]]) -> Event:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.counters.dropped += 1
        return event

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            if self._deliver(event):
                self.counters.sent += 1
            else:
                self.counters.failed += 1

    def _deliver(self, event: Event) -> bool:
        for attempt in range(WEBHOOK_TRIES):
            if self._post(event):
                return True
            if self._stopped.wait(0.2 * 2**attempt):  # backoff; a stop ends the tries
                return False
        return False

    def _post(self, event: Event) -> bool:
        request = urllib.request.Request(self.url, data=event.to_payload(), method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                return 200 <= answer.status < 300
        except (urllib.error.URLError, OSError, ValueError) as err:
            log.debug("webhook %s: %s", self.url, err)
            return False

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._thread.join(5.0)


class SnapshotSink:
    """A JPEG of the event's frame with the boxes drawn; the event names the file. The folder
    keeps ``keep`` files and ``max_bytes`` at most, the oldest deleted first."""

    name = "snapshots"

    def __init__(self, folder: Path, max_bytes: int, keep: int) -> None:
        self.folder, self.max_bytes, self.keep = folder, max_bytes, keep
        folder.mkdir(parents=True, exist_ok=True)
        self.counters = SinkCounters()

    def emit(self, event: Event, image: np.ndarray | None, boxes: Sequence[Sequence[float]]) -> Event:
        if image is None:
            return event
        from dataclasses import replace

        from PIL import Image, ImageDraw

        name = f"{event.pipeline}-{event.seq:08d}-{event.kind}.jpg"
        picture = Image.fromarray(np.ascontiguousarray(image))
        draw = ImageDraw.Draw(picture)
        for box in boxes:
            draw.rectangle([float(v) for v in box[:4]], outline=(255, 0, 0), width=2)
        try:
            picture.save(self.folder / name, format="JPEG", quality=SNAPSHOT_QUALITY)
            self.counters.sent += 1
            self._trim()
        except OSError as err:
            self.counters.failed += 1
            log.warning("snapshot not written: %s", err)
            return event
        return replace(event, snapshot=name)

    def _trim(self) -> None:
        files = sorted(self.folder.glob("*.jpg"), key=lambda p: p.stat().st_mtime_ns)
        total = sum(p.stat().st_size for p in files)
        while files and (len(files) > self.keep or total > self.max_bytes):
            oldest = files.pop(0)
            total -= oldest.stat().st_size
            oldest.unlink()

    def close(self) -> None:
        return None


def make_sinks(specs: Sequence[SinkSpec], publish: Callable[[Event], None] | None) -> list[Sink]:
    """The sinks of a pipeline, snapshots first (so the other sinks' events name the file)."""
    sinks: list[Sink] = []
    for spec in sorted(specs, key=lambda s: s.snapshots is None):
        if spec.snapshots is not None:
            sinks.append(SnapshotSink(Path(spec.snapshots), spec.max_bytes, spec.keep))
        elif spec.file is not None:
            sinks.append(FileSink(Path(spec.file), spec.max_bytes, spec.keep))
        elif spec.webhook is not None:
            sinks.append(WebhookSink(spec.webhook, spec.timeout_s))
        elif spec.mqtt and publish is not None:
            sinks.append(MqttSink(publish))
        elif spec.mqtt:
            log.warning("an mqtt sink without mqtt: in agent.yaml: its events go nowhere")
    return sinks
