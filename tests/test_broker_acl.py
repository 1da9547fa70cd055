"""The shipped broker config and per-device ACL (deploy/mosquitto), on a real mosquitto.

mosquitto runs with deploy/mosquitto/mosquitto.conf itself (port and paths swapped for temporary
ones) and deploy/mosquitto/acl unchanged, so what is tested is what ships. Devices pi-07 (group
kitchen) and pi-08 (group lobby) and the operator are the users that ACL names.
"""

from __future__ import annotations

import getpass
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from device_agent.telemetry.outbox import Forwarder, Outbox
from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.topics import Topics
from tests.broker import Broker, free_port, start_mosquitto, wait_until

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "mosquitto"
TOPICS = Topics()
USERS = {"pi-07": "pw-07", "pi-08": "pw-08", "operator": "pw-operator"}


class Inbox:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.messages: list[tuple[str, bytes]] = []

    def __call__(self, message: Incoming) -> None:
        with self._lock:
            self.messages.append((message.topic, message.payload))

    def payloads(self) -> list[bytes]:
        with self._lock:
            return [payload for _, payload in self.messages]


def shipped_config(port: int, workdir: Path) -> str:
    """deploy/mosquitto/mosquitto.conf with its port and file locations moved into ``workdir``."""
    text = (DEPLOY / "mosquitto.conf").read_text()
    replacements = {
        "listener 1883\n": f"listener {port} 127.0.0.1\n",
        "/etc/mosquitto/edgepack/passwd": str(workdir / "passwd"),
        "/etc/mosquitto/edgepack/acl": str(DEPLOY / "acl"),
        "persistence_location /var/lib/mosquitto/": f"persistence_location {workdir}/",
    }
    for old, new in replacements.items():
        assert old in text, f"deploy/mosquitto/mosquitto.conf no longer contains {old!r}"
        text = text.replace(old, new)
    # As root, mosquitto would switch to user "mosquitto", which cannot read a temp dir.
    return text + f"\nuser {getpass.getuser()}\n"


@pytest.fixture
def secured_broker(tmp_path: Path) -> Iterator[Broker]:
    workdir = tmp_path / "broker"
    workdir.mkdir()
    passwd = workdir / "passwd"
    for index, (user, password) in enumerate(USERS.items()):
        create = ["-c"] if index == 0 else []
        subprocess.run(["mosquitto_passwd", *create, "-b", str(passwd), user, password],
                       check=True, capture_output=True, stdin=subprocess.DEVNULL)
    port = free_port()
    broker = start_mosquitto(config=shipped_config(port, workdir), port=port, workdir=workdir)
    try:
        yield broker
    finally:
        broker.kill()


def login(broker: Broker, user: str, *, password: str | None = None, protocol: str = "5") -> MqttTransport:
    return MqttTransport(broker.settings(client_id=f"{user}-client", username=user,
                                         password=USERS[user] if password is None else password, protocol=protocol))


def up(transport: MqttTransport, *filters: str) -> MqttTransport:
    transport.start()
    assert transport.wait_connected(5), transport.last_error
    assert wait_until(lambda: all(transport.is_subscribed(f) for f in filters)), filters
    return transport


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_device_cannot_publish_on_or_read_another_devices_topics(secured_broker: Broker, protocol: str) -> None:
    operator_inbox, a_inbox, b_inbox = Inbox(), Inbox(), Inbox()
    operator = login(secured_broker, "operator", protocol=protocol)
    operator.subscribe(TOPICS.everything(), 1, operator_inbox)
    device_a = login(secured_broker, "pi-07", protocol=protocol)
    # A tries to listen to B's commands and to the whole tree; the broker filters on delivery.
    device_a.subscribe(TOPICS.cmd("pi-08"), 1, a_inbox)
    device_a.subscribe(TOPICS.everything(), 1, a_inbox)
    device_b = login(secured_broker, "pi-08", protocol=protocol)
    device_b.subscribe(TOPICS.cmd("pi-08"), 1, b_inbox)
    transports = [operator, device_a, device_b]
    try:
        up(operator, TOPICS.everything())
        up(device_a)
        up(device_b, TOPICS.cmd("pi-08"))

        # A forges B's telemetry and a command to B; mosquitto refuses both.
        refused: list[bool] = []
        device_a.publish(TOPICS.telemetry("pi-08"), b"forged telemetry", qos=1, on_done=refused.append)
        device_a.publish(TOPICS.cmd("pi-08"), b"forged command", qos=1, on_done=refused.append)
        if protocol == "5":  # MQTT 5 says so in the PUBACK (and mosquitto then drops the connection)
            assert wait_until(lambda: refused == [False, False]), refused
        # A's own telemetry goes through (after A's reconnect, if the broker dropped it).
        assert wait_until(lambda: device_a.connected, timeout=5)
        device_a.publish(TOPICS.telemetry("pi-07"), b"own telemetry", qos=1)
        assert wait_until(lambda: b"own telemetry" in operator_inbox.payloads(), timeout=5)

        # The operator commands B, then A: each device receives its own command only.
        assert wait_until(lambda: device_a.connected and device_a.is_subscribed(TOPICS.everything()))
        operator.publish(TOPICS.cmd("pi-08"), b"for B", qos=1)
        operator.publish(TOPICS.cmd("pi-07"), b"for A", qos=1)
        assert wait_until(lambda: b"for A" in a_inbox.payloads())
        assert wait_until(lambda: b"for B" in b_inbox.payloads())

        assert b"forged telemetry" not in operator_inbox.payloads()
        assert b"forged command" not in operator_inbox.payloads() + b_inbox.payloads()
        assert b"for B" not in a_inbox.payloads()
        assert b"own telemetry" not in a_inbox.payloads()  # A may not even read its own telemetry back
        assert set(a_inbox.payloads()) == {b"for A"}
    finally:
        for transport in transports:
            transport.close()


