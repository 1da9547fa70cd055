"""The broker options every host command takes (``deploy``, ``device ...``, ``fleet ...``), with
the same ``EDGEPACK_MQTT_*`` variables, turned into one :class:`~sdk.broker.BrokerOptions`.

The password is read from ``--password-file`` or ``EDGEPACK_MQTT_PASSWORD``, never from a flag
(a flag's value is visible to every user in the process list).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from sdk.broker import BrokerOptions

PASSWORD_ENV = "EDGEPACK_MQTT_PASSWORD"
_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)

_BROKER_HELP = "MQTT broker as HOST:PORT (or EDGEPACK_MQTT_BROKER)."
def _options(cert_flag: str = "--tls-cert", key_flag: str = "--tls-key") -> list[Any]:
    """The options; ``fleet serve`` names the client certificate's flags ``--broker-tls-cert`` and
    ``--broker-tls-key`` (its ``--tls-cert``/``--tls-key`` are its own HTTPS certificate)."""
    return [
        click.option("--username", envvar="EDGEPACK_MQTT_USERNAME", help="MQTT user (or EDGEPACK_MQTT_USERNAME)."),
        click.option("--password-file", type=_FILE, envvar="EDGEPACK_MQTT_PASSWORD_FILE",
                     help=f"File whose first line is the MQTT password (or EDGEPACK_MQTT_PASSWORD_FILE; "
                          f"{PASSWORD_ENV} holds the password itself)."),
        click.option("--tls", "tls", is_flag=True, envvar="EDGEPACK_MQTT_TLS",
                     help="Connect with TLS, verifying the broker against the system's CAs (implied by --tls-ca)."),
        click.option("--tls-ca", type=_FILE, envvar="EDGEPACK_MQTT_TLS_CA",
                     help="CA certificate that signed the broker's certificate (or EDGEPACK_MQTT_TLS_CA)."),
        click.option(cert_flag, "tls_cert", type=_FILE, envvar="EDGEPACK_MQTT_TLS_CERT",
                     help="Client certificate, for brokers that authenticate by certificate "
                          "(or EDGEPACK_MQTT_TLS_CERT)."),
        click.option(key_flag, "tls_key", type=_FILE, envvar="EDGEPACK_MQTT_TLS_KEY",
                     help=f"Private key of {cert_flag} (or EDGEPACK_MQTT_TLS_KEY)."),
        click.option("--topic-root", default="edgepack/v1", show_default=True, envvar="EDGEPACK_MQTT_TOPIC_ROOT",
                     help="Topic root of the fleet (or EDGEPACK_MQTT_TOPIC_ROOT)."),
    ]


def broker_options(func: Callable[..., Any] | None = None, *, required: bool = True, cert_flag: str = "--tls-cert",
                   key_flag: str = "--tls-key") -> Any:
    """Add the broker options to a click command; it receives them as ``broker: BrokerOptions``
    (None when ``required`` is False and no ``--broker`` was given, e.g. ``fleet status --server``)."""
    if func is None:
        return functools.partial(broker_options, required=required, cert_flag=cert_flag, key_flag=key_flag)

    @functools.wraps(func)
    def wrapper(*args: Any, broker_address: str | None, username: str | None, password_file: Path | None, tls: bool,
                tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None, topic_root: str,
                **kwargs: Any) -> Any:
        if broker_address is None:
            return func(*args, broker=None, **kwargs)
        if (tls_cert is None) != (tls_key is None):
            raise click.UsageError(f"{cert_flag} and {key_flag} go together")
        password = None if password_file is not None else os.environ.get(PASSWORD_ENV) or None
        if password is not None and not username:
            raise click.UsageError(f"{PASSWORD_ENV} is set but no --username (or EDGEPACK_MQTT_USERNAME)")
        broker = BrokerOptions.build(broker_address, username=username, password=password,
                                     password_file=password_file, tls=tls, tls_ca=tls_ca, tls_cert=tls_cert,
                                     tls_key=tls_key, topic_root=topic_root)
        return func(*args, broker=broker, **kwargs)

    for option in reversed(_options(cert_flag, key_flag)):
        wrapper = option(wrapper)
    return click.option("--broker", "broker_address", required=required, envvar="EDGEPACK_MQTT_BROKER",
                        help=_BROKER_HELP)(wrapper)
