"""What an idle agent has imported: the run path loads the MQTT client, telemetry and the update
machinery only when agent.yaml has ``mqtt:`` and Pillow only when an image arrives, so an
agent serving a model over HTTP does not hold them (issue 25 item 10; the memory they cost is
measured by ``tools/bench/agent_rss.py``, BENCHMARKS.md, never asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.artifacts import build_artifact
from tests.broker import free_port

ROOT = Path(__file__).resolve().parent.parent
# The run path as `edgepack-agent run` takes it (the CLI module, then the daemon started on the
# config), in a fresh interpreter: prints whether a model is served and every module loaded.
RUN_PATH = """
import json, sys
import device_agent.cli
from device_agent.config import load_config
from device_agent.daemon import Daemon
daemon = Daemon(load_config(sys.argv[1])).start()
try:
    print(json.dumps({"served": daemon.service.model is not None, "modules": sorted(sys.modules)}))
finally:
    daemon.stop()
"""
MQTT_AND_UPDATES = (
    "paho",
    "edgepack_core.mqtt_transport",
    "device_agent.telemetry.reporter",
    "device_agent.telemetry.metrics",
    "device_agent.updates.service",
    "device_agent.updates.download",
    "device_agent.updates.xfer",
    "device_agent.updates.journal",
    "device_agent.telemetry.outbox",
    "sqlite3",
)
ONLY_FOR_IMAGES = ("PIL",)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, keypair) -> Path:
    return build_artifact(tmp_path_factory.mktemp("lazy"), keypair[0])


def loaded_by_an_idle_agent(folder: Path, artifact: Path, public: Path, mqtt_port: int | None) -> set[str]:
    config = folder / "agent.yaml"
    mqtt = f"mqtt: {{host: 127.0.0.1, port: {mqtt_port}}}\n" if mqtt_port else ""
    config.write_text(
        f"device_id: lazy-01\nstore: {folder / 'store'}\ntrust: [{public}]\nprofile: x86\n"
        f'artifact: {artifact}\napi: {{listen: "127.0.0.1:{free_port()}"}}\n{mqtt}'
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, "-c", RUN_PATH, str(config)], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer = json.loads(done.stdout.splitlines()[-1])
    assert answer["served"]
    return set(answer["modules"])


@pytest.fixture(scope="module")
def without_mqtt(tmp_path_factory, artifact, keypair) -> set[str]:
    return loaded_by_an_idle_agent(tmp_path_factory.mktemp("http-only"), artifact, keypair[1], None)


def matching(modules: set[str], names: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == name or m.startswith(name + ".") for name in names))


def test_an_agent_without_mqtt_never_loads_the_mqtt_client_telemetry_or_updates(without_mqtt):
    assert "onnxruntime" in without_mqtt and "device_agent.http.server" in without_mqtt  # it really serves
    assert matching(without_mqtt, MQTT_AND_UPDATES) == []


def test_an_idle_agent_has_not_loaded_pillow_before_an_image_arrives(without_mqtt):
    assert matching(without_mqtt, ONLY_FOR_IMAGES) == []


def test_an_agent_with_mqtt_loads_them_when_it_starts_them(tmp_path, artifact, keypair, mosquitto_broker):
    modules = loaded_by_an_idle_agent(tmp_path, artifact, keypair[1], mosquitto_broker.port)
    assert matching(modules, MQTT_AND_UPDATES) != []
    assert {"paho.mqtt.client", "device_agent.telemetry.reporter", "device_agent.updates.service"} <= modules
    assert matching(modules, ONLY_FOR_IMAGES) == []


WEB_FRAMEWORKS = ("hypercorn", "starlette", "anyio", "h2", "wsproto")


def test_an_idle_agent_serves_http_without_hypercorn_starlette_or_anyio(without_mqtt):
    """The HTTP API is the agent's own server and router on h11 (device_agent/http/server.py, web.py)."""
    assert {"h11", "device_agent.http.server", "device_agent.http.web"} <= without_mqtt  # it really serves HTTP
    assert matching(without_mqtt, WEB_FRAMEWORKS) == []


