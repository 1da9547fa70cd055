"""Several named models on one agent (issue 24, item 2): ``models:`` in agent.yaml, a slot per
model (its own store and service), the HTTP routes that name a model, and the pure choices of a
slot. The end-to-end updates of one model while another serves are in test_multi_model_e2e.py."""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from device_agent.config import MAX_MODELS, check_config
from device_agent.errors import BadRequest, ConfigError, NoModelError
from device_agent.models import choose, deploy_refusal, deploy_target
from edgepack_core.errors import SchemaError
from edgepack_core.protocol.messages import DeviceState, parse_state
from tests.agent_process import free_port
from tests.artifacts import build_artifact
from tests.conftest import run_cli

BASE = {"device_id": "cam-01", "store": "/tmp/store", "trust": ["/tmp/k.pub"]}


def _models(count: int) -> list[dict[str, str]]:
    return [{"name": f"m{i}", "artifact": f"m{i}.edgepkg"} for i in range(count)]


# ------------------------------------------------------------------------------------ agent.yaml


def test_models_parse_into_named_entries_up_to_the_limit(tmp_path):
    config = check_config({**BASE, "models": _models(MAX_MODELS)}, tmp_path / "agent.yaml")
    assert [entry.name for entry in config.models] == [f"m{i}" for i in range(MAX_MODELS)]
    assert config.models[0].artifact == tmp_path / "m0.edgepkg" and config.artifact is None


def test_one_model_over_the_limit_is_refused_naming_the_key(tmp_path):
    with pytest.raises(SchemaError, match="models"):
        check_config({**BASE, "models": _models(MAX_MODELS + 1)}, tmp_path / "agent.yaml")


def test_an_empty_models_list_is_refused(tmp_path):
    with pytest.raises(SchemaError, match="models"):
        check_config({**BASE, "models": []}, tmp_path / "agent.yaml")


def test_artifact_and_models_together_are_refused_naming_both(tmp_path):
    with pytest.raises(ConfigError) as caught:
        check_config({**BASE, "artifact": "a.edgepkg", "models": _models(1)}, tmp_path / "agent.yaml")
    assert caught.value.key == "models" and "artifact" in caught.value.problem


def test_a_model_name_given_twice_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"models\[1\]\.name.*'m0' is named twice"):
        check_config(
            {**BASE, "models": [*_models(1), {"name": "m0", "artifact": "other.edgepkg"}]}, tmp_path / "agent.yaml"
        )


@pytest.mark.parametrize(
    "item",
    [
        {"name": "a", "artifact": "a.edgepkg", "version": "1"},
        {"name": "a"},
        {"artifact": "a.edgepkg"},
        {"name": "../a", "artifact": "a.edgepkg"},
    ],
)
def test_a_models_item_with_an_unknown_missing_or_unsafe_key_is_refused(tmp_path, item):
    with pytest.raises(SchemaError, match="models"):
        check_config({**BASE, "models": [item]}, tmp_path / "agent.yaml")


# ------------------------------------------------------------------------------------ pure choices


def test_a_request_naming_no_model_goes_to_the_only_one():
    assert choose(("digits",), None) == "digits"


def test_a_request_naming_no_model_among_several_is_a_400_naming_them():
    with pytest.raises(BadRequest) as caught:
        choose(("detector", "classifier"), None)
    assert caught.value.http_status == 400 and caught.value.kind == "model_required"
    assert "detector, classifier" in str(caught.value)


def test_a_request_for_a_model_not_installed_is_a_404_naming_the_installed_ones():
    with pytest.raises(BadRequest) as caught:
        choose(("detector", "classifier"), "vad")
    assert caught.value.http_status == 404 and "installed: detector, classifier" in str(caught.value)


def test_a_request_on_an_agent_without_models_has_no_model():
    with pytest.raises(NoModelError):
        choose((), None)
    with pytest.raises(BadRequest, match="installed: none"):
        choose((), "digits")


def test_a_deploy_goes_to_its_slot_or_a_new_one_only_where_allowed():
    assert deploy_refusal((), "digits", None) is None  # an empty device takes any name
    assert deploy_refusal(("digits",), "digits", None) is None
    assert "'vad' is not allowed on this device (allowed: digits;" in deploy_refusal(("digits",), "vad", None)
    assert deploy_refusal(("digits",), "vad", frozenset({"digits", "vad"})) is None
    assert "(allowed: digits;" in deploy_refusal(("digits",), "vad", frozenset({"digits"}))
    assert deploy_refusal(("digits",), None, None) is None and deploy_target(("digits",), None) == "digits"
    assert "must name one" in deploy_refusal(("a", "b"), None, None)
    assert deploy_target((), None) is None and deploy_target(("a", "b"), "b") == "b"


def test_a_new_slot_beyond_the_most_models_is_refused():
    held = tuple(f"m{i}" for i in range(MAX_MODELS))
    allowed = frozenset({*held, "one-more"})
    assert deploy_refusal(held[:-1], "one-more", allowed) is None  # the limit itself passes
    assert "the most it takes" in deploy_refusal(held, "one-more", allowed)


