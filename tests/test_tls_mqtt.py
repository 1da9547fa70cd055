"""TLS between the MQTT clients (host commands and the agent) and a real mosquitto TLS listener:
a plain client on the TLS port is told the port expects TLS, a certificate from another CA is
named with the broker's address, on both sides; never a bare "cannot reach the broker"."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgepack_core.errors import BrokerTlsError
from edgepack_core.mqtt_settings import MqttSettings, TlsSettings
from edgepack_core.mqtt_transport import MqttTransport
from tests.agent_process import AgentProcess
from tests.artifacts import build_artifact
from tests.broker import Broker, free_port, start_mosquitto, wait_until
from tests.conftest import run_cli
from tests.tls_certs import make_ca


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(folder / "ca"), make_ca(folder / "other", "another CA")
    return {"ca": ca, "other": other, "broker": ca.issue(folder / "b", "broker")}


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory, pki) -> Iterator[Broker]:
    """mosquitto with only a TLS listener (the shipped config's 8883 section, on a free port)."""
    port = free_port()
    broker = start_mosquitto(f"cafile {pki['ca'].cert}\ncertfile {pki['broker'].cert}\nkeyfile {pki['broker'].key}\n",
                             port=port, workdir=tmp_path_factory.mktemp("mosquitto"))
    yield broker
    broker.kill()


@pytest.fixture(scope="module")
def plain_broker(tmp_path_factory) -> Iterator[Broker]:
    broker = start_mosquitto(workdir=tmp_path_factory.mktemp("plain"))
    yield broker
    broker.kill()


def _settings(broker: Broker, tls: TlsSettings | None) -> MqttSettings:
    return MqttSettings(host="127.0.0.1", port=broker.port, client_id="probe", tls=tls, reconnect_min=0.05,
                        reconnect_max=0.3)


def test_a_plain_client_on_the_tls_port_is_told_the_port_expects_tls(tls_broker):
    transport = MqttTransport(_settings(tls_broker, None))
    try:
        with pytest.raises(BrokerTlsError) as failure:
            transport.connect_or_raise(10)
    finally:
        transport.close()
    assert str(failure.value) == (f"the broker port 127.0.0.1:{tls_broker.port} seems to expect TLS (set mqtt.tls / "
                                  "--tls-ca); it closed a plain MQTT connection without an answer")


def test_a_plain_broker_that_closes_is_not_taken_for_a_tls_port(plain_broker):
    """The probe asks the port, it does not guess: a plain listener is still "cannot reach"."""
    from tests.broker import port_accepts

    plain_broker.stop()
    assert not port_accepts(plain_broker.port)
    transport = MqttTransport(_settings(plain_broker, None))
    try:
        with pytest.raises(Exception) as failure:
            transport.connect_or_raise(1)
    finally:
        transport.close()
        plain_broker.start()
    assert not isinstance(failure.value, BrokerTlsError)
    assert "cannot reach the broker" in str(failure.value)


def test_a_broker_certificate_from_another_ca_is_named_with_the_broker_address(tls_broker, pki, caplog):
    transport = MqttTransport(_settings(tls_broker, TlsSettings(ca=str(pki["other"].cert))))
    caplog.set_level(logging.WARNING, logger="edgepack.mqtt")
    try:
        with pytest.raises(BrokerTlsError) as failure:
            transport.connect_or_raise(10)
    finally:
        transport.close()
    assert str(failure.value) == (f"certificate verify failed: self-signed certificate in certificate chain "
                                  f"(127.0.0.1:{tls_broker.port}); set mqtt.tls.ca (agent.yaml) or --tls-ca to the "
                                  "CA that signed the broker's certificate")


def test_a_tls_client_on_a_plain_port_is_told_so(plain_broker, pki):
    transport = MqttTransport(_settings(plain_broker, TlsSettings(ca=str(pki["ca"].cert))))
    try:
        with pytest.raises(BrokerTlsError) as failure:
            transport.connect_or_raise(10)
    finally:
        transport.close()
    assert f"the broker at 127.0.0.1:{plain_broker.port} does not speak TLS on this port" in str(failure.value)


def test_the_host_cli_says_it_in_one_line(tls_broker, pki):
    plain = run_cli("edgepack", "fleet", "status", "--broker", tls_broker.address, "--wait", "1", timeout=60)
    assert plain.returncode == 1 and len(plain.stderr.strip().splitlines()) == 1, plain.stderr
    assert "seems to expect TLS (set mqtt.tls / --tls-ca)" in plain.stderr
    foreign = run_cli("edgepack", "fleet", "status", "--broker", tls_broker.address, "--tls-ca",
                      str(pki["other"].cert), "--wait", "1", timeout=60)
    assert foreign.returncode == 1 and len(foreign.stderr.strip().splitlines()) == 1, foreign.stderr
    assert f"certificate verify failed: self-signed certificate in certificate chain ({tls_broker.address})" \
        in foreign.stderr
    good = run_cli("edgepack", "fleet", "status", "--broker", tls_broker.address, "--tls-ca", str(pki["ca"].cert),
                   "--wait", "0.5", timeout=60)
    assert good.returncode == 0, good.stderr


def test_the_agent_logs_a_plain_connection_to_the_tls_port_once(tmp_path: Path, tls_broker, keypair):
    """The agent keeps retrying in the background (it must never stop trying), and its log says
    why, once, instead of nothing or a line per retry."""
    artifact = build_artifact(tmp_path / "a", keypair[0], version="1.0.0", factor=2.0)
    agent = AgentProcess(tmp_path, device="pi-09", broker_port=tls_broker.port, trust=keypair[1],
                         artifact=artifact).start()
    try:
        assert wait_until(lambda: "seems to expect TLS" in agent.log.read_text(), timeout=30)
        text = agent.log.read_text()
    finally:
        agent.stop()
    assert text.count("seems to expect TLS") == 1, text[-3000:]
