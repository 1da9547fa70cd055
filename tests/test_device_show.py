"""``edgepack device show DEVICE_ID``: one device in one view for an operator on call, through a
real `edgepack fleet serve`, a real mosquitto and simulated devices (tools/fleet_sim.py) in a
rollout, with a device target, a release marked bad, a certificate from the fleet CA, and a
hostile device whose reasons carry terminal escapes; then the pure renderer's boundaries."""

from __future__ import annotations

import json
import time

import pytest

from edgepack_core.fsutil import sha256_file
from edgepack_core.protocol.messages import JobEvent
from edgepack_core.protocol.topics import Topics
from sdk.device_view import MAX_TEXT, Answers, DeviceView, Identity, Pipeline, clean, parse
from sdk.device_view_text import MAX_LINES, WIDTH, age, fit, render
from tests.artifacts import build_artifact
from tests.broker import free_port, start_mosquitto
from tests.fleet_server_process import ROOT, FleetServerProcess, edgepack, enroll, make_keys, wait_for
from tools.fleet_sim import STATE_SCHEMA, TELEMETRY_SCHEMA, Behaviour, SimFleet

ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x9b31m\u202e"
EVIL = f"ok{ESCAPES}\nFORGED LINE: device is healthy"


def _env(server: FleetServerProcess) -> dict[str, str]:
    return {"EDGEPACK_SERVER": server.url, "EDGEPACK_SERVER_TOKEN_FILE": str(server.keys.token_file)}


def _hostile_device(broker, device: str = "evil-01") -> None:
    """An offline state, a job answer and a refused pipeline, each reason with escapes."""
    topics, now = Topics(ROOT), time.time()
    state = {
        "schema": STATE_SCHEMA,
        "device": device,
        "status": "offline",
        "ts": now,
        "reason": EVIL,
        "groups": ["evil"],
        "model": {"name": "scale", "version": "6.6.6"},
    }
    telemetry = {
        "schema": TELEMETRY_SCHEMA,
        "device": device,
        "seq": 1,
        "ts": now,
        "latency_ms": {"p50": 1.0},
        "inferences": {"interval": 1, "total": 1},
        "pipelines": [{"name": "door", "state": "refused", "reason": EVIL}],
    }
    job = JobEvent(device, f"job-{device}", "deploy", "failed", True, now, reason=EVIL)
    broker.publish(
        [
            (topics.state(device), json.dumps(state).encode()),
            (topics.telemetry(device), json.dumps(telemetry).encode()),
            (topics.job(device), job.encode()),
        ],
    )


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, keypair):
    """Two simulated devices in group 'show' in a rollout of scale 1.1.0 (held in a 60 s health
    window, so it stays in progress), show-00001 with its own target scale 1.2.0, then 1.1.0
    marked bad (the rollout pauses); show-00000 enrolled with a certificate; evil-01 hostile."""
    folder = tmp_path_factory.mktemp("show")
    broker = start_mosquitto(workdir=folder / "mosquitto")
    server = FleetServerProcess(
        folder / "server", broker=broker.address, keys=make_keys(folder / "keys", release=keypair)
    ).start()
    arts = {v: build_artifact(folder / "arts", keypair[0], version=v) for v in ("1.1.0", "1.2.0")}
    env = _env(server)
    behaviour = Behaviour(groups=("show",), health_window_s=60.0)
    try:
        with SimFleet(broker.host, broker.port, 2, rate=2, prefix="show", behaviour=behaviour) as sims:
            assert sims.wait_ready()
            assert wait_for(
                lambda: (
                    server.get("/api/devices?group=show&online=true")["total"] == 2
                    and server.get("/api/devices/show-00000")["memory_rss_bytes"] is not None
                )
            )
            created = edgepack(
                "rollout",
                "create",
                str(arts["1.1.0"]),
                "--group",
                "show",
                "--waves",
                "100",
                "--reason",
                "night mode",
                env=env,
            )
            assert created.returncode == 0, created.stderr
            rollout = created.stdout.split()[1].rstrip(":")
            assert wait_for(
                lambda: all(d["state"] == "active" for d in server.get(f"/api/rollouts/{rollout}")["devices"]), 60
            )
            target = edgepack("target", "set", str(arts["1.2.0"]), "--device", "show-00001", env=env)
            assert target.returncode == 0, target.stderr
            bad = edgepack("artifact", "bad", sha256_file(arts["1.1.0"]), "--reason", "NaN on night frames", env=env)
            assert bad.returncode == 0, bad.stderr
            assert wait_for(lambda: server.get(f"/api/rollouts/{rollout}")["state"] == "paused", 30)
            issued = enroll(server, "show-00000", ("show",))
            _hostile_device(broker)
            assert wait_for(
                lambda: (
                    server.call("GET", "/api/devices/evil-01/history")[0] == 200
                    and server.get("/api/devices/evil-01")["pipelines"]
                )
            )
            _hostile_device(broker, "gone-01")
            assert wait_for(lambda: server.call("GET", "/api/devices/gone-01/history")[0] == 200)
            gone = edgepack("device", "decommission", "gone-01", "--reason", "stolen from the loading bay", env=env)
            assert gone.returncode == 0, gone.stderr
            yield server, rollout, arts, issued
    finally:
        server.stop()
        broker.kill()


