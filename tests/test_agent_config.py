"""agent.yaml is parsed once into frozen dataclasses (device_agent/config.py): each section's
fields are exactly its schema keys, values arrive typed (floats, tuples, absolute paths), an
unknown key anywhere is refused with its dotted path, and what used to be checked only when the
daemon started (the topic root) is refused when the file loads."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from device_agent.config import (
    CONFIG_SCHEMA,
    AgentConfig,
    ApiSettings,
    BrokerSettings,
    HealthWindow,
    LimitSettings,
    OutboxSettings,
    UpdateSettings,
    check_config,
    load_config,
)
from device_agent.errors import ConfigError
from device_agent.memory import MemorySettings
from device_agent.telemetry.reporter import settings_from_config
from edgepack_core.artifact import Limits
from edgepack_core.errors import SchemaError
from edgepack_core.mqtt_settings import TlsSettings

BASE = {"device_id": "pi-07", "store": "store", "trust": ["keys/release.pub"]}
FULL_YAML = """\
device_id: pi-07
store: store
trust: [keys/release.pub]
operator_keys: [keys/op.pub]
profile: rpi
threads: 2
artifact: first.edgepkg
log_level: debug
api: {listen: "0.0.0.0:9000", read_timeout_s: 12, max_streams: 3, stream_idle_s: 2, max_body_bytes: 1000,
      max_buffered_bytes: 1000}
limits: {max_artifact_bytes: 100, max_member_bytes: 50, max_total_bytes: 200}
mqtt:
  host: broker.local
  port: 8883
  telemetry_interval: 5
  groups: [kitchen, hall]
  username: pi-07
  password: s3cret-word
  tls: {ca: ca.pem, cert: dev.pem, key: dev.key}
  queue: {path: outbox/o.db, max_messages: 7}
updates:
  health_window_s: {default: 60}
  max_error_rate: 0
  min_latency_increase_ms: 5
  allowed_origins: ["https://objects.example:443"]
  download_dir: dl
  min_free_bytes: 0
