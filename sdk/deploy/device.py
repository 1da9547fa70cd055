"""``edgepack device``: one command to one device, and its answer.

The command is built by the shared protocol builder (validated as the device would), signed
with an operator key when one is given (rollback and cancel change what a device runs, so a
device with ``operator_keys`` refuses them unsigned), and the reply is the command's final
job event.

A rollback is bound to the model it undoes (``from_version``: a device serving another model
refuses it, so a rollback delivered late cannot revert a newer deploy): :func:`send_rollback`
takes it from the caller or asks the device what it serves (a ``get-state`` round trip).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from edgepack_core.errors import UsageError
from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.protocol.messages import JobEvent
from edgepack_core.protocol.topics import Topics
from edgepack_core.signing import SigningKey
from sdk.broker import BrokerOptions
from sdk.deploy.messaging import command_messages, listen_for_jobs, make_command, publish_acknowledged
from sdk.errors import DeployError

DEVICE_COMMAND_TTL_S = 300.0


def send_command(broker: BrokerOptions | str, device: str, command_type: str, *, root: str = "edgepack/v1",
                 timeout: float = 10.0, operator_key: SigningKey | None = None,
                 **body: Any) -> tuple[JobEvent, float]:
    """Send one command (ping, get-state, rollback, cancel, ...) and wait for its final job event.
    Returns (event, round-trip seconds)."""
    options = broker if isinstance(broker, BrokerOptions) else BrokerOptions(broker, topic_root=root)
    topics = Topics(options.topic_root)
    command = make_command(command_type, device=device, operator_key=operator_key, ttl_s=DEVICE_COMMAND_TTL_S,
                           **body)
    done = threading.Event()
    answers: list[JobEvent] = []

    def on_event(event: JobEvent) -> None:
        if event.device == device and event.job == command["id"] and event.final and not answers:
            answers.append(event)
            done.set()

    transport = options.connect("edgepack-cmd")
    try:
        listen_for_jobs(transport, topics.job(device), topics, on_event)
        started = time.perf_counter()
        publish_acknowledged(transport, command_messages(topics, [(topics.cmd(device), command)]), timeout)
        if not done.wait(max(0.0, timeout - (time.perf_counter() - started))):
            raise DeployError(f"{device} did not answer {command_type} within {timeout:g} s")
        return answers[0], time.perf_counter() - started
    finally:
        transport.close()


def parse_model_ref(text: str) -> dict[str, str]:
    """``NAME@VERSION`` as a rollback's ``from_version``; UsageError naming the form if not."""
    name, sep, version = text.rpartition("@")
    if not sep or not is_valid_id(name) or not version:
        raise UsageError(f"{text[:100]!r} is not a model as NAME@VERSION (e.g. digits@1.2.0)")
    return {"name": name, "version": version}


def serving_model(broker: BrokerOptions | str, device: str, *, root: str = "edgepack/v1",
                  timeout: float = 10.0, model: str | None = None) -> dict[str, str]:
    """The model ``device`` reports serving (``get-state``), as a rollback's ``from_version``:
    ``model`` when named; without a name, the only one (DeployError naming them when the device
    holds several)."""
    event, _ = send_command(broker, device, "get-state", root=root, timeout=timeout)
    detail = event.detail if event.state == "done" else {}
    active = _chosen_model(device, detail, model)
    if not isinstance(active, dict) or not active.get("name") or not active.get("version"):
        raise DeployError(f"{device} reports no model it serves ({event.state}: "
                          f"{event.reason}); name the model to roll back from")
    return {"name": str(active["name"]), "version": str(active["version"])}


def _chosen_model(device: str, detail: Mapping[str, Any], model: str | None) -> Any:
    """The get-state entry of ``model`` (None: the only model) in ``detail``. Pure."""
    held = [m for m in detail.get("models") or [] if isinstance(m, dict) and m.get("state") == "serving"]
    names = ", ".join(str(m.get("name")) for m in held) or "none"
    if model is not None:
        chosen = next((m for m in held if m.get("name") == model), None)
        if chosen is None and detail:
            raise DeployError(f"{device} serves no model {model!r} (serving: {names})")
        return chosen
    if len(held) > 1:
        raise DeployError(f"{device} serves several models ({names}): name the one to roll back (--model NAME)")
    return detail.get("active")


def send_rollback(broker: BrokerOptions | str, device: str, *, from_version: dict[str, str] | None = None,
                  root: str = "edgepack/v1", timeout: float = 10.0, operator_key: SigningKey | None = None,
                  model: str | None = None) -> tuple[JobEvent, float]:
    """Roll ``device`` back from ``from_version`` (default: the model it reports serving, or
    the one named ``model`` on a device holding several)."""
    if from_version is None:
        from_version = serving_model(broker, device, root=root, timeout=timeout, model=model)
    return send_command(broker, device, "rollback", root=root, timeout=timeout, operator_key=operator_key,
                        from_version=from_version)
