"""The agent as a user meets it: the HTTP API on a real socket, the CLI as real subprocesses,
`edgepack-agent run` as a daemon that stops cleanly on SIGTERM."""

from __future__ import annotations

import http.client
import io
import json
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from device_agent.config import load_config
from device_agent.errors import ConfigError
from device_agent.http.server import ApiServer
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.errors import SchemaError
from edgepack_core.signing import TrustStore, load_public_key
from tests.artifacts import build_artifact
from tests.conftest import cli, run_cli


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, keypair) -> Path:
    return build_artifact(tmp_path_factory.mktemp("http"), keypair[0], version="1.0.0", factor=2.0)


@pytest.fixture()
def server(artifact, keypair, tmp_path):
    verified = extract_artifact(artifact, tmp_path / "m", TrustStore([load_public_key(keypair[1])]))
    service = InferenceService(load_model(verified.root, verified.manifest))
    api = ApiServer(("127.0.0.1", 0), service, max_body_bytes=4096).start()
    yield f"http://127.0.0.1:{api.port}", service
    api.stop()


def _post(url: str, body: bytes, content_type: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def test_predict_json_and_npy_bodies(server):
    base, _ = server
    status, answer = _post(f"{base}/predict", json.dumps({"inputs": {"x": [[1, 2, 3, 4]]}}).encode(),
                           "application/json")
    assert status == 200 and answer["outputs"]["y"] == [[2, 4, 6, 8]]
    assert answer["model"] == {"name": "scale", "version": "1.0.0"} and answer["provider"] == "CPUExecutionProvider"
    status, answer = _post(f"{base}/predict", _npy(np.ones((2, 4), np.float32)), "application/x-npy")
    assert status == 200 and answer["outputs"]["y"] == [[2.0] * 4] * 2


@pytest.mark.parametrize(
    ("body", "content_type", "status", "kind"),
    [
        (json.dumps({"inputs": {"x": [[1, 2, 3]]}}).encode(), "application/json", 400, "shape"),
        (json.dumps({"inputs": {"nope": [[1, 2, 3, 4]]}}).encode(), "application/json", 400, "unknown_input"),
        (json.dumps({"inputs": {"x": [["a", "b", "c", "d"]]}}).encode(), "application/json", 400, "dtype"),
        (b"{not json", "application/json", 400, "bad_json"),
        (_npy(np.ones((1, 4), np.int64)), "application/x-npy", 400, "dtype"),
        (b"\xff\xd8\xff\xe0 corrupt jpeg", "image/jpeg", 415, "unsupported_media"),
        (b"x" * 5000, "application/octet-stream", 413, "too_large"),
    ],
)
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, content_type, status, kind):
    base, _ = server
    got_status, answer = _post(f"{base}/predict", body, content_type)
    assert (got_status, answer["error"]["kind"]) == (status, kind)
    ok_status, ok = _post(f"{base}/predict", json.dumps({"inputs": {"x": [[1, 1, 1, 1]]}}).encode(),
                          "application/json")
    assert ok_status == 200 and ok["outputs"]["y"] == [[2, 2, 2, 2]]


def test_healthz_and_prometheus_metrics(server):
    base, _ = server
    with urllib.request.urlopen(f"{base}/healthz") as response:
        health = json.load(response)
    assert health["status"] == "ok" and health["model"]["provider"] == "CPUExecutionProvider"
    for _ in range(3):
        _post(f"{base}/predict", json.dumps({"inputs": {"x": [[1, 1, 1, 1]]}}).encode(), "application/json")
    _post(f"{base}/predict", json.dumps({"inputs": {"x": [[1]]}}).encode(), "application/json")
    with urllib.request.urlopen(f"{base}/metrics") as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert samples['edgepack_requests_total{status="ok"}'] == 3
    assert samples['edgepack_requests_total{status="client_error"}'] == 1
    assert samples['edgepack_errors_total{kind="shape"}'] == 1
    assert samples['edgepack_inference_latency_seconds_bucket{le="+Inf"}'] == 3
    assert samples["edgepack_inference_latency_seconds_count"] == 3
    assert any(k.startswith("edgepack_model_info{") and 'name="scale"' in k for k in samples)