def test_a_device_publishes_its_own_pipeline_events_and_cannot_forge_another_devices(secured_broker: Broker
                                                                                     ) -> None:
    inbox = Inbox()
    operator = login(secured_broker, "operator")
    operator.subscribe(TOPICS.everything(), 1, inbox)
    device = login(secured_broker, "pi-07")
    try:
        up(operator, TOPICS.everything())
        up(device)
        device.publish(TOPICS.events("pi-08"), b"forged event", qos=1)
        device.publish(TOPICS.events("pi-07"), b"own event", qos=1)
        assert wait_until(lambda: b"own event" in inbox.payloads(), timeout=5)
        assert b"forged event" not in inbox.payloads()
    finally:
        operator.close()
        device.close()


def test_group_commands_reach_only_members(secured_broker: Broker) -> None:
    kitchen, lobby = TOPICS.group_cmd("kitchen"), TOPICS.group_cmd("lobby")
    a_inbox, b_inbox = Inbox(), Inbox()
    device_a, device_b = login(secured_broker, "pi-07"), login(secured_broker, "pi-08")
    for device, inbox in ((device_a, a_inbox), (device_b, b_inbox)):
        device.subscribe(kitchen, 1, inbox)
        device.subscribe(lobby, 1, inbox)
    operator = login(secured_broker, "operator")
    try:
        up(device_a, kitchen, lobby)
        up(device_b, kitchen, lobby)
        up(operator)
        operator.publish(kitchen, b"kitchen job", qos=1)
        operator.publish(lobby, b"lobby job", qos=1)
        assert wait_until(lambda: a_inbox.payloads() == [b"kitchen job"] and b_inbox.payloads() == [b"lobby job"])
        # A device cannot command its own group either.
        refused: list[bool] = []
        device_a.publish(kitchen, b"self-issued", qos=1, on_done=refused.append)
        assert wait_until(lambda: refused == [False])
        operator.publish(lobby, b"marker", qos=1)
        assert wait_until(lambda: b"marker" in b_inbox.payloads())
        assert b"self-issued" not in a_inbox.payloads() + b_inbox.payloads()
    finally:
        for transport in (device_a, device_b, operator):
            transport.close()


@pytest.mark.parametrize(("user", "password"), [("pi-07", "wrong"), ("stranger", "x"), (None, None)])
def test_unknown_or_anonymous_clients_are_refused(secured_broker: Broker, user: str | None,
                                                  password: str | None) -> None:
    transport = MqttTransport(secured_broker.settings(client_id="intruder", username=user, password=password))
    transport.start()
    try:
        assert wait_until(lambda: transport.last_error is not None and "not authori" in transport.last_error.lower())
        assert not transport.connected
    finally:
        transport.close()


