"""Terminal escape injection: a device (or anyone who can publish as one) sends strings with
``\\x1b]0;...\\x07`` (retitle), ``\\x1b]52`` (clipboard), ``\\x1b[2J`` (wipe), C1 CSI, ``\\r``,
``\\n`` (forged lines) and U+202E (reversed text); the fleet server stores them as they came.
Every command that prints them must show them escaped (sdk/text_safety.py, sdk/cli/terminal.py).

One real `edgepack fleet serve`, one real mosquitto and one hostile device (answering every
command it is sent with hostile text) for the module; each test runs the real CLI."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import paho.mqtt.client as mqtt
import pytest

from edgepack_core.protocol.logs import LogLine, chunk_records
from edgepack_core.protocol.messages import JobEvent
from edgepack_core.protocol.topics import Topics
from tests.artifacts import build_artifact
from tests.broker import free_port, start_mosquitto
from tests.fleet_server_process import ROOT, FleetServerProcess, make_keys, wait_for
from tests.fleet_server_process import edgepack as run_edgepack
from tools.fleet_sim import STATE_SCHEMA

ESCAPES = "\x1b]0;pwned\x07\x1b]52;c;cHduZWQ=\x07\x1b[2J\x9b31m\r\u202e"
EVIL = f"ok{ESCAPES}\nFORGED LINE: converged"
SHOWN = "ok\\x1b]0;pwned\\x07\\x1b]52;c;cHduZWQ=\\x07\\x1b[2J\\x9b31m\\x0d\\u202e\\x0aFORGED LINE: converged"
DEVICE = "evil-01"
SETTING = "mqtt.telemetry_interval"


def edgepack(*args: str, env: dict[str, str]) -> Any:
    """The CLI with its output as it came: a raw ``\\r`` is not read as a newline."""
    return run_edgepack(*args, env=env, exact=True)


def assert_inert(*outputs: str) -> None:
    """No byte of the escapes reaches the terminal, and no device text starts a line of its own."""
    for output in outputs:
        for raw in ("\x1b", "\x07", "\x9b", "\r", "\u202e", "\nFORGED"):
            assert raw not in output, (raw, output)


class HostileDevice:
    """``evil-01`` on the broker: an online state whose model version, provider and settings
    results carry :data:`EVIL`, and every command answered with it (a failed job, or log records)."""

    def __init__(self, host: str, port: int) -> None:
        self.topics = Topics(ROOT)
        self.client = mqtt.Client(
            mqtt.CallbackAPIVersion.VERSION2, client_id=f"evil-{free_port()}", protocol=mqtt.MQTTv5
        )
        self.client.on_message = self._on_command
        self.client.connect(host, port)
        self.client.subscribe(self.topics.cmd(DEVICE), qos=1)
        self.client.loop_start()

    def publish_state(self) -> None:
        state = {
            "schema": STATE_SCHEMA,
            "device": DEVICE,
            "status": "online",
            "ts": time.time(),
            "groups": ["evil"],
            "provider": EVIL,
            "model": {"name": "scale", "version": EVIL},
            "settings": {
                "generation": 1,
                "results": {SETTING: f"refused: {EVIL}"},
                "keys": {"release": [], "operator": []},
            },
        }
        self.client.publish(self.topics.state(DEVICE), json.dumps(state), qos=1, retain=True).wait_for_publish(10)

    def _on_command(self, _client: Any, _userdata: Any, message: Any) -> None:
        command = json.loads(message.payload)
        now = time.time()
        if command["type"] == "fetch-logs":
            records = [LogLine(1, now - 1, "error", "edgepack.agent", EVIL)]
            for chunk in chunk_records(records, device=DEVICE, request=command["id"], now=now):
                self.client.publish(self.topics.logs(DEVICE), chunk, qos=1)
            return
        event = JobEvent(DEVICE, command["id"], command["type"], "failed", True, now, reason=EVIL)
        self.client.publish(self.topics.job(DEVICE), event.encode(), qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, keypair) -> Iterator[tuple[FleetServerProcess, Any, dict[str, str], Any]]:
    folder = tmp_path_factory.mktemp("termsafe")
    broker = start_mosquitto(workdir=folder / "mosquitto")
    server = FleetServerProcess(
        folder / "server", broker=broker.address, keys=make_keys(folder / "keys", release=keypair)
    ).start()
    env = {
        "EDGEPACK_SERVER": server.url,
        "EDGEPACK_SERVER_TOKEN_FILE": str(server.keys.token_file),
        "EDGEPACK_MQTT_BROKER": broker.address,
    }
    device = HostileDevice(broker.host, broker.port)
    try:
        device.publish_state()
        assert wait_for(lambda: server.call("GET", f"/api/devices/{DEVICE}")[0] == 200)
        yield server, broker, env, build_artifact(folder / "arts", keypair[0], version="1.1.0")
    finally:
        device.close()
        server.stop()
        broker.kill()


def test_a_device_model_and_provider_with_terminal_escapes_are_printed_escaped_by_fleet_status(stack):
    _server, broker, env, _art = stack
    through_server = edgepack("fleet", "status", env=env)
    assert through_server.returncode == 0, through_server.stderr
    row = next(line for line in through_server.stdout.splitlines() if line.startswith(DEVICE))
    assert "scale ok\\x1b]0;pwned" in row and " ok\\x1b]0;pwned\\x07\\x1b]52" in row  # model, provider: cut, inert
    watched = edgepack("fleet", "watch", "--broker", broker.address, "--duration", "1", "--interval", "0", env=env)
    assert watched.returncode == 0, watched.stderr
    assert "scale ok\\x1b]0;pwned" in watched.stdout
    assert_inert(through_server.stdout, through_server.stderr, watched.stdout, watched.stderr)


def test_a_device_job_reason_with_terminal_escapes_is_printed_escaped_by_device_ping_and_history(stack):
    _server, _broker, env, _art = stack
    ping = edgepack("device", "ping", DEVICE, "--timeout", "20", env=env)
    assert ping.returncode == 1 and ping.stderr.startswith("edgepack: error: evil-01: job ")
    assert ping.stderr.endswith(f"ended failed: {SHOWN}\n") and len(ping.stderr.splitlines()) == 1
    assert json.loads(ping.stdout)["job"]["reason"] == EVIL  # --json-like answer: JSON escapes it
    history = edgepack("device", "history", DEVICE, env=env)
    assert history.returncode == 0, history.stderr
    assert f"ping : failed: {SHOWN}" in history.stdout and f"(final): {SHOWN}" in history.stdout
    assert_inert(ping.stdout, ping.stderr, history.stdout, history.stderr)


def test_a_device_answer_with_terminal_escapes_is_printed_escaped_by_device_get_state_over_mqtt(stack):
    _server, broker, env, _art = stack
    done = edgepack("device", "get-state", DEVICE, "--broker", broker.address, "--timeout", "20", env=env)
    assert done.returncode == 1 and done.stderr.endswith(f"ended failed: {SHOWN}\n"), done.stderr
    assert json.loads(done.stdout)["reason"] == EVIL
    assert_inert(done.stdout, done.stderr)


def test_a_device_log_record_with_terminal_escapes_is_printed_escaped_by_device_logs(stack):
    _server, _broker, env, _art = stack
    done = edgepack("device", "logs", DEVICE, "--timeout", "20", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].endswith(f"ERROR    edgepack.agent: {SHOWN}")
    assert_inert(done.stdout, done.stderr)


def test_a_device_job_reason_with_terminal_escapes_is_printed_escaped_by_deploy(stack):
    _server, broker, env, art = stack
    done = edgepack(
        "deploy", str(art), "--device", DEVICE, "--broker", broker.address, "--wait", "--timeout", "20", env=env
    )
    assert done.returncode == 1, done.stderr
    assert f"{DEVICE}: failed (final) {SHOWN}" in done.stderr  # the progress line
    assert f"failed       {SHOWN}" in done.stdout  # the result table
    assert_inert(done.stdout, done.stderr)


def test_a_device_job_reason_with_terminal_escapes_is_printed_escaped_by_rollout_status_and_list(stack):
    server, _broker, env, art = stack
    created = edgepack("rollout", "create", str(art), "--device", DEVICE, "--reason", EVIL, env=env)
    assert created.returncode == 0, created.stderr
    rollout = created.stdout.split()[1].rstrip(":")
    assert server.finished(rollout, 60)["state"] == "failed"
    status = edgepack("rollout", "status", rollout, env=env)
    listed = edgepack("rollout", "list", env=env)
    assert status.returncode == 0 and listed.returncode == 0, (status.stderr, listed.stderr)
    assert f"by admin: {SHOWN}" in status.stdout  # the operator's reason, in the history
    assert any(line.startswith(f"  {DEVICE}") and SHOWN in line for line in status.stdout.splitlines())
    assert f"failed: {DEVICE}: failed ({SHOWN})" in listed.stdout  # the rollout's reason quotes the device's
    assert_inert(created.stdout, created.stderr, status.stdout, status.stderr, listed.stdout, listed.stderr)


def test_a_device_reason_with_terminal_escapes_is_logged_escaped_by_fleet_serve(stack):
    """The failed rollout of the test above: the server logs its reason, which quotes the device's."""
    server = stack[0]
    log = server.log.read_bytes().decode()
    assert f"failed: {DEVICE}: failed ({SHOWN})" in log
    assert_inert(log)


