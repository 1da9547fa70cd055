"""MqttTransport against a real mosquitto: delivery, broker restart, last will, hostile payloads."""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from edgepack_core.errors import InvalidPublishError, MqttSettingsError, SchemaError, UsageError
from edgepack_core.mqtt_settings import MqttSettings, TlsSettings, Will, backoff_delay
from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.topics import Topics
from tests.broker import Broker, free_port, port_accepts, start_mosquitto, wait_until

ROOT = Path(__file__).resolve().parent.parent
TOPICS = Topics()


class Inbox:
    """Collects messages from a transport handler, thread-safely."""

    def __init__(self) -> None:
        self.messages: list[Incoming] = []
        self._lock = threading.Lock()

    def __call__(self, message: Incoming) -> None:
        with self._lock:
            self.messages.append(message)

    def payloads(self) -> list[bytes]:
        with self._lock:
            return [m.payload for m in self.messages]


def start_and_wait(transport: MqttTransport, *filters: str) -> MqttTransport:
    """Start ``transport`` and wait until it is connected and its filters are granted."""
    transport.start()
    assert transport.wait_connected(5), transport.last_error
    assert wait_until(lambda: all(transport.is_subscribed(f) for f in filters)), filters
    return transport


@contextlib.contextmanager
def connected(transport: MqttTransport, *filters: str) -> Iterator[MqttTransport]:
    """:func:`start_and_wait`, closing the transport at the end of the block."""
    try:
        yield start_and_wait(transport, *filters)
    finally:
        transport.close()


# ---------------------------------------------------------------------- pure parts


def test_backoff_doubles_up_to_the_cap_with_bounded_jitter() -> None:
    caps = [backoff_delay(n, 0.5, 30.0, 1.0) for n in range(10)]
    assert caps[:7] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert caps[7:] == [30.0, 30.0, 30.0]
    for attempt in range(12):
        low, high = backoff_delay(attempt, 0.5, 30.0, 0.0), backoff_delay(attempt, 0.5, 30.0, 1.0)
        assert low == high / 2  # at least half the cap: never hammers a broker that is down
        assert low <= backoff_delay(attempt, 0.5, 30.0, 0.37) <= high <= 30.0
    assert backoff_delay(10_000, 0.5, 30.0, 0.5) == 22.5  # no overflow for long outages
    with pytest.raises(ValueError):
        backoff_delay(-1, 0.5, 30.0, 0.5)


@pytest.mark.parametrize(("field", "value"), [
    ("port", 0), ("port", 70000), ("keepalive", 0), ("protocol", "3"), ("reconnect_min", 0.0),
    ("reconnect_min", 60.0), ("max_queued", 0), ("max_incoming_bytes", 0), ("topic_root", "a/+/b"),
    ("session_expiry", -1),
])
def test_bad_settings_are_refused_with_the_field_path(field: str, value: object) -> None:
    with pytest.raises(SchemaError) as info:
        MqttSettings(host="localhost", **{field: value})  # type: ignore[arg-type]
    assert field in str(info.value)


def test_missing_tls_files_are_a_settings_error_at_construction(tmp_path: Path) -> None:
    settings = MqttSettings(host="localhost", port=8883, tls=TlsSettings(ca=str(tmp_path / "missing-ca.pem")))
    with pytest.raises(MqttSettingsError) as info:
        MqttTransport(settings)
    assert info.value.path == "mqtt.tls"


@pytest.mark.parametrize("topic_filter", ["", "a/#/b", "a/b#", "a/+b/c", "$share/g", "$share/g/a/#/b"])
def test_invalid_filters_are_refused_before_reaching_the_network_thread(topic_filter: str) -> None:
    transport = MqttTransport(MqttSettings(host="localhost"))
    with pytest.raises(UsageError):
        transport.subscribe(topic_filter, 1, lambda message: None)


def test_a_persistent_session_needs_a_client_id() -> None:
    with pytest.raises(MqttSettingsError) as info:
        MqttSettings(host="localhost", session_expiry=60)
    assert info.value.path == "mqtt.client_id"


