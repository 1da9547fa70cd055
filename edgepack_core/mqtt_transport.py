"""A paho-mqtt 2.x client with the connection policy Edgepack needs, on its own network thread.

Why a wrapper and not paho's ``loop_start()``: the agent must never block on the network, yet it
needs things paho's threaded loop does not give:

- reconnects with exponential backoff *and jitter* (paho doubles a fixed delay, so after a
  broker restart a whole fleet comes back in lock-step); the schedule is :func:`backoff_delay`,
  a pure function, and this module's own thread drives ``reconnect()`` / ``loop()`` with it;
- subscriptions that are remembered and re-issued after every (re)connect, so a broker restart
  without persistence does not silently leave the device deaf to its commands;
- TCP_NODELAY on the client socket: with Nagle's algorithm on, a QoS 1 request/response pays
  the 40 ms delayed-ACK timer on every exchange (tools/bench/mqtt_rtt.py measures it);
- handler exceptions and oversized incoming payloads are logged and contained, never fatal
  to the network thread;
- publish completion (PUBACK) reported per message, which the outbox needs to count a message
  as delivered only once the broker has it.

The one MQTT client of the project: the agent, ``edgepack deploy``, ``edgepack device`` and
``edgepack fleet`` all use it (it lives in the shared core for that reason; paho-mqtt is a
base dependency). Host tools call :meth:`MqttTransport.connect_or_raise` to turn "the broker
refused the login" and "the broker cannot be reached" into errors at start-up, while the agent
simply keeps retrying in the background.

Writes always happen on the network thread: the client registers an (empty)
``on_socket_register_write`` hook, which tells paho to queue a packet and wake the loop through
its socket pair instead of writing on the caller's thread.
"""

from __future__ import annotations

import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edgepack_core.errors import (  # the broker errors are named here too (re-exported)
    BrokerConnectError,
    BrokerLoginRefused,
    BrokerTlsError,
    BrokerUnreachable,
    InvalidPublishError,
    MqttSettingsError,
    UsageError,
)
from edgepack_core.mqtt_settings import MqttSettings, Payload, backoff_delay, encode_payload
from edgepack_core.mqtt_tls import TlsDiagnosis

log = logging.getLogger("edgepack.mqtt")

# Room for the fixed header, a topic of up to 64 KiB and v5 properties on top of the payload
# limit, when the limit is announced to the broker as MQTT 5's Maximum Packet Size.
_PACKET_OVERHEAD = 65536 + 1024
_MAX_PACKET = 268435455  # the largest remaining length MQTT can encode

PublishCallback = Callable[[bool], None]


# CONNACK reason codes (MQTT 5 numbering; paho maps the 3.1.1 return codes 4 and 5 onto them).
_LOGIN_REFUSED = frozenset({134, 135})  # bad user name or password, not authorized


@dataclass(frozen=True)
class Incoming:
    """One received message as handed to a subscription handler. ``mid`` and ``generation``
    (which connection delivered it) are what :meth:`MqttTransport.ack` needs."""

    topic: str
    payload: bytes
    qos: int
    retain: bool
    mid: int = 0
    generation: int = 0


Handler = Callable[[Incoming], None]


def _filter_for_matching(topic_filter: str) -> str:
    """The part of a filter incoming topics are matched against (``$share/<g>/`` stripped)."""
    if topic_filter.startswith("$share/"):
        parts = topic_filter.split("/", 2)
        return parts[2] if len(parts) == 3 else topic_filter
    return topic_filter


def _check_filter(topic_filter: str) -> None:
    """Refuse a filter the broker would reject (and paho would raise on, in the network thread)."""
    levels = _filter_for_matching(topic_filter).split("/")
    for index, level in enumerate(levels):
        if ("#" in level and (level != "#" or index != len(levels) - 1)) or ("+" in level and level != "+"):
            raise UsageError(f"invalid topic filter {topic_filter!r}: '+' and '#' must fill a level, '#' only last")
    if not topic_filter or (topic_filter.startswith("$share/") and topic_filter.count("/") < 2):
        raise UsageError(f"invalid topic filter {topic_filter!r}")


@dataclass
class _Subscription:
    qos: int
    handler: Handler
    match: str
    identifier: int