def test_a_device_reported_version_and_reason_with_terminal_escapes_are_printed_escaped_by_target(stack):
    _server, _broker, env, art = stack
    wait = edgepack("target", "set", str(art), "--device", DEVICE, "--wait", "--timeout", "3", env=env)
    assert wait.returncode == 1 and wait.stderr.startswith("edgepack: error: 1 device(s) not on target")
    assert len(wait.stderr.splitlines()) == 1
    show = edgepack("target", "show", "--device", DEVICE, env=env)
    assert show.returncode == 0, show.stderr
    assert f"  runs   scale: {SHOWN}" in show.stdout
    assert_inert(wait.stdout, wait.stderr, show.stdout, show.stderr)


def test_a_device_settings_result_with_terminal_escapes_is_printed_escaped_by_fleet_settings_show(stack):
    _server, _broker, env, _art = stack
    done = edgepack("fleet", "settings", "set", "--device", DEVICE, f"{SETTING}=5", env=env)
    assert done.returncode == 0, done.stderr
    show = edgepack("fleet", "settings", "show", "--device", DEVICE, env=env)
    assert show.returncode == 0, show.stderr
    assert show.stdout.splitlines()[1].endswith(f"refused: {SHOWN}")
    assert_inert(show.stdout, show.stderr)


class _HostileServer(http.server.BaseHTTPRequestHandler):
    """A fleet server (or a man in the middle of plain HTTP) that sends raw escapes: an audit
    export line that is not ASCII JSON, and a refusal whose message carries them."""

    def do_GET(self) -> None:
        if self.path.startswith("/api/audit"):
            body = b'{"action":"device.ping","detail":"' + ESCAPES.encode() + b'"}\n' + b"plain" + ESCAPES.encode()
            self._answer(200, body, "application/x-ndjson")
        else:
            self._answer(
                400, json.dumps({"error": {"code": "bad_request", "message": EVIL}}).encode(), "application/json"
            )

    def _answer(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: Any) -> None:
        pass


