"""Device enrollment on a real ``edgepack fleet serve``: one-time tokens and the attacks on them,
the CSR checks, bounds, revocation (and decommission), broker passwords on a real mosquitto, and
the pure rules (rotation due, the generated ACL against the shipped one, mosquitto's ``$7$``)."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from device_agent.enroll import csr_pem, new_key
from sdk.fleet_server.broker_files import acl_base, acl_text, password_entry, password_text
from sdk.fleet_server.ca import MAX_CSR_BYTES
from sdk.fleet_server.enrollment import Broker, Enrollment, renewal_due
from tests.broker import Broker as Mosquitto
from tests.broker import start_mosquitto
from tests.conftest import cli
from tests.fleet_server_process import FleetServerProcess, make_keys

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "mosquitto"


@pytest.fixture(scope="module")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mosquitto]:
    broker = start_mosquitto(workdir=tmp_path_factory.mktemp("mosquitto"))
    yield broker
    broker.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, mosquitto: Mosquitto) -> Iterator[FleetServerProcess]:
    folder = tmp_path_factory.mktemp("enroll-server")
    base = folder / "passwd-base"
    subprocess.run(
        ["mosquitto_passwd", "-c", "-b", str(base), "operator", "pw-operator"], check=True, capture_output=True
    )
    process = FleetServerProcess(
        folder,
        broker=mosquitto.address,
        keys=make_keys(folder / "keys"),
        extra=(
            "--ca-dir",
            str(folder / "ca"),
            "--broker-crl-file",
            str(folder / "fleet.crl"),
            "--broker-acl-file",
            str(folder / "acl"),
            "--broker-acl-base",
            str(DEPLOY / "acl"),
            "--broker-password-file",
            str(folder / "passwd"),
            "--broker-password-base",
            str(base),
            "--enroll-broker",
            "mqtts://mqtt.example:8883",
        ),
    ).start()
    yield process
    process.stop()


def token_for(server: FleetServerProcess, device: str, **body: object) -> str:
    status, done = server.call("POST", f"/api/devices/{device}/enrollment", body)
    assert status == 201, done
    return str(done["token"])


def redeem(server: FleetServerProcess, token: str, csr: str | None) -> tuple[int, dict]:
    return server.call("POST", "/api/enroll", {"token": token, **({"csr": csr} if csr is not None else {})}, token=None)


def test_a_token_used_twice_is_refused(server: FleetServerProcess) -> None:
    token = token_for(server, "tw-01", groups=["kitchen"])
    status, answer = redeem(server, token, csr_pem(new_key(), "tw-01"))
    assert status == 200, answer
    cert = x509.load_pem_x509_certificate(answer["certificate"].encode())
    assert cert.subject.rfc4514_string() == "CN=tw-01" and answer["groups"] == ["kitchen"]
    assert answer["broker"] == {"host": "mqtt.example", "port": 8883, "tls": True}
    again = redeem(server, token, csr_pem(new_key(), "tw-01"))
    assert again[0] == 403 and "already used" in again[1]["error"]["message"]
    # Two redemptions at once: the conditional claim lets exactly one through.
    token = token_for(server, "tw-02")
    answers: list[int] = []
    threads = [
        threading.Thread(target=lambda: answers.append(redeem(server, token, csr_pem(new_key(), "tw-02"))[0]))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answers) == [200, 403, 403, 403]


def test_a_csr_for_another_device_id_is_refused(server: FleetServerProcess) -> None:
    token = token_for(server, "cn-01")
    status, answer = redeem(server, token, csr_pem(new_key(), "cn-02"))
    assert status == 403 and "'cn-02' is not the device this token is for" in answer["error"]["message"]
    # The refusal did not use the token: the device it is for still enrolls with it.
    assert redeem(server, token, csr_pem(new_key(), "cn-01"))[0] == 200


def test_an_unknown_token_and_a_csr_its_key_did_not_sign_are_refused(server: FleetServerProcess) -> None:
    status, answer = redeem(server, "x" * 43, csr_pem(new_key(), "sg-01"))
    assert status == 403 and "not a valid enrollment token" in answer["error"]["message"]
    token = token_for(server, "sg-01")
    csr = x509.load_pem_x509_csr(csr_pem(new_key(), "sg-01").encode())
    der = bytearray(csr.public_bytes(serialization.Encoding.DER))
    der[-1] ^= 0x01  # a flipped bit in the signature
    forged = (
        "-----BEGIN CERTIFICATE REQUEST-----\n"
        + base64.encodebytes(bytes(der)).decode()
        + "-----END CERTIFICATE REQUEST-----\n"
    )
    status, answer = redeem(server, token, forged)
    assert status == 422 and "csr" in answer["error"]["message"], answer
    weak = ec.generate_private_key(ec.SECP256K1())  # not a curve the CA takes
    status, answer = redeem(server, token, csr_pem(weak, "sg-01"))  # type: ignore[arg-type]
    assert status == 422 and "P-256" in answer["error"]["message"]
    assert redeem(server, token, csr_pem(new_key(), "sg-01"))[0] == 200  # none of those used it


def test_an_oversize_csr_is_refused_with_413(server: FleetServerProcess) -> None:
    token = token_for(server, "big-01")
    at_limit = redeem(server, token, "A" * MAX_CSR_BYTES)
    assert at_limit[0] == 422, at_limit  # read and checked: not a CSR
    over = redeem(server, token, "A" * (MAX_CSR_BYTES + 1))
    assert over[0] == 413 and "csr" in over[1]["error"]["message"]
    body = json.dumps({"token": token, "csr": "A" * 16 * 1024}).encode()
    assert (
        server.call("POST", "/api/enroll", data=body, token=None, headers={"Content-Type": "application/json"})[0]
        == 413
    )
    assert redeem(server, token, csr_pem(new_key(), "big-01"))[0] == 200


def test_an_expired_token_is_refused(tmp_path: Path) -> None:
    from sdk.fleet_server.db import open_database

    database = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        enrollment = Enrollment(database, tmp_path / "ca", Broker("mqtt.example", 8883, True))
        made = enrollment.create_token("ex-01", [], password=False, ttl_s=3600, actor="admin", remote="", now=1000.0)
        expired = made["expires_at"]
        with pytest.raises(Exception, match="expired at") as refused:
            enrollment.redeem(made["token"], csr_pem(new_key(), "ex-01"), remote="", now=expired)
        assert getattr(refused.value, "status", None) == 403
        answer = enrollment.redeem(made["token"], csr_pem(new_key(), "ex-01"), remote="", now=expired - 0.001)
        assert answer["device"] == "ex-01"
    finally:
        database.dispose()


def test_enrollment_routes_are_for_admins_and_revocation_reaches_the_crl(server: FleetServerProcess) -> None:
    assert server.call("POST", "/api/devices/rv-01/enrollment", {}, token=None)[0] == 401
    assert server.call("POST", "/api/devices/rv-01/revoke", {}, token=None)[0] == 401
    assert server.call("POST", "/api/devices/rv-01/revoke", {})[0] == 404  # nothing to revoke
    serials = []
    for device in ("rv-01", "rv-02"):
        status, answer = redeem(server, token_for(server, device, groups=["hall"]), csr_pem(new_key(), device))
        assert status == 200
        serials.append(answer["serial"])
    acl = (server.folder / "acl").read_text()
    assert "user rv-01\ntopic read edgepack/v1/grp/hall/cmd" in acl
    status, done = server.call("POST", "/api/devices/rv-01/revoke", {"reason": "lost"})
    assert status == 200 and done["revoked"] == [serials[0]]
    assert server.call("DELETE", "/api/devices/rv-02", {"reason": "scrapped"})[0] == 200  # decommission revokes
    crl = x509.load_pem_x509_crl((server.folder / "fleet.crl").read_bytes())
    ca = x509.load_pem_x509_certificate((server.folder / "ca" / "ca.crt").read_bytes())
    assert crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
    assert sorted(f"{r.serial_number:x}" for r in crl) == sorted(serials)
    assert ((server.folder / "ca" / "ca.key").stat().st_mode & 0o777) == 0o600
    audit = server.get("/api/audit?limit=50")["entries"]
    assert {"device.enroll_identity", "device.revoke", "device.certificate"} <= {e["action"] for e in audit}


def test_a_password_enrollment_logs_in_to_a_real_mosquitto(server: FleetServerProcess, tmp_path: Path) -> None:
    token = token_for(server, "pw-01", password=True)
    status, answer = redeem(server, token, csr_pem(new_key(), "pw-01"))  # the agent always sends a CSR
    assert status == 200 and "certificate" not in answer and answer["username"] == "pw-01"
    password = answer["password"]
    entries = (server.folder / "passwd").read_text()
    assert entries.startswith("operator:$7$") and "\npw-01:$7$101$" in entries and password not in entries
    assert password.encode() not in (server.folder / "fleet.db").read_bytes()
    broker = start_mosquitto(
        f"password_file {server.folder / 'passwd'}\n", anonymous=False, workdir=tmp_path / "mosquitto"
    )
    try:
        for user, secret, code in (
            ("pw-01", password, 0),
            ("pw-01", password[:-1] + "x", 5),
            ("operator", "pw-operator", 0),
        ):
            done = subprocess.run(
                [
                    "mosquitto_pub",
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(broker.port),
                    "-u",
                    user,
                    "-P",
                    secret,
                    "-t",
                    "t",
                    "-m",
                    "m",
                    "-q",
                    "1",
                ],
                capture_output=True,
                timeout=30,
            )
            assert done.returncode == code, (user, done.stderr)
    finally:
        broker.kill()
    assert redeem(server, token, csr_pem(new_key(), "pw-01"))[0] == 403  # delivered once


def test_the_cli_enrolls_and_a_refusal_is_one_line(server: FleetServerProcess, tmp_path: Path) -> None:
    base = [
        cli("edgepack"),
        "fleet",
        "enroll",
        "cl-01",
        "--group",
        "g1",
        "--server",
        server.url,
        "--token-file",
        str(server.keys.token_file),
    ]
    done = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("ept") and len(done.stdout.strip()) == 46, done.stderr
    config = tmp_path / "agent.yaml"
    config.write_text("# a comment\ndevice_id: cl-01\nstore: store\ntrust: [release.pub]\nlog_level: debug\n")
    agent = [
        cli("edgepack-agent"),
        "enroll",
        "--server",
        server.url,
        "--token",
        done.stdout.strip(),
        "--config",
        str(config),
    ]
    enrolled = subprocess.run(agent, capture_output=True, text=True, timeout=60)
    assert enrolled.returncode == 0, enrolled.stderr
    document = yaml.safe_load(config.read_text())
    assert document["log_level"] == "debug" and document["mqtt"]["groups"] == ["g1"]
    assert document["mqtt"]["tls"] == {
        "ca": "identity/ca.crt",
        "cert": "identity/device.pem",
        "key": "identity/device.pem",
    }
    assert document["enrollment"] == {"server": server.url}
    assert ((tmp_path / "identity" / "device.pem").stat().st_mode & 0o777) == 0o600
    again = subprocess.run(agent, capture_output=True, text=True, timeout=60)
    assert again.returncode == 1 and again.stderr.count("\n") == 1 and "already used" in again.stderr
    assert "Traceback" not in again.stderr
    expires = subprocess.run([*base, "--expires", "40d"], capture_output=True, text=True, timeout=60)
    assert expires.returncode == 2 and expires.stderr.count("\n") == 1 and "expires_in_s" in expires.stderr


def test_rotation_is_due_after_two_thirds_of_the_life() -> None:
    assert not renewal_due(0.0, 90.0, 59.999)
    assert renewal_due(0.0, 90.0, 60.0)
    assert renewal_due(0.0, 90.0, 89.999)
    assert not renewal_due(0.0, 90.0, 90.0)  # expired: too late to rotate, enroll again


def test_the_generated_acl_keeps_every_line_of_the_shipped_one_but_its_group_examples() -> None:
    shipped = (DEPLOY / "acl").read_text().splitlines()
    base = acl_base((DEPLOY / "acl").read_text())
    examples = {
        "user pi-07",
        "user pi-08",
        "topic read edgepack/v1/grp/kitchen/cmd",
        "topic read edgepack/v1/grp/lobby/cmd",
    }
    assert [line for line in base if line] == [line for line in shipped if line and line not in examples]
    assert "user operator" in base and "pattern read edgepack/v1/dev/%u/cmd" in base
    text = acl_text(base, {"pi-07": ["kitchen", "hall", "kitchen"], "pi-09": []})
    assert text.endswith("user pi-07\ntopic read edgepack/v1/grp/hall/cmd\ntopic read edgepack/v1/grp/kitchen/cmd\n")
    assert "pi-09" not in text
    assert acl_base(text) == base  # read back as its own base (a restart): nothing doubles, nothing is lost
    # An operator's own section that grants more than group commands is kept.
    custom = acl_base("user tool\ntopic read edgepack/v1/grp/a/cmd\ntopic read edgepack/v1/dev/+/state\n")
    assert custom == ["user tool", "topic read edgepack/v1/grp/a/cmd", "topic read edgepack/v1/dev/+/state"]


def test_password_entries_are_mosquitto_passwd_hashes(tmp_path: Path) -> None:
    made = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(made), "dev", "s3cret-pw"], check=True, capture_output=True)
    line = made.read_text().strip()
    _, _, iterations, salt, _ = line.split(":", 1)[1].split("$")
    assert line == f"dev:{password_entry('s3cret-pw', base64.b64decode(salt), int(iterations))}"
    assert password_text("operator:x\ndev:old\n", {"dev": "$7$new"}) == "operator:x\ndev:$7$new\n"



def test_a_device_enrolls_over_https_with_a_private_ca_and_says_so_without_it(
    tmp_path: Path, mosquitto: Mosquitto
) -> None:
    import ssl

    from tests.tls_certs import make_ca

    ca = make_ca(tmp_path / "ca")
    issued = ca.issue(tmp_path / "ca", "fleet")
    keys = make_keys(tmp_path / "keys")
    https = FleetServerProcess(tmp_path / "server", broker=mosquitto.address, keys=keys,
                               extra=("--tls-cert", str(issued.cert), "--tls-key", str(issued.key)),
                               context=ssl.create_default_context(cafile=str(ca.cert))).start()
    try:
        token = token_for(https, "tls-01")
        config = tmp_path / "agent.yaml"
        config.write_text("device_id: tls-01\nstore: store\ntrust: [release.pub]\n")
        agent = [cli("edgepack-agent"), "enroll", "--server", https.url, "--token", token, "--config", str(config)]
        refused = subprocess.run(agent, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
        assert "certificate verify failed" in refused.stderr and https.url in refused.stderr
        done = subprocess.run([*agent, "--ca", str(ca.cert)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert yaml.safe_load(config.read_text())["enrollment"] == {"server": https.url, "ca": str(ca.cert)}
    finally:
        https.stop()


def test_a_password_enrollment_writes_the_password_to_a_file_never_into_agent_yaml(
    server: FleetServerProcess, tmp_path: Path
) -> None:
    from device_agent.config import load_config

    token = token_for(server, "pf-01", password=True, groups=["g2"])
    config = tmp_path / "agent.yaml"
    config.write_text("device_id: pf-01\nstore: store\ntrust: [release.pub]\n")
    done = subprocess.run([cli("edgepack-agent"), "enroll", "--server", server.url, "--token", token, "--config",
                           str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    secret = tmp_path / "identity" / "mqtt-password"
    password = secret.read_text().strip()
    assert len(password) == 43 and (secret.stat().st_mode & 0o777) == 0o600
    assert password not in config.read_text()
    loaded = load_config(config)
    assert loaded.mqtt is not None and loaded.mqtt.username == "pf-01" and loaded.mqtt.password == password
    assert loaded.mqtt.tls is not None and loaded.mqtt.tls.cert is None  # the broker's CA only: mqtts://
    assert "pf-01:$7$" in (server.folder / "passwd").read_text()


class RecordingSink:
    """Records what the driver would sign and publish (the driver's own path is the e2e test's)."""

    def __init__(self) -> None:
        self.recorded: list[dict] = []
        self.published: list[dict] = []

    def record_command(self, connection: object, device: str, kind: str, command: dict, now: float) -> dict:
        self.recorded.append({"device": device, "kind": kind, **command})
        return command

    def publish(self, commands: list[dict], now: float) -> None:
        self.published += commands


def test_only_a_devices_newest_certificate_is_rotated_and_once_until_its_token_expires(tmp_path: Path) -> None:
    from sdk.fleet_server.db import open_database
    from sdk.fleet_server.enrollment import RENEW_AT, RENEWAL_TTL_S

    database = open_database(f"sqlite:///{tmp_path / 'fleet.db'}")
    try:
        enrollment = Enrollment(database, tmp_path / "ca", Broker("mqtt.example", 8883, True), validity_days=90)
        issued = []
        for at in (1_000_000.0, 1_000_100.0):  # enrolled twice: two valid certificates
            made = enrollment.create_token("rn-01", [], password=False, ttl_s=3600, actor="a", remote="", now=at)
            issued.append(enrollment.redeem(made["token"], csr_pem(new_key(), "rn-01"), remote="", now=at))
        not_before = 1_000_100.0 - 300  # the CA's allowance for clock skew
        due = not_before + (issued[1]["not_after"] - not_before) * RENEW_AT  # as the server computes it
        sink = RecordingSink()
        assert enrollment.send_renewals(sink, due - 1) == 0  # the older one is due by then, but superseded
        assert enrollment.send_renewals(sink, due) == 1
        assert [c["id"] for c in sink.published] == [c["id"] for c in sink.recorded]
        command = sink.recorded[0]
        assert (command["device"], command["kind"], command["type"]) == ("rn-01", "renew-cert", "renew-certificate")
        assert enrollment.send_renewals(sink, due + 10) == 0  # sent: not again while its token lives
        assert enrollment.send_renewals(sink, due + RENEWAL_TTL_S + 1) == 1  # its token expired unused
        renewed = enrollment.redeem(sink.recorded[-1]["token"], csr_pem(new_key(), "rn-01"), remote="",
                                    now=due + RENEWAL_TTL_S + 2)
        assert "groups" not in renewed and renewed["serial"] != issued[1]["serial"]
        assert enrollment.send_renewals(sink, due + RENEWAL_TTL_S + 3) == 0  # the new one is not due
    finally:
        database.dispose()


def test_a_device_renews_only_the_identity_file_enroll_wrote() -> None:
    from device_agent.config import check_config
    from device_agent.updates.renewal import renewal_problem

    base = {"device_id": "d", "store": "/s", "trust": ["/t.pub"]}
    tls = {"ca": "/i/ca.crt", "cert": "/i/device.pem", "key": "/i/device.pem"}
    enrolled = {**base, "mqtt": {"host": "m", "tls": tls}, "enrollment": {"server": "https://fleet.example"}}
    assert renewal_problem(check_config(enrolled, None)) == ""
    assert "no enrollment section" in renewal_problem(check_config({**base, "mqtt": enrolled["mqtt"]}, None))
    split = {**enrolled, "mqtt": {"host": "m", "tls": {**tls, "key": "/i/device.key"}}}
    assert "one file" in renewal_problem(check_config(split, None))
