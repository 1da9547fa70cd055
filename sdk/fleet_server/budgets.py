"""Per-device budgets of the ingest: token buckets and a bounded ledger of drops. Pure (the
caller passes the time), thread-safe where the MQTT network threads share them.

Why per device: the broker's ACL lets a device publish only on its own topics, so the device of
a topic is who pays. One device flooding job events or telemetry uses up its own bucket and
its excess is dropped (counted, with the reason) before it costs the queue, the writer or a
row; every other device keeps its own budget.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass

MAX_TRACKED_DEVICES = 100_000
"""Buckets kept at most (least recently used evicted: an evicted device starts full again)."""
MAX_LEDGER_DEVICES = 10_000
"""Devices with their own drop counts at most; beyond, drops are counted under ``(other)``."""
OTHER = "(other)"


@dataclass(frozen=True)
class Rate:
    """``per_s`` tokens a second, at most ``burst`` saved up."""

    per_s: float
    burst: float

    def __post_init__(self) -> None:
        if not (self.per_s > 0 and self.burst >= 1):  # (NaN fails both)
            raise ValueError(f"a rate needs per_s > 0 and burst >= 1, got {self.per_s!r}/{self.burst!r}")


def parse_rate(text: str, what: str = "rate") -> Rate:
    """``PER_S/BURST`` (``10/200``) into a :class:`Rate`; :class:`ValueError` naming the form."""
    per_s, sep, burst = text.strip().partition("/")
    try:
        if not sep:
            raise ValueError
        rate = Rate(float(per_s), float(burst))
    except ValueError as err:
        raise ValueError(f"{what} {text!r} must be PER_SECOND/BURST with per second above 0 and a burst of at "
                         "least 1 (e.g. 10/200)") from err
    if not (rate.per_s <= 1e6 and rate.burst <= 1e9):
        raise ValueError(f"{what} {text!r}: at most 1000000 a second and a burst of 1000000000")
    return rate


@dataclass(frozen=True)
class IngestLimits:
    """The per-device budgets of the ingest (docs/fleet-server.md, "Per-device budgets")."""

    job: Rate = Rate(10.0, 200.0)
    state: Rate = Rate(10.0, 200.0)
    telemetry: Rate = Rate(20.0, 2000.0)
    command: Rate = Rate(1.0, 20.0)  # per cmd topic: what the ingest audits of commands it did not send


class Buckets:
    """One token bucket per device for one kind of message."""

    def __init__(self, rate: Rate, max_devices: int = MAX_TRACKED_DEVICES) -> None:
        self.rate = rate
        self.max_devices = max_devices
        self._state: OrderedDict[str, tuple[float, float]] = OrderedDict()  # device: (tokens, at)
        self._lock = threading.Lock()

    def allow(self, device: str, now: float) -> bool:
        """Take one token of ``device``'s bucket; False (nothing taken) when it is empty."""
        with self._lock:
            tokens, at = self._state.pop(device, (self.rate.burst, now))
            tokens = min(self.rate.burst, tokens + max(0.0, now - at) * self.rate.per_s)
            allowed = tokens >= 1.0
            self._state[device] = (tokens - 1.0 if allowed else tokens, now)
            if len(self._state) > self.max_devices:
                self._state.popitem(last=False)
            return allowed


class DropLedger:
    """Drops by device and reason, bounded to :data:`MAX_LEDGER_DEVICES` devices."""

    def __init__(self, max_devices: int = MAX_LEDGER_DEVICES) -> None:
        self.max_devices = max_devices
        self._by_device: dict[str, Counter[str]] = {}
        self._lock = threading.Lock()

    def add(self, device: str, reason: str, count: int = 1) -> None:
        with self._lock:
            key = device if device in self._by_device or len(self._by_device) < self.max_devices else OTHER
            self._by_device.setdefault(key, Counter())[reason] += count

    def top(self, limit: int = 50) -> dict[str, dict[str, int]]:
        """The ``limit`` devices with the most drops, each with its drops by reason."""
        with self._lock:
            ranked = sorted(self._by_device.items(), key=lambda item: (-sum(item[1].values()), item[0]))
            return {device: dict(reasons) for device, reasons in ranked[:limit]}

    def of(self, device: str) -> dict[str, int]:
        with self._lock:
            return dict(self._by_device.get(device, {}))