def test_a_server_answer_with_terminal_escapes_is_printed_escaped_by_fleet_audit_export_and_the_error_line(tmp_path):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HostileServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("x" * 32)
    env = {"EDGEPACK_SERVER": f"http://127.0.0.1:{httpd.server_address[1]}", "EDGEPACK_SERVER_TOKEN_FILE": str(token)}
    try:
        audit = edgepack("fleet", "audit", "export", env=env)
        refused = edgepack("rollout", "list", env=env)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert audit.returncode == 0, audit.stderr
    first, second = audit.stdout.splitlines()
    assert json.loads(first)["detail"] == ESCAPES and json.loads(second) == f"plain{ESCAPES}"  # same data, as JSON
    assert refused.returncode == 2
    assert refused.stderr == f"edgepack: error: the server refused (400 bad_request): {SHOWN}\n"
    assert_inert(audit.stdout, audit.stderr, refused.stdout, refused.stderr)


# --------------------------------------------------------------------------- the pure rule


def test_escape_shows_every_control_format_separator_and_surrogate_and_keeps_printable_text():
    from sdk import device_view, text_safety
    from sdk.text_safety import escape

    assert device_view.clean is text_safety.clean  # edgepack device show prints by the same rule
    hostile = "\x00\x1b\x7f\x85\x9b\u200b\u202e\u2066\u2028\u2029\ud800\ue000\U000e0001\ufeff"
    assert escape(hostile) == (
        "\\x00\\x1b\\x7f\\x85\\x9b\\u200b\\u202e\\u2066\\u2028\\u2029\\ud800\\ue000\\ue0001\\ufeff"
    )
    assert escape("Café 日本 → ✓ tab-less, back\\slash") == "Café 日本 → ✓ tab-less, back\\slash"
    assert escape(escape(EVIL)) == escape(EVIL) == SHOWN  # idempotent: printing twice changes nothing


