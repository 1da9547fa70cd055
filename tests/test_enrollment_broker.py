"""Enrollment end to end on a real mosquitto with the shipped config's TLS listener turned on
(``require_certificate``, ``use_identity_as_username``, ``crlfile``) and the ACL the fleet server
generates from the shipped one: a real ``edgepack fleet serve`` enrolls a real ``edgepack-agent``
whose key is made by ``edgepack-agent enroll``; the agent connects with its certificate and runs
its group's commands; the server rotates the certificate over the signed command path and the
agent reconnects with the new one; after ``edgepack fleet revoke`` (and the broker reload the
server runs) the revoked certificate cannot connect, while a device enrolled beside it still can.
"""

from __future__ import annotations

import datetime
import getpass
import ipaddress
import json
import sqlite3
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.agent_process import AgentProcess
from tests.broker import Broker, free_port, start_mosquitto
from tests.conftest import cli
from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "mosquitto"
ROOT = "edgepack/v1"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def broker_certificate(folder: Path) -> tuple[Path, Path, Path]:
    """A private CA (not the fleet's) and the broker's server certificate for 127.0.0.1."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("test broker CA"))
        .issuer_name(_name("test broker CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = folder / "broker-ca.crt", folder / "broker.crt", folder / "broker.key"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def shipped_tls_config(plain: int, tls: int, folder: Path, fleet_ca: Path, cert: Path, key: Path) -> str:
    """deploy/mosquitto/mosquitto.conf with its TLS listener turned on as docs/enrollment.md says."""
    text = (DEPLOY / "mosquitto.conf").read_text()
    replacements = {
        "listener 1883\n": f"listener {plain} 127.0.0.1\n",
        "#listener 8883\n": f"listener {tls} 127.0.0.1\n",
        "#certfile /etc/mosquitto/certs/broker.crt": f"certfile {cert}",
        "#keyfile /etc/mosquitto/certs/broker.key": f"keyfile {key}",
        "#cafile /etc/mosquitto/edgepack/fleet-ca.crt": f"cafile {fleet_ca}",
        "#require_certificate true": "require_certificate true",
        "#use_identity_as_username true": "use_identity_as_username true",
        "#crlfile /etc/mosquitto/edgepack/fleet.crl": f"crlfile {folder / 'fleet.crl'}",
        "/etc/mosquitto/edgepack/passwd": str(folder / "passwd"),
        "/etc/mosquitto/edgepack/acl": str(folder / "acl"),
        "persistence_location /var/lib/mosquitto/": f"persistence_location {folder}/",
    }
    for old, new in replacements.items():
        assert old in text, f"deploy/mosquitto/mosquitto.conf no longer contains {old!r}"
        text = text.replace(old, new)
    return text + f"\nuser {getpass.getuser()}\n"


@dataclass
class Fleet:
    folder: Path
    broker: Broker
    server: FleetServerProcess
    tls_port: int
    broker_ca: Path
    operator: Any
    messages: list[tuple[str, Any]]

    def enroll_token(self, device: str, *groups: str) -> str:
        args = [
            cli("edgepack"),
            "fleet",
            "enroll",
            device,
            *(a for g in groups for a in ("--group", g)),
            "--server",
            self.server.url,
            "--token-file",
            str(self.server.keys.token_file),
        ]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def jobs(self, device: str) -> list[dict]:
        return [p for t, p in list(self.messages) if t == f"{ROOT}/dev/{device}/job"]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    folder = tmp_path / "broker"
    folder.mkdir()
    broker_ca, cert, key = broker_certificate(folder)
    ca_dir = tmp_path / "fleet-ca"
    made = subprocess.run(
        [cli("edgepack"), "fleet", "ca-init", "--ca-dir", str(ca_dir), "--crl-file", str(folder / "fleet.crl")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    (folder / "acl").write_text((DEPLOY / "acl").read_text())
    subprocess.run(
        ["mosquitto_passwd", "-c", "-b", str(folder / "passwd"), "operator", "pw-operator"],
        check=True,
        capture_output=True,
    )
    plain, tls = free_port(), free_port()
    broker = start_mosquitto(
        config=shipped_tls_config(plain, tls, folder, Path(made.stdout.strip()), cert, key), port=plain, workdir=folder
    )
    password = tmp_path / "operator-password"
    password.write_text("pw-operator\n")
    keys = make_keys(tmp_path / "keys")
    assert broker.process is not None
    server = FleetServerProcess(
        tmp_path / "server",
        broker=broker.address,
        keys=keys,
        extra=(
            "--username",
            "operator",
            "--password-file",
            str(password),
            "--ca-dir",
            str(ca_dir),
            "--broker-acl-file",
            str(folder / "acl"),
            "--broker-crl-file",
            str(folder / "fleet.crl"),
            "--enroll-broker",
            f"mqtts://127.0.0.1:{tls}",
            "--broker-ca",
            str(broker_ca),
            "--broker-reload-command",
            f"kill -HUP {broker.process.pid}",
            "--renew-interval",
            "1s",
        ),
    ).start()
    messages: list[tuple[str, Any]] = []
    operator = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-operator", protocol=mqtt.MQTTv5)
    operator.username_pw_set("operator", "pw-operator")
    subscribed = threading.Event()
    operator.on_connect = lambda c, *_: c.subscribe(f"{ROOT}/#", qos=1)
    operator.on_subscribe = lambda *_: subscribed.set()
    operator.on_message = lambda _c, _u, m: messages.append((m.topic, _json(m.payload)))
    operator.connect("127.0.0.1", plain)
    operator.loop_start()
    assert subscribed.wait(10)
    try:
        yield Fleet(tmp_path, broker, server, tls, broker_ca, operator, messages)
    finally:
        operator.disconnect()
        operator.loop_stop()
        server.stop()
        broker.kill()


def _json(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return payload


def enrolled_agent(fleet: Fleet, device: str, *groups: str) -> AgentProcess:
    """A real agent whose agent.yaml ``edgepack-agent enroll`` completed (key made on the device)."""
    folder = fleet.folder / device
    folder.mkdir()
    agent = AgentProcess(
        folder,
        device=device,
        broker_port=fleet.broker.port,
        trust=fleet.server.keys.release_pub,
        artifact=None,
        operator_keys=[fleet.server.keys.operator_pub],
    )
    token = fleet.enroll_token(device, *groups)
    done = subprocess.run(
        [
            cli("edgepack-agent"),
            "enroll",
            "--server",
            fleet.server.url,
            "--token",
            token,
            "--config",
            str(agent.config),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return agent


def start_without_model(agent: AgentProcess) -> None:
    """The agent holds no model (its HTTP health says so): it is up once its MQTT birth is heard."""
    with open(agent.log, "ab") as log:
        agent.proc = subprocess.Popen(
            [cli("edgepack-agent"), "run", "--config", str(agent.config)],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )


def tls_connects(fleet: Fleet, identity: Path, ca: Path) -> bool:
    """Whether the broker's TLS listener accepts a client with this certificate (a fresh
    connection, as a device's next reconnect would make)."""
    answered = threading.Event()
    accepted: list[bool] = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"probe-{free_port()}", protocol=mqtt.MQTTv5)
    client.tls_set(ca_certs=str(ca), certfile=str(identity), keyfile=str(identity))

    def on_connect(_c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
        accepted.append(not reason.is_failure)
        answered.set()

    client.on_connect = on_connect
    try:
        client.connect("127.0.0.1", fleet.tls_port)
    except (ssl.SSLError, OSError):
        return False
    client.loop_start()
    try:
        answered.wait(5)
    finally:
        client.disconnect()
        client.loop_stop()
    return accepted == [True]


@pytest.mark.slow  # an integration run: a broker, a fleet server and two agents (about 20 s)
def test_an_enrolled_device_connects_is_rotated_and_after_revocation_cannot_connect(fleet: Fleet) -> None:
    agent = enrolled_agent(fleet, "pi-07", "kitchen")
    enrolled_agent(fleet, "pi-08", "lobby")
    identity = fleet.folder / "pi-07" / "identity" / "device.pem"
    ca = fleet.folder / "pi-07" / "identity" / "ca.crt"
    acl = (fleet.folder / "broker" / "acl").read_text()
    assert "user pi-07\ntopic read edgepack/v1/grp/kitchen/cmd" in acl
    assert "pattern read edgepack/v1/dev/%u/cmd" in acl  # the shipped patterns, unchanged
    start_without_model(agent)
    try:
        assert wait_for(
            lambda: any(
                p.get("status") == "online"
                for t, p in list(fleet.messages)
                if t == f"{ROOT}/dev/pi-07/state" and isinstance(p, dict)
            ),
            30,
        )
        # A command to its group reaches it (the ACL the server generated lets it read the group topic).
        ping = {
            "schema": "edgepack.cmd/1",
            "id": "grp-ping-1",
            "type": "ping",
            "expires_at": time.time() + 60,
            "target": {"group": "kitchen"},
        }
        fleet.operator.publish(f"{ROOT}/grp/kitchen/cmd", json.dumps(ping), qos=1)
        assert wait_for(
            lambda: any(j.get("job") == "grp-ping-1" and j.get("state") == "done" for j in fleet.jobs("pi-07")), 30
        ), fleet.jobs("pi-07")
        first = x509.load_pem_x509_certificate(identity.read_bytes())

        # Rotation: the certificate is made due (past 2/3 of its life) in the server's records.
        database = sqlite3.connect(fleet.server.db_url.removeprefix("sqlite:///"))
        with database:
            database.execute(
                "UPDATE device_certificates SET not_before = ?, not_after = ? WHERE serial = ?",
                (time.time() - 700, time.time() + 300, f"{first.serial_number:x}"),
            )
        database.close()
        assert wait_for(
            lambda: any(j.get("type") == "renew-certificate" and j.get("state") == "done" for j in fleet.jobs("pi-07")),
            60,
        ), fleet.jobs("pi-07")
        second = x509.load_pem_x509_certificate(identity.read_bytes())
        assert second.serial_number != first.serial_number
        assert second.public_key() != first.public_key()  # a new key, made on the device
        assert (identity.stat().st_mode & 0o777) == 0o600
        # It reconnected with the new certificate, and its group still reaches it.
        ping["id"] = "grp-ping-2"
        assert wait_for(
            lambda: any(
                p.get("status") == "online"
                for t, p in list(fleet.messages)[-50:]
                if t == f"{ROOT}/dev/pi-07/state" and isinstance(p, dict)
            ),
            30,
        )
        fleet.operator.publish(f"{ROOT}/grp/kitchen/cmd", json.dumps(ping), qos=1)
        assert wait_for(
            lambda: any(j.get("job") == "grp-ping-2" and j.get("state") == "done" for j in fleet.jobs("pi-07")), 30
        )
        # No reconnect failed: the broker never published pi-07's last will.
        assert not [
            p
            for t, p in list(fleet.messages)
            if t == f"{ROOT}/dev/pi-07/state" and isinstance(p, dict) and p.get("status") == "offline"
        ]
    finally:
        agent.stop()
    assert tls_connects(fleet, identity, ca)

    # Revocation: into the CRL, which mosquitto re-reads on the SIGHUP the server's reload command sends.
    done = subprocess.run(
        [
            cli("edgepack"),
            "fleet",
            "revoke",
            "pi-07",
            "--server",
            fleet.server.url,
            "--token-file",
            str(fleet.server.keys.token_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and f"{second.serial_number:x}" in done.stdout, done.stderr
    crl = x509.load_pem_x509_crl((fleet.folder / "broker" / "fleet.crl").read_bytes())
    assert crl.get_revoked_certificate_by_serial_number(second.serial_number) is not None
    assert wait_for(lambda: not tls_connects(fleet, identity, ca), 20)
    # The device enrolled beside it still connects with its own certificate.
    assert tls_connects(fleet, fleet.folder / "pi-08" / "identity" / "device.pem", ca)
