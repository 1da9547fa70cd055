"""The fleet server's TLS settings and context (``fleet serve --tls-cert/--tls-key
[--tls-client-ca]``), checked at start: a key others can read, a missing or mismatched file is
one line before anything listens. No uvicorn here (server.py imports it at start-up only)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from sdk.errors import ServerConfigError


@dataclass(frozen=True)
class ServerTls:
    """The server's certificate chain and key (PEM), and the CA its clients' certificates must
    come from when mutual TLS is on."""

    cert: Path
    key: Path
    client_ca: Path | None = None


def _why(err: Exception) -> str:
    return str(getattr(err, "reason", None) or getattr(err, "strerror", None) or err)


def _check_key_mode(path: Path) -> None:
    try:
        mode = path.stat().st_mode
    except OSError as err:
        raise ServerConfigError(f"--tls-key {path}: {_why(err)}") from err
    if mode & 0o077:
        raise ServerConfigError(f"--tls-key {path} is readable by others (mode {mode & 0o777:o}); chmod 600 it")


def server_context(tls: ServerTls) -> ssl.SSLContext:
    """The server's TLS context (TLS 1.2 at least), every file checked now: one line at start."""
    _check_key_mode(tls.key)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert, tls.key)
    except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
        raise ServerConfigError(f"cannot load --tls-cert {tls.cert} with --tls-key {tls.key}: {_why(err)}") from err
    if tls.client_ca is not None:
        try:
            context.load_verify_locations(cafile=tls.client_ca)
        except (OSError, ValueError) as err:
            raise ServerConfigError(f"cannot load --tls-client-ca {tls.client_ca}: {_why(err)}") from err
        context.verify_mode = ssl.CERT_REQUIRED
    return context
