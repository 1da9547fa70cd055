"""``edgepack-agent enroll``: this device's identity from the fleet server, with a key made here.

The private key (EC P-256) is made on the device and never sent: the server gets a CSR whose CN
is the device id and the one-time token an admin printed (``edgepack fleet enroll``), and answers
the certificate its CA signed, the CA bundle, the broker's address and the groups the server
holds. The key and certificate go into one file (``identity/device.pem``, 0600) so that a
renewal replaces both with one atomic rename: a reconnect never pairs an old key with a new
certificate. agent.yaml gets ``device_id``, ``mqtt`` (host, port, groups, the ``tls`` section:
``cert`` and ``key`` both name that file) and ``enrollment`` (the server, for renewals), the
rest kept; the new document is validated as the agent would before it atomically replaces the
old one (YAML comments are not kept). With a password token (``--password`` on the server) the
broker password goes to ``identity/mqtt-password`` (0600) instead.

The renewal (a signed ``renew-certificate`` command, :mod:`device_agent.updates.renewal`) runs the
same exchange with a renewal token. Only the standard library's HTTPS client is used, with the
``--ca`` file (or ``enrollment.ca``) when the server's certificate is from a private CA.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from device_agent.config import CONFIG_SCHEMA, MAX_CONFIG_BYTES, check_config
from device_agent.errors import ConfigError, EnrollError
from edgepack_core.fsutil import atomic_write
from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.yamlfile import read_yaml_file

MAX_ANSWER_BYTES = 64 * 1024
TIMEOUT_S = 30.0
IDENTITY_DIR = "identity"
DEVICE_PEM = "device.pem"
CA_PEM = "ca.crt"
PASSWORD_FILE = "mqtt-password"
_MAX_PEM = 32 * 1024


@dataclass(frozen=True)
class Credentials:
    """What the server answered, checked and typed: a certificate (or a password), the CA
    bundle, the broker and the groups (None: a renewal, which keeps the groups)."""

    device: str
    ca: str
    host: str
    port: int
    tls: bool
    groups: tuple[str, ...] | None
    certificate: str | None = None
    password: str | None = None


def _text(answer: Mapping[str, Any], key: str, limit: int = _MAX_PEM) -> str:
    value = answer.get(key)
    if not isinstance(value, str) or not value or len(value) > limit:
        raise EnrollError(f"the server's answer has no usable {key!r}")
    return value


def parse_answer(answer: Any, device: str) -> Credentials:
    """The server's answer, every field bounded and typed; :class:`EnrollError` otherwise. Pure."""
    if not isinstance(answer, dict) or answer.get("device") != device:
        raise EnrollError(f"the server's answer is not for device {device}")
    broker = answer.get("broker")
    if not isinstance(broker, dict) or not isinstance(broker.get("port"), int) or not 0 < broker["port"] < 65536:
        raise EnrollError("the server's answer has no usable broker address")
    groups = answer.get("groups")
    if groups is not None and (
        not isinstance(groups, list) or not all(isinstance(g, str) and is_valid_id(g) for g in groups)
    ):
        raise EnrollError("the server's answer has unusable groups")
    certificate = _text(answer, "certificate") if "certificate" in answer else None
    password = _text(answer, "password", 256) if certificate is None else None
    return Credentials(
        device,
        _text(answer, "ca"),
        _text(broker, "host", 255),
        broker["port"],
        bool(broker.get("tls")),
        None if groups is None else tuple(groups),
        certificate,
        password,
    )


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def csr_pem(key: ec.EllipticCurvePrivateKey, device: str) -> str:
    """A CSR for ``key`` with the device id as its subject's CN."""
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, device)])
    request = x509.CertificateSigningRequestBuilder().subject_name(subject).sign(key, hashes.SHA256())
    return request.public_bytes(serialization.Encoding.PEM).decode()