# ---------------------------------------------------------------------- real broker


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_publish_qos1_is_acknowledged_and_delivered_with_nodelay(mosquitto_broker: Broker, protocol: str) -> None:
    inbox = Inbox()
    consumer = MqttTransport(mosquitto_broker.settings(client_id="consumer", protocol=protocol))
    consumer.subscribe(TOPICS.all_of("telemetry"), 1, inbox)
    producer = MqttTransport(mosquitto_broker.settings(client_id="pi-07", protocol=protocol))
    with connected(consumer, TOPICS.all_of("telemetry")), connected(producer):
        assert producer.tcp_nodelay_active is True
        acks: list[bool] = []
        assert producer.publish(TOPICS.telemetry("pi-07"), {"n": 1}, qos=1, on_done=acks.append)
        assert producer.publish(TOPICS.telemetry("pi-07"), "two", qos=1, on_done=acks.append)
        assert wait_until(lambda: len(inbox.payloads()) == 2)
        assert inbox.payloads() == [b'{"n":1}', b"two"]
        assert wait_until(lambda: acks == [True, True])
        assert inbox.messages[0].topic == "edgepack/v1/dev/pi-07/telemetry" and inbox.messages[0].qos == 1
        with pytest.raises(InvalidPublishError):
            producer.publish("edgepack/v1/dev/+/cmd", b"x")  # wildcards cannot be published to
        with pytest.raises(InvalidPublishError):
            producer.publish(TOPICS.telemetry("pi-07"), {"latency": float("nan")})  # not JSON


def test_broker_restart_subscription_is_restored_on_the_same_port(mosquitto_broker: Broker) -> None:
    inbox = Inbox()
    events: list[str] = []
    device = MqttTransport(mosquitto_broker.settings(client_id="pi-07"))
    device.subscribe(TOPICS.cmd("pi-07"), 1, inbox)
    device.on_connected(lambda: events.append("up"))
    device.on_disconnected(lambda: events.append("down"))
    operator = MqttTransport(mosquitto_broker.settings(client_id="operator"))
    with connected(device, TOPICS.cmd("pi-07")), connected(operator):
        operator.publish(TOPICS.cmd("pi-07"), b"before", qos=1)
        assert wait_until(lambda: inbox.payloads() == [b"before"])

        port = mosquitto_broker.port
        mosquitto_broker.restart()  # persistence off: the broker forgot every subscription
        assert mosquitto_broker.port == port
        assert wait_until(lambda: events == ["up", "down", "up"], timeout=10), events
        assert wait_until(lambda: device.is_subscribed(TOPICS.cmd("pi-07")), timeout=5)
        assert operator.wait_connected(5)
        # The operator may still be reconnecting its own session: resend until it lands.
        assert wait_until(lambda: operator.publish(TOPICS.cmd("pi-07"), b"after", qos=1) and b"after" in
                          inbox.payloads(), timeout=10, interval=0.1)
    assert inbox.payloads()[0] == b"before"


WILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from edgepack_core.mqtt_transport import MqttTransport
    from edgepack_core.mqtt_settings import MqttSettings, Will
    port, state = int(sys.argv[1]), sys.argv[2]
    settings = MqttSettings(host="127.0.0.1", port=port, client_id="pi-07", keepalive=60,
                            will=Will(state, b"offline-will", qos=1, retain=True))
    transport = MqttTransport(settings)
    transport.on_connected(lambda: transport.publish(state, b"online", qos=1, retain=True,
                                                     on_done=lambda ok: print("online", flush=True)))
    transport.start()
    time.sleep(60)