# ------------------------------------------------------------------------------------ the state message


def test_the_state_message_lists_every_model_and_keeps_model_for_old_readers():
    doc = {
        "schema": "edgepack.state/1",
        "device": "cam-01",
        "status": "online",
        "ts": 1.0,
        "model": {"name": "detector", "version": "1.0.0", "sha256": "a" * 64},
        "models": [
            {"name": "detector", "version": "1.0.0", "sha256": "a" * 64, "state": "serving"},
            {"name": "classifier", "version": "2.0.0", "sha256": "b" * 64, "state": "serving"},
            {"name": "../bad", "version": "1", "sha256": None, "state": "serving"},
            {"name": "detector", "version": "9.9.9", "sha256": None, "state": "serving"},
        ],
    }
    state = parse_state("cam-01", json.dumps(doc).encode())
    assert isinstance(state, DeviceState)
    assert state.model is not None and state.model.name == "detector"
    assert [(m.name, m.version) for m in state.models] == [("detector", "1.0.0"), ("classifier", "2.0.0")]


def test_a_state_from_an_agent_before_several_models_has_no_models_list():
    doc = {
        "schema": "edgepack.state/1",
        "device": "cam-01",
        "status": "online",
        "ts": 1.0,
        "model": {"name": "digits", "version": "1.0.0", "sha256": None},
    }
    state = parse_state("cam-01", json.dumps(doc).encode())
    assert isinstance(state, DeviceState) and state.models == ()


# ------------------------------------------------------------------------------------ a real agent


