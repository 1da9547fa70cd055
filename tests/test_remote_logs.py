"""Remote logs (issue 25, item 5), end to end: what an agent logged could only be read with
journalctl on the device. A real agent (``edgepack-agent run``) logs in to the shipped broker
config and ACL as pi-07 with its password (``mqtt.password_file``); the fleet server (logged in as the operator) sends a
signed ``fetch-logs``, the agent answers on ``dev/pi-07/logs`` in chunks, the server stores
them and ``edgepack device logs`` prints the lines. The ring survives a restart, the device's
rate limit refuses a fetch over its burst with the time to retry, ``--follow`` ends on Ctrl-C
with exit 0, and the configured password and private keys are never kept, printed or sent.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from edgepack_core.command_auth import sign_command
from edgepack_core.protocol.commands import build_command
from edgepack_core.protocol.topics import Topics
from sdk.keys import load_operator_key
from tests.agent_process import AgentProcess, Observer
from tests.artifacts import build_artifact
from tests.conftest import cli
from tests.fleet_server_process import FleetServerProcess, edgepack, wait_for
from tests.test_broker_acl import USERS, Inbox, login, secured_broker, up  # noqa: F401  (the fixture)

TOPICS = Topics()
DEVICE = "pi-07"
PASSWORD = USERS[DEVICE]

_LEAK = '''
import logging, os, threading, time

def _leak():
    from device_agent.logring import LogRing
    root = logging.getLogger()
    while not any(isinstance(h, LogRing) for h in root.handlers):
        time.sleep(0.02)
    text = open(os.environ["EDGEPACK_TEST_LEAK"]).read()
    leaky = logging.getLogger("edgepack.agent.leaky")
    leaky.warning("a library logged its settings: password=%s and %s", os.environ["EDGEPACK_TEST_PW"], text)
    try:
        raise RuntimeError("connect failed with " + os.environ["EDGEPACK_TEST_PW"] + " " + text)
    except RuntimeError:
        leaky.exception("LEAK-MARK the broker said no")

if os.environ.get("EDGEPACK_TEST_LEAK"):
    threading.Thread(target=_leak, daemon=True).start()
'''


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, keypair) -> Path:
    return build_artifact(tmp_path_factory.mktemp("art"), keypair[0], version="1.1.0")


def _env(server: FleetServerProcess) -> dict[str, str]:
    return {"EDGEPACK_SERVER": server.url, "EDGEPACK_SERVER_TOKEN_FILE": str(server.keys.token_file)}


def _agent(folder: Path, broker, keys, keypair, artifact: Path, logs: dict) -> AgentProcess:
    agent = AgentProcess(folder, device=DEVICE, broker_port=broker.port, trust=keypair[1], artifact=artifact,
                         operator_keys=[keys.operator_pub])
    secret = folder / "mqtt-password"
    secret.write_text(PASSWORD + "\n")
    secret.chmod(0o600)
    login = f"keepalive: 5, username: {DEVICE}, password_file: {secret},"
    text = agent.config.read_text().replace("keepalive: 5,", login)
    agent.config.write_text(text + f"logs: {json.dumps(logs)}\n")
    return agent


def _key_lines(pem: Path) -> list[str]:
    """The private key's base64 body (a label line such as ``edgepack-key: operator`` is no secret)."""
    text = pem.read_text()
    body = text[text.index("-----BEGIN PRIVATE KEY-----"):].splitlines()[1:]
    return [line for line in body if line and not line.startswith("-----")]