class MqttTransport:
    """One MQTT connection on a background thread. Call :meth:`start`, then use it freely from
    any thread; nothing here blocks on the network except :meth:`close` (bounded by a timeout).

    Hooks and handlers run on the network thread: keep them short and hand work to a queue.
    """

    def __init__(self, settings: MqttSettings) -> None:
        self.settings = settings
        self._rng = random.Random()
        self._lock = threading.Lock()  # subscriptions, connection flag, publish bookkeeping
        self._subscriptions: dict[str, _Subscription] = {}
        self._next_identifier = 0  # MQTT 5 subscription identifiers, one per subscribe() call
        self._active: set[str] = set()
        self._suback_pending: dict[int, str] = {}
        # mid -> (qos, callback) of every publish paho accepted, until its acknowledgement.
        self._pending_acks: dict[int, tuple[int, PublishCallback | None]] = {}
        self._early_acks: dict[int, bool] = {}
        self._connected_hooks: list[Callable[[], None]] = []
        self._disconnected_hooks: list[Callable[[], None]] = []
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = 0
        self._generation = 0  # counts successful connects; an ack from an older connection is void
        self.dropped_incoming = 0
        self.last_error: str | None = None
        self.refused: str | None = None  # the last CONNACK failure reason, until a connect succeeds
        self._answered = threading.Event()  # any CONNACK, success or failure
        self._refused_code: int | None = None
        self._tls = TlsDiagnosis(settings.host, settings.port, tls=settings.tls is not None,
                                 timeout=settings.connect_timeout)  # names TLS failures (mqtt_tls.py)
        self._client = self._make_client()

    # ------------------------------------------------------------------ setup

    def _make_client(self) -> mqtt.Client:
        s = self.settings
        v5 = s.protocol == "5"
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=s.client_id,
            clean_session=None if v5 else s.session_expiry == 0,
            protocol=MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311,
        )
        # paho re-raises callback exceptions unless told not to, which would end our thread.
        client.suppress_exceptions = True
        client.manual_ack_set(s.manual_ack)
        client.max_inflight_messages_set(s.max_inflight)
        client.max_queued_messages_set(s.max_queued)
        client.connect_timeout = s.connect_timeout
        if s.username is not None:
            client.username_pw_set(s.username, s.password)
        if s.tls is not None:
            try:  # loads the files now, so a wrong path fails at start-up, not on every reconnect
                client.tls_set(
                    ca_certs=s.tls.ca, certfile=s.tls.cert, keyfile=s.tls.key,
                    cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT,
                )
            except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
                raise MqttSettingsError("tls", f"cannot load the TLS files: {err}") from err
            client.tls_insecure_set(s.tls.insecure)
        self._set_will(client)
        client.on_socket_open = self._on_socket_open
        client.on_socket_register_write = self._keep_writes_on_network_thread
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        properties = None
        if v5:
            properties = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]  # paho leaves __init__ unannotated
            properties.MaximumPacketSize = min(_MAX_PACKET, s.max_incoming_bytes + _PACKET_OVERHEAD)
            if s.session_expiry:
                properties.SessionExpiryInterval = s.session_expiry
        # connect_async only records where to connect; our thread opens the socket.
        client.connect_async(
            s.host, s.port, keepalive=s.keepalive,
            clean_start=s.session_expiry == 0 if v5 else mqtt.MQTT_CLEAN_START_FIRST_ONLY,
            properties=properties,
        )
        return client

    def _set_will(self, client: mqtt.Client) -> None:
        will = self.settings.will
        if will is not None:
            client.will_set(will.topic, will.encoded(), will.qos, will.retain)

    def start(self) -> MqttTransport:
        """Start the network thread; it connects (and reconnects) in the background."""
        if self._thread is not None:
            raise UsageError("MqttTransport.start() called twice")
        self._thread = threading.Thread(
            target=self._run, name=f"mqtt-{self.settings.client_id or 'client'}", daemon=True
        )
        self._thread.start()
        return self

    def __enter__(self) -> MqttTransport:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ public API

    @property
    def connected(self) -> bool:
        """True between a successful CONNACK and the loss of the connection."""
        return self._connected.is_set()

    def wait_connected(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds for a connection (start-up and tests only)."""
        return self._connected.wait(timeout)

    def connect_or_raise(self, timeout: float = 10.0) -> None:
        """Start if needed and wait for the broker's answer: return once connected, raise
        :class:`BrokerLoginRefused` when the broker says no to the credentials (retrying would
        only repeat that), :class:`BrokerUnreachable` when nothing answers within ``timeout``."""
        if self._thread is None:
            self.start()
        address = f"{self.settings.host}:{self.settings.port}"
        deadline = time.monotonic() + timeout
        while not self._connected.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                detail = f": {self.last_error}" if self.last_error else ""
                raise BrokerUnreachable(f"cannot reach the broker at {address}{detail}")
            self._answered.wait(min(remaining, 0.5))
            self._answered.clear()
            if self._tls.problem is not None and not self._connected.is_set():
                raise BrokerTlsError(self._tls.problem)
            refused = self.refused
            if refused is not None and not self._connected.is_set():
                if self._refused_code in _LOGIN_REFUSED:
                    raise BrokerLoginRefused(address, refused)
                raise BrokerConnectError(f"the broker at {address} refused the connection: {refused}")

    @property
    def tcp_nodelay_active(self) -> bool | None:
        """Whether the live socket has TCP_NODELAY set; None while there is no socket."""
        sock = self._client.socket()
        if not isinstance(sock, socket.socket):  # None, or a websocket wrapper without socket options
            return None
        try:
            return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        except OSError:
            return None

    def reload_tls(self) -> None:
        """Load the TLS client certificate, key and CA files again and reconnect with them (a
        certificate renewal replaced the files): the next connection uses the new certificate,
        and until then the current one stays up. paho keeps its SSL context private and lets it
        be set once, so the context it holds is reloaded in place."""
        tls = self.settings.tls
        context = getattr(self._client, "_ssl_context", None)
        if tls is None or context is None:
            raise MqttSettingsError("tls", "this connection does not use TLS: nothing to reload")
        try:
            if tls.cert is not None:
                context.load_cert_chain(tls.cert, tls.key)
            if tls.ca is not None:
                context.load_verify_locations(tls.ca)
        except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
            raise MqttSettingsError("tls", f"cannot load the TLS files: {err}") from err
        self._client.disconnect()  # the network thread reconnects, with the reloaded files

    def on_connected(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after every successful (re)connect, once subscriptions are re-issued
        (the place to publish a retained "online" birth message)."""
        with self._lock:
            self._connected_hooks.append(hook)

    def on_disconnected(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` whenever an established connection is lost or closed."""
        with self._lock:
            self._disconnected_hooks.append(hook)

    def is_subscribed(self, topic_filter: str) -> bool:
        """True once the broker granted the subscription on the current connection."""
        with self._lock:
            return topic_filter in self._active

    def publish(
        self,
        topic: str,
        payload: Payload,
        qos: int = 1,
        retain: bool = False,
        *,
        on_done: PublishCallback | None = None,
    ) -> bool:
        """Queue a message; never blocks. True if it was accepted for delivery.

        QoS>0 messages published while disconnected are kept (up to ``max_queued``) and sent on
        reconnect; QoS 0 ones are refused then. ``on_done(accepted)`` runs on the network thread
        when the broker acknowledged the message (PUBACK/PUBCOMP; for QoS 0 when it was written):
        ``accepted`` is False if an MQTT 5 broker answered with a failure reason code (e.g. not
        authorised). It is not called for a message that never got an answer (closed first).
        """
        data = encode_payload(topic, payload)
        if self._stop.is_set():
            return False  # closed: paho would queue it for a connection that never comes
        try:
            info = self._client.publish(topic, data, qos, retain)
        except ValueError as err:
            raise InvalidPublishError(topic, str(err)) from err
        kept = info.rc == MQTTErrorCode.MQTT_ERR_SUCCESS or (info.rc == MQTTErrorCode.MQTT_ERR_NO_CONN and qos > 0)
        if not kept:
            log.debug("publish to %s refused locally: %s", topic, mqtt.error_string(info.rc))
            return False
        with self._lock:
            early = self._early_acks.pop(info.mid, None)
            if early is None:
                self._pending_acks[info.mid] = (qos, on_done)
        if early is not None and on_done is not None:
            self._call_safely(on_done, early)
        return True

    def subscribe(self, topic_filter: str, qos: int, handler: Handler) -> None:
        """Subscribe now if connected, and again after every reconnect. A second call with the
        same filter replaces the handler. Shared subscriptions (``$share/<group>/<filter>``) work.

        Brokers may send one copy of a message per matching subscription. On MQTT 5 every
        subscription carries a Subscription Identifier and each copy goes only to the handler it
        was sent for, so overlapping filters each see a message once. MQTT 3.1.1 has no such
        identifier and a copy goes to every matching handler; mosquitto sends v3 clients a
        single copy, but a broker that sends one per subscription would repeat it there.
        """
        if qos not in (0, 1, 2):
            raise UsageError(f"subscription QoS {qos!r} is not 0, 1 or 2")
        _check_filter(topic_filter)
        with self._lock:
            self._next_identifier += 1
            self._subscriptions[topic_filter] = _Subscription(
                qos, handler, _filter_for_matching(topic_filter), self._next_identifier
            )
            if self._connected.is_set():
                self._send_subscribe([topic_filter])

    def unsubscribe(self, topic_filter: str) -> None:
        """Forget a subscription (and tell the broker, if connected)."""
        with self._lock:
            if self._subscriptions.pop(topic_filter, None) is None:
                return
            self._active.discard(topic_filter)
            if self._connected.is_set():
                self._client.unsubscribe(topic_filter)

    def close(
        self,
        clean_payload: Payload | None = None,
        *,
        topic: str | None = None,
        qos: int = 1,
        retain: bool = True,
        timeout: float = 2.0,
    ) -> bool:
        """Publish a final message (e.g. the retained "offline" state, to ``topic`` or else the
        will's topic), wait up to ``timeout`` for its acknowledgement, then disconnect cleanly and
        stop the thread. A clean DISCONNECT discards the last will, which is why the final state
        must be published explicitly. Returns True if the final message was acknowledged.
        """
        acknowledged = False
        if clean_payload is not None:
            target = topic or (self.settings.will.topic if self.settings.will else None)
            if target is None:
                raise UsageError("close(clean_payload=...) needs a topic when no will is configured")
            done = threading.Event()
            if self.connected and self.publish(target, clean_payload, qos, retain, on_done=lambda ok: done.set()):
                acknowledged = done.wait(timeout)
        self._stop.set()
        self._client.disconnect()  # queues DISCONNECT and wakes the loop out of select()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout + 2.0)
        return acknowledged

    # ------------------------------------------------------------------ network thread

    def _run(self) -> None:
        loop_timeout = min(1.0, self.settings.keepalive / 2)
        first = True
        broken = False  # the socket paho holds is unusable after an unexpected error
        while not self._stop.is_set():
            try:
                if broken or self._client.socket() is None:
                    if not first:
                        delay = backoff_delay(
                            self._failures, self.settings.reconnect_min, self.settings.reconnect_max, self._rng.random()
                        )
                        self._failures += 1
                        if self._stop.wait(delay):
                            break
                    first = False
                    try:
                        if callable(getattr(self.settings.will, "payload", None)):
                            self._set_will(self._client)  # a fresh timestamp for this connection
                        self._client.reconnect()  # closes any old socket first
                    except OSError as err:  # refused, unreachable, DNS, TLS handshake, timeout
                        self.last_error = self._tls.connect_error(err)
                        log.info("%s", self.last_error)
                        if self._tls.problem is not None:
                            self._answered.set()
                        continue
                    broken = False
                self._client.loop(loop_timeout)
            except Exception:  # a paho bug must not end the thread that keeps the device reachable
                log.exception("MQTT network loop error; reconnecting")
                broken = True
                self._mark_lost()
        self._finish()

    def _finish(self) -> None:
        """Send DISCONNECT if still connected and let the loop flush it, bounded in time."""
        deadline = time.monotonic() + 2.0
        if self._client.socket() is not None:
            self._client.disconnect()
        while self._client.socket() is not None and time.monotonic() < deadline:
            self._client.loop(0.1)
        sock = self._client.socket()
        if sock is not None:  # the broker did not take the DISCONNECT in time; the client is done
            sock.close()
        self._mark_lost()

    def _mark_lost(self) -> None:
        """The connection is gone (paho's on_disconnect, an internal error, or close)."""
        with self._lock:
            was_connected = self._connected.is_set()
            self._connected.clear()
            self._active.clear()
            self._suback_pending.clear()
            # paho discards unsent QoS 0 messages on reconnect and never reports them.
            self._pending_acks = {mid: entry for mid, entry in self._pending_acks.items() if entry[0] > 0}
            hooks = list(self._disconnected_hooks)
        if was_connected:
            self._run_hooks(hooks)

    # ------------------------------------------------------------------ paho callbacks (network thread)

    def _keep_writes_on_network_thread(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        """Registered only so paho never writes on a publishing thread (see module docstring)."""

    def _on_socket_open(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1 if self.settings.tcp_nodelay else 0)
        except (OSError, AttributeError) as err:  # e.g. a unix socket or a websocket wrapper
            log.debug("cannot set TCP_NODELAY: %s", err)

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, properties: Any) -> None:
        if reason.is_failure:
            self.last_error = f"broker refused the connection: {reason}"
            self._refused_code = reason.value
            self.refused = str(reason)
            self._answered.set()
            log.warning("%s", self.last_error)
            return
        self._failures = 0
        self.last_error = None
        self.refused = None
        self._tls.connected()
        with self._lock:
            self._generation += 1
            self._connected.set()
            self._active.clear()
            if self._subscriptions:
                self._send_subscribe(list(self._subscriptions))
            hooks = list(self._connected_hooks)
        log.info("connected to %s:%s", self.settings.host, self.settings.port)
        self._answered.set()
        self._run_hooks(hooks)

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: Any, reason: ReasonCode, properties: Any
    ) -> None:
        if self._connected.is_set():
            log.info("disconnected from %s:%s: %s", self.settings.host, self.settings.port, reason)
        elif self.refused is None and self._tls.closed_before_connack():
            self.last_error = self._tls.problem
            self._answered.set()
        self._mark_lost()

    def _send_subscribe(self, filters: list[str]) -> None:
        """Issue SUBSCRIBE for ``filters`` (caller holds ``self._lock``)."""
        for topic_filter in filters:
            subscription = self._subscriptions[topic_filter]
            properties = None
            if self.settings.protocol == "5":
                properties = Properties(PacketTypes.SUBSCRIBE)  # type: ignore[no-untyped-call]  # as in _connect
                properties.SubscriptionIdentifier = subscription.identifier
            rc, mid = self._client.subscribe(topic_filter, subscription.qos, properties=properties)
            if rc == MQTTErrorCode.MQTT_ERR_SUCCESS and mid is not None:
                self._suback_pending[mid] = topic_filter

    def _on_subscribe(
        self, client: mqtt.Client, userdata: Any, mid: int, reasons: list[ReasonCode], properties: Any
    ) -> None:
        with self._lock:
            topic_filter = self._suback_pending.pop(mid, None)
            if topic_filter is None or not reasons:
                return
            if reasons[0].is_failure:
                log.warning("broker refused subscription to %s: %s", topic_filter, reasons[0])
            elif topic_filter in self._subscriptions:
                self._active.add(topic_filter)

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason: ReasonCode, properties: Any) -> None:
        accepted = not reason.is_failure
        if not accepted:
            log.warning("broker refused message %d: %s", mid, reason)
        with self._lock:
            if mid in self._pending_acks:
                callback = self._pending_acks.pop(mid)[1]
            else:  # acknowledged before publish() got to record the mid
                self._early_acks[mid] = accepted
                return
        if callback is not None:
            self._call_safely(callback, accepted)

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            size = len(message.payload)
            topic = message.topic
            if size > self.settings.max_incoming_bytes:
                self.dropped_incoming += 1
                log.warning("dropped %d-byte message on %s: over max_incoming_bytes (%d)",
                            size, topic, self.settings.max_incoming_bytes)
                self._ack_dropped(message)
                return
            with self._lock:
                subscriptions = list(self._subscriptions.values())
                generation = self._generation
            incoming = Incoming(topic, bytes(message.payload), message.qos, bool(message.retain), message.mid,
                                generation)
            identifiers = getattr(message.properties, "SubscriptionIdentifier", None) or []
            if identifiers:
                handlers = [sub.handler for sub in subscriptions if sub.identifier in identifiers]
            else:
                handlers = [sub.handler for sub in subscriptions if mqtt.topic_matches_sub(sub.match, topic)]
        except Exception:  # e.g. a topic that is not UTF-8
            log.exception("dropped an undecodable incoming message")
            self._ack_dropped(message)
            return
        if not handlers:
            self._ack_dropped(message)
        for handler in handlers:
            if not self._call_safely(handler, incoming):
                self.ack(incoming)  # a handler that raised will not ack: never leave the broker waiting

    def ack(self, message: Incoming) -> bool:
        """Acknowledge ``message`` (with ``manual_ack``; a no-op otherwise, and for QoS 0); True if
        an acknowledgement was sent. An ack for a message of an earlier connection is dropped: the
        broker redelivers it anyway, under a new packet id that the old one must not hit. Acks must
        follow the order the messages arrived in (MQTT 4.6)."""
        if not self.settings.manual_ack or message.qos == 0:
            return False
        with self._lock:
            current = message.generation == self._generation and self._connected.is_set()
        if current:
            self._client.ack(message.mid, message.qos)
        return current

    def _ack_dropped(self, message: mqtt.MQTTMessage) -> None:
        if self.settings.manual_ack and message.qos > 0:
            self._client.ack(message.mid, message.qos)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _call_safely(function: Callable[..., None], *args: Any) -> bool:
        try:
            function(*args)
        except Exception:
            log.exception("MQTT handler %r failed", function)
            return False
        return True

    def _run_hooks(self, hooks: list[Callable[[], None]]) -> None:
        for hook in hooks:
            self._call_safely(hook)