def test_outbox_counts_a_message_the_broker_refuses_and_moves_on(secured_broker: Broker, tmp_path: Path) -> None:
    operator_inbox = Inbox()
    operator = login(secured_broker, "operator")
    operator.subscribe(TOPICS.everything(), 1, operator_inbox)
    device = login(secured_broker, "pi-07")
    outbox = Outbox(tmp_path / "outbox.db")
    forwarder = Forwarder(outbox, device, window=1)
    try:
        up(operator, TOPICS.everything())
        up(device)
        forwarder.start()
        outbox.put(TOPICS.job("pi-08"), b"misrouted", 1, "job")  # not this device's topic
        outbox.put(TOPICS.job("pi-07"), b"job result", 1, "job")
        assert wait_until(lambda: outbox.counters()["queued"] == 0, timeout=10), outbox.counters()
        counters = outbox.counters()
        assert (counters["delivered"], counters["refused"], counters["dropped_by_kind"]["job"]) == (1, 1, 1)
        assert wait_until(lambda: b"job result" in operator_inbox.payloads())
        assert b"misrouted" not in operator_inbox.payloads()
    finally:
        forwarder.stop()
        device.close()
        operator.close()


def _burst_received_by_an_offline_consumer(broker: Broker, count: int) -> tuple[int, int]:
    """Device pi-07 publishes ``count`` QoS 1 messages while the operator's persistent session is
    offline; return (messages the broker acknowledged, messages the operator then receives)."""
    received: list[bytes] = []
    topic = TOPICS.telemetry("pi-07")

    def consumer() -> MqttTransport:
        transport = MqttTransport(broker.settings(client_id="fleet-consumer", username="operator",
                                                  password=USERS["operator"], session_expiry=600))
        transport.subscribe(topic, 1, lambda message: received.append(message.payload))
        return transport

    first = up(consumer(), topic)
    first.close()
    acks: list[bool] = []

    def publish(payloads: list[bytes]) -> None:
        device = MqttTransport(broker.settings(client_id="pi-07", username="pi-07", password=USERS["pi-07"],
                                               max_queued=len(payloads)))
        try:
            up(device)
            for payload in payloads:
                assert device.publish(topic, payload, qos=1, on_done=acks.append)
            assert wait_until(lambda: len(acks) == len(payloads), timeout=20)
        finally:
            device.close()

    publish([b"%d" % index for index in range(count)])
    burst = sum(acks)
    again = up(consumer())
    try:
        # A marker published now lands behind whatever the broker kept (it moved up to 20 of them
        # in flight on reconnect, so the queue has room): when it arrives, the queue is drained.
        acks.clear()
        publish([b"end"])
        assert wait_until(lambda: b"end" in received, timeout=20)
        return burst, len(received) - 1
    finally:
        again.close()


def test_shipped_queue_limits_keep_a_burst_that_mosquittos_default_drops(tmp_path: Path) -> None:
    results = {}
    for name, extra in (("shipped", ""), ("mosquitto default", "max_queued_messages 1000\n")):
        workdir = tmp_path / name.replace(" ", "-")
        workdir.mkdir()
        subprocess.run(["mosquitto_passwd", "-c", "-b", str(workdir / "passwd"), "operator", USERS["operator"]],
                       check=True, capture_output=True, stdin=subprocess.DEVNULL)
        subprocess.run(["mosquitto_passwd", "-b", str(workdir / "passwd"), "pi-07", USERS["pi-07"]],
                       check=True, capture_output=True, stdin=subprocess.DEVNULL)
        port = free_port()
        broker = start_mosquitto(extra, config=shipped_config(port, workdir), port=port, workdir=workdir)
        try:
            results[name] = _burst_received_by_an_offline_consumer(broker, 1500)
        finally:
            broker.kill()
    assert results["shipped"] == (1500, 1500)
    acked, received = results["mosquitto default"]
    assert acked == 1500 and received == 1000  # every message acknowledged, a third silently gone


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_device_publishing_a_command_to_itself_is_refused(secured_broker: Broker, protocol: str) -> None:
    """A device account (or whoever took its password) must not command the device, even itself."""
    operator_inbox, own_inbox = Inbox(), Inbox()
    operator = login(secured_broker, "operator", protocol=protocol)
    operator.subscribe(TOPICS.everything(), 1, operator_inbox)
    device = login(secured_broker, "pi-07", protocol=protocol)
    device.subscribe(TOPICS.cmd("pi-07"), 1, own_inbox)
    try:
        up(operator, TOPICS.everything())
        up(device, TOPICS.cmd("pi-07"))
        operator.publish(TOPICS.cmd("pi-07"), b"real command", qos=1)
        assert wait_until(lambda: b"real command" in own_inbox.payloads())
        refused: list[bool] = []
        device.publish(TOPICS.cmd("pi-07"), b"self command", qos=1, on_done=refused.append)
        if protocol == "5":
            assert wait_until(lambda: refused == [False]), refused
        assert wait_until(lambda: device.connected and device.is_subscribed(TOPICS.cmd("pi-07")), timeout=5)
        device.publish(TOPICS.xfer("pi-07", "t1", "data"), b"forged chunk", qos=1)
        # What a device may send; queued QoS 1, so it also arrives after a reconnect the refusal caused.
        device.publish(TOPICS.xfer("pi-07", "t1", "req"), b"chunk request", qos=1)
        device.publish(TOPICS.job("pi-07"), b"job event", qos=1)
        assert wait_until(lambda: {b"chunk request", b"job event"} <= set(operator_inbox.payloads()), timeout=10)
        assert b"self command" not in operator_inbox.payloads() + own_inbox.payloads()
        assert b"forged chunk" not in operator_inbox.payloads()
    finally:
        device.close()
        operator.close()


