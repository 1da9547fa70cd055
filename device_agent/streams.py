"""Per-stream state of stateful models (inputs declared ``role: state``).

A stream is a caller-chosen id (``X-Edgepack-Stream`` over HTTP, ``stream=`` in the Python
API) under which the agent keeps the state outputs of the last call and feeds them to the next.
The table is bounded: at most ``max_streams`` streams (the least recently used one is dropped
to make room) and a stream unused for ``idle_s`` seconds is forgotten, so a client that opens
streams and walks away cannot grow the agent's memory. A stream belongs to one model: after a
swap, its next call starts again from the init state (an old model's state may not even have
the new model's shape).

Calls on one stream are serialised (a stream's state is a sequence); calls on different
streams run in parallel.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from edgepack_core.protocol.ids import validate_id

DEFAULT_MAX_STREAMS = 64
DEFAULT_STREAM_IDLE_S = 300.0

State = dict[str, np.ndarray]


@dataclass
class _Stream:
    model_sha: str
    state: State
    last_used: float
    lock: threading.Lock = field(default_factory=threading.Lock)


class StreamTable:
    """Bounded LRU table of stream states with idle expiry. ``clock`` is injectable for tests."""

    def __init__(self, max_streams: int = DEFAULT_MAX_STREAMS, idle_s: float = DEFAULT_STREAM_IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_streams < 1 or idle_s <= 0:
            raise ValueError("max_streams must be >= 1 and idle_s > 0")
        self.max_streams = max_streams
        self.idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._streams: OrderedDict[str, _Stream] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._streams)

    def __contains__(self, stream_id: object) -> bool:
        with self._lock:
            return stream_id in self._streams

    @staticmethod
    def check_id(stream_id: object) -> str:
        """The id if it is valid (edgepack_core.protocol.ids); raises InvalidNameError."""
        return validate_id(stream_id, "stream")

    def reset(self, stream_id: str) -> bool:
        """Forget a stream; True when it existed."""
        self.check_id(stream_id)
        with self._lock:
            return self._streams.pop(stream_id, None) is not None

    def _expire(self, now: float) -> None:
        while self._streams:
            oldest_id, oldest = next(iter(self._streams.items()))
            if now - oldest.last_used < self.idle_s:
                break
            del self._streams[oldest_id]

    def _entry(self, stream_id: str, model_sha: str, init: Mapping[str, np.ndarray]) -> _Stream:
        now = self._clock()
        with self._lock:
            self._expire(now)
            entry = self._streams.get(stream_id)
            if entry is None or entry.model_sha != model_sha:
                entry = _Stream(model_sha, dict(init), now)
                self._streams[stream_id] = entry
                while len(self._streams) > self.max_streams:
                    self._streams.popitem(last=False)
            entry.last_used = now
            self._streams.move_to_end(stream_id)
            return entry

    @contextmanager
    def hold(self, stream_id: str | None, model_sha: str, init: Mapping[str, np.ndarray]) -> Iterator[State]:
        """The state to feed, as a fresh dict the caller updates; kept for the stream only when
        the block ends without an error. ``stream_id`` None: the init state, kept nowhere."""
        if stream_id is None:
            yield dict(init)
            return
        entry = self._entry(self.check_id(stream_id), model_sha, init)
        with entry.lock:
            state = dict(entry.state)
            yield state
            entry.state = state
            entry.last_used = self._clock()
