"""Frames between a source's reader and a pipeline's inference: the typed frame and the queue
whose policy decides what happens when inference is slower than the source.

``latest`` keeps at most ``size`` frames and drops the oldest to make room, counting every drop
(a 5 FPS model on a 25 FPS camera answers the newest frame, never one from minutes ago);
``every`` blocks the reader instead (backpressure: a file or a recording is processed whole,
nothing dropped). The reader and the consumer wait on a condition, never on a sleep.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SourceFrame:
    """One decoded frame (``image``: HxWx3 uint8 RGB) or audio block (``audio``: float32
    mono samples at ``sample_rate``), numbered from the source's (re)start, with the time it was
    read (or the file's own timestamp: ``ts`` drives the rules, so a clip replays alike)."""

    index: int
    ts: float
    image: np.ndarray | None = None
    audio: np.ndarray | None = None
    sample_rate: int = 0
    read_at: float = 0.0  # time.monotonic() when the reader handed it over (frame age)


class FrameQueue:
    """A bounded hand-over from one reader to one consumer with the source's policy."""

    def __init__(self, size: int, policy: str) -> None:
        if size < 1 or policy not in ("latest", "every"):
            raise ValueError(f"a queue of {size} frames with policy {policy!r}")
        self.size, self.policy = size, policy
        self._frames: deque[SourceFrame] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.dropped = 0
        self.put_count = 0

    def put(self, frame: SourceFrame) -> bool:
        """Hand ``frame`` over; False once the queue is closed (the reader should stop)."""
        with self._cond:
            while self.policy == "every" and len(self._frames) >= self.size and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            if len(self._frames) >= self.size:
                self._frames.popleft()
                self.dropped += 1
            self._frames.append(frame)
            self.put_count += 1
            self._cond.notify_all()
            return True

    def get(self, timeout: float | None = None) -> SourceFrame | None:
        """The oldest frame held, waiting up to ``timeout``; None on timeout or once closed and empty."""
        with self._cond:
            if not self._frames and not self._closed:
                self._cond.wait(timeout)
            if not self._frames:
                return None
            frame = self._frames.popleft()
            self._cond.notify_all()
            return frame

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._frames)
