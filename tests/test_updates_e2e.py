"""Remote updates end to end: a real mosquitto, the agent as a real subprocess, `edgepack deploy`.

Named after what they show or block: zero failed requests during an update, tampered artifact,
downgrade, smoke-test failure, health-window rollback, kill -9 in every job state, duplicate
command, broker restart mid-transfer, hostile commands.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from edgepack_core import faults
from edgepack_core.signing import TrustStore, load_public_key
from sdk.broker import BrokerOptions
from sdk.deploy import DeployOptions, deploy
from tests.agent_process import AgentProcess, LoadGenerator, Observer
from tests.artifacts import build_artifact, resign_with_changes, wrong_golden_outputs
from tests.conftest import run_cli
from tests.fleet_server_process import wait_for

pytestmark = pytest.mark.slow


def _sqrt_model(path: Path) -> Path:
    """y = sqrt(x): finite on the (positive) golden inputs, NaN on negative requests."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Sqrt", ["x"], ["y"])], "sqrt", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def arts(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("updates")
    key = keypair[0]
    out = {
        "v1": build_artifact(folder, key, version="1.0.0", factor=2.0),
        "v2": build_artifact(folder, key, version="1.1.0", factor=3.0),
    }
    out["wrong_golden"] = resign_with_changes(out["v2"], folder / "wrong.edgepkg", key,
                                              replace=wrong_golden_outputs(out["v2"]),
                                              manifest_changes={"version": "1.5.0"})
    big_asset = np.random.default_rng(0).bytes(3 * 1024 * 1024)
    out["big"] = resign_with_changes(out["v2"], folder / "big.edgepkg", key, replace={"assets/blob.bin": big_asset},
                                     manifest_changes={"version": "1.2.0"})
    # A validly shaped artifact whose model byte was flipped after signing.
    tampered = folder / "tampered.edgepkg"
    with tarfile.open(out["v2"]) as src, tarfile.open(tampered, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name == "model/model.onnx":
                data = data[:-1] + bytes([data[-1] ^ 0x01])
            dst.addfile(member, io.BytesIO(data))
    out["tampered"] = tampered
    np.savez(folder / "positive.npz", x=np.abs(np.random.default_rng(1).standard_normal((4, 4))).astype(np.float32))
    _sqrt_model(folder / "sqrt.onnx")
    (folder / "sqrt.yaml").write_text("name: scale\nversion: 1.3.0\nmodel: {path: sqrt.onnx}\ntargets: [x86]\n"
                                      "validate: {data: {npz: positive.npz, sample_axis: {x: 0}}}\n"
                                      "golden: {data: {npz: positive.npz, sample_axis: {x: 0}}}\n")
    from sdk.packager.pipeline import build
    from sdk.recipe import load_recipe

    out["nan_on_negative"] = build(load_recipe(folder / "sqrt.yaml"), key_paths=[str(key)],
                                   output=folder / "sqrt.edgepkg").output
    return out


@pytest.fixture()
def agent(tmp_path, mosquitto_broker, keypair, arts):
    process = AgentProcess(tmp_path, device="pi-07", broker_port=mosquitto_broker.port, trust=keypair[1],
                           artifact=arts["v1"], groups=["kitchen"], health_window_s=0.5).start()
    yield process
    process.stop()


@pytest.fixture()
def observer(mosquitto_broker):
    watch = Observer(mosquitto_broker.port)
    yield watch
    watch.close()


def _deploy_cli(artifact: Path, broker, *extra: str):
    return run_cli("edgepack", "deploy", str(artifact), "--device", "pi-07", "--broker", broker.address, "--wait",
                   "--timeout", "60", *extra)


def test_update_under_continuous_load_fails_no_request(agent, arts, mosquitto_broker):
    with LoadGenerator(agent) as load:
        assert wait_for(lambda: load.ok > 0, 30), load.failures  # the load is running
        result = _deploy_cli(arts["v2"], mosquitto_broker)
        assert wait_for(lambda: "1.1.0" in load.versions, 30), load.failures  # ... and reaches the new model
    assert result.returncode == 0, result.stderr
    assert agent.version() == "1.1.0"
    assert load.failures == []
    assert load.versions == {"1.0.0", "1.1.0"} and load.ok > 50


def test_update_over_mqtt_chunks_survives_a_broker_restart_mid_transfer(agent, arts, mosquitto_broker, keypair):
    trust = TrustStore([load_public_key(keypair[1])])
    outcome: dict = {}
    seen_states: list[str] = []

    def run() -> None:
        outcome["result"] = deploy(DeployOptions(arts["big"], BrokerOptions(mosquitto_broker.address),
                                                 devices=("pi-07",), transfer="mqtt", chunk_size=4096, timeout=90,
                                                 trust=trust, on_event=lambda d, e: seen_states.append(e.state)))

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.time() + 20
    while "downloading" not in seen_states and time.time() < deadline:
        time.sleep(0.005)
    mosquitto_broker.restart()
    states_at_restart = list(seen_states)
    thread.join(120)
    assert "downloading" in states_at_restart and "verifying" not in states_at_restart, "restart was mid-transfer"
    result = outcome["result"]
    assert result.succeeded, result.jobs["pi-07"]
    assert agent.version() == "1.2.0"


def test_tampered_artifact_is_rejected_and_the_old_model_keeps_serving(agent, arts, mosquitto_broker):
    result = _deploy_cli(arts["tampered"], mosquitto_broker)
    assert result.returncode == 1
    assert "rejected" in result.stdout and "sha256 differs" in result.stdout
    assert agent.version() == "1.0.0"
    status, answer = agent.predict([1, 1, 1, 1])
    assert status == 200 and answer["outputs"]["y"] == [[2.0, 2.0, 2.0, 2.0]]


def test_downgrade_is_rejected_unless_forced(agent, arts, mosquitto_broker):
    assert _deploy_cli(arts["v2"], mosquitto_broker).returncode == 0
    refused = _deploy_cli(arts["v1"], mosquitto_broker)
    assert refused.returncode == 1 and "scale 1.0.0 is not newer than scale 1.1.0" in refused.stdout
    assert agent.version() == "1.1.0"
    forced = _deploy_cli(arts["v1"], mosquitto_broker, "--force-downgrade")
    assert forced.returncode == 0 and agent.version() == "1.0.0"


def test_model_failing_its_smoke_test_is_not_activated(agent, arts, mosquitto_broker):
    result = _deploy_cli(arts["wrong_golden"], mosquitto_broker)
    assert result.returncode == 1
    assert "failed" in result.stdout and "differs from golden" in result.stdout
    assert agent.version() == "1.0.0"
    assert list((agent.folder / "pi-07-store" / "downloads").iterdir()) == [], "failed downloads are cleaned up"


def test_unhealthy_model_is_rolled_back_after_the_health_window(agent, arts, mosquitto_broker, keypair):
    with LoadGenerator(agent, values=[-1.0, -2.0, 3.0, 4.0]) as load:
        result = _deploy_cli(arts["nan_on_negative"], mosquitto_broker, "--health-window", "1.5")
    assert result.returncode == 1
    assert "rolled_back" in result.stdout and "non-finite" in result.stdout
    assert agent.version() == "1.0.0"
    # the NaN answers of the window were model errors (issue 24, item 7), and nothing else failed
    assert load.failures and all(f.startswith("500: ") and "non_finite_output" in f for f in load.failures)
    status = run_cli("edgepack-agent", "status", "--store", str(agent.folder / "pi-07-store"), "--trust",
                     str(keypair[1]), "--json")
    assert json.loads(status.stdout)["active"]["version"] == "1.0.0", "the rollback is persisted in the store"


def test_a_device_rollback_after_the_health_window_rejected_a_version_fails_and_changes_nothing(
        agent, arts, mosquitto_broker, observer):
    """Issue 24's incident through the real CLI: the health window rolls the NaN model back, the next
    ``edgepack device rollback`` must not bring it back; the retained state names the rejected
    artifact, also after an agent restart (``<store>/rejected.json``)."""
    with LoadGenerator(agent, values=[-1.0, -2.0, 3.0, 4.0]):
        result = _deploy_cli(arts["nan_on_negative"], mosquitto_broker, "--health-window", "1.5")
    assert result.returncode == 1 and "rolled_back" in result.stdout
    rollback = run_cli("edgepack", "device", "rollback", "pi-07", "--broker", mosquitto_broker.address,
                       "--timeout", "30")
    assert rollback.returncode == 1 and "Traceback" not in rollback.stderr, rollback.stderr
    event = json.loads(rollback.stdout)
    assert event["state"] == "failed" and event["reason"] == (
        "rollback failed: no earlier version that passed its health window is kept on this device; "
        "serving scale 1.0.0")
    assert agent.version() == "1.0.0"

    from edgepack_core.fsutil import sha256_file

    agent.stop()
    heard = len(observer.of("/dev/pi-07/state"))
    agent.start()

    def rejected_in_a_new_birth() -> list:
        births = [d for d in observer.of("/dev/pi-07/state")[heard:] if d.get("status") == "online"]
        return births[-1].get("rejected", []) if births else []

    assert observer.wait_for(lambda: rejected_in_a_new_birth(), 30)
    (entry,) = rejected_in_a_new_birth()
    assert (entry["version"], entry["stage"], entry["sha256"]) == (
        "1.3.0", "health_window", sha256_file(arts["nan_on_negative"]))
    assert "non-finite outputs" in entry["reason"]


def test_same_deploy_command_delivered_twice_installs_once(agent, arts, mosquitto_broker, observer, tmp_path):
    import hashlib

    data = arts["v2"].read_bytes()
    server_dir = tmp_path / "www"
    server_dir.mkdir()
    from sdk.deploy import ArtifactServer

    sha = hashlib.sha256(data).hexdigest()
    server = ArtifactServer(arts["v2"], sha)
    try:
        command = {"schema": "edgepack.cmd/1", "id": "dup-1", "type": "deploy", "expires_at": time.time() + 60,
                   "artifact": {"url": server.url}, "version": "1.1.0", "size": len(data), "sha256": sha}
        observer.publish("edgepack/v1/dev/pi-07/cmd", json.dumps(command))
        observer.publish("edgepack/v1/grp/kitchen/cmd", json.dumps(command))
        assert observer.wait_for(lambda: any(e.get("final") for e in observer.jobs("pi-07", "dup-1")), 30)
        observer.publish("edgepack/v1/dev/pi-07/cmd", json.dumps(command))
        assert observer.wait_for(lambda: sum(1 for e in observer.jobs("pi-07", "dup-1") if e.get("duplicate")) >= 2)
    finally:
        server.stop()
    events = observer.jobs("pi-07", "dup-1")
    assert sum(1 for e in events if e["state"] == "downloading" and not e.get("duplicate")) == 1, "ran once"
    assert sum(1 for e in events if e.get("duplicate")) >= 2
    assert agent.version() == "1.1.0"


@pytest.mark.parametrize(("state", "expected"), [
    ("downloading", "active"), ("verifying", "active"), ("staging", "active"), ("testing", "active"),
    ("active", "rolled_back"),
])
def test_kill_9_in_each_job_state_then_restart_ends_consistent(tmp_path, mosquitto_broker, keypair, arts, state,
                                                               expected):
    agent = AgentProcess(tmp_path, device="pi-09", broker_port=mosquitto_broker.port, trust=keypair[1],
                         artifact=arts["v1"], health_window_s=0.5)
    agent.start(env=faults.switch(f"job-{state}"))
    watch = Observer(mosquitto_broker.port)
    holder: dict = {}
    try:
        thread = threading.Thread(target=lambda: holder.update(result=deploy(DeployOptions(
            arts["v2"], BrokerOptions(mosquitto_broker.address), devices=("pi-09",), timeout=60))))
        thread.start()
        assert agent.wait_exit(30) == -9, "the agent should have been killed at the crash point"
        env = {k: v for k, v in os.environ.items() if k != faults.ENV}
        agent.start(env=env)
        thread.join(90)
        final = [e for e in watch.jobs("pi-09") if e.get("final") and e.get("type") == "deploy"]
        assert final and final[-1]["state"] == expected, watch.jobs("pi-09")
        assert agent.version() == ("1.1.0" if expected == "active" else "1.0.0")
        store = run_cli("edgepack-agent", "status", "--store", str(tmp_path / "pi-09-store"), "--trust",
                        str(keypair[1]), "--json")
        status = json.loads(store.stdout)
        assert "error" not in (status["active"] or {})
        models = [p.name for p in (tmp_path / "pi-09-store" / "models").iterdir()]
        assert len(models) <= 2 and not [m for m in models if m.startswith(".")]
    finally:
        watch.close()
        agent.stop()


def test_hostile_commands_are_rejected_and_the_agent_keeps_running(agent, observer):
    hostile = [
        b"not json at all",
        json.dumps({"schema": "edgepack.cmd/1", "id": "c1", "type": "format-disk", "expires_at": 9e9}).encode(),
        json.dumps({"schema": "edgepack.cmd/1", "id": "c2", "type": "ping", "expires_at": 1}).encode(),
        json.dumps({"schema": "edgepack.cmd/1", "id": "c3", "type": "deploy", "expires_at": 9e9,
                    "artifact": {"url": "file:///etc/passwd"}, "version": "9.0.0", "size": 1,
                    "sha256": "0" * 64}).encode(),
        b"{" + b'"x": 1,' * 20000 + b'"y": 2}',
    ]
    for payload in hostile:
        observer.publish("edgepack/v1/dev/pi-07/cmd", payload)
    assert observer.wait_for(lambda: len([e for e in observer.jobs("pi-07") if e["state"] == "rejected"]) >= 4)
    reasons = {e["job"]: e["reason"] for e in observer.jobs("pi-07") if e["state"] == "rejected"}
    assert "unknown command type" in reasons["c1"]
    assert "expired" in reasons["c2"]
    assert "artifact" in reasons["c3"]
    ping = run_cli("edgepack", "device", "ping", "pi-07", "--broker", f"127.0.0.1:{observer.client._port}")
    assert ping.returncode == 0 and json.loads(ping.stdout)["reason"] == "pong"
    assert agent.version() == "1.0.0"
    assert "no operator_keys in agent.yaml: commands are not authenticated" in agent.log.read_text()


def test_staged_rollout_stops_at_the_canaries_when_they_fail(tmp_path, mosquitto_broker, keypair, arts):
    agents = [AgentProcess(tmp_path, device=f"k-{i}", broker_port=mosquitto_broker.port, trust=keypair[1],
                           artifact=arts["v1"], groups=["kitchen"]).start() for i in range(2)]
    try:
        births = Observer(mosquitto_broker.port)  # the agents' retained births reached the broker
        try:
            assert births.wait_for(lambda: births.of("/dev/k-0/state") and births.of("/dev/k-1/state"), 30)
        finally:
            births.close()
        failed = run_cli("edgepack", "deploy", str(arts["wrong_golden"]), "--group", "kitchen", "--canary", "50%",
                         "--broker", mosquitto_broker.address, "--wait", "--timeout", "60", "--json")
        assert failed.returncode == 1
        summary = json.loads(failed.stdout)
        assert summary["aborted"].startswith("canary failed on k-0")
        assert summary["devices"]["k-0"]["state"] == "failed"
        assert summary["devices"]["k-1"]["state"] == "skipped"
        assert [a.version() for a in agents] == ["1.0.0", "1.0.0"]

        good = run_cli("edgepack", "deploy", str(arts["v2"]), "--group", "kitchen", "--canary", "50%",
                       "--broker", mosquitto_broker.address, "--wait", "--timeout", "60", "--expect", "2")
        assert good.returncode == 0, good.stderr
        assert [a.version() for a in agents] == ["1.1.0", "1.1.0"]
    finally:
        for agent in agents:
            agent.stop()


def test_cli_rollback_names_what_it_undoes(agent, arts, mosquitto_broker):
    """``edgepack device rollback`` fills ``from_version`` from the device's own get-state, or
    from ``--from``; a device serving another model refuses it and keeps serving."""
    def rollback(*extra: str):
        return run_cli("edgepack", "device", "rollback", "pi-07", "--broker", mosquitto_broker.address,
                       "--timeout", "30", *extra)

    assert _deploy_cli(arts["v2"], mosquitto_broker).returncode == 0 and agent.version() == "1.1.0"
    stale = rollback("--from", "scale@1.0.0")
    assert stale.returncode == 1 and "Traceback" not in stale.stderr
    event = json.loads(stale.stdout)
    assert event["state"] == "rejected" and event["reason"] == \
        "the device has moved on: this rollback is from scale 1.0.0, the device serves scale 1.1.0"
    assert agent.version() == "1.1.0"
    filled = rollback()
    assert filled.returncode == 0, filled.stdout + filled.stderr
    assert json.loads(filled.stdout)["reason"] == "rolled back to scale 1.0.0" and agent.version() == "1.0.0"
    bad = rollback("--from", "scale-1.0.0")
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "edgepack: error: 'scale-1.0.0' is not a model as NAME@VERSION (e.g. digits@1.2.0)"], bad.stderr


def test_without_operator_keys_the_agent_warns_on_stderr_at_every_start(agent):
    warning = "edgepack-agent: warning: no operator_keys in agent.yaml: commands are not authenticated, so ANYONE " \
              "WHO CAN PUBLISH TO THE BROKER CAN COMMAND THIS DEVICE"
    assert agent.log.read_text().count(warning) == 1
    agent.stop()
    agent.start()
    assert agent.log.read_text().count(warning) == 2
