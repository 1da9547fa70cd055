"""What went wrong with TLS between an MQTT client and its broker, said once and plainly.

paho reports a plain client on a TLS listener as a connection closed before its CONNACK (the
broker drops the bytes it cannot read as TLS), which :class:`~.mqtt_transport.MqttTransport`
used to report as ``cannot reach the broker``. :class:`TlsDiagnosis` tells that case apart by
probing the port once per failure streak with a TLS handshake that verifies nothing (it only
asks whether the port answers TLS), and names certificate failures with the broker's address
(``certificate verify failed: <reason> (HOST:PORT)``, edgepack_core/tls.py). Host commands raise
:class:`~.errors.BrokerTlsError` at once; the agent logs each distinct problem once as a warning
and keeps retrying with its back-off.
"""

from __future__ import annotations

import logging
import socket
import ssl

from edgepack_core.tls import tls_failure

log = logging.getLogger("edgepack.mqtt")

_CA_HINT = "; set mqtt.tls.ca (agent.yaml) or --tls-ca to the CA that signed the broker's certificate"


def port_speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` answers a TLS handshake (nothing verified, nothing sent after it)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True  # the handshake completed: the port speaks TLS
    except ssl.SSLError as err:
        return str(err.reason or "").upper() not in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE")
    except OSError:
        return False


class TlsDiagnosis:
    """The TLS problem of one client's current run of failed connects (None when there is none)."""

    def __init__(self, host: str, port: int, *, tls: bool, timeout: float) -> None:
        self.host, self.port, self.tls, self.timeout = host, port, tls, min(timeout, 5.0)
        self.problem: str | None = None
        self._probed = False
        self._logged: str | None = None

    def connect_error(self, err: OSError) -> str:
        """The line for a failed connect (TLS or not); a TLS one becomes :attr:`problem`."""
        where = f"{self.host}:{self.port}"
        line = tls_failure(err, where)
        if line is None and self.tls and isinstance(err, (ConnectionResetError, ConnectionAbortedError)):
            line = self._plain_port(where)  # mosquitto resets a TLS hello on a plain listener
        if line is None:
            return f"connect to {where} failed: {err}"
        if "local issuer" in line or "self-signed" in line or "self signed" in line:
            line += _CA_HINT
        elif "speak TLS on this port" in line:
            line = (
                f"the broker at {where} does not speak TLS on this port (TLS handshake failed): drop "
                "mqtt.tls / --tls, or use the broker's TLS port"
            )
        self._found(line)
        return line

    def _plain_port(self, where: str) -> str | None:
        """Probed once per streak: the line for a plain port a TLS client reached, or None."""
        if self._probed:
            return self.problem
        self._probed = True
        if port_speaks_tls(self.host, self.port, self.timeout):
            return None
        return f"TLS handshake failed: the other end does not speak TLS on this port ({where})"

    def closed_before_connack(self) -> bool:
        """A plain connection the broker closed without a CONNACK: whether the port speaks TLS
        (probed once until the next successful connect); sets :attr:`problem` if so."""
        if self.tls or self._probed:
            return self.problem is not None
        self._probed = True
        if port_speaks_tls(self.host, self.port, self.timeout):
            self._found(
                f"the broker port {self.host}:{self.port} seems to expect TLS (set mqtt.tls / --tls-ca); "
                "it closed a plain MQTT connection without an answer"
            )
        return self.problem is not None

    def connected(self) -> None:
        self.problem, self._probed, self._logged = None, False, None

    def _found(self, line: str) -> None:
        self.problem = line
        if line != self._logged:
            self._logged = line
            log.warning("%s", line)