@pytest.fixture
def fleet(tmp_path, secured_broker, server_keys, keypair, artifact):  # noqa: F811  (the fixture, as a parameter)
    """The server as the operator, pi-07 leaking its password and the operator's private key into
    its own log (a library logging its settings), an MQTT reader of every message."""
    password_file = tmp_path / "operator-password"
    password_file.write_text(USERS["operator"])
    server = FleetServerProcess(tmp_path / "server", broker=secured_broker.address, keys=server_keys,
                                extra=("--username", "operator", "--password-file", str(password_file))).start()
    leak_dir = tmp_path / "leak"
    leak_dir.mkdir()
    (leak_dir / "sitecustomize.py").write_text(_LEAK)
    env = {"PYTHONPATH": f"{leak_dir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "EDGEPACK_TEST_LEAK": str(server_keys.operator_key), "EDGEPACK_TEST_PW": PASSWORD}
    agent = _agent(tmp_path, secured_broker, server_keys, keypair, artifact,
                   {"fetch_burst": 3, "fetch_per_minute": 0.01})
    inbox = Inbox()
    reader = login(secured_broker, "operator")
    reader.subscribe(TOPICS.everything(), 1, inbox)
    up(reader, TOPICS.everything())
    try:
        agent.start(env=env)
        assert wait_for(lambda: server.call("GET", f"/api/devices/{DEVICE}")[0] == 200, 30), server.log_text()[-2000:]
        yield server, agent, inbox
    finally:
        agent.stop()
        reader.close()
        server.stop()


def _fetch_done(server: FleetServerProcess, body: dict) -> str:
    status, done = server.call("POST", f"/api/devices/{DEVICE}/logs/fetch", body)
    assert status == 200, done
    command = done["command"]
    assert wait_for(lambda: server.get(f"/api/devices/{DEVICE}/logs?request={command}&limit=1")["request"]["complete"],
                    30), server.log_text()[-2000:]
    return command


def test_the_agent_logs_the_server_fetches_and_the_cli_prints_the_lines(fleet, server_keys):
    server, agent, inbox = fleet
    shown = edgepack("device", "logs", DEVICE, "--lines", "500", env=_env(server))
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert any(re.fullmatch(rf"\S+Z INFO +edgepack\.agent: HTTP API on http://127\.0\.0\.1:{agent.port}", line)
               for line in lines), shown.stdout
    entry = server.get("/api/audit?action=logs.fetch")["entries"][0]
    assert entry["actor"] == "admin" and entry["detail"]["lines"] == 500
    assert all(e["kind"] != "fetch-logs" for e in server.get(f"/api/devices/{DEVICE}/history")["entries"])
    chunks = [json.loads(p) for t, p in inbox.messages if t == TOPICS.logs(DEVICE)]
    assert chunks and chunks[-1]["last"] and all(len(p) <= 64 * 1024 for t, p in inbox.messages)

    # The ring survives a restart: what pi-07 logged while stopping comes back with the next fetch.
    agent.stop()
    agent.start()
    shown = edgepack("device", "logs", DEVICE, "--lines", "10000", "--level", "info", env=_env(server))
    assert shown.returncode == 0, shown.stderr
    assert "edgepack.agent: received SIGTERM: stopping" in shown.stdout, shown.stdout
    assert sum("HTTP API on http://127.0.0.1" in line for line in shown.stdout.splitlines()) == 2
    assert all(" DEBUG " not in line for line in shown.stdout.splitlines())

    # The rate limit (logs.fetch_burst 3 after the restart): the third fetch passes, the fourth is
    # refused on the device with the time to retry, and the CLI says so in one line.
    _fetch_done(server, {"lines": 5})
    _fetch_done(server, {"lines": 5})
    refused = edgepack("device", "logs", DEVICE, "--lines", "5", env=_env(server))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert re.fullmatch(r"edgepack: error: pi-07: log fetch refused: over the limit of 3 at once and "
                        r"0\.01 a minute; retry in \d+\.\d s\n", refused.stderr), refused.stderr


def test_following_the_logs_ends_on_ctrl_c_with_exit_0(fleet):
    server, _agent, _inbox = fleet
    command = [cli("edgepack"), "device", "logs", DEVICE, "--lines", "3", "--follow", "--interval", "1"]
    follow = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, **_env(server)})
    try:
        assert follow.stdout is not None
        first = follow.stdout.readline()  # the first fetch's lines are printed: it is following now
        assert " INFO " in first or " WARNING " in first, first
        follow.send_signal(signal.SIGINT)
        assert follow.wait(30) == 0
        assert "Traceback" not in follow.stderr.read()
    finally:
        if follow.poll() is None:
            follow.kill()


