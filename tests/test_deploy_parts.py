"""The parts of edgepack deploy below the orchestrator: the chunk sender reads ranges from the
file (never the artifact in memory), commands are signed over every field the device checks,
and deploy options are validated without naming CLI flags."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import pytest

from edgepack_core.command_auth import authorize_command, verify_command
from edgepack_core.errors import CommandSignatureError
from edgepack_core.mqtt_settings import MqttSettings
from edgepack_core.mqtt_transport import Incoming, MqttTransport
from edgepack_core.protocol.codec import decode_chunk, request_payload
from edgepack_core.protocol.commands import Command, CommandBuildError, encode_command, parse_command
from edgepack_core.protocol.topics import Topics
from edgepack_core.signing import TrustStore, generate_private_key
from sdk.broker import BrokerOptionError, BrokerOptions, read_password_file
from sdk.deploy import DeployOptions, XferSender, make_command
from sdk.errors import DeployError

TOPICS = Topics()


class _RecordingTransport(MqttTransport):
    """A transport that is never started: subscriptions are recorded, publishes kept in a list."""

    def __init__(self) -> None:
        super().__init__(MqttSettings(host="127.0.0.1"))
        self.sent: list[tuple[str, bytes]] = []

    def publish(self, topic, payload, qos=1, retain=False, *, on_done=None):  # type: ignore[override]
        self.sent.append((topic, bytes(payload)))
        return True


def _request(device: str, transfer: str, chunks: list[int]) -> Incoming:
    return Incoming(TOPICS.xfer(device, transfer, "req"), request_payload(chunks), 1, False)


def test_chunk_sender_reads_ranges_not_the_whole_artifact(tmp_path: Path):
    big = tmp_path / "big.edgepkg"
    with open(big, "wb") as handle:  # 1 GiB, sparse: cheap on disk, costly if read whole
        handle.truncate(1 << 30)
        handle.seek((1 << 30) - 5)
        handle.write(b"tail!")
    transport = _RecordingTransport()
    tracemalloc.start()
    try:
        sender = XferSender(transport, TOPICS, big, "t1", 64 * 1024, devices=["pi-07"])
        sender._on_request(_request("pi-07", "t1", [sender.chunks - 1, 0]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        sender.close()
    assert peak < 4 * 1024 * 1024, f"{peak} bytes traced for two 64 KiB chunks of a 1 GiB artifact"
    assert [decode_chunk(frame)[0] for _, frame in transport.sent] == [sender.chunks - 1, 0]
    assert decode_chunk(transport.sent[0][1])[1].endswith(b"tail!")
    assert transport.sent[0][0] == TOPICS.xfer("pi-07", "t1", "data")


def test_chunk_sender_answers_only_rollout_devices_and_its_own_transfer(tmp_path: Path):
    artifact = tmp_path / "a.edgepkg"
    artifact.write_bytes(bytes(range(256)) * 40)
    transport = _RecordingTransport()
    sender = XferSender(transport, TOPICS, artifact, "t1", 1024, devices=["pi-07"])
    try:
        sender._on_request(_request("pi-99", "t1", [0]))      # not in this rollout
        sender._on_request(_request("pi-07", "t2", [0]))      # another transfer
        sender._on_request(_request("pi-07", "t1", [10, 9]))  # 10 is past the last chunk (0..9)
        assert [decode_chunk(frame) for _, frame in transport.sent] == [(9, artifact.read_bytes()[9 * 1024:])]
    finally:
        sender.close()
    sender._on_request(_request("pi-07", "t1", [0]))  # closed: answers nothing, raises nothing
    assert len(transport.sent) == 1


def _deploy_fields() -> dict:
    return {"name": "digits", "version": "1.2.0", "size": 10, "sha256": "ab" * 32,
            "artifact": {"url": "http://127.0.0.1:1/a.edgepkg"}}


def test_signed_deploy_carries_allow_contract_change_under_the_signature():
    key = generate_private_key()
    trust = TrustStore([key.private.public_key()])
    command = make_command("deploy", device="pi-07", operator_key=key, allow_contract_change=True,
                           **_deploy_fields())
    assert command["allow_contract_change"] is True and set(command["signature"]) == {"keyid", "sig"}
    assert verify_command(command, trust) == key.key_id
    parsed = parse_command(encode_command(command), time.time())
    assert isinstance(parsed, Command)
    assert authorize_command(parsed.body, trust, device_id="pi-07", groups=[], now=time.time()) == key.key_id
    with pytest.raises(CommandSignatureError):
        verify_command({**command, "allow_contract_change": False}, trust)
    with pytest.raises(CommandSignatureError):
        authorize_command(parsed.body, trust, device_id="pi-08", groups=[], now=time.time())


def test_unsigned_commands_have_no_signature_field():
    command = make_command("rollback", device="pi-07", from_version={"name": "digits", "version": "1.2.0"})
    assert "signature" not in command and command["target"] == {"device": "pi-07"}


def test_a_rollback_cannot_be_built_without_the_version_it_rolls_back_from():
    with pytest.raises(CommandBuildError) as caught:
        make_command("rollback", device="pi-07")
    assert "from_version" in str(caught.value)


@pytest.mark.parametrize(("text", "parsed"), [
    ("digits@1.2.0", {"name": "digits", "version": "1.2.0"}),
    ("a@b@1.0.0", None), ("digits", None), ("@1.2.0", None), ("digits@", None), ("bad name@1.0.0", None),
])
def test_from_name_at_version(text, parsed):
    from edgepack_core.errors import UsageError
    from sdk.deploy import parse_model_ref

    if parsed is not None:
        assert parse_model_ref(text) == parsed
        return
    with pytest.raises(UsageError) as caught:
        parse_model_ref(text)
    assert "is not a model as NAME@VERSION" in str(caught.value) and "--" not in str(caught.value)


def test_library_errors_do_not_name_cli_flags(tmp_path: Path):
    broker = BrokerOptions("127.0.0.1:1883")
    problems = []
    for call in (lambda: DeployOptions(artifact=tmp_path / "a", broker=broker),
                 lambda: BrokerOptions("no-port"),
                 lambda: BrokerOptions("h:1", password="x"),
                 lambda: read_password_file(tmp_path / "missing")):
        with pytest.raises((DeployError, BrokerOptionError)) as caught:
            call()
        problems.append(str(caught.value))
    assert all("--" not in problem for problem in problems), problems


def test_password_file_first_line_bounded_and_non_empty(tmp_path: Path):
    path = tmp_path / "pw"
    path.write_text("s3cret\nignored\n")
    assert read_password_file(path) == "s3cret"
    path.write_text("\n")
    with pytest.raises(BrokerOptionError, match="empty"):
        read_password_file(path)
    path.write_bytes(b"x" * 4097)
    with pytest.raises(BrokerOptionError, match="over"):
        read_password_file(path)
    path.write_bytes(b"x" * 4096)
    assert read_password_file(path) == "x" * 4096


@pytest.mark.parametrize(("devices", "group", "field"), [(("../x",), None, "device"), ((), "a/b", "group")])
def test_deploy_targets_are_validated_before_anything_connects(tmp_path: Path, devices, group, field):
    from edgepack_core.protocol.ids import InvalidNameError

    with pytest.raises(InvalidNameError) as caught:
        DeployOptions(artifact=tmp_path / "a", broker=BrokerOptions("127.0.0.1:1883"), devices=devices, group=group)
    assert caught.value.path == field


@pytest.mark.parametrize(("transfer", "what"), [("http", "HTTP server"), ("mqtt", "chunk sender")])
def test_deploy_without_wait_needs_a_hosted_url(tmp_path: Path, transfer, what):
    from tests.conftest import run_cli

    artifact = tmp_path / "a.edgepkg"
    artifact.write_bytes(b"x")
    result = run_cli("edgepack", "deploy", str(artifact), "--device", "pi-07", "--broker", "127.0.0.1:1",
                     "--transfer", transfer)
    assert result.returncode == 2 and f"the built-in {what} lives only while deploy runs" in result.stderr
