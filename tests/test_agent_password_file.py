"""agent.yaml takes the broker password from a file (``mqtt.password_file``, mode checked like the
fleet server's token file); an inline ``mqtt.password`` still works, with one deprecation warning
from ``edgepack-agent run``."""

from __future__ import annotations

import re
import subprocess

import pytest

from device_agent.config import MAX_PASSWORD_FILE_BYTES, check_config, inline_password_warning
from device_agent.errors import ConfigError
from tests.agent_process import AgentProcess
from tests.conftest import cli


def _config(tmp_path, **mqtt):
    doc = {"device_id": "d1", "store": str(tmp_path / "store"), "trust": ["k.pub"],
           "mqtt": {"host": "broker", "username": "d1", **mqtt}}
    return check_config(doc, tmp_path / "agent.yaml")


def _secret(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "mqtt-password"
    path.write_text(text)
    path.chmod(mode)
    return path


def test_the_password_comes_from_a_file_only_its_owner_can_read(tmp_path):
    path = _secret(tmp_path, "s3cret-Pa55\nignored second line\n")
    config = _config(tmp_path, password_file="mqtt-password")
    assert config.mqtt.password == "s3cret-Pa55" and config.mqtt.password_file == path
    assert "s3cret" not in repr(config)  # never in a log line that prints the config
    assert inline_password_warning(config) == ""
    path.chmod(0o640)
    with pytest.raises(ConfigError, match=re.escape("readable by others (mode 640); chmod 600 it")) as caught:
        _config(tmp_path, password_file="mqtt-password")
    assert "mqtt.password_file" in str(caught.value) and "s3cret" not in str(caught.value)


def test_a_password_file_is_bounded_and_must_hold_a_password(tmp_path):
    _secret(tmp_path, "x" * MAX_PASSWORD_FILE_BYTES)
    assert len(_config(tmp_path, password_file="mqtt-password").mqtt.password) == MAX_PASSWORD_FILE_BYTES
    _secret(tmp_path, "x" * (MAX_PASSWORD_FILE_BYTES + 1))
    with pytest.raises(ConfigError, match=f"over {MAX_PASSWORD_FILE_BYTES} bytes"):
        _config(tmp_path, password_file="mqtt-password")
    _secret(tmp_path, "\n\n")
    with pytest.raises(ConfigError, match="holds no password"):
        _config(tmp_path, password_file="mqtt-password")
    with pytest.raises(ConfigError, match="cannot read"):
        _config(tmp_path, password_file="missing")


def test_a_password_given_twice_or_without_a_username_is_refused(tmp_path):
    _secret(tmp_path, "pw\n")
    with pytest.raises(ConfigError, match=re.escape("together with mqtt.password_file")):
        _config(tmp_path, password_file="mqtt-password", password="pw")
    doc = {"device_id": "d1", "store": "s", "trust": ["k.pub"], "mqtt": {"host": "b", "password_file": "x"}}
    with pytest.raises(ConfigError, match=re.escape("mqtt.password_file: is set without mqtt.username")):
        check_config(doc, tmp_path / "agent.yaml")


def test_an_inline_password_still_works_with_one_deprecation_warning(tmp_path, mosquitto_broker, keypair):
    config = _config(tmp_path, password="inline-pw")
    assert config.mqtt.password == "inline-pw" and "deprecated" in inline_password_warning(config)
    agent = AgentProcess(tmp_path, device="pw-1", broker_port=mosquitto_broker.port, trust=keypair[1],
                         artifact=None)
    text = agent.config.read_text().replace("groups: []}", "groups: [], username: pw-1, password: inline-pw}")
    agent.config.write_text(text)
    done = subprocess.Popen([cli("edgepack-agent"), "run", "--config", str(agent.config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in done.stdout:  # the warning is printed before the agent serves: read until it
            lines.append(line)
            if "HTTP API on" in line or len(lines) > 200:
                break
    finally:
        done.terminate()
        rest, _ = done.communicate(timeout=60)  # drained: a full pipe would block the agent's shutdown logging
    output = "".join(lines) + rest  # all of it: the warning once, the password never
    assert output.count("mqtt.password in agent.yaml is deprecated") == 1, output
    assert "inline-pw" not in output