def test_the_mqtt_password_and_private_keys_never_appear_in_logs(fleet, server_keys):
    server, agent, inbox = fleet
    shown = edgepack("device", "logs", DEVICE, "--lines", "10000", env=_env(server))
    assert shown.returncode == 0, shown.stderr
    assert "password=[redacted]" in shown.stdout and "[redacted private key]" in shown.stdout, shown.stdout
    assert "LEAK-MARK the broker said no" in shown.stdout  # the exception's record, traceback redacted
    agent.stop()  # its stderr is complete
    secrets = [PASSWORD, *_key_lines(server_keys.operator_key)]
    ring = b"".join(path.read_bytes() for path in (agent.folder / f"{DEVICE}-store" / "logs").glob("*.jsonl"))
    assert b"LEAK-MARK" in ring and b"[redacted private key]" in ring
    stderr = agent.log.read_text()
    assert "LEAK-MARK" in stderr and "[redacted]" in stderr
    payloads = b"".join(payload for _, payload in inbox.messages)
    assert b"LEAK-MARK" in payloads
    stored = json.dumps(server.get(f"/api/devices/{DEVICE}/logs?limit=10000"))
    for secret in secrets:
        assert secret.encode() not in ring, f"{secret!r} kept in the ring"
        assert secret not in stderr, f"{secret!r} printed on stderr"
        assert secret.encode() not in payloads, f"{secret!r} sent over MQTT"
        assert secret not in stored and secret not in shown.stdout


def test_an_unsigned_fetch_logs_is_refused(tmp_path, mosquitto_broker, server_keys, keypair, artifact):
    """With operator_keys, a fetch-logs anyone could publish is rejected and nothing is sent; the
    same command signed by the operator key is answered."""
    agent = AgentProcess(tmp_path, device="cam-09", broker_port=mosquitto_broker.port, trust=keypair[1],
                         artifact=artifact, operator_keys=[server_keys.operator_pub]).start()
    observer = Observer(mosquitto_broker.port)
    try:
        assert observer.wait_for(lambda: observer.of("cam-09/state"))
        unsigned = build_command("fetch-logs", device="cam-09", lines=10)
        observer.publish(TOPICS.cmd("cam-09"), json.dumps(unsigned))
        assert observer.wait_for(lambda: observer.jobs("cam-09", unsigned["id"]))
        event = observer.jobs("cam-09", unsigned["id"])[-1]
        assert event["state"] == "rejected" and "must be signed" in event["reason"], event
        signed = sign_command(build_command("fetch-logs", device="cam-09", lines=10),
                              load_operator_key(server_keys.operator_key))
        observer.publish(TOPICS.cmd("cam-09"), json.dumps(signed))
        assert observer.wait_for(lambda: any(p["request"] == signed["id"] and p["last"]
                                             for p in observer.of("cam-09/logs")))
        assert not [p for p in observer.of("cam-09/logs") if p["request"] == unsigned["id"]]
        done = observer.wait_for(lambda: [e for e in observer.jobs("cam-09", signed["id"]) if e["state"] == "done"])
        assert done
    finally:
        observer.close()
        agent.stop()


def test_log_fetch_mistakes_are_4xx_naming_the_field_and_a_viewer_reads_but_cannot_fetch(fleet):
    server, _agent, _inbox = fleet
    path = f"/api/devices/{DEVICE}/logs"
    for body, field in (({"lines": 10_001}, "lines"), ({"lines": 0}, "lines"), ({"level": "loud"}, "level"),
                        ({"lines": 10_001.0}, "lines"), ({"lines": 9.5}, "lines"), ({"lines": True}, "lines"),
                        ({"since": -1}, "since"), ({"tail": True}, "tail")):
        status, doc = server.call("POST", f"{path}/fetch", body)
        assert status == 400 and field in doc["error"]["message"], (body, doc)
    assert server.call("POST", "/api/devices/nobody/logs/fetch", {})[0] == 404
    assert server.call("GET", "/api/devices/nobody/logs")[0] == 404
    for query, field in (("level=loud", "level"), ("limit=10001", "limit"), ("since=-1", "since"), ("tail=1", "tail")):
        status, doc = server.call("GET", f"{path}?{query}")
        assert status == 400 and field in doc["error"]["message"], (query, doc)
    _fetch_done(server, {"lines": 10_000})  # the limit itself passes
    # JSON's 10000.0 is the integer 10000 (JSON Schema says so): asked and signed as an integer.
    command = _fetch_done(server, {"lines": 10_000.0})
    entry = server.get("/api/audit?action=logs.fetch")["entries"][0]
    assert entry["detail"]["command"] == command and type(entry["detail"]["lines"]) is int, entry
    assert server.get(f"{path}?limit=10000")["records"]
    status, made = server.call("POST", "/api/tokens", {"name": "logs-viewer", "role": "viewer"})
    assert status == 201, made
    assert server.call("GET", path, token=made["token"])[0] == 200
    status, doc = server.call("POST", f"{path}/fetch", {}, token=made["token"])
    assert status == 403 and "logs.fetch needs the operator role" in doc["error"]["message"], doc
