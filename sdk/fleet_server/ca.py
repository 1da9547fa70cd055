"""The fleet's certificate authority: device client certificates for CSRs, and the CRL.

Why a CA of its own: the broker (mosquitto with ``require_certificate`` and
``use_identity_as_username``) takes a client certificate's CN as the username, and the shipped
ACL derives every permission from the username, so a certificate whose CN is the device id is
the device's identity. The key is made on the device and never leaves it; the server only ever
sees a CSR (docs/enrollment.md).

The CA's key (EC P-256) and self-signed certificate live in the server's data folder
(``ca.key`` 0600, ``ca.crt``), made on first use. Device certificates are short-lived (90 days
by default) and rotated over the signed command path before they expire; a revoked serial is
listed in the CRL the broker reads (``crlfile``). The CRL's ``nextUpdate`` is the CA's own expiry:
the broker reads only this file and OpenSSL refuses every client once a CRL has expired, so it
must not go stale between two broker reloads.

:func:`check_csr` is pure (bytes in, a parsed request or a :class:`SchemaError` out); the
rest signs with the key held here.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from edgepack_core.errors import SchemaError
from edgepack_core.fsutil import atomic_write
from sdk.errors import ServerConfigError

CA_KEY = "ca.key"
CA_CERT = "ca.crt"
DEFAULT_VALIDITY_DAYS = 90
MAX_VALIDITY_DAYS = 825
CA_VALIDITY_DAYS = 3650
MAX_CSR_BYTES = 8 * 1024
"""A CSR is a few hundred bytes; anything this large is refused before it is parsed."""
CLOCK_SKEW_S = 300
"""A certificate is valid from this long before it was signed: a device clock a little behind
the server's must not see a certificate from the future."""
_CURVES = (ec.SECP256R1, ec.SECP384R1)
_MIN_RSA_BITS = 2048


@dataclass(frozen=True)
class Issued:
    """A certificate the CA signed: its PEM, serial (hex) and validity (unix seconds)."""

    pem: str
    serial: str
    not_before: float
    not_after: float


@dataclass(frozen=True)
class Revoked:
    """One CRL entry: a serial (hex) and when it was revoked."""

    serial: str
    at: float


def _utc(seconds: float) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.timezone.utc)


def _check_key(key: object) -> None:
    if isinstance(key, ec.EllipticCurvePublicKey):
        if not isinstance(key.curve, _CURVES):
            raise SchemaError("csr", f"the key's curve {key.curve.name} is not P-256 or P-384")
        return
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < _MIN_RSA_BITS:
            raise SchemaError("csr", f"an RSA key of {key.key_size} bits is too short (at least {_MIN_RSA_BITS})")
        return
    raise SchemaError("csr", "the key must be EC P-256/P-384 or RSA (edgepack-agent enroll makes P-256)")


def check_csr(pem: str) -> tuple[x509.CertificateSigningRequest, str]:
    """The parsed CSR and its subject's CN, when ``pem`` is one PEM CSR of at most
    :data:`MAX_CSR_BYTES` whose signature verifies (the requester holds the key) with an
    accepted key; :class:`SchemaError` naming the problem otherwise. Pure."""
    data = pem.encode("utf-8", "surrogatepass")
    if len(data) > MAX_CSR_BYTES:
        raise SchemaError("csr", f"{len(data)} bytes is over the limit of {MAX_CSR_BYTES}")
    try:
        csr = x509.load_pem_x509_csr(data)
    except ValueError as err:
        raise SchemaError("csr", f"not a PEM certificate signing request: {str(err)[:200]}") from err
    try:
        signed = csr.is_signature_valid
    except (ValueError, InvalidSignature, x509.UnsupportedGeneralNameType) as err:
        raise SchemaError("csr", f"its signature cannot be checked: {str(err)[:200]}") from err
    if not signed:
        raise SchemaError("csr", "its signature does not verify (the CSR was not made with its key)")
    _check_key(csr.public_key())
    names = csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if len(names) != 1 or not isinstance(names[0].value, str):
        raise SchemaError("csr", "the subject must hold exactly one CN: the device id")
    return csr, names[0].value


