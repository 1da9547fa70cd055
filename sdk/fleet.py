"""The fleet view: every device's state and latest telemetry, built from MQTT messages.

``FleetView`` is pure: it takes (topic, payload, receive time) and answers "which devices,
online or not, running what". A device is offline when its retained state says so (its
last will, or a clean shutdown) or when nothing was heard from it for ``silence_s``.
Messages are parsed by :mod:`edgepack_core.protocol.messages` (the same parser as the fleet
server's); what it refuses is counted by reason and dropped, never raised. ``collect`` and
``stream_messages`` are the thin I/O around it, on the shared ``MqttTransport``.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.ids import validate_id
from edgepack_core.protocol.messages import (
    Decommissioned,
    DeviceState,
    ModelRef,
    Telemetry,
    parse_state,
    parse_telemetry,
)
from edgepack_core.protocol.topics import DEFAULT_ROOT, Topics
from sdk.broker import BrokerOptions
from sdk.text_safety import cell

__all__ = ["DeviceRow", "FleetView", "collect", "format_table", "stream_messages"]

log = logging.getLogger("edgepack.fleet")

MAX_DEVICES = 1_000_000


@dataclass
class DeviceRow:
    device: str
    status: str = "unknown"  # online | offline | silent | unknown
    status_reason: str = ""
    last_seen: float | None = None
    model: ModelRef | None = None
    provider: str | None = None
    profile: str | None = None
    groups: list[str] = field(default_factory=list)
    capabilities: dict[str, Any] = field(default_factory=dict)
    telemetry: Telemetry | None = None
    telemetry_count: int = 0
    last_seq: int | None = None
    seq_gaps: int = 0
    restarts: int = 0

    def to_json(self) -> dict[str, Any]:
        telemetry = self.telemetry
        return {
            "device": self.device,
            "status": self.status,
            "status_reason": self.status_reason,
            "last_seen": self.last_seen,
            "model": None if self.model is None else self.model.to_json(),
            "provider": self.provider,
            "profile": self.profile,
            "groups": self.groups,
            "latency_ms": None if telemetry is None else telemetry.latency_ms(),
            "errors": None if telemetry is None else dict(telemetry.error_kinds),
            "inferences": None if telemetry is None else {"interval": telemetry.inferences_interval,
                                                          "total": telemetry.inferences_total},
            "queue": None if telemetry is None or telemetry.queue is None else asdict(telemetry.queue),
            "telemetry_messages": self.telemetry_count,
            "telemetry_gaps": self.seq_gaps,
            "restarts_seen": self.restarts,
        }


@dataclass
class FleetView:
    """Pure aggregation of state and telemetry messages into one row per device."""

    root: str = DEFAULT_ROOT
    silence_s: float = 60.0
    devices: dict[str, DeviceRow] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._topics = Topics(self.root)

    def _drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _row(self, device: str) -> DeviceRow | None:
        row = self.devices.get(device)
        if row is None:
            if len(self.devices) >= MAX_DEVICES:
                self._drop("too_many_devices")
                return None
            row = self.devices[device] = DeviceRow(device)
        return row

    def apply(self, topic: str, payload: bytes, now: float) -> None:
        """Take one message. Never raises for bad input: counts it in ``dropped`` by the
        protocol's refusal reason (:data:`~edgepack_core.protocol.bounds.Refusal`)."""
        parsed = self._topics.parse(topic)
        if parsed is None:
            self._drop("bad_topic")
            return
        if parsed.kind not in ("state", "telemetry") or parsed.device is None:
            return
        message = (parse_state if parsed.kind == "state" else parse_telemetry)(parsed.device, payload)
        if isinstance(message, str):
            self._drop(message)
        elif isinstance(message, Decommissioned):
            self.devices.pop(message.device, None)  # retained state cleared: device decommissioned
        elif isinstance(message, DeviceState):
            self._apply_state(message, now)
        else:
            self._apply_telemetry(message, now)

    def _apply_state(self, state: DeviceState, now: float) -> None:
        row = self._row(state.device)
        if row is None:
            return
        row.status = state.status
        row.status_reason = state.reason
        row.last_seen = now
        row.model = state.model or row.model  # a last will names no model: keep what it ran
        if state.capabilities is not None:
            row.capabilities = state.capabilities_dict()
            row.profile = state.profile or row.profile
        if state.groups is not None:
            row.groups = list(state.groups)
        row.provider = state.provider or row.provider

    def _apply_telemetry(self, sample: Telemetry, now: float) -> None:
        row = self._row(sample.device)
        if row is None:
            return
        row.telemetry = sample
        row.telemetry_count += 1
        row.last_seen = now
        if row.status in ("unknown", "silent"):
            row.status = "online"
        row.model = sample.model or row.model
        row.provider = sample.provider or row.provider
        seq = sample.seq
        if seq is not None:
            if row.last_seq is not None and seq < row.last_seq:
                row.restarts += 1  # the agent restarted and began a new sequence
            elif row.last_seq is not None and seq > row.last_seq + 1:
                row.seq_gaps += seq - row.last_seq - 1
            row.last_seq = seq

    def rows(self, now: float) -> list[DeviceRow]:
        """Rows sorted by device id, with silent devices marked as such."""
        out = []
        for device in sorted(self.devices):
            row = self.devices[device]
            if row.status == "online" and row.last_seen is not None and now - row.last_seen > self.silence_s:
                row.status = "silent"
                row.status_reason = f"nothing heard for {now - row.last_seen:.0f}s"
            out.append(row)
        return out


