"""The signed ``renew-certificate`` command: a new key and certificate before the old one expires.

The fleet server sends it (signed by the operator key, with a one-time renewal token) once the
device's certificate is past two thirds of its life. On a thread of its own (the MQTT network
thread only dispatches), the agent makes a new key and CSR, redeems the token at the server it
enrolled with (agent.yaml ``enrollment.server``, over HTTPS with ``enrollment.ca``), replaces the
identity file (certificate and key in one file: one rename swaps both) and the CA bundle
atomically, reloads them into the MQTT connection and reconnects with them. The old certificate
stays valid until it expires, so no reconnect fails in between; a renewal that fails changes
nothing and is answered ``failed`` with the reason (the server sends another once the token
expired).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from device_agent.config import AgentConfig
from device_agent.errors import EnrollError
from device_agent.updates import jobs as J
from edgepack_core.errors import EdgepackError
from edgepack_core.fsutil import atomic_write
from edgepack_core.protocol.commands import Command

log = logging.getLogger("edgepack.agent.renewal")

Reply = Callable[[Command, str, str], None]


def renewal_problem(config: AgentConfig) -> str:
    """Why this device cannot renew its certificate ("" when it can): no ``enrollment`` section,
    or TLS files not laid out as ``edgepack-agent enroll`` writes them. Pure."""
    if config.enrollment is None:
        return "agent.yaml has no enrollment section: enroll with edgepack-agent enroll to renew certificates"
    tls = config.mqtt.tls if config.mqtt is not None else None
    if tls is None or tls.cert is None or tls.key != tls.cert:
        return "mqtt.tls.cert and mqtt.tls.key must name one file, as edgepack-agent enroll writes them"
    return ""


def renew(config: AgentConfig, token: str) -> float:
    """Fetch a new certificate for a new key and swap the files; returns its expiry."""
    from device_agent.enroll import request_certificate  # cryptography: only when a renewal comes

    assert config.enrollment is not None and config.mqtt is not None and config.mqtt.tls is not None
    tls = config.mqtt.tls
    credentials, identity = request_certificate(config.enrollment.server, token, config.device_id, config.enrollment.ca)
    if tls.ca is not None:
        atomic_write(Path(tls.ca), credentials.ca.encode(), mode=0o644)
    atomic_write(Path(str(tls.cert)), identity, mode=0o600)
    from cryptography import x509

    return x509.load_pem_x509_certificate(identity).not_valid_after_utc.timestamp()


def start(config: AgentConfig, transport: Any, command: Command, reply: Reply) -> None:
    """Renew on a thread of its own; ``reply(command, state, reason)`` answers the command."""
    problem = renewal_problem(config)
    if problem:
        reply(command, J.FAILED, problem)
        return

    def run() -> None:
        try:
            expires = renew(config, str(command.body["token"]))
            transport.reload_tls()
        except (EnrollError, EdgepackError, OSError) as err:
            log.warning("certificate renewal failed: %s", err)
            reply(command, J.FAILED, f"certificate renewal failed: {err}")
            return
        until = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(expires))
        log.info("certificate renewed, valid until %s; reconnecting with it", until)
        reply(command, J.DONE, f"certificate renewed, valid until {until}")

    threading.Thread(target=run, name="certificate-renewal", daemon=True).start()