""")


def test_last_will_is_published_when_the_agent_process_is_killed(mosquitto_broker: Broker) -> None:
    state = TOPICS.state("pi-07")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    agent = subprocess.Popen([sys.executable, "-c", WILL_SCRIPT, str(mosquitto_broker.port), state],
                             stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
    try:
        assert agent.stdout is not None
        assert agent.stdout.readline().strip() == "online"
        agent.send_signal(signal.SIGKILL)
        agent.wait(5)
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    inbox = Inbox()
    observer = MqttTransport(mosquitto_broker.settings(client_id="observer"))
    observer.subscribe(state, 1, inbox)
    with connected(observer, state):
        assert wait_until(lambda: inbox.payloads() == [b"offline-will"]), inbox.payloads()
        assert inbox.messages[0].retain  # a late subscriber (fleet status) sees it too


def test_clean_close_publishes_the_final_state_and_suppresses_the_will(mosquitto_broker: Broker) -> None:
    state = TOPICS.state("pi-07")
    inbox = Inbox()
    observer = MqttTransport(mosquitto_broker.settings(client_id="observer"))
    observer.subscribe(state, 1, inbox)
    device = MqttTransport(mosquitto_broker.settings(client_id="pi-07", will=Will(state, b"offline-will")))
    with connected(observer, state):
        start_and_wait(device)
        started = time.monotonic()
        assert device.close(b"offline-clean") is True
        assert time.monotonic() - started < 2.0
        assert not device.connected
        assert wait_until(lambda: inbox.payloads() == [b"offline-clean"])
        # The broker sends a will as it handles the disconnect, which came before this marker.
        assert observer.publish(state, b"marker", qos=1, retain=False)
        assert wait_until(lambda: b"marker" in inbox.payloads())
        assert inbox.payloads() == [b"offline-clean", b"marker"]


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_hostile_payloads_do_not_kill_the_network_thread(mosquitto_broker: Broker, protocol: str) -> None:
    parsed: list[object] = []

    def strict_json_handler(message: Incoming) -> None:
        parsed.append(json.loads(message.payload))  # raises on garbage, like a careless handler

    cmd = TOPICS.cmd("pi-07")
    device = MqttTransport(mosquitto_broker.settings(client_id="pi-07", protocol=protocol,
                                                     max_incoming_bytes=64 * 1024))
    device.subscribe(cmd, 1, strict_json_handler)
    attacker = MqttTransport(mosquitto_broker.settings(client_id="attacker", protocol=protocol))
    with connected(device, cmd), connected(attacker):
        for payload in (b"\xff\xfe\x00not json", b"", b"{" * 10_000, os.urandom(300 * 1024), b"[1, 2"):
            assert attacker.publish(cmd, payload, qos=1)
        assert attacker.publish(cmd, {"id": "c1"}, qos=1)
        assert wait_until(lambda: parsed == [{"id": "c1"}]), parsed
        assert device.connected
        if protocol == "3.1.1":
            assert device.dropped_incoming == 1  # the 300 KiB message, dropped by the transport
        else:
            assert device.dropped_incoming == 0  # MQTT 5: Maximum Packet Size made the broker drop it
        # The thread is still serving: a later command still arrives.
        assert attacker.publish(cmd, {"id": "c2"}, qos=1)
        assert wait_until(lambda: parsed == [{"id": "c1"}, {"id": "c2"}])


def test_start_never_blocks_when_the_broker_is_unreachable() -> None:
    settings = MqttSettings(host="127.0.0.1", port=free_port(), client_id="lonely", reconnect_min=0.05,
                            reconnect_max=0.2, max_queued=2)
    transport = MqttTransport(settings)
    started = time.monotonic()
    transport.start()
    assert not transport.publish("edgepack/v1/dev/lonely/telemetry", b"x", qos=0)  # QoS 0 is not kept offline
    assert transport.publish("edgepack/v1/dev/lonely/job", b"1", qos=1)  # QoS 1 waits for a connection
    assert transport.publish("edgepack/v1/dev/lonely/job", b"2", qos=1)
    assert not transport.publish("edgepack/v1/dev/lonely/job", b"3", qos=1)  # over max_queued: refused
    assert time.monotonic() - started < 0.5
    assert wait_until(lambda: transport.last_error is not None and "refused" in transport.last_error.lower())
    assert not transport.connected
    started = time.monotonic()
    transport.close(b"offline", topic="edgepack/v1/dev/lonely/state")
    assert time.monotonic() - started < 1.0


def test_shared_subscription_splits_fleet_messages_between_consumers(mosquitto_broker: Broker) -> None:
    shared = "$share/fleet/" + TOPICS.all_of("telemetry")
    first, second = Inbox(), Inbox()
    consumers = [MqttTransport(mosquitto_broker.settings(client_id=f"fleet-{i}")) for i in (1, 2)]
    consumers[0].subscribe(shared, 1, first)
    consumers[1].subscribe(shared, 1, second)
    producer = MqttTransport(mosquitto_broker.settings(client_id="pi-07"))
    with connected(consumers[0], shared), connected(consumers[1], shared), connected(producer):
        for i in range(40):
            producer.publish(TOPICS.telemetry(f"dev-{i % 4}"), str(i), qos=1)
        assert wait_until(lambda: len(first.payloads()) + len(second.payloads()) == 40)
        assert first.payloads() and second.payloads()  # both consumers got a share
        assert sorted(first.payloads() + second.payloads()) == sorted(str(i).encode() for i in range(40))


def test_persistent_session_receives_commands_sent_while_offline(mosquitto_broker: Broker) -> None:
    cmd = TOPICS.cmd("pi-07")
    operator = MqttTransport(mosquitto_broker.settings(client_id="operator"))
    with connected(operator):
        first = MqttTransport(mosquitto_broker.settings(client_id="pi-07", session_expiry=300))
        first.subscribe(cmd, 1, Inbox())
        start_and_wait(first, cmd)
        first.close()
        acks: list[bool] = []
        operator.publish(cmd, b"deploy while offline", qos=1, on_done=acks.append)
        assert wait_until(lambda: acks == [True])
        inbox = Inbox()
        again = MqttTransport(mosquitto_broker.settings(client_id="pi-07", session_expiry=300))
        again.subscribe(cmd, 1, inbox)
        with connected(again, cmd):
            assert wait_until(lambda: inbox.payloads() == [b"deploy while offline"]), inbox.payloads()


def test_overlapping_subscriptions_each_see_a_message_once(mosquitto_broker: Broker) -> None:
    everything, own_cmd = Inbox(), Inbox()
    device = MqttTransport(mosquitto_broker.settings(client_id="pi-07"))
    device.subscribe(TOPICS.everything(), 1, everything)
    device.subscribe(TOPICS.cmd("pi-07"), 1, own_cmd)
    operator = MqttTransport(mosquitto_broker.settings(client_id="operator"))
    with connected(device, TOPICS.everything(), TOPICS.cmd("pi-07")), connected(operator):
        operator.publish(TOPICS.cmd("pi-07"), b"c1", qos=1)
        operator.publish(TOPICS.telemetry("other"), b"t1", qos=1)
        # A duplicate copy would come right behind its original, so before a later marker.
        operator.publish(TOPICS.cmd("pi-07"), b"end", qos=1)
        assert wait_until(lambda: b"end" in own_cmd.payloads() and b"end" in everything.payloads())
        assert everything.payloads() == [b"c1", b"t1", b"end"]
        assert own_cmd.payloads() == [b"c1", b"end"]


def _write_ca_and_server_cert(folder: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it (PEM files)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgepack test CA")])
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .sign(ca_key, hashes.SHA256()))
    server_cert = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
                   .issuer_name(ca_name).public_key(server_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .sign(ca_key, hashes.SHA256()))
    ca_path, cert_path, key_path = folder / "ca.pem", folder / "server.pem", folder / "server.key"
    ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_path.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    return ca_path, cert_path, key_path


def test_tls_connects_with_the_right_ca_and_refuses_an_unknown_one(tmp_path: Path) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    ca, cert, key = _write_ca_and_server_cert(certs)
    other_ca = tmp_path / "other"
    other_ca.mkdir()
    wrong_ca, _, _ = _write_ca_and_server_cert(other_ca)
    tls_port = free_port()
    broker = start_mosquitto(f"listener {tls_port} 127.0.0.1\ncafile {ca}\ncertfile {cert}\nkeyfile {key}\n",
                             workdir=tmp_path / "broker")
    try:
        assert wait_until(lambda: port_accepts(tls_port))
        good = MqttTransport(MqttSettings(host="127.0.0.1", port=tls_port, client_id="pi-07",
                                          tls=TlsSettings(ca=str(ca))))
        with connected(good):
            assert good.tcp_nodelay_active is True  # set on the TLS socket too
            acks: list[bool] = []
            assert good.publish(TOPICS.telemetry("pi-07"), b"over tls", qos=1, on_done=acks.append)
            assert wait_until(lambda: acks == [True])
        impostor_check = MqttTransport(MqttSettings(host="127.0.0.1", port=tls_port, client_id="pi-08",
                                                    reconnect_min=0.05, reconnect_max=0.2,
                                                    tls=TlsSettings(ca=str(wrong_ca))))
        impostor_check.start()
        try:
            assert wait_until(lambda: impostor_check.last_error is not None
                              and "certificate verify failed" in impostor_check.last_error.lower())
            assert not impostor_check.connected
        finally:
            impostor_check.close()
    finally:
        broker.kill()
