"""The device's answer to a signed ``fetch-logs`` command: the records it asks for from the log
ring (``device_agent/logring.py``), published on ``{root}/dev/{d}/logs`` in numbered chunks of
at most 64 KiB (:func:`edgepack_core.protocol.logs.chunk_records`), the last one marked; the
command's job ends ``done`` naming how many records and chunks were sent, or ``failed`` with
the reason (over the rate limit: when to retry; no ring; the broker would not take a chunk).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from device_agent.logring import LogRing, LogSettings
from device_agent.updates import jobs as J
from device_agent.updates.log_rate import Bucket, Rate, take
from edgepack_core.protocol.logs import chunk_records
from edgepack_core.protocol.topics import Topics

log = logging.getLogger("edgepack.agent.logs")

DEFAULT_LINES = 1000


@dataclass(frozen=True)
class Answer:
    """The job state a fetch ends in, its reason and the facts for the job event's detail."""

    state: str
    reason: str
    detail: dict[str, Any]


class LogFetcher:
    """Answers fetches for one device; the bucket is its only state (the network thread's)."""

    def __init__(self, ring: LogRing | None, transport: Any, topics: Topics, device_id: str,
                 settings: LogSettings, now: float) -> None:
        self.ring, self.transport, self.topics, self.device_id = ring, transport, topics, device_id
        self.rate = Rate(float(settings.fetch_burst), settings.fetch_per_minute / 60.0)
        self.bucket: Bucket = self.rate.full(now)

    def answer(self, command_id: str, body: dict[str, Any], now: float) -> Answer:
        if self.ring is None:
            return Answer(J.FAILED, "this agent keeps no log ring (it runs without edgepack-agent run)", {})
        self.bucket, wait_s = take(self.bucket, self.rate, now)
        if wait_s:
            why = (f"log fetch refused: over the limit of {self.rate.burst:g} at once and "
                   f"{self.rate.per_s * 60:g} a minute; retry in {wait_s:.1f} s")
            return Answer(J.FAILED, why, {"retry_in_s": round(wait_s, 3)})
        records = self.ring.query(since=body.get("since"), level=body.get("level", "debug"),
                                  lines=int(body.get("lines", DEFAULT_LINES)))
        chunks = chunk_records(records, device=self.device_id, request=command_id, now=now)
        topic = self.topics.logs(self.device_id)
        for number, payload in enumerate(chunks):
            if not self.transport.publish(topic, payload, qos=1):
                return Answer(J.FAILED, f"log chunk {number} of {len(chunks)} not taken by the MQTT client "
                                        "(disconnected and its queue is full)", {"chunks_sent": number})
        newest = records[-1].ts if records else None
        return Answer(J.DONE, f"sent {len(records)} log records in {len(chunks)} chunks",
                      {"records": len(records), "chunks": len(chunks), "newest": newest})
