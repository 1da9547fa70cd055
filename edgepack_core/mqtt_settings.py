"""How the MQTT client connects: its settings, validated when they are made, the reconnect
backoff and the payload encoding. Pure (no socket, no thread): the policies
:mod:`edgepack_core.mqtt_transport` applies, kept apart so they are read and tested alone."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from edgepack_core.errors import InvalidPublishError, MqttSettingsError
from edgepack_core.protocol.topics import DEFAULT_ROOT, validate_root

DEFAULT_MAX_INCOMING_BYTES = 1 << 20
Payload = bytes | bytearray | str | Mapping[str, Any] | Sequence[Any]


def encode_payload(topic: str, payload: Payload) -> bytes:
    """bytes as they are, str as UTF-8, anything else as compact JSON (NaN refused: not JSON)."""
    if isinstance(payload, (bytes, bytearray)):
        return bytes(payload)
    if isinstance(payload, str):
        return payload.encode("utf-8")
    try:
        return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except (TypeError, ValueError) as err:
        raise InvalidPublishError(topic, f"payload is not JSON-serialisable: {err}") from err


def backoff_delay(attempt: int, minimum: float, maximum: float, jitter: float) -> float:
    """Seconds to wait before reconnect attempt number ``attempt`` (0 = first retry).

    The cap doubles from ``minimum`` per failed attempt up to ``maximum``; the wait is drawn
    from [cap/2, cap] ("equal jitter") with ``jitter`` in [0, 1). Half the cap is guaranteed
    so retries never hammer a broker that is down, the random half spreads a fleet that lost
    the same broker at the same moment so it does not reconnect in one burst.
    """
    if attempt < 0 or not 0.0 <= jitter <= 1.0:
        raise ValueError("attempt must be >= 0 and jitter in [0, 1]")
    cap = min(maximum, minimum * 2.0 ** min(attempt, 64))
    return cap * (0.5 + 0.5 * jitter)


@dataclass(frozen=True)
class TlsSettings:
    """TLS for the broker connection. ``ca`` None means the system's CA store; ``cert``/``key``
    are the client certificate for brokers that authenticate devices by certificate;
    ``insecure`` skips the host name check (never in production: it allows a MITM)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    insecure: bool = False


@dataclass(frozen=True)
class Will:
    """The last will the broker publishes if the connection dies without a DISCONNECT.

    ``payload`` may be a callable: it is called again before every connection attempt, so a
    will can carry the time of the connection whose loss it reports (the broker stores the
    will at CONNECT and publishes it unchanged, so that is the latest time a will can hold).
    """

    topic: str
    payload: Payload | Callable[[], Payload]
    qos: int = 1
    retain: bool = True

    def encoded(self) -> bytes:
        """The payload's bytes now (the callable's result, if it is one)."""
        payload = self.payload() if callable(self.payload) else self.payload
        return encode_payload(self.topic, payload)


@dataclass(frozen=True)
class MqttSettings:
    """Everything :class:`MqttTransport` needs to connect. Times are seconds.

    ``max_queued`` bounds paho's in-memory queue of unacknowledged QoS>0 messages (paho's
    default 0 means unlimited, which lets a long outage grow memory without bound; durable
    buffering is the outbox's job, not paho's). ``session_expiry`` > 0 asks the broker to keep
    the session (subscriptions and queued QoS 1 messages) that long after a disconnect: MQTT 5
    Session Expiry Interval with clean start off, or clean session off on 3.1.1; it needs a
    fixed ``client_id``. ``max_incoming_bytes`` drops larger incoming messages; on MQTT 5 it
    is also announced to the broker as Maximum Packet Size so they are not even sent.
    ``manual_ack`` makes the handlers' owner acknowledge each QoS 1 message itself
    (:meth:`MqttTransport.ack`), e.g. only once it is committed to a database: with a
    persistent session the broker then redelivers whatever a crash left unacknowledged.
    """

    host: str
    port: int = 1883
    keepalive: int = 30
    protocol: Literal["5", "3.1.1"] = "5"
    client_id: str = ""
    username: str | None = None
    password: str | None = None
    tls: TlsSettings | None = None
    topic_root: str = DEFAULT_ROOT
    reconnect_min: float = 0.5
    reconnect_max: float = 30.0
    will: Will | None = None
    max_inflight: int = 20
    max_queued: int = 1000
    max_incoming_bytes: int = DEFAULT_MAX_INCOMING_BYTES
    session_expiry: int = 0
    manual_ack: bool = False
    tcp_nodelay: bool = True
    connect_timeout: float = 5.0

    def __post_init__(self) -> None:
        _check_endpoint(self)
        _check_bounds(self)
        _check_session(self)


def _check_endpoint(s: MqttSettings) -> None:
    """Where and how to connect: host, port, keepalive, protocol and topic root."""
    if not isinstance(s.host, str) or not s.host:
        raise MqttSettingsError("host", "must be a non-empty host name or address")
    if not isinstance(s.port, int) or not 0 < s.port < 65536:
        raise MqttSettingsError("port", f"{s.port!r} is not a TCP port (1-65535)")
    if not isinstance(s.keepalive, int) or not 1 <= s.keepalive <= 65535:
        raise MqttSettingsError("keepalive", f"{s.keepalive!r} must be 1..65535 seconds")
    if s.protocol not in ("5", "3.1.1"):
        raise MqttSettingsError("protocol", f"{s.protocol!r} is not one of '5', '3.1.1'")
    validate_root(s.topic_root)


def _check_bounds(s: MqttSettings) -> None:
    """The explicit bounds: reconnect delays, queues, message size and connect timeout."""
    if not 0 < s.reconnect_min <= s.reconnect_max:
        raise MqttSettingsError(
            "reconnect_min",
            f"needs 0 < reconnect_min ({s.reconnect_min}) <= reconnect_max ({s.reconnect_max})",
        )
    for name in ("max_inflight", "max_queued", "max_incoming_bytes"):
        value = getattr(s, name)
        if not isinstance(value, int) or value < 1:
            raise MqttSettingsError(name, f"{value!r} must be a positive integer (an explicit bound)")
    if s.connect_timeout <= 0:
        raise MqttSettingsError("connect_timeout", "must be positive")


def _check_session(s: MqttSettings) -> None:
    """The session: its expiry and fixed client id, the login and the last will."""
    if not isinstance(s.session_expiry, int) or s.session_expiry < 0:
        raise MqttSettingsError("session_expiry", f"{s.session_expiry!r} must be >= 0 seconds")
    if s.session_expiry and not s.client_id:
        raise MqttSettingsError("client_id", "a persistent session (session_expiry > 0) needs a fixed client_id")
    if s.password is not None and s.username is None:
        raise MqttSettingsError("password", "is set without a username")
    if s.will is not None and s.will.qos not in (0, 1, 2):
        raise MqttSettingsError("will.qos", f"{s.will.qos!r} is not 0, 1 or 2")