def test_device_show_prints_identity_models_health_rollout_history_and_the_bad_release(fleet):
    server, rollout, arts, issued = fleet
    done = edgepack("device", "show", "show-00000", env=_env(server))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("BAD RELEASE: scale 1.1.0 (artifact " + sha256_file(arts["1.1.0"])[:12])
    assert lines[0].endswith(": NaN on night frames; see edgepack device rollback, edgepack target set")
    assert "by admin" in lines[0]
    assert lines[1].startswith("device show-00000: online, last seen ") and lines[1].endswith(" ago")
    assert lines[2] == "  groups: show"
    assert f"certificate {issued['serial'][:16]} expires in " in lines[3]
    text = done.stdout
    assert "  scale: runs 1.1.0" in text and "no target" in text
    assert "provider CPUExecutionProvider" in text and "memory 47.7 MiB" in text and "cpu 12.5%" in text
    assert f"  {rollout} paused" in text and "this device: wave 1, active" in text
    assert "history (last 1, newest first)" in text and f"rollout {rollout}: " in text
    assert "pipelines" not in text  # it runs none


def test_device_show_json_is_the_whole_typed_document(fleet):
    server, rollout, arts, _issued = fleet
    done = edgepack("device", "show", "show-00001", "--json", env=_env(server))
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["schema"] == "edgepack.device-show/1"
    assert doc["identity"]["id"] == "show-00001" and doc["identity"]["online"] is True
    assert doc["identity"]["groups"] == ["show"] and doc["identity"]["enrolled"] is True
    assert doc["identity"]["credentials_known"] is True and doc["identity"]["certificate"] is None
    [model] = doc["models"]
    assert model["model"] == "scale" and model["runs"] == "1.1.0"
    assert model["target"] == sha256_file(arts["1.2.0"]) and model["source"] == "device"
    assert model["difference"] == "runs 1.1.0, target 1.2.0"
    assert doc["target"]["state"] == "wait" and doc["target"]["reason"]
    assert doc["health"]["memory_rss_bytes"] == 50_000_000 and doc["health"]["provider"] == "CPUExecutionProvider"
    assert [r["id"] for r in doc["rollouts"]] == [rollout] and doc["rollouts"][0]["state"] == "paused"
    assert doc["rollouts"][0]["device_state"] == "active"
    assert 1 <= len(doc["history"]) <= 5 and doc["history"][0]["rollout"] == rollout
    [bad] = doc["bad_releases"]
    assert bad["sha256"] == sha256_file(arts["1.1.0"]) and bad["reason"] == "NaN on night frames"


def test_an_unknown_device_is_one_line_and_exit_1_and_server_errors_are_the_other_commands(fleet, tmp_path):
    server = fleet[0]
    done = edgepack("device", "show", "nobody-99", env=_env(server))
    assert (done.returncode, done.stdout, done.stderr) == (1, "", "edgepack: error: no device nobody-99\n")
    wrong = tmp_path / "wrong"
    wrong.write_text("x" * 32 + "\n")
    wrong.chmod(0o600)
    refused = edgepack("device", "show", "show-00000", "--server", server.url, "--token-file", str(wrong))
    assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1 and "401" in refused.stderr
    away = edgepack(
        "device",
        "show",
        "show-00000",
        "--server",
        f"http://127.0.0.1:{free_port()}",
        "--token-file",
        str(server.keys.token_file),
    )
    assert away.returncode == 1 and away.stderr.startswith("edgepack: error: cannot reach the fleet server at ")
    assert len(away.stderr.splitlines()) == 1