"""


def _section_schema(*path: str) -> dict[str, Any]:
    node = CONFIG_SCHEMA
    for key in path:
        node = node["properties"][key]
    return node


@pytest.mark.parametrize(
    "cls, path",
    [
        (ApiSettings, ("api",)),
        (LimitSettings, ("limits",)),
        (BrokerSettings, ("mqtt",)),
        (TlsSettings, ("mqtt", "tls")),
        (OutboxSettings, ("mqtt", "queue")),
        (UpdateSettings, ("updates",)),
        (MemorySettings, ("memory",)),
    ],
)
def test_each_typed_section_holds_exactly_its_schema_keys(cls, path):
    fields = {field.name for field in dataclasses.fields(cls)}
    assert fields == set(_section_schema(*path)["properties"])


def test_the_health_window_and_the_whole_config_hold_exactly_their_schema_keys():
    window = _section_schema("updates", "health_window_s")["anyOf"][1]["properties"]
    assert {field.name for field in dataclasses.fields(HealthWindow)} == set(window)
    top = {field.name for field in dataclasses.fields(AgentConfig)} - {"path"}
    assert top == set(CONFIG_SCHEMA["properties"])


def test_a_full_agent_yaml_parses_into_typed_frozen_values(tmp_path):
    (tmp_path / "agent.yaml").write_text(FULL_YAML)
    config = load_config(tmp_path / "agent.yaml")
    root = tmp_path.resolve()
    assert config.trust == (root / "keys" / "release.pub",) and config.operator_keys == (root / "keys" / "op.pub",)
    assert (config.profile, config.threads, config.artifact, config.log_level) == (
        "rpi",
        2,
        root / "first.edgepkg",
        "debug",
    )
    assert config.api.address == ("0.0.0.0", 9000)
    assert type(config.api.read_timeout_s) is float and type(config.api.stream_idle_s) is float
    assert config.api.max_streams == 3 and config.api.keep_alive_s == ApiSettings().keep_alive_s
    assert config.limits.reader_limits() == dataclasses.replace(
        Limits(), max_archive_bytes=100, max_member_bytes=50, max_total_bytes=200
    )
    mqtt = config.mqtt
    assert mqtt is not None and mqtt.groups == ("kitchen", "hall") and type(mqtt.telemetry_interval) is float
    assert mqtt.tls == TlsSettings(ca=str(root / "ca.pem"), cert=str(root / "dev.pem"), key=str(root / "dev.key"))
    assert mqtt.queue == OutboxSettings(path=root / "outbox" / "o.db", max_messages=7)
    updates = config.updates
    assert updates.health_window_s == HealthWindow(default=60.0, min=5.0, max=3600.0)
    assert updates.health_policy().max_error_rate == 0.0 and type(updates.max_error_rate) is float
    assert updates.health_policy().min_latency_increase_s == 0.005
    assert updates.allowed_origins == ("https://objects.example:443",) and updates.allowed_names is None
    assert (updates.download_dir, updates.min_free_bytes) == (root / "dl", 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.updates.enabled = False  # type: ignore[misc]
    assert "s3cret-word" not in repr(config)


def test_defaults_fill_every_absent_section(tmp_path):
    config = check_config(BASE, tmp_path / "agent.yaml")
    assert (config.api, config.limits, config.mqtt, config.updates) == (
        ApiSettings(),
        LimitSettings(),
        None,
        UpdateSettings(),
    )
    assert config.limits.reader_limits() == Limits()
    assert config.api.address == ("127.0.0.1", 8750)
    assert check_config({**BASE, "api": {"enabled": False}}, None).api.address is None


@pytest.mark.parametrize(
    "path",
    [
        "bogus",
        "api.bogus",
        "limits.bogus",
        "mqtt.bogus",
        "mqtt.tls.bogus",
        "mqtt.queue.bogus",
        "updates.bogus",
        "updates.health_window_s.bogus",
        "memory.bogus",
    ],
)
def test_an_unknown_key_is_refused_naming_its_path(tmp_path, path):
    document: dict[str, Any] = {
        **BASE,
        "mqtt": {"host": "b", "tls": {}, "queue": {}},
        "updates": {"health_window_s": {}},
    }
    *parents, leaf = path.split(".")
    node = document
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = 1
    with pytest.raises(SchemaError) as caught:
        check_config(document, tmp_path / "agent.yaml")
    assert f": {path}: unknown key" in str(caught.value), caught.value


def test_an_empty_tls_section_means_tls_with_the_system_cas(tmp_path):
    """``tls: {}`` asks for TLS; it must not quietly connect in plain text."""
    config = check_config({**BASE, "mqtt": {"host": "broker.local", "tls": {}}}, tmp_path / "agent.yaml")
    assert config.mqtt is not None
    assert settings_from_config(config.mqtt, "pi-07").tls == TlsSettings()
    plain = check_config({**BASE, "mqtt": {"host": "broker.local"}}, tmp_path / "agent.yaml")
    assert plain.mqtt is not None and settings_from_config(plain.mqtt, "pi-07").tls is None


@pytest.mark.parametrize(
    "root, refused",
    [
        ("edgepack/v1", False),
        ("site-a/edge.pack_2", False),
        ("a/+/b", True),
        ("a//b", True),
        ("$SYS/x", True),
    ],
)
def test_a_bad_topic_root_is_refused_when_agent_yaml_loads(tmp_path, root, refused):
    document = {**BASE, "mqtt": {"host": "b", "topic_root": root}}
    if not refused:
        config = check_config(document, tmp_path / "agent.yaml")
        assert config.mqtt is not None and settings_from_config(config.mqtt, "pi-07").topic_root == root
        return
    with pytest.raises(ConfigError, match=r"mqtt\.topic_root"):
        check_config(document, tmp_path / "agent.yaml")


@pytest.mark.parametrize("listen, refused", [("h:65535", False), ("h:65536", True), (":1", False), ("h:0", True)])
def test_the_listen_port_is_bounded(tmp_path, listen, refused):
    document = {**BASE, "api": {"listen": listen}}
    if refused:
        with pytest.raises(ConfigError, match=r"api\.listen"):
            check_config(document, tmp_path / "agent.yaml")
    else:
        assert check_config(document, tmp_path / "agent.yaml").api.address is not None


def test_a_body_limit_over_the_buffer_is_refused_and_equal_passes(tmp_path):
    equal = {**BASE, "api": {"max_body_bytes": 4096, "max_buffered_bytes": 4096}}
    assert check_config(equal, tmp_path / "agent.yaml").api.max_buffered_bytes == 4096
    with pytest.raises(ConfigError, match=r"api\.max_buffered_bytes"):
        check_config({**BASE, "api": {"max_body_bytes": 4097, "max_buffered_bytes": 4096}}, tmp_path / "a.yaml")


def test_a_password_without_a_username_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"mqtt\.password"):
        check_config({**BASE, "mqtt": {"host": "b", "password": "x"}}, tmp_path / "agent.yaml")


def test_paths_resolve_against_the_config_folder_not_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "etc"
    config = check_config({**BASE, "updates": {"download_dir": "../dl"}}, folder / "agent.yaml")
    assert config.store == (folder / "store").resolve() and config.updates.download_dir == (tmp_path / "dl").resolve()
    assert isinstance(config.store, Path)
