"""How the host tools reach the broker: one set of connection options (address, credentials,
TLS, topic root) for ``edgepack deploy``, ``edgepack device`` and ``edgepack fleet``.

Why one place: an operator sets up credentials once (flags or ``EDGEPACK_MQTT_*`` variables)
and every command logs in the same way, through the one shared client
(:class:`~edgepack_core.mqtt_transport.MqttTransport`). A broker that refuses the login is
reported as such at once, instead of retrying until a timeout that reads like a network
problem. The password comes from a file or the environment, never from the command line,
where other users could read it in the process list.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from edgepack_core.mqtt_settings import MqttSettings, TlsSettings
from edgepack_core.mqtt_transport import MqttTransport
from edgepack_core.protocol.topics import DEFAULT_ROOT, validate_root
from sdk.errors import BrokerOptionError

MAX_PASSWORD_FILE_BYTES = 4096

# Host tools turn connection failures into one error line (``connect_or_raise``); without a
# handler, Python's last-resort handler would print the transport's own warnings as a second,
# unformatted copy. Whoever configures logging (-v, an embedding program) still gets them.
logging.getLogger("edgepack.mqtt").addHandler(logging.NullHandler())


def parse_broker(text: str) -> tuple[str, int]:
    """``HOST:PORT`` into its parts; :class:`BrokerOptionError` for anything else."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BrokerOptionError(f"the broker address must be HOST:PORT, got {text!r}")
    return host, int(port)


def read_password_file(path: Path) -> str:
    """The password in ``path``: its first line, without the line end. Bounded and non-empty."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_PASSWORD_FILE_BYTES + 1)
    except OSError as err:
        raise BrokerOptionError(f"cannot read the password file {path}: {err.strerror or err}") from err
    if len(data) > MAX_PASSWORD_FILE_BYTES:
        raise BrokerOptionError(f"the password file {path} is over {MAX_PASSWORD_FILE_BYTES} bytes")
    try:
        password = data.decode("utf-8").splitlines()[0] if data.strip() else ""
    except UnicodeDecodeError as cause:
        raise BrokerOptionError(f"the password file {path} is not UTF-8 text") from cause
    if not password:
        raise BrokerOptionError(f"the password file {path} is empty")
    return password


@dataclass(frozen=True)
class BrokerOptions:
    """Where and how a host tool connects. ``tls`` None means plain TCP."""

    address: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: TlsSettings | None = None
    topic_root: str = DEFAULT_ROOT
    protocol: str = "5"
    connect_timeout: float = 10.0

    def __post_init__(self) -> None:
        parse_broker(self.address)
        validate_root(self.topic_root)
        if self.password is not None and self.username is None:
            raise BrokerOptionError("a broker password was given without a user name")
        if self.tls is not None and (self.tls.cert is None) != (self.tls.key is None):
            raise BrokerOptionError("a TLS client certificate needs its key, and the key its certificate")

    @classmethod
    def build(cls, address: str, *, username: str | None = None, password: str | None = None,
              password_file: Path | None = None, tls: bool = False, tls_ca: Path | None = None,
              tls_cert: Path | None = None, tls_key: Path | None = None,
              topic_root: str = DEFAULT_ROOT) -> BrokerOptions:
        """Options from what a user typed: a password file wins over a password; any TLS file
        turns TLS on (``tls`` alone uses the system's CA store)."""
        if password_file is not None:
            password = read_password_file(password_file)
        use_tls = tls or any(p is not None for p in (tls_ca, tls_cert, tls_key))
        tls_settings = TlsSettings(ca=_path(tls_ca), cert=_path(tls_cert), key=_path(tls_key)) if use_tls else None
        return cls(address, username=username or None, password=password or None, tls=tls_settings,
                   topic_root=topic_root)

    def settings(self, client_prefix: str) -> MqttSettings:
        """Client settings with a fresh client id (two tools at once must not kick each other off)."""
        host, port = parse_broker(self.address)
        return MqttSettings(host=host, port=port, client_id=f"{client_prefix}-{uuid.uuid4().hex[:10]}",
                            username=self.username, password=self.password, tls=self.tls,
                            topic_root=self.topic_root, protocol=self.protocol,  # type: ignore[arg-type]
                            reconnect_min=0.2, reconnect_max=5.0)

    def connect(self, client_prefix: str) -> MqttTransport:
        """A started, connected transport; raises ``BrokerLoginRefused`` / ``BrokerUnreachable``
        (closing the transport first) when the broker says no or does not answer."""
        transport = MqttTransport(self.settings(client_prefix))
        try:
            transport.connect_or_raise(self.connect_timeout)
        except BaseException:
            transport.close(timeout=0.5)
            raise
        return transport


def _path(path: Path | None) -> str | None:
    return None if path is None else str(path)