def test_config_rejects_unknown_and_mistyped_keys(tmp_path):
    config = tmp_path / "agent.yaml"
    config.write_text("device_id: pi-07\nstore: s\ntrust: [k.pub]\nmqtt: {host: h, telemetry_intreval: 5}\n")
    with pytest.raises(SchemaError) as caught:
        load_config(config)
    assert caught.value.path == "mqtt.telemetry_intreval" and "unknown key" in caught.value.problem
    config.write_text("device_id: pi-07\nstore: s\ntrust: [k.pub]\nthreads: many\n")
    with pytest.raises(SchemaError, match="threads: expected integer"):
        load_config(config)
    config.write_text("device_id: pi/07\nstore: s\ntrust: [k.pub]\n")
    with pytest.raises(SchemaError, match="device_id"):
        load_config(config)
    config.write_text("device_id: pi-07\nstore: s\ntrust: [keys/k.pub]\nprofile: rpi\n")
    loaded = load_config(config)
    assert loaded.store == tmp_path / "s" and loaded.trust == (tmp_path / "keys" / "k.pub",)
    assert loaded.profile == "rpi" and loaded.api.address == ("127.0.0.1", 8750)


def test_predict_cli_prints_the_contract_json(artifact, keypair, tmp_path):
    np.save(tmp_path / "in.npy", np.array([[1, 2, 3, 4]], np.float32))
    result = run_cli("edgepack-agent", "predict", "--artifact", str(artifact), "--trust", str(keypair[1]),
                     "--input", str(tmp_path / "in.npy"), "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert set(answer) >= {"model", "provider", "outputs", "result"}
    assert answer["model"] == {"name": "scale", "version": "1.0.0"}
    assert answer["outputs"] == {"y": [[2.0, 4.0, 6.0, 8.0]]} and answer["result"] is None


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["predict", "--artifact", "{artifact}", "--trust", "{pub}", "--input", "{missing}"], 2, "no such input"),
        (["predict", "--artifact", "{missing}", "--trust", "{pub}", "--input", "{npy}"], 1, "no such artifact"),
        (["verify", "--artifact", "{artifact}", "--trust", "{private}"], 1, "private key"),
        (["predict", "--artifact", "{artifact}", "--trust", "{pub}", "--input", "{bad_npy}"], 1, "shape"),
        (["install", "--store", "{store}", "--artifact", "{artifact}", "--trust", "{pub}", "--profile", "toaster"],
         2, "invalid choice"),
    ],
)
def test_agent_cli_errors_are_one_line_with_the_right_exit_code(artifact, keypair, tmp_path, args, code, needle):
    np.save(tmp_path / "in.npy", np.ones((1, 4), np.float32))
    np.save(tmp_path / "bad.npy", np.ones((1, 7), np.float32))
    values = {"artifact": str(artifact), "pub": str(keypair[1]), "private": str(keypair[0]),
              "missing": str(tmp_path / "missing"), "npy": str(tmp_path / "in.npy"),
              "bad_npy": str(tmp_path / "bad.npy"), "store": str(tmp_path / "store")}
    result = run_cli("edgepack-agent", *[a.format(**values) for a in args])
    assert result.returncode == code
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stderr
    assert needle in lines[-1]
    if code == 1:
        assert len(lines) == 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_run_daemon_installs_serves_and_stops_cleanly_on_sigterm(artifact, keypair, tmp_path):
    port = _free_port()
    config = tmp_path / "agent.yaml"
    config.write_text(f"device_id: pi-07\nstore: {tmp_path / 'store'}\ntrust: [{keypair[1]}]\nprofile: rpi\n"
                      f"artifact: {artifact}\napi: {{listen: '127.0.0.1:{port}'}}\n")
    proc = subprocess.Popen([cli("edgepack-agent"), "run", "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        health = None
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
                    health = json.load(response)
                break
            except OSError:
                time.sleep(0.1)
        assert health is not None and health["model"]["name"] == "scale"
        assert health["model"]["provider"] == "CPUExecutionProvider"
        assert health["model"]["provider_fallbacks"][0]["provider"] == "XnnpackExecutionProvider"
        status, answer = _post(f"http://127.0.0.1:{port}/predict",
                               json.dumps({"inputs": {"x": [[1, 2, 3, 4]]}}).encode(), "application/json")
        assert status == 200 and answer["outputs"]["y"] == [[2, 4, 6, 8]]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    assert "Traceback" not in stderr
    status_out = run_cli("edgepack-agent", "status", "--store", str(tmp_path / "store"), "--trust", str(keypair[1]),
                         "--json")
    assert json.loads(status_out.stdout)["active"]["version"] == "1.0.0"


def test_run_with_a_bad_config_is_one_line_exit_2(tmp_path):
    config = tmp_path / "agent.yaml"
    config.write_text("device_id: pi-07\nstore: s\ntrust: [k.pub]\nprofil: rpi\n")
    result = run_cli("edgepack-agent", "run", "--config", str(config))
    assert result.returncode == 2
    assert "profil: unknown key" in result.stderr and "Traceback" not in result.stderr


def test_api_bounds_in_agent_yaml_are_validated_up_front(tmp_path):
    config = tmp_path / "agent.yaml"
    base = "device_id: pi-07\nstore: s\ntrust: [k.pub]\n"
    config.write_text(base)
    defaults = load_config(config).api
    assert (defaults.read_timeout_s, defaults.max_connections, defaults.workers, defaults.max_queue) == (30, 64, 4, 64)
    assert defaults.max_image_pixels is None  # sized for the device when the API starts
    config.write_text(base + "api: {read_timeout_s: 2.5, max_connections: 8, workers: 1, max_queue: 0, "
                             "max_body_bytes: 1024, max_buffered_bytes: 1024, max_image_pixels: 640000}\n")
    api = load_config(config).api
    assert (api.read_timeout_s, api.max_connections, api.workers, api.max_queue) == (2.5, 8, 1, 0)
    assert (api.max_body_bytes, api.max_buffered_bytes, api.max_image_pixels) == (1024, 1024, 640000)
    for bad, needle in [("api: {read_timout_s: 5}", "api.read_timout_s: unknown key"),
                        ("api: {workers: 0}", "api.workers"), ("api: {read_timeout_s: 0}", "api.read_timeout_s"),
                        ("api: {max_body_bytes: 1025, max_buffered_bytes: 1024}", "api.max_buffered_bytes"),
                        ("api: {keep_alive_s: .nan}", "api.keep_alive_s")]:
        config.write_text(base + bad + "\n")
        with pytest.raises((SchemaError, ConfigError), match=re.escape(needle)):
            load_config(config)


def test_accepted_connections_send_without_waiting_for_acks(artifact, keypair, tmp_path):
    """TCP_NODELAY on the agent's side: an answer's head and body go out at once, never held
    about 40 ms for the client's delayed ACK (asyncio sets it only on an IPPROTO_TCP socket)."""
    verified = extract_artifact(artifact, tmp_path / "m", TrustStore([load_public_key(keypair[1])]))
    api = ApiServer(("127.0.0.1", 0), InferenceService(load_model(verified.root, verified.manifest))).start()
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=10)
    try:
        connection.request("GET", "/healthz")
        assert connection.getresponse().read() and api.listening.proto == socket.IPPROTO_TCP
        sockets = [c.writer.get_extra_info("socket") for c in api.connections()]
        assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
    finally:
        connection.close()
        api.stop()