def test_an_idle_agent_loads_the_openapi_document_and_the_v2_protocol_with_their_first_request(without_mqtt):
    assert matching(without_mqtt, ("device_agent.http.openapi", "device_agent.http.oip")) == []


def test_an_idle_agent_without_mqtt_has_not_imported_cryptography(without_mqtt):
    """Signatures are checked through libsodium (edgepack_core/ed25519.py): the store verified
    the installed artifact at start, and cryptography (6.6 MiB resident) never loaded."""
    assert "nacl.bindings" in without_mqtt and "edgepack_core.ed25519" in without_mqtt
    assert matching(without_mqtt, ("cryptography",)) == []


def test_an_idle_agent_with_mqtt_has_not_imported_cryptography(tmp_path, artifact, keypair, mosquitto_broker):
    """With ``mqtt:``, still without cryptography: only enroll and a certificate renewal import
    it, when they run (the command and settings-document checks load with the first command,
    and without it too: the test after the next)."""
    modules = loaded_by_an_idle_agent(tmp_path, artifact, keypair[1], mosquitto_broker.port)
    assert {"paho.mqtt.client", "device_agent.updates.service"} <= modules
    assert matching(modules, ("cryptography",)) == []


# What an idle agent needs only when a rare event comes (issue 25 item 10): a pipeline document or
# a golden stream's replay, a settings document, an audio model's WAV decoder, the parsers of the
# state messages and the MQTT settings (an agent without mqtt: never sends one), a download.
ONLY_FOR_RARE_EVENTS = (
    "device_agent.pipelines",
    "edgepack_core.pipeline_spec",
    "edgepack_core.settings_doc",
    "device_agent.updates.settings_apply",
    "edgepack_core.audio",
    "wave",
    "edgepack_core.protocol.messages",
    "edgepack_core.mqtt_settings",
    "urllib.request",
)
# With mqtt: the update service is up, but what a command brings loads with the command: a
# deploy's download (http.client and urllib's opener), MQTT transfer and golden probes, the
# authorization of a signed command, settings documents, certificate renewal.
ONLY_FOR_COMMANDS = (
    "device_agent.pipelines",
    "edgepack_core.pipeline_spec",
    "edgepack_core.settings_doc",
    "device_agent.updates.settings_apply",
    "device_agent.updates.download",
    "device_agent.updates.xfer",
    "edgepack_core.protocol.codec",
    "device_agent.updates.golden_probe",
    "edgepack_core.command_auth",
    "device_agent.updates.renewal",
    "edgepack_core.audio",
    "wave",
)


def test_an_idle_agent_without_mqtt_holds_no_module_of_a_rare_event(without_mqtt):
    assert {"device_agent.remote_settings", "device_agent.updates.golden_stream", "device_agent.store"} <= without_mqtt
    assert matching(without_mqtt, ONLY_FOR_RARE_EVENTS) == []


def test_an_idle_agent_with_mqtt_loads_what_a_command_needs_only_when_one_comes(
    tmp_path, artifact, keypair, mosquitto_broker
):
    modules = loaded_by_an_idle_agent(tmp_path, artifact, keypair[1], mosquitto_broker.port)
    assert {"device_agent.updates.service", "device_agent.updates.deploy_flow", "paho.mqtt.client"} <= modules
    assert matching(modules, ONLY_FOR_COMMANDS) == []


def test_the_modules_a_command_loads_do_not_import_cryptography():
    """What the first command loads (its authorization, a settings document) checks signatures
    without cryptography, as the agent did at start before they were lazy."""
    code = (
        "import json, sys\n"
        "import device_agent.updates.service, device_agent.updates.settings_apply, edgepack_core.command_auth\n"
        "print(json.dumps(sorted(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, check=True)
    modules = set(json.loads(done.stdout))
    assert {"edgepack_core.command_auth", "edgepack_core.settings_doc"} <= modules
    assert matching(modules, ("cryptography",)) == []