@pytest.fixture(scope="module")
def two_artifacts(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("two-models")
    return {
        "alpha": build_artifact(folder, keypair[0], name="alpha", factor=2.0),
        "beta": build_artifact(folder, keypair[0], name="beta", factor=3.0),
    }


def _request(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            raw = response.read()
            status = response.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode()


ROW = {"inputs": {"x": [[1.0, 2.0, 3.0, 4.0]]}}


def _daemon(tmp_path: Path, keypair, models: list[dict[str, str]]):
    from device_agent.daemon import Daemon

    config = check_config(
        {
            "device_id": "cam-01",
            "store": str(tmp_path / "store"),
            "trust": [str(keypair[1])],
            "models": models,
            "api": {"listen": f"127.0.0.1:{free_port()}"},
        },
        tmp_path / "agent.yaml",
    )
    return Daemon(config)


def test_two_models_are_served_by_name_with_their_own_stores(tmp_path, keypair, two_artifacts):
    daemon = _daemon(tmp_path, keypair, [{"name": n, "artifact": str(a)} for n, a in two_artifacts.items()]).start()
    try:
        assert daemon.api is not None
        port = daemon.api.port
        status, alpha = _request(port, "POST", "/predict/alpha", ROW)
        assert status == 200 and alpha["outputs"]["y"] == [[2.0, 4.0, 6.0, 8.0]]
        status, beta = _request(port, "POST", "/predict/beta", ROW)
        assert status == 200 and beta["outputs"]["y"] == [[3.0, 6.0, 9.0, 12.0]]
        status, refused = _request(port, "POST", "/predict", ROW)
        assert status == 400 and refused["error"]["kind"] == "model_required"
        assert "alpha, beta" in refused["error"]["message"]
        status, unknown = _request(port, "POST", "/predict/gamma", ROW)
        assert status == 404 and "installed: alpha, beta" in unknown["error"]["message"]
        status, v2 = _request(
            port,
            "POST",
            "/v2/models/beta/infer",
            {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]},
        )
        assert status == 200 and v2["model_name"] == "beta" and v2["outputs"][0]["data"] == [3.0] * 4
        status, health = _request(port, "GET", "/healthz")
        assert status == 200 and health["model"]["name"] == "alpha"
        assert [(m["name"], m["version"], m["state"]) for m in health["models"]] == [
            ("alpha", "1.0.0", "serving"),
            ("beta", "1.0.0", "serving"),
        ]
        assert all(m["model_bytes"] > 0 for m in health["models"])
        _, metrics = _request(port, "GET", "/metrics")
        assert 'edgepack_requests_total{model="alpha",status="ok"} 1' in metrics
        assert 'edgepack_requests_total{model="beta",status="ok"} 2' in metrics  # /predict/beta and v2
        assert 'edgepack_inference_latency_seconds_count{model="beta"} 2' in metrics
        assert [m["name"] for m in daemon.status().models] == ["alpha", "beta"]
    finally:
        daemon.stop()
    layout = tmp_path / "store" / "slots"
    assert sorted(p.name for p in layout.iterdir()) == ["alpha", "beta"]
    assert not (tmp_path / "store" / "state.json").exists(), "the root store holds no model with models:"
    restarted = _daemon(tmp_path, keypair, [{"name": n, "artifact": "/nonexistent"} for n in two_artifacts]).start()
    try:  # served from the store: the configured artifacts are not read again
        assert restarted.models.names == ("alpha", "beta")
    finally:
        restarted.stop()
    store = ["--store", str(tmp_path / "store"), "--trust", str(keypair[1])]
    listed = json.loads(run_cli("edgepack-agent", "status", *store, "--json", check=True).stdout)
    assert listed["active"] is None and {n: m["active"]["name"] for n, m in listed["models"].items()} == {
        "alpha": "alpha",
        "beta": "beta",
    }
    one = json.loads(run_cli("edgepack-agent", "status", *store, "--model", "beta", "--json", check=True).stdout)
    assert one["active"]["name"] == "beta" and "models" not in one
    refused = run_cli("edgepack-agent", "rollback", *store, "--model", "beta")
    assert refused.returncode == 1 and "no earlier version" in refused.stderr and "Traceback" not in refused.stderr


def test_a_models_item_whose_artifact_holds_another_model_is_refused_at_start(tmp_path, keypair, two_artifacts):
    from edgepack_core.errors import EdgepackError

    daemon = _daemon(tmp_path, keypair, [{"name": "gamma", "artifact": str(two_artifacts["alpha"])}])
    with pytest.raises(EdgepackError, match="holds model 'alpha', not 'gamma'"):
        daemon.start()
    daemon.stop()


def test_a_single_model_store_laid_out_before_named_models_keeps_serving(tmp_path, keypair, two_artifacts):
    from device_agent.daemon import Daemon

    config = check_config(
        {
            "device_id": "cam-01",
            "store": str(tmp_path / "store"),
            "trust": [str(keypair[1])],
            "artifact": str(two_artifacts["alpha"]),
            "api": {"listen": f"127.0.0.1:{free_port()}"},
        },
        tmp_path / "agent.yaml",
    )
    daemon = Daemon(config).start()
    try:
        assert daemon.api is not None
        assert json.loads((tmp_path / "store" / "state.json").read_text())["active"].startswith("alpha-1.0.0-")
        assert _request(daemon.api.port, "POST", "/predict", ROW)[0] == 200
        assert _request(daemon.api.port, "POST", "/predict/alpha", ROW)[0] == 200
        _, metrics = _request(daemon.api.port, "GET", "/metrics")
        assert 'edgepack_requests_total{status="ok"} 2' in metrics  # one model: the series as they were
    finally:
        daemon.stop()
    assert not (tmp_path / "store" / "slots").exists()


def test_telemetry_carries_each_models_figures_and_a_bad_entry_is_dropped():
    from device_agent.telemetry.metrics import TelemetryAggregator
    from edgepack_core.protocol.messages import ModelTelemetry, Telemetry, parse_telemetry
    from edgepack_core.protocol.payloads import validate_payload

    built = TelemetryAggregator("cam-01", started=0.0).build(
        now=1.0,
        ts=1.0,
        model=None,
        provider=None,
        system=None,
        queue={"queued": 0, "dropped": 0, "produced": 0, "delivered": 0},
    )
    sample = dataclasses.replace(
        built,
        models=(
            ModelTelemetry(
                "detector",
                "1.0.0",
                3,
                3,
                1,
                1,
                (("runtime", 1),),
                (("runtime", 1),),
                latency_p50=2.0,
                throughput_per_s=3.0,
            ),
            ModelTelemetry("classifier", "2.0.0", 2, 2, 0, 0, throughput_per_s=2.0),
        ),
    )
    doc = sample.to_json()
    validate_payload("telemetry", doc)  # the schema the fleet reads it with
    doc["models"].append({"name": "../x", "inferences": {"interval": 1, "total": 1}})
    parsed = parse_telemetry("cam-01", json.dumps(doc).encode())
    assert not isinstance(parsed, str)
    assert [(m.name, m.inferences_total, m.errors_total, m.error_kinds) for m in parsed.models] == [
        ("detector", 3, 1, (("runtime", 1),)),
        ("classifier", 2, 0, ()),
    ]
    assert parsed.models[0].latency_p50 == 2.0
    assert "models" not in Telemetry(device="cam-01").to_json(), "one model: the sample as it always was"


def test_removing_the_root_stores_model_clears_its_state_and_a_restart_serves_nothing(tmp_path, keypair, two_artifacts):
    from device_agent.daemon import Daemon

    config = check_config(
        {
            "device_id": "cam-01",
            "store": str(tmp_path / "store"),
            "trust": [str(keypair[1])],
            "api": {"listen": f"127.0.0.1:{free_port()}"},
        },
        tmp_path / "agent.yaml",
    )
    daemon = Daemon(config)
    daemon.install_artifact(two_artifacts["alpha"])
    slot = daemon.models.get("alpha")
    assert slot is not None and slot.store is daemon.store
    daemon.remove_slot(slot)
    assert daemon.models.names == () and daemon.service.model is None
    assert json.loads((tmp_path / "store" / "state.json").read_text()) == {"active": None, "previous": None}
    assert list((tmp_path / "store" / "models").iterdir()) == []
    restarted = Daemon(config).start()
    try:
        assert restarted.api is not None and restarted.models.names == ()
        status, health = _request(restarted.api.port, "GET", "/healthz")
        assert status == 503 and health["models"] == []
        assert _request(restarted.api.port, "POST", "/predict", ROW)[0] == 503
    finally:
        restarted.stop()