def identity_pem(key: ec.EllipticCurvePrivateKey, certificate: str) -> bytes:
    """The certificate and its key in one PEM file: what one rename swaps."""
    try:
        cert = x509.load_pem_x509_certificate(certificate.encode())
    except ValueError as err:
        raise EnrollError(f"the server's certificate is not PEM: {str(err)[:200]}") from err
    if cert.public_key() != key.public_key():
        raise EnrollError("the server's certificate is not for the key made here")
    return cert.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _error_text(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read(4096))
        return str(body["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError, OSError):
        return str(err.reason)[:300]


def post(server: str, body: dict[str, Any], ca: Path | None, timeout: float = TIMEOUT_S) -> Any:
    """POST ``body`` to the server's ``/api/enroll``; the JSON answer, bounded."""
    context = ssl.create_default_context(cafile=str(ca) if ca else None) if server.startswith("https:") else None
    request = urllib.request.Request(
        f"{server.rstrip('/')}/api/enroll",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            data = response.read(MAX_ANSWER_BYTES + 1)
    except urllib.error.HTTPError as err:
        raise EnrollError(f"the fleet server refused: {err.code} {_error_text(err)}") from err
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if isinstance(reason, ssl.SSLCertVerificationError):
            raise EnrollError(f"certificate verify failed: {reason.verify_message} ({server}; give --ca FILE)") from err
        raise EnrollError(f"cannot reach the fleet server {server}: {reason}") from err
    if len(data) > MAX_ANSWER_BYTES:
        raise EnrollError(f"the server's answer is over {MAX_ANSWER_BYTES} bytes")
    try:
        return json.loads(data)
    except ValueError as err:
        raise EnrollError("the server's answer is not JSON") from err


def request_certificate(server: str, token: str, device: str, ca: Path | None) -> tuple[Credentials, bytes]:
    """Make a key, send its CSR with ``token``; the credentials and the identity file's bytes."""
    key = new_key()
    credentials = parse_answer(post(server, {"token": token, "csr": csr_pem(key, device)}, ca), device)
    if credentials.certificate is None:
        raise EnrollError("the server answered a password to a certificate request")
    return credentials, identity_pem(key, credentials.certificate)


def _read(config: Path) -> dict[str, Any]:
    document = read_yaml_file(
        config, MAX_CONFIG_BYTES, lambda problem: ConfigError("<file>", problem, config=str(config)), kind="config"
    )
    if not isinstance(document, dict):
        raise ConfigError("<root>", "must be a mapping of keys", config=str(config))
    return document


def updated_config(
    document: Mapping[str, Any], credentials: Credentials, files: Mapping[str, str], server: str, ca: str | None
) -> dict[str, Any]:
    """agent.yaml after enrollment: the device id, the broker, groups, TLS files or the password,
    the enrollment section; everything else as it was. Pure."""
    updated = dict(document)
    updated["device_id"] = credentials.device
    mqtt = {
        key: value
        for key, value in dict(document.get("mqtt") or {}).items()
        if key not in ("username", "password", "password_file")
    }
    mqtt.update(host=credentials.host, port=credentials.port)
    if credentials.groups is not None:
        mqtt["groups"] = list(credentials.groups)
    tls = dict(mqtt.get("tls") or {})
    tls.pop("cert", None), tls.pop("key", None)
    if credentials.tls or credentials.certificate is not None:
        tls["ca"] = files["ca"]
    if credentials.certificate is not None:
        tls.update(cert=files["identity"], key=files["identity"])
    else:
        mqtt["username"] = credentials.device
        secret = {"password_file": files["password"]} if _has_password_file() else {"password": credentials.password}
        mqtt.update(secret)
    if tls:
        mqtt["tls"] = tls
    updated["mqtt"] = mqtt
    updated["enrollment"] = {"server": server, **({"ca": ca} if ca else {})}
    return updated


def _has_password_file() -> bool:
    return "password_file" in CONFIG_SCHEMA["properties"]["mqtt"]["properties"]


def enroll(config: Path, server: str, token: str, *, ca: Path | None = None, device: str | None = None) -> Credentials:
    """The whole ``edgepack-agent enroll``: see the module docstring."""
    document = _read(config)
    device = device or document.get("device_id")
    if not isinstance(device, str) or not is_valid_id(device):
        raise ConfigError(
            "device_id", "is not set: give --device-id (the id the token was made for)", config=str(config)
        )
    folder = config.parent / IDENTITY_DIR
    folder.mkdir(mode=0o700, exist_ok=True)
    if len(token) > 128:
        raise EnrollError("the token is longer than any the fleet server makes")
    key = new_key()
    answer = post(server, {"token": token, "csr": csr_pem(key, device)}, ca)
    credentials = parse_answer(answer, device)
    files = {
        "ca": f"{IDENTITY_DIR}/{CA_PEM}",
        "identity": f"{IDENTITY_DIR}/{DEVICE_PEM}",
        "password": f"{IDENTITY_DIR}/{PASSWORD_FILE}",
    }
    ca_text = str(ca.resolve()) if ca else None
    new_document = updated_config(document, credentials, files, server, ca_text)
    if credentials.certificate is not None:
        atomic_write(folder / DEVICE_PEM, identity_pem(key, credentials.certificate), mode=0o600)
    elif _has_password_file():
        atomic_write(folder / PASSWORD_FILE, f"{credentials.password}\n".encode(), mode=0o600)
    atomic_write(folder / CA_PEM, credentials.ca.encode(), mode=0o644)
    check_config(new_document, config.resolve())  # never write an agent.yaml the agent would refuse
    mode = config.stat().st_mode & 0o777
    atomic_write(config, yaml.safe_dump(new_document, sort_keys=False).encode(), mode=mode)
    return credentials


def cmd_enroll(args: Any) -> int:
    """``edgepack-agent enroll`` (the parser is device_agent/cli.py's)."""
    credentials = enroll(
        Path(args.config), args.server, args.token, ca=Path(args.ca) if args.ca else None, device=args.device_id
    )
    how = "certificate" if credentials.certificate is not None else "broker password"
    groups = ", ".join(credentials.groups or ()) or "none"
    print(
        f"enrolled {credentials.device} with a {how} for {credentials.host}:{credentials.port} (groups: {groups}); "
        f"{args.config} updated"
    )
    return 0
