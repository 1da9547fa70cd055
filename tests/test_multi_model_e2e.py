"""Several named models on one device, end to end (issue 24, item 2, done-when): a real
``edgepack-agent run`` process with ``models:``, a real mosquitto, signed commands. One model is
updated and then rolled back while a load generator hits both: no request fails, the other model
never changes, the job events name the model and the state message lists both."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sdk.broker import BrokerOptions
from sdk.deploy import DeployOptions, deploy
from sdk.deploy.device import send_command, send_rollback
from sdk.errors import DeployError
from sdk.keys import load_operator_key, write_operator_keypair
from tests.agent_process import AgentProcess, Observer
from tests.artifacts import build_artifact
from tests.conftest import run_cli

pytestmark = pytest.mark.slow

ROW = json.dumps({"inputs": {"x": [[1.0, 1.0, 1.0, 1.0]]}}).encode()
FACTORS = {("alpha", "1.0.0"): 2.0, ("alpha", "1.1.0"): 3.0, ("beta", "1.0.0"): 5.0, ("beta", "1.1.0"): 7.0}


class TwoModelLoad:
    """Requests to ``/predict/alpha`` and ``/predict/beta`` from one thread each, until stopped:
    every answer must be a 200 whose output is the factor of the version it names."""

    def __init__(self, port: int, names: tuple[str, ...] = ("alpha", "beta")) -> None:
        self.port = port
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.failures: list[str] = []
        self.seen: dict[str, set[str]] = {name: set() for name in names}
        self.answers = 0
        self.threads = [threading.Thread(target=self._run, args=(name,), daemon=True) for name in self.seen]

    def _one(self, name: str) -> str:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/predict/{name}", data=ROW, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                answer = json.load(response)
        except urllib.error.HTTPError as err:
            return f"{name}: {err.code} {err.read()[:300]!r}"
        except OSError as err:
            return f"{name}: connection: {err}"
        model = answer["model"]
        expected = FACTORS.get((model["name"], model["version"]))
        if model["name"] != name or answer["outputs"]["y"] != [[expected] * 4]:
            return f"{name}: answered by {model} with {answer['outputs']}"
        with self.lock:
            self.seen[name].add(model["version"])
            self.answers += 1
        return ""

    def _run(self, name: str) -> None:
        while not self.stop.is_set():
            failure = self._one(name)
            if failure:
                with self.lock:
                    self.failures.append(failure)

    def __enter__(self) -> TwoModelLoad:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)


@pytest.fixture(scope="module")
def arts(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("multi-model")
    return {
        (name, version): build_artifact(folder, keypair[0], name=name, version=version, factor=factor)
        for (name, version), factor in FACTORS.items()
    }


def _latest_state(watch: Observer) -> dict:
    states = [s for s in watch.of("/dev/cam-01/state") if s.get("status") == "online"]
    return states[-1] if states else {}


def _telemetry_models(watch: Observer) -> dict[str, dict]:
    samples = watch.of("/dev/cam-01/telemetry")
    return {m["name"]: m for m in samples[-1].get("models", [])} if samples else {}


def _models_in_state(watch: Observer) -> dict[str, str]:
    return {m["name"]: m["version"] for m in _latest_state(watch).get("models", [])}


def test_a_device_serves_two_models_and_updates_and_rolls_back_one_while_the_other_serves(
    tmp_path: Path, keypair, arts, mosquitto_broker
):
    agent, operator = _two_model_agent(tmp_path, keypair, arts, mosquitto_broker.port)
    watch = Observer(mosquitto_broker.port)
    agent.start()
    broker = BrokerOptions(mosquitto_broker.address)
    try:
        assert watch.wait_for(lambda: _models_in_state(watch) == {"alpha": "1.0.0", "beta": "1.0.0"}, 20), (
            _latest_state(watch)
        )
        with TwoModelLoad(agent.port) as load:
            assert watch.wait_for(lambda: load.answers >= 20, 20)
            result = deploy(
                DeployOptions(arts[("alpha", "1.1.0")], broker, devices=("cam-01",), timeout=60, operator_key=operator)
            )
            assert result.succeeded, result
            assert watch.wait_for(lambda: "1.1.0" in load.seen["alpha"] and load.answers >= 60, 20)
            assert _models_in_state(watch) == {"alpha": "1.1.0", "beta": "1.0.0"}
            with pytest.raises(DeployError, match=r"several models \(alpha, beta\): name the one"):
                send_rollback(broker, "cam-01", operator_key=operator, timeout=30)
            # the version it undoes is asked of the device (get-state lists every model)
            event, _ = send_rollback(broker, "cam-01", model="alpha", operator_key=operator, timeout=30)
            assert event.state == "done" and event.reason == "rolled back to alpha 1.0.0", event
            assert event.detail.get("model") == "alpha"
            answered = load.answers
            assert watch.wait_for(lambda: load.answers >= answered + 20, 20)
        assert load.failures == [], load.failures[:5]
        assert load.seen == {"alpha": {"1.0.0", "1.1.0"}, "beta": {"1.0.0"}}, "beta changed"
        assert watch.wait_for(lambda: _models_in_state(watch) == {"alpha": "1.0.0", "beta": "1.0.0"}, 10)
        deploy_events = [e for e in watch.jobs("cam-01", result.command_id)]
        assert deploy_events and all(e.get("detail", {}).get("model") == "alpha" for e in deploy_events)
        health = agent.health()
        assert [(m["name"], m["version"]) for m in health["models"]] == [("alpha", "1.0.0"), ("beta", "1.0.0")]
        # beta kept its own history: nothing to roll back to, and alpha is untouched by the refusal
        refused, _ = send_rollback(
            broker, "cam-01", from_version={"name": "beta", "version": "1.0.0"}, operator_key=operator, timeout=30
        )
        assert refused.state == "failed" and "no earlier version" in refused.reason, refused
        assert [m["version"] for m in agent.health()["models"]] == ["1.0.0", "1.0.0"]
        # telemetry labels each model's figures by name
        assert watch.wait_for(
            lambda: (
                {n: m["version"] for n, m in _telemetry_models(watch).items()} == {"alpha": "1.0.0", "beta": "1.0.0"}
            ),
            10,
        ), _telemetry_models(watch)
        figures = _telemetry_models(watch)
        assert figures["alpha"]["inferences"]["total"] > 0 and figures["beta"]["inferences"]["total"] > 0
        assert figures["alpha"]["errors"] == {} and figures["beta"]["errors"] == {}
        unknown, _ = send_rollback(
            broker, "cam-01", from_version={"name": "gamma", "version": "1.0.0"}, operator_key=operator, timeout=30
        )
        assert unknown.state == "failed" and "installed: alpha, beta" in unknown.reason, unknown
    finally:
        agent.stop()
        watch.close()
    store = tmp_path / "cam-01-store"
    assert sorted(p.name for p in (store / "slots").iterdir()) == ["alpha", "beta"]


def _two_model_agent(
    tmp_path: Path, keypair, arts, broker_port: int, updates: dict | None = None
) -> tuple[AgentProcess, object]:
    write_operator_keypair(tmp_path / "op.key", tmp_path / "op.pub")
    agent = AgentProcess(
        tmp_path,
        device="cam-01",
        broker_port=broker_port,
        trust=keypair[1],
        artifact=None,
        operator_keys=[tmp_path / "op.pub"],
        health_window_s=1.0,
        updates=updates,
    )
    models = [{"name": name, "artifact": str(arts[(name, "1.0.0")])} for name in ("alpha", "beta")]
    with agent.config.open("a") as config:
        config.write(f"models: {json.dumps(models)}\n")
    return agent, load_operator_key(tmp_path / "op.key")


def test_a_deploy_of_one_model_runs_while_the_other_is_in_its_health_window(tmp_path, keypair, arts, mosquitto_broker):
    agent, operator = _two_model_agent(tmp_path, keypair, arts, mosquitto_broker.port)
    watch = Observer(mosquitto_broker.port)
    agent.start()
    broker = BrokerOptions(mosquitto_broker.address)
    outcome: dict = {}
    slow = threading.Thread(
        target=lambda: outcome.update(
            alpha=deploy(
                DeployOptions(
                    arts[("alpha", "1.1.0")],
                    broker,
                    devices=("cam-01",),
                    timeout=90,
                    health_window_s=60.0,
                    operator_key=operator,
                )
            )
        )
    )
    try:
        slow.start()

        def alpha_watched() -> bool:
            return any(
                e["state"] == "active" and not e["final"] and e.get("detail", {}).get("model") == "alpha"
                for e in watch.jobs("cam-01")
            )

        assert watch.wait_for(alpha_watched, 30), watch.jobs("cam-01")
        beta = deploy(
            DeployOptions(arts[("beta", "1.1.0")], broker, devices=("cam-01",), timeout=60, operator_key=operator)
        )
        assert beta.succeeded, beta
        alpha_final = [e for e in watch.jobs("cam-01") if e.get("detail", {}).get("model") == "alpha" and e["final"]]
        assert alpha_final == [], "beta's deploy waited for alpha's health window"
        assert [(m["name"], m["version"]) for m in agent.health()["models"]] == [("alpha", "1.1.0"), ("beta", "1.1.0")]
        event, _ = send_rollback(broker, "cam-01", model="alpha", operator_key=operator, timeout=30)
        assert event.state == "done" and event.reason == "rolled back to alpha 1.0.0", event
        slow.join(60)
        alpha = outcome["alpha"].jobs["cam-01"]
        assert alpha.state == "rolled_back" and f"rolled back by command {event.job}" in alpha.reason, alpha
        assert [(m["name"], m["version"]) for m in agent.health()["models"]] == [("alpha", "1.0.0"), ("beta", "1.1.0")]
    finally:
        slow.join(60)
        agent.stop()
        watch.close()


def test_a_removed_model_stops_serving_and_its_store_goes_while_the_other_serves(
    tmp_path, keypair, arts, mosquitto_broker
):
    agent, operator = _two_model_agent(
        tmp_path, keypair, arts, mosquitto_broker.port, updates={"allowed_names": ["alpha", "beta"]}
    )
    watch = Observer(mosquitto_broker.port)
    agent.start()
    broker = BrokerOptions(mosquitto_broker.address)
    try:
        unsigned, _ = send_command(broker, "cam-01", "remove", model="beta", timeout=30)
        assert unsigned.state == "rejected" and "must be signed" in unsigned.reason, unsigned
        unknown, _ = send_command(broker, "cam-01", "remove", model="gamma", operator_key=operator, timeout=30)
        assert unknown.state == "failed" and "installed: alpha, beta" in unknown.reason, unknown
        with TwoModelLoad(agent.port, names=("alpha",)) as load:
            assert watch.wait_for(lambda: load.answers >= 10, 20)
            removed, _ = send_command(broker, "cam-01", "remove", model="beta", operator_key=operator, timeout=30)
            answered = load.answers
            assert watch.wait_for(lambda: load.answers >= answered + 10, 20)
        assert load.failures == [], load.failures[:5]
        assert removed.state == "done" and removed.reason == "removed beta 1.0.0", removed
        assert removed.detail.get("model") == "beta"
        assert [m["name"] for m in agent.health()["models"]] == ["alpha"]
        status, answer = _post(agent.port, "/predict/beta")
        assert status == 404 and "installed: alpha" in answer["error"]["message"]
        assert _post(agent.port, "/predict")[0] == 200, "one model left: /predict serves it"
        assert watch.wait_for(lambda: _models_in_state(watch) == {"alpha": "1.0.0"}, 10), _latest_state(watch)
        assert not (tmp_path / "cam-01-store" / "slots" / "beta").exists()
        # a model not held comes back as a new slot where updates.allowed_names lists it
        back = deploy(
            DeployOptions(arts[("beta", "1.1.0")], broker, devices=("cam-01",), timeout=60, operator_key=operator)
        )
        assert back.succeeded, back
        assert [(m["name"], m["version"]) for m in agent.health()["models"]] == [("alpha", "1.0.0"), ("beta", "1.1.0")]
        assert _post(agent.port, "/predict")[0] == 400, "two models again: /predict must name one"
        gone, _ = send_command(broker, "cam-01", "remove", model="beta", operator_key=operator, timeout=30)
        assert gone.state == "done", gone
        cli = ["--broker", mosquitto_broker.address, "--operator-key", str(tmp_path / "op.key"), "--timeout", "30"]
        missing = run_cli("edgepack", "device", "remove", "cam-01", "--model", "gamma", *cli)
        assert missing.returncode == 1 and "installed: alpha" in missing.stderr and "Traceback" not in missing.stderr
        last = run_cli("edgepack", "device", "remove", "cam-01", "--model", "alpha", *cli, check=True)
        assert json.loads(last.stdout)["reason"] == "removed alpha 1.0.0"
        health = agent.health()
        assert health["status"] == "no model" and health["models"] == []
        assert _post(agent.port, "/predict")[0] == 503
    finally:
        agent.stop()
        watch.close()
    store = tmp_path / "cam-01-store"
    assert list((store / "slots").iterdir()) == [], "a removed model's store is left"


def _post(port: int, path: str) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=ROW, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_a_target_naming_a_model_absent_removes_it_from_the_device_and_converges(
    tmp_path: Path, keypair, arts, mosquitto_broker, server_keys
):
    """Issue 24 items 1 and 2 together: the desired state says `beta: absent`; the server sends
    the signed remove (the reconciler's, not a hand-sent one), the device stops serving beta and
    the target reads converged, while alpha serves throughout."""
    from tests.fleet_server_process import FleetServerProcess, edgepack, wait_for

    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=server_keys).start()
    agent = AgentProcess(tmp_path, device="cam-01", broker_port=mosquitto_broker.port, trust=keypair[1],
                         artifact=None, operator_keys=[server_keys.operator_pub], health_window_s=1.0)
    models = [{"name": name, "artifact": str(arts[(name, "1.0.0")])} for name in ("alpha", "beta")]
    with agent.config.open("a") as config:
        config.write(f"models: {json.dumps(models)}\n")
    agent.start()
    env = {"EDGEPACK_SERVER": server.url, "EDGEPACK_SERVER_TOKEN_FILE": str(server_keys.token_file)}
    try:
        assert wait_for(lambda: server.call("GET", "/api/devices/cam-01")[0] == 200, 30)
        with TwoModelLoad(agent.port, names=("alpha",)) as load:
            result = edgepack("target", "set", "--device", "cam-01", "--model", "beta", "absent", "--reason",
                              "beta retired", env=env)
            assert result.returncode == 0, result.stdout + result.stderr
            assert wait_for(lambda: [m["name"] for m in agent.health()["models"]] == ["alpha"], 60), agent.health()
            assert wait_for(lambda: server.get("/api/devices/cam-01/target")["state"] == "converged", 60), \
                server.get("/api/devices/cam-01/target")
        assert load.failures == [] and load.answers > 0, load.failures[:5]
        sent = [e for e in server.get("/api/audit?action=command.sent")["entries"] if e["target"] == "cam-01"]
        assert [(e["detail"]["command"]["type"], e["detail"]["command"].get("model")) for e in sent] == [
            ("remove", "beta")], sent
    finally:
        agent.stop()
        server.stop()
