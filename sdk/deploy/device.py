"""``edgepack device``: one command to one device, and its answer.

The command is built by the shared protocol builder (validated as the device would), signed
with an operator key when one is given (rollback and cancel change what a device runs, so a
device with ``operator_keys`` refuses them unsigned), and the reply is the command's final
job event.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from edgepack_core.protocol.topics import ParsedTopic, Topics
from edgepack_core.signing import SigningKey
from sdk.broker import BrokerOptions
from sdk.deploy.messaging import DeployError, command_messages, listen_for_jobs, make_command, publish_acknowledged

DEVICE_COMMAND_TTL_S = 300.0


def send_command(broker: BrokerOptions | str, device: str, command_type: str, *, root: str = "edgepack/v1",
                 timeout: float = 10.0, operator_key: SigningKey | None = None,
                 **body: Any) -> tuple[dict[str, Any], float]:
    """Send one command (ping, get-state, rollback, cancel, ...) and wait for its final job event.
    Returns (event, round-trip seconds)."""
    options = broker if isinstance(broker, BrokerOptions) else BrokerOptions(broker, topic_root=root)
    topics = Topics(options.topic_root)
    command = make_command(command_type, device=device, operator_key=operator_key, ttl_s=DEVICE_COMMAND_TTL_S,
                           **body)
    done = threading.Event()
    answer: dict[str, Any] = {}

    def on_event(parsed: ParsedTopic, event: dict[str, Any]) -> None:
        if parsed.device == device and event.get("job") == command["id"] and event.get("final") is True:
            answer.update(event)
            done.set()

    transport = options.connect("edgepack-cmd")
    try:
        listen_for_jobs(transport, topics.job(device), topics, on_event)
        started = time.perf_counter()
        publish_acknowledged(transport, command_messages(topics, [(topics.cmd(device), command)]), timeout)
        if not done.wait(max(0.0, timeout - (time.perf_counter() - started))):
            raise DeployError(f"{device} did not answer {command_type} within {timeout:g} s")
        return answer, time.perf_counter() - started
    finally:
        transport.close()