def test_terminal_escapes_from_a_hostile_device_never_reach_the_operators_terminal(fleet):
    server = fleet[0]
    done = edgepack("device", "show", "evil-01", env=_env(server))
    assert done.returncode == 0, done.stderr
    for raw in ("\x1b", "\x07", "\x9b", "\u202e", "\nFORGED"):
        assert raw not in done.stdout
    assert "ok\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m\\u202e\\x0aFORGED LINE" in done.stdout  # shown, inert
    assert "device evil-01: offline: ok\\x1b" in done.stdout  # the status reason
    assert "door: refused: ok\\x1b" in done.stdout and "(job job-evil-01)" in done.stdout
    assert all(len(line) <= WIDTH for line in done.stdout.splitlines())
    as_json = edgepack("device", "show", "evil-01", "--json", env=_env(server))
    assert "\x1b" not in as_json.stdout and json.loads(as_json.stdout)["identity"]["status_reason"].startswith(
        "ok\\x1b"
    )


# --------------------------------------------------------------------------- the pure parts


def test_age_is_coarse_with_pinned_boundaries():
    assert [age(s) for s in (-5, 0, 59.9, 60, 3599, 3600, 86399, 86400, 90061)] == [
        "0s",
        "0s",
        "59s",
        "1m",
        "59m",
        "1h 0m",
        "23h 59m",
        "1d 0h",
        "1d 1h",
    ]


def test_clean_keeps_the_limit_cuts_past_it_and_escapes_controls():
    assert clean("x" * MAX_TEXT) == "x" * MAX_TEXT
    assert clean("x" * (MAX_TEXT + 1)) == "x" * (MAX_TEXT - 1) + "…"
    assert clean("a\x1bb\u2028c\ud800", 100) == "a\\x1bb\\u2028c\\ud800"
    assert len(clean("\x1b" * 1000, 10)) <= 10 and clean(None) == "" and clean(7) == ""


def test_fit_cuts_a_line_past_the_width():
    assert fit("y" * WIDTH) == "y" * WIDTH
    assert fit("y" * (WIDTH + 1)) == "y" * (WIDTH - 1) + "…"


def _with_pipelines(count: int) -> DeviceView:
    pipes = tuple(Pipeline(f"p{i}", "running", "", 10, 2.0, 0, 0, "up") for i in range(count))
    return DeviceView(identity=Identity(id="d-1", enrolled=True), pipelines=pipes)


def test_render_prints_at_most_max_lines_of_a_section_and_counts_the_rest():
    at_limit = render(_with_pipelines(MAX_LINES), 0.0)
    assert f"  p{MAX_LINES - 1}: running" in at_limit and "more pipelines" not in at_limit
    over = render(_with_pipelines(MAX_LINES + 1), 0.0)
    assert f"  p{MAX_LINES}: running" not in over and "  ... 1 more pipelines (--json for all)" in over


def test_a_decommissioned_device_is_shown_as_such():
    view = parse(
        Answers("gone-1", decommissioned={"device": "gone-1", "at": 100.0, "actor": "ann", "reason": "stolen"})
    )
    assert render(view, 100.0 + 7200) == (
        "device gone-1: decommissioned 2h 0m ago by ann: stolen\n"
        "  its messages are dropped until it is enrolled again; certificate: not known to this server"
    )


def test_a_decommissioned_device_is_shown_with_when_who_and_why(fleet):
    server = fleet[0]
    done = edgepack("device", "show", "gone-01", env=_env(server))
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first.startswith("device gone-01: decommissioned ") and first.endswith(
        " by admin: stolen from the loading bay"
    )
    assert second.startswith("  its messages are dropped until it is enrolled again; no certificate")
    doc = json.loads(edgepack("device", "show", "gone-01", "--json", env=_env(server)).stdout)
    assert doc["identity"]["enrolled"] is False and doc["identity"]["status"] == "decommissioned"
    assert doc["models"] == [] and doc["health"] is None and doc["history"] == []


def test_a_viewer_token_is_enough(fleet, tmp_path):
    server = fleet[0]
    status, made = server.call("POST", "/api/tokens", {"name": "night-viewer", "role": "viewer"})
    assert status == 201, made
    token_file = tmp_path / "viewer"
    token_file.write_text(made["token"] + "\n")
    token_file.chmod(0o600)
    done = edgepack("device", "show", "show-00000", "--server", server.url, "--token-file", str(token_file))
    assert done.returncode == 0, done.stderr
    assert "BAD RELEASE" in done.stdout and "expires in" in done.stdout