def test_last_will_carries_the_time_of_the_lost_connection(secured_broker: Broker, tmp_path: Path) -> None:
    """The retained offline state said "ts": 0; it must say when the lost connection was made."""
    import json
    import sys

    script = tmp_path / "agent.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {str(DEPLOY.parent.parent)!r})\n"
        "from device_agent.config import BrokerSettings\n"
        "from device_agent.telemetry.reporter import AgentStatus, TelemetryReporter, settings_from_config\n"
        f"s = settings_from_config(BrokerSettings('127.0.0.1', {secured_broker.port}, keepalive=2,"
        f" username='pi-07', password={USERS['pi-07']!r}), 'pi-07')\n"
        f"r = TelemetryReporter('pi-07', s, {str(tmp_path / 'o.db')!r}, AgentStatus, interval=0.2).start()\n"
        "r.transport.wait_connected(5); print('up', flush=True); time.sleep(60)\n"
    )
    states: list[dict] = []
    operator = login(secured_broker, "operator")
    operator.subscribe(TOPICS.state("pi-07"), 1, lambda m: states.append(json.loads(m.payload)) if m.payload else None)
    up(operator, TOPICS.state("pi-07"))
    started = time.time()
    agent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert agent.stdout is not None and agent.stdout.readline().strip() == "up"
        assert wait_until(lambda: any(s.get("status") == "online" for s in states), timeout=10)
        agent.kill()
        killed = time.time()
        agent.wait(5)
        assert wait_until(lambda: states[-1].get("status") == "offline", timeout=15), states
        will = states[-1]
        assert "last will" in will["reason"]
        assert started <= will["ts"] <= killed
    finally:
        agent.kill()
        operator.close()


def test_the_operator_can_clear_a_decommissioned_devices_retained_state_and_a_device_cannot(
        secured_broker: Broker) -> None:
    """Issue 24: the documented empty retained payload could not be sent by the shipped operator
    ACL (RC:135), so a decommissioned device stayed on the broker. Another device still cannot."""
    device_a = up(login(secured_broker, "pi-07"))
    device_b = login(secured_broker, "pi-08")
    operator = login(secured_broker, "operator")
    try:
        device_a.publish(TOPICS.state("pi-07"), b'{"status": "online"}', qos=1, retain=True)
        up(device_b)
        refused: list[bool] = []
        device_b.publish(TOPICS.state("pi-07"), b"", qos=1, retain=True, on_done=refused.append)
        assert wait_until(lambda: refused == [False]), refused
        inbox = Inbox()
        operator.subscribe(TOPICS.state("pi-07"), 1, inbox)
        up(operator, TOPICS.state("pi-07"))
        assert wait_until(lambda: inbox.payloads() == [b'{"status": "online"}'])  # B's clear did nothing
        accepted: list[bool] = []
        operator.publish(TOPICS.state("pi-07"), b"", qos=1, retain=True, on_done=accepted.append)
        assert wait_until(lambda: accepted == [True]), accepted
        operator.close()  # the checker logs in under the same client id
        late = Inbox()
        checker = login(secured_broker, "operator")
        checker.subscribe(TOPICS.state("pi-07"), 1, late)
        checker.subscribe(TOPICS.cmd("pi-07"), 1, late)
        up(checker, TOPICS.state("pi-07"), TOPICS.cmd("pi-07"))
        checker.publish(TOPICS.cmd("pi-07"), b"marker", qos=1)  # arrives after anything retained
        assert wait_until(lambda: b"marker" in late.payloads())
        assert late.payloads() == [b"marker"]  # nothing retained any more
        checker.close()
    finally:
        for transport in (device_a, device_b, operator):
            transport.close()
