"""TLS failures as one line, and what the first bytes of a connection speak (pure).

Shared by the fleet server (a plain HTTP request on its TLS port is told so), the CLI's client,
the agent's downloads and the MQTT client, so that every side names a TLS failure the same way:
``certificate verify failed: <OpenSSL's reason> (<where>)``, never a bare
``[SSL: CERTIFICATE_VERIFY_FAILED]`` traceback nor "could not fetch" / "cannot reach".
OpenSSL's verify messages are fixed texts (plus the host name the client asked for), so a line
carries nothing the remote side chose.
"""

from __future__ import annotations

import ssl

HTTP_METHODS = (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"CONNECT", b"TRACE")
_TLS_RECORD_HANDSHAKE = 0x16
_MAX_CAUSES = 8
_MAX_REASON = 200


def first_bytes_kind(data: bytes) -> str:
    """What a client's first bytes are: ``"tls"`` (a TLS handshake record), ``"http"`` (an HTTP
    request line's method and space), ``"more"`` (too few bytes to tell) or ``"other"``."""
    if not data:
        return "more"
    if data[0] == _TLS_RECORD_HANDSHAKE:
        return "tls"
    for method in HTTP_METHODS:
        word = method + b" "
        if data.startswith(word):
            return "http"
        if word.startswith(data):
            return "more"
    return "other"


def _clean(text: str) -> str:
    """One line, bounded."""
    line = " ".join(str(text).split())
    return line if len(line) <= _MAX_REASON else line[: _MAX_REASON - 3] + "..."


def _causes(err: BaseException) -> list[BaseException]:
    """``err``, a ``URLError``'s reason and the cause chain, at most a few deep."""
    seen: list[BaseException] = []
    todo: list[object] = [err]
    while todo and len(seen) < _MAX_CAUSES:
        item = todo.pop(0)
        if not isinstance(item, BaseException) or any(item is other for other in seen):
            continue
        seen.append(item)
        todo.extend([getattr(item, "reason", None), item.__cause__, item.__context__])
    return seen


def tls_failure(err: BaseException, where: str) -> str | None:
    """The one line for a TLS failure anywhere in ``err``'s chain, or None when it is not one.

    ``where`` names the other end (a URL, ``HOST:PORT``). A certificate the client could not
    verify (unknown issuer, expired, wrong host name) is ``certificate verify failed: ...``;
    a TLS client on a port that does not speak TLS, and a server that wants a client certificate,
    are named as such; any other handshake failure is ``TLS handshake failed: ...``."""
    for cause in _causes(err):
        if isinstance(cause, ssl.SSLCertVerificationError):
            message = cause.verify_message or cause.reason or "the certificate was not accepted"
            return f"certificate verify failed: {_clean(message)} ({where})"
    for cause in _causes(err):
        if isinstance(cause, ssl.SSLError):
            return _handshake_line(cause, where)
    return None


def _handshake_line(err: ssl.SSLError, where: str) -> str:
    reason = str(err.reason or "").upper()
    if reason in ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG"):
        return f"TLS handshake failed: the other end does not speak TLS on this port ({where})"
    if isinstance(err, ssl.SSLEOFError) or reason == "UNEXPECTED_EOF_WHILE_READING":
        return f"TLS handshake failed: the other end closed the connection (does it speak TLS on this port?) ({where})"
    if "CERTIFICATE_REQUIRED" in reason or "HANDSHAKE_FAILURE" in reason or "BAD_CERTIFICATE" in reason:
        return (
            f"TLS handshake failed: the server refused this client's certificate or wants one "
            f"({_clean(str(err.reason).lower().replace('_', ' '))}) ({where})"
        )
    if "UNKNOWN_CA" in reason:
        return f"TLS handshake failed: the server does not trust this client's certificate (unknown ca) ({where})"
    detail = err.reason or err.strerror or type(err).__name__
    return f"TLS handshake failed: {_clean(str(detail).lower().replace('_', ' '))} ({where})"


def client_context(ca: str | None = None, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
    """A verifying client context: ``ca`` (PEM, one or more certificates) instead of the system's
    store when given, and a client certificate for mutual TLS. ``OSError``/``ssl.SSLError`` on an
    unreadable or wrong file (the caller names the option)."""
    context = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        context.load_cert_chain(cert, key)
    return context
