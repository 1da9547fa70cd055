"""The MQTT steps the host's commands share: publish and wait for the broker's PUBACK, listen
for job events (after the broker granted the subscription), build and sign a command.

Why wait for PUBACK: "sent" must mean "the broker has it", or a tool that exits right after
publishing can lose the command; and an MQTT 5 broker that refuses the publish (its ACL)
says so in the PUBACK, which becomes an error here instead of a silent timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from edgepack_core.command_auth import sign_command
from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.commands import build_command, encode_command
from edgepack_core.protocol.messages import JobEvent, parse_job_event
from edgepack_core.protocol.topics import Topics
from edgepack_core.signing import SigningKey
from sdk.errors import DeployError

log = logging.getLogger("edgepack.deploy")


def make_command(command_type: str, *, device: str | None = None, group: str | None = None,
                 operator_key: SigningKey | None = None, **fields: Any) -> dict[str, Any]:
    """A validated command for one device or group, signed when an operator key is given."""
    command = build_command(command_type, device=device, group=group, **fields)
    return sign_command(command, operator_key) if operator_key is not None else command


def publish_acknowledged(transport: MqttTransport, messages: Sequence[tuple[str, bytes]], timeout: float) -> None:
    """Publish every (topic, payload) at QoS 1 and return once the broker acknowledged all of
    them; :class:`DeployError` if it refused one or did not answer within ``timeout``."""
    done = threading.Semaphore(0)
    refused: list[str] = []

    def on_done(topic: str) -> Callable[[bool], None]:
        def callback(accepted: bool) -> None:
            if not accepted:
                refused.append(topic)
            done.release()
        return callback

    for topic, payload in messages:
        if not transport.publish(topic, payload, qos=1, on_done=on_done(topic)):
            raise DeployError(f"could not queue the message for {topic}")
    deadline = time.monotonic() + timeout
    for _ in messages:
        if not done.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise DeployError(f"the broker did not acknowledge the command within {timeout:g} s")
    if refused:
        raise DeployError(f"the broker refused the command on {refused[0]} (is this user allowed to send "
                          "commands?)")


def command_messages(topics: Topics, commands: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, bytes]]:
    """(topic, wire bytes) for (topic, command) pairs: each command encoded once, bounded."""
    return [(topic, encode_command(command)) for topic, command in commands]


def listen_for_jobs(transport: MqttTransport, topic_filter: str, topics: Topics,
                    on_event: Callable[[JobEvent], None], timeout: float = 10.0) -> None:
    """Subscribe ``on_event`` to job events and wait until the broker granted the subscription
    (a command sent before that could be answered before anyone listens). Events are parsed by
    :func:`~edgepack_core.protocol.messages.parse_job_event`; what it refuses is logged and
    dropped."""

    def handler(message: Incoming) -> None:
        parsed = topics.parse(message.topic)
        if parsed is None or parsed.kind != "job" or parsed.device is None:
            return
        event = parse_job_event(parsed.device, message.payload)
        if isinstance(event, str):
            log.debug("dropped a job event on %s: %s", parsed.device, event)
            return
        on_event(event)

    transport.subscribe(topic_filter, 1, handler)
    deadline = time.monotonic() + timeout
    while not transport.is_subscribed(topic_filter):
        if time.monotonic() > deadline:
            raise DeployError(f"the broker did not grant the subscription to {topic_filter} within {timeout:g} s")
        time.sleep(0.005)
