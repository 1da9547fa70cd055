"""Throwaway certificate authorities and certificates for the TLS tests (``cryptography``; the
same shapes docs/tls.md makes with openssl: a CA, a server certificate with SANs, client
certificates). Every file is PEM; keys are written mode 0600."""

from __future__ import annotations

import contextlib
import datetime
import http.server
import ipaddress
import socket
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_DAY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclass(frozen=True)
class Ca:
    """A CA: its certificate file (what clients pass as ``--ca``) and its signing key in memory."""

    cert: Path
    name: x509.Name
    key: ec.EllipticCurvePrivateKey

    def issue(self, folder: Path, name: str, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
              client: bool = False, expired: bool = False) -> Issued:
        """A leaf certificate for ``hosts`` (server) or a client certificate named ``name``."""
        now = datetime.datetime.now(datetime.timezone.utc)
        key = ec.generate_private_key(ec.SECP256R1())
        start, end = (now - 3 * _DAY, now - _DAY) if expired else (now - datetime.timedelta(minutes=5), now + _DAY)
        usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                   .issuer_name(self.name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                   .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                                  critical=False))
        if not client:
            builder = builder.add_extension(x509.SubjectAlternativeName([_san(host) for host in hosts]),
                                            critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        folder.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.touch(mode=0o600)
        key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return Issued(cert_path, key_path)


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def make_ca(folder: Path, name: str = "edgepack test CA") -> Ca:
    now = datetime.datetime.now(datetime.timezone.utc)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - _DAY).not_valid_after(now + 30 * _DAY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name.replace(' ', '-')}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return Ca(path, subject, key)


class _Handler(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@dataclass
class HttpsServer:
    url: str
    connections: list[int]  # one entry per accepted TCP connection (a TLS attempt)


@contextlib.contextmanager
def serve_https(issued: Issued, body: bytes = b"", client_ca: Path | None = None) -> Iterator[HttpsServer]:
    """A small HTTPS server on loopback with ``issued``'s certificate, answering every GET with
    ``body`` (with ``client_ca``: only to clients with a certificate from it); counts the
    connections it accepted (the handshake is done per request, in the server's thread, so a
    refused handshake is one connection and no request)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(issued.cert, issued.key)
    if client_ca is not None:
        context.load_verify_locations(cafile=client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    handler = type("Handler", (_Handler,), {"body": body})
    connections: list[int] = []

    class Server(http.server.ThreadingHTTPServer):
        def get_request(self):  # type: ignore[no-untyped-def]
            sock, address = self.socket.accept()
            connections.append(1)
            return context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address

        def handle_error(self, request, client_address) -> None:  # type: ignore[no-untyped-def]
            pass  # a refused handshake is the test's point, not noise

        def shutdown_request(self, request) -> None:  # type: ignore[no-untyped-def]
            """Close lingering, as a real server should: a client whose TLS 1.3 request is still
            arriving would otherwise get a reset instead of the alert sent before it."""
            with contextlib.suppress(OSError):
                socket.socket.shutdown(request, socket.SHUT_WR)
                request.settimeout(2)
                while socket.socket.recv(request, 65536):
                    pass
            self.close_request(request)

    httpd = Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield HttpsServer(f"https://127.0.0.1:{httpd.server_address[1]}", connections)
    finally:
        httpd.shutdown()
        httpd.server_close()