def test_a_table_cell_keeps_its_width_and_cuts_one_past_it():
    from sdk.text_safety import cell

    assert cell("x" * 24, 24) == "x" * 24
    assert cell("x" * 25, 24) == "x" * 23 + "…"
    assert cell("\x1b" * 6, 24) == "\\x1b" * 6 and cell("\x1b" * 7, 24) == "\\x1b" * 5 + "\\x1…"
    assert cell(None, 5) == "-" and cell(12.5, 32) == "12.5"


def test_json_lines_re_encodes_each_line_across_writes_and_bounds_a_line_without_end(monkeypatch):
    import io

    from sdk.cli import terminal

    sink = io.BytesIO()
    lines = terminal.JsonLines(sink)
    lines.write(b'{"a":"\x1b]0;x\x07"}\n{"b"')
    lines.write(b":1}\n\n\xff\x1b\n")
    monkeypatch.setattr(terminal, "MAX_LINE_BYTES", 8)
    lines.write(b"123456789")  # one past the bound: passed on whole, not held
    lines.close()
    out = sink.getvalue()
    assert out == b'{"a":"\\u001b]0;x\\u0007"}\n{"b":1}\n"\\ufffd\\u001b"\n123456789\n'
    assert all(32 <= byte < 127 or byte == 10 for byte in out)


def test_a_log_record_is_one_escaped_line_and_its_traceback_keeps_its_lines_escaped():
    import logging
    import sys

    from sdk.cli.terminal import EscapingFormatter

    try:
        raise ValueError(EVIL)
    except ValueError:
        info = sys.exc_info()
    record = logging.LogRecord(
        "edgepack.fleet_server", logging.ERROR, __file__, 1, "rollout %s failed: %s", ("ro-1", EVIL), info
    )
    lines = EscapingFormatter("%(levelname)s %(name)s: %(message)s").format(record).split("\n")
    assert lines[0] == f"ERROR edgepack.fleet_server: rollout ro-1 failed: {SHOWN}"
    assert lines[1] == "Traceback (most recent call last):" and lines[-1] == f"ValueError: {SHOWN}"
    assert_inert("\n".join(lines))
