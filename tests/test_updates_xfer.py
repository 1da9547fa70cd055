"""The device side of a chunked MQTT transfer (device_agent/updates/xfer.py) against the host's
sender over a real mosquitto: the file is assembled and checked against the announced sha256,
and bytes that do not match it are refused with nothing left behind."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from device_agent.updates.xfer import WINDOW, Receiver, TransferError, XferSpec
from edgepack_core.mqtt_settings import MqttSettings
from edgepack_core.mqtt_transport import MqttTransport
from edgepack_core.protocol.codec import chunk_count
from edgepack_core.protocol.topics import Topics
from sdk.deploy import XferSender

TOPICS = Topics()
CHUNK = 1024


@pytest.fixture()
def transports(mosquitto_broker):
    pair = [MqttTransport(MqttSettings(host="127.0.0.1", port=mosquitto_broker.port, client_id=name))
            for name in ("host", "pi-07")]
    for transport in pair:
        transport.start()
        assert transport.wait_connected(10)
    yield pair
    for transport in pair:
        transport.close()


def _receive(transports, tmp_path: Path, served: bytes, announced: bytes) -> Path:
    host, device = transports
    artifact = tmp_path / "served.edgepkg"
    artifact.write_bytes(served)
    sender = XferSender(host, TOPICS, artifact, "t1", CHUNK, devices=["pi-07"])
    try:
        spec = XferSpec("t1", CHUNK, chunk_count(len(announced), CHUNK))
        receiver = Receiver(device, TOPICS, "pi-07", spec, size=len(announced),
                            sha256=hashlib.sha256(announced).hexdigest(), target=tmp_path / "in" / "x.edgepkg")
        return receiver.run(timeout=60)
    finally:
        sender.close()


def test_a_transfer_of_more_chunks_than_the_request_window_is_assembled_whole(transports, tmp_path):
    (tmp_path / "in").mkdir()
    data = os.urandom(CHUNK * (WINDOW + 3) + 17)  # more than one window, the last chunk short
    target = _receive(transports, tmp_path, data, data)
    assert target.read_bytes() == data
    assert sorted(p.name for p in target.parent.iterdir()) == ["x.edgepkg"], "the .part and .chunks remain"


def test_bytes_that_do_not_match_the_announced_sha256_are_refused_and_removed(transports, tmp_path):
    (tmp_path / "in").mkdir()
    announced = os.urandom(CHUNK * 3)
    served = announced[:-1] + bytes([announced[-1] ^ 1])  # same size, one bit off
    with pytest.raises(TransferError, match="the assembled file does not match the sha256"):
        _receive(transports, tmp_path, served, announced)
    assert list((tmp_path / "in").iterdir()) == []