def format_table(rows: list[DeviceRow], now: float) -> str:
    """The human table of ``edgepack fleet status``; every cell a device sent (model, provider,
    figures) escaped and cut to its column (:func:`sdk.text_safety.cell`), so a row is one line."""
    header = f"{'DEVICE':<20} {'STATUS':<8} {'MODEL':<24} {'PROVIDER':<26} {'P50 MS':>7} {'P99 MS':>7} " \
             f"{'ERRORS':>6} {'LAST SEEN':>9}"
    lines = [header]
    for row in rows:
        model = f"{row.model.name} {row.model.version}" if row.model else None
        sample = row.telemetry
        total_errors = (sample.errors_total or 0) if sample is not None else 0
        seen = f"{now - row.last_seen:.0f}s ago" if row.last_seen else "-"
        p50, p99 = (sample.latency_p50, sample.latency_p99) if sample is not None else (None, None)
        lines.append(
            f"{cell(row.device, 20):<20} {cell(row.status, 8):<8} {cell(model, 24):<24} "
            f"{cell(row.provider or None, 26):<26} {cell(p50, 32):>7} {cell(p99, 32):>7} {cell(total_errors, 32):>6} "
            f"{seen:>9}"
        )
    online = sum(1 for r in rows if r.status == "online")
    lines.append(f"{len(rows)} device(s), {online} online")
    return "\n".join(lines)


# --------------------------------------------------------------------------- I/O


def stream_messages(options: BrokerOptions, *, share: str | None = None) -> Iterator[tuple[str, bytes, float]]:
    """Yield (topic, payload, receive time) from the state and telemetry topics until closed;
    an empty topic is a tick (every 0.1 s without a message) so callers can stop on time.

    With ``share``, telemetry is read through the MQTT 5 shared subscription
    ``$share/<share>/...`` so several consumers split the load; state stays a normal
    subscription, since every consumer needs every device's retained state.
    """
    topics = Topics(options.topic_root)
    inbox: queue.Queue[tuple[str, bytes, float]] = queue.Queue(maxsize=100_000)

    def on_message(message: Incoming) -> None:
        try:
            inbox.put_nowait((message.topic, message.payload, time.time()))
        except queue.Full:
            log.warning("fleet inbox full: dropping a message")

    telemetry = topics.all_of("telemetry")
    transport = MqttTransport(options.settings("edgepack-fleet"))
    transport.subscribe(topics.all_of("state"), 1, on_message)
    transport.subscribe(f"$share/{validate_id(share, 'share')}/{telemetry}" if share else telemetry, 1, on_message)
    try:
        transport.connect_or_raise(options.connect_timeout)
        while True:
            try:
                yield inbox.get(timeout=0.1)
            except queue.Empty:
                yield ("", b"", time.time())
    finally:
        transport.close(timeout=0.5)


def collect(options: BrokerOptions, *, wait_s: float = 2.0, quiet_s: float = 0.5, silence_s: float = 60.0,
            on_tick: Callable[[FleetView], None] | None = None, share: str | None = None) -> FleetView:
    """Read the fleet for up to ``wait_s`` seconds, ending early once retained states have
    arrived and the stream has been quiet for ``quiet_s``."""
    view = FleetView(root=options.topic_root, silence_s=silence_s)
    started = last = time.time()
    for topic, payload, received in stream_messages(options, share=share):
        if topic:
            view.apply(topic, payload, received)
            last = received
        if on_tick is not None:
            on_tick(view)
        now = time.time()
        if now - started >= wait_s or (view.devices and now - last >= quiet_s):
            break
    return view
