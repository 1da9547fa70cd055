"""How many ``fetch-logs`` commands a device answers: a token bucket, pure.

Why a bound at all: a fetch costs the device up to its whole ring in MQTT traffic (about
1 MiB by default), and a signed command can be sent in a loop by a script or a dashboard left
open; the excess is refused with the time to wait, not queued.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bucket:
    """``tokens`` left at time ``at`` (unix seconds)."""

    tokens: float
    at: float


@dataclass(frozen=True)
class Rate:
    """``burst`` tokens at most, refilled at ``per_s`` a second."""

    burst: float
    per_s: float

    def full(self, now: float) -> Bucket:
        return Bucket(self.burst, now)


def take(bucket: Bucket, rate: Rate, now: float) -> tuple[Bucket, float]:
    """Take one token: the bucket after, and 0.0 when it was taken, else the seconds until one
    will be there (nothing taken). A clock that went back refills nothing."""
    tokens = min(rate.burst, bucket.tokens + max(0.0, now - bucket.at) * rate.per_s)
    if tokens >= 1.0:
        return Bucket(tokens - 1.0, now), 0.0
    return Bucket(tokens, now), (1.0 - tokens) / rate.per_s