class FleetCA:
    """The CA key and certificate of one fleet server's data folder."""

    def __init__(
        self, key: ec.EllipticCurvePrivateKey, certificate: x509.Certificate, validity_days: int = DEFAULT_VALIDITY_DAYS
    ) -> None:
        if not 1 <= validity_days <= MAX_VALIDITY_DAYS:
            raise ServerConfigError(f"--cert-validity {validity_days} days must be 1 to {MAX_VALIDITY_DAYS}")
        self.key = key
        self.certificate = certificate
        self.validity_s = validity_days * 86400.0

    @property
    def pem(self) -> str:
        return self.certificate.public_bytes(serialization.Encoding.PEM).decode()

    @classmethod
    def open(
        cls, folder: Path, *, validity_days: int = DEFAULT_VALIDITY_DAYS, name: str = "Edgepack fleet CA", now: float
    ) -> FleetCA:
        """The CA of ``folder``, made there on first use (the key 0600, the folder 0700). A key
        file that others can read is refused, as the token file is."""
        key_path, cert_path = folder / CA_KEY, folder / CA_CERT
        if not key_path.exists():
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            cls._create(key_path, cert_path, name, now)
        try:
            mode = key_path.stat().st_mode
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except (OSError, ValueError) as err:
            raise ServerConfigError(f"cannot load the fleet CA in {folder}: {str(err)[:200]}") from err
        if mode & 0o077:
            raise ServerConfigError(
                f"the fleet CA key {key_path} is readable by others (mode {mode & 0o777:o}); chmod 600 it"
            )
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ServerConfigError(f"the fleet CA key {key_path} is not an EC key")
        return cls(key, certificate, validity_days)

    @staticmethod
    def _create(key_path: Path, cert_path: Path, name: str, now: float) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        public = key.public_key()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(_utc(now - CLOCK_SKEW_S))
            .not_valid_after(_utc(now + CA_VALIDITY_DAYS * 86400.0))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        try:  # never over another key: of two servers starting at once, one makes the CA
            atomic_write(key_path, key_pem, mode=0o600, overwrite=False)
        except FileExistsError:
            return
        atomic_write(cert_path, certificate.public_bytes(serialization.Encoding.PEM), mode=0o644)

    def issue(self, csr: x509.CertificateSigningRequest, device: str, now: float) -> Issued:
        """A client certificate for ``device`` (CN = the device id, whatever else the CSR asked
        for) with the CSR's key, valid ``validity_days`` from now."""
        public = csr.public_key()
        serial = x509.random_serial_number()
        not_before, not_after = now - CLOCK_SKEW_S, now + self.validity_s
        certificate = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, device)]))
            .issuer_name(self.certificate.subject)
            .public_key(public)
            .serial_number(serial)
            .not_valid_before(_utc(not_before))
            .not_valid_after(_utc(not_after))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return Issued(
            certificate.public_bytes(serialization.Encoding.PEM).decode(), f"{serial:x}", not_before, not_after
        )

    def crl(self, revoked: Iterable[Revoked], now: float, number: int) -> bytes:
        """The CRL (PEM) listing ``revoked``, valid until the CA itself expires."""
        builder = (
            x509.CertificateRevocationListBuilder()
            .issuer_name(self.certificate.subject)
            .last_update(_utc(now - CLOCK_SKEW_S))
            .next_update(self.certificate.not_valid_after_utc)
            .add_extension(x509.CRLNumber(number), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
        )
        for entry in revoked:
            builder = builder.add_revoked_certificate(
                x509.RevokedCertificateBuilder()
                .serial_number(int(entry.serial, 16))
                .revocation_date(_utc(entry.at))
                .build()
            )
        return builder.sign(self.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
