"""The agent's artifact downloads over HTTPS with a private CA (agent.yaml ``updates.ca``): a real
TLS server on loopback with certificates made in the test, the download function and a real
agent daemon taking a deploy command."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from device_agent.config import load_config
from device_agent.errors import ConfigError
from device_agent.updates.download import Bounds, DownloadError, allowed_origins, download
from tests.agent_process import AgentProcess, Observer
from tests.artifacts import build_artifact
from tests.tls_certs import make_ca, serve_https

PAYLOAD = b"edgepack artifact bytes " * 4096


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(folder / "ca"), make_ca(folder / "other", "another CA")
    return {"ca": ca, "other": other, "server": ca.issue(folder / "s", "artifacts"),
            "foreign": other.issue(folder / "f", "foreign"), "expired": ca.issue(folder / "e", "old", expired=True),
            "device": ca.issue(folder / "d", "pi-07", client=True)}


def _fetch(url: str, target: Path, ca: Path | None, client: tuple[str, str] | None = None) -> Path:
    bounds = Bounds(origins=allowed_origins([url]), max_bytes=1 << 20, ca=ca, stall_s=5.0, client=client)
    return download(f"{url}/a.edgepkg", target, size=len(PAYLOAD), sha256=hashlib.sha256(PAYLOAD).hexdigest(),
                    bounds=bounds)


def test_a_download_over_https_verifies_with_updates_ca(tmp_path, pki):
    with serve_https(pki["server"], PAYLOAD) as server:
        assert _fetch(server.url, tmp_path / "a.edgepkg", pki["ca"].cert).read_bytes() == PAYLOAD


def test_a_download_without_the_ca_fails_at_once_with_the_certificate_line(tmp_path, pki):
    """No retry can make an untrusted certificate verify: one connection, and the job's reason
    names the certificate and the host, not "could not fetch from the server"."""
    with serve_https(pki["server"], PAYLOAD) as server, pytest.raises(DownloadError) as failure:
        _fetch(server.url, tmp_path / "a.edgepkg", None)
    host = server.url.split("://")[1]
    assert str(failure.value) == (f"certificate verify failed: unable to get local issuer certificate ({host}); "
                                  "set updates.ca to the CA that signed it")
    assert len(server.connections) == 1
    assert not (tmp_path / "a.edgepkg").exists() and not (tmp_path / "a.edgepkg.part").exists()


def test_a_server_certificate_from_another_ca_is_refused_by_the_agent(tmp_path, pki):
    with serve_https(pki["foreign"], PAYLOAD) as server, pytest.raises(DownloadError) as failure:
        _fetch(server.url, tmp_path / "a.edgepkg", pki["ca"].cert)
    assert str(failure.value).startswith("certificate verify failed: unable to get local issuer certificate")
    assert len(server.connections) == 1


def test_an_expired_artifact_server_certificate_is_named_in_the_reason(tmp_path, pki):
    with serve_https(pki["expired"], PAYLOAD) as server, pytest.raises(DownloadError) as failure:
        _fetch(server.url, tmp_path / "a.edgepkg", pki["ca"].cert)
    assert str(failure.value) == f"certificate verify failed: certificate has expired ({server.url.split('://')[1]})"


def test_the_device_presents_its_certificate_to_an_artifact_server_with_mutual_tls(tmp_path, pki):
    device = (str(pki["device"].cert), str(pki["device"].key))
    with serve_https(pki["server"], PAYLOAD, client_ca=pki["ca"].cert) as server:
        assert _fetch(server.url, tmp_path / "a.edgepkg", pki["ca"].cert, device).read_bytes() == PAYLOAD


def test_a_device_without_a_certificate_is_refused_by_mutual_tls_and_told_why(tmp_path, pki):
    with serve_https(pki["server"], PAYLOAD, client_ca=pki["ca"].cert) as server, \
            pytest.raises(DownloadError) as failure:
        _fetch(server.url, tmp_path / "a.edgepkg", pki["ca"].cert)
    assert str(failure.value).startswith("TLS handshake failed: the server refused this client's certificate or "
                                         f"wants one (tlsv13 alert certificate required) ({server.url.split('://')[1]})")
    assert len(server.connections) == 1


def test_agent_yaml_hands_the_mqtt_client_certificate_to_downloads(tmp_path, pki):
    (tmp_path / "agent.yaml").write_text(
        f"device_id: pi-07\nstore: store\ntrust: [k.pub]\nmqtt: {{host: broker, tls: {{ca: {pki['ca'].cert}, "
        f"cert: {pki['device'].cert}, key: {pki['device'].key}}}}}\n")
    assert load_config(tmp_path / "agent.yaml").client_certificate() == (str(pki["device"].cert),
                                                                         str(pki["device"].key))


def test_updates_ca_is_resolved_beside_agent_yaml_and_a_file_that_is_no_ca_is_refused(tmp_path, pki):
    (tmp_path / "ca.pem").write_bytes(pki["ca"].cert.read_bytes())
    (tmp_path / "agent.yaml").write_text("device_id: pi-1\nstore: store\ntrust: [k.pub]\nupdates: {ca: ca.pem}\n")
    assert load_config(tmp_path / "agent.yaml").updates.ca == (tmp_path / "ca.pem").resolve()
    (tmp_path / "ca.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"updates\.ca: cannot load .*ca\.pem as CA certificates"):
        load_config(tmp_path / "agent.yaml")


def test_the_agent_installs_from_an_https_server_with_its_ca_and_names_a_foreign_certificate(
        tmp_path, mosquitto_broker, keypair, pki):
    """A real agent daemon: a deploy from the private-CA server becomes active; one from a server
    whose certificate another CA signed fails with the certificate line, without five attempts."""
    v1 = build_artifact(tmp_path / "a", keypair[0], version="1.0.0", factor=2.0)
    v2 = build_artifact(tmp_path / "b", keypair[0], version="1.1.0", factor=3.0)
    data = v2.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    with serve_https(pki["server"], data) as good, serve_https(pki["foreign"], data) as foreign:
        agent = AgentProcess(tmp_path, device="pi-07", broker_port=mosquitto_broker.port, trust=keypair[1],
                             artifact=v1, updates={"ca": str(pki["ca"].cert),
                                                   "allowed_origins": [good.url, foreign.url]}).start()
        observer = Observer(mosquitto_broker.port)
        try:
            for job, url in (("tls-foreign", foreign.url), ("tls-good", good.url)):
                command = {"schema": "edgepack.cmd/1", "id": job, "type": "deploy", "expires_at": time.time() + 60,
                           "artifact": {"url": f"{url}/v2.edgepkg"}, "version": "1.1.0", "size": len(data),
                           "sha256": sha}
                observer.publish("edgepack/v1/dev/pi-07/cmd", json.dumps(command))
                assert observer.wait_for(lambda job=job: any(e.get("final") or e["state"] == "failed"
                                                             for e in observer.jobs("pi-07", job)), 60)
            assert agent.version() == "1.1.0"
            failed = [e for e in observer.jobs("pi-07", "tls-foreign") if e["state"] == "failed"]
            host = foreign.url.split("://")[1]
            assert failed and failed[-1]["reason"] == (f"certificate verify failed: unable to get local issuer "
                                                       f"certificate ({host}); set updates.ca to the CA that signed it")
            assert len(foreign.connections) == 1
            assert "certificate verify failed" in agent.log.read_text()
        finally:
            observer.close()
            agent.stop()
