"""Throwaway certificate authorities and certificates for the TLS tests (``cryptography``; the
same shapes docs/tls.md makes with openssl: a CA, a server certificate with SANs, client
certificates). Every file is PEM; keys are written mode 0600."""

from __future__ import annotations

import datetime
import ipaddress
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
