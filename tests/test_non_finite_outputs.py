"""Issue 24, item 7 (incident: "NaN outputs are invisible": HTTP 200 with "score": "NaN",
counted status="ok", the fleet's error chart at 0, `edgepack-agent predict` exiting 0).

The model is built from code: y = Sqrt(x), so a negative input gives NaN (its golden samples are
positive). A NaN/inf in an output the recipe does not allow is a model error everywhere: a 500
``non_finite_output`` naming the output and the count on /predict and on the v2 route, the
typed error in the Python API, ``status="server_error"`` and the kind in /metrics, the error
kind in telemetry, and exit 1 from ``predict``. Where the recipe declares
``outputs.y.allow_non_finite``, the answer is served flagged (``non_finite_outputs``) and
still counted."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from device_agent.errors import InferenceError, NonFiniteOutput
from device_agent.finiteness import judge_outputs, non_finite_counts
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore, load_public_key
from sdk.errors import RecipeError
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.agent_process import AgentProcess
from tests.conftest import run_cli

NEGATIVE = [[-1.0, 4.0, -9.0, 16.0]]  # two NaN of four
TINY_NEGATIVE = float(-np.finfo(np.float32).smallest_subnormal)


def sqrt_model(path: Path) -> Path:
    """y = Sqrt(x), x float32 [batch, 4]: NaN for every negative input."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    model = helper.make_model(
        helper.make_graph([helper.make_node("Sqrt", ["x"], ["y"])], "sqrt", [x], [y]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 8
    onnx.save(model, path)
    return path


def build_sqrt(folder: Path, key: Path, *, allow: bool = False, golden: np.ndarray | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    sqrt_model(folder / "sqrt.onnx")
    np.savez(folder / "positive.npz", x=np.array([[1.0, 4.0, 9.0, 16.0], [0.0, 0.25, 2.0, 3.0]], np.float32))
    data = "{npz: positive.npz}"
    if golden is not None:
        np.savez(folder / "golden.npz", x=golden)
        data = "{npz: golden.npz}"
    outputs = "outputs: {y: {allow_non_finite: true}}\n" if allow else ""
    (folder / "sqrt.yaml").write_text(
        f"name: sqrt\nversion: 1.0.0\nmodel: {{path: sqrt.onnx}}\n{outputs}"
        f"validate: {{data: {{npz: positive.npz}}}}\ngolden: {{data: {data}}}\n"
    )
    return build(load_recipe(folder / "sqrt.yaml"), key_paths=[str(key)], output=folder / "sqrt.edgepkg").output


@pytest.fixture(scope="module")
def refusing(tmp_path_factory, keypair) -> Path:
    return build_sqrt(tmp_path_factory.mktemp("sqrt"), keypair[0])


@pytest.fixture(scope="module")
def allowing(tmp_path_factory, keypair) -> Path:
    return build_sqrt(tmp_path_factory.mktemp("sqrt-allowed"), keypair[0], allow=True)


@pytest.fixture()
def agent(tmp_path, keypair, refusing):
    process = AgentProcess(tmp_path, device="nan-01", broker_port=None, trust=keypair[1], artifact=refusing).start()
    yield process
    process.stop()


def _call(url: str, body: bytes, content_type: str = "application/json") -> tuple[int, dict, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err), dict(err.headers)


def _predict(port: int, rows: list[list[float]]) -> tuple[int, dict]:
    status, answer, _ = _call(f"http://127.0.0.1:{port}/predict", json.dumps({"inputs": {"x": rows}}).encode())
    return status, answer


def _metrics(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return set(response.read().decode().splitlines())


def _loaded(artifact: Path, keypair, folder: Path) -> InferenceService:
    verified = extract_artifact(artifact, folder, TrustStore([load_public_key(keypair[1])]))
    return InferenceService(load_model(verified.root, verified.manifest))


# ------------------------------------------------------------------ the agent process over HTTP


def test_nan_outputs_are_a_500_and_counted_as_model_errors(agent):
    status, answer = _predict(agent.port, NEGATIVE)
    assert status == 500, answer
    assert answer["error"]["kind"] == "non_finite_output"
    assert "output y holds 2 NaN/infinite value(s) of 4" in answer["error"]["message"]
    assert "outputs.NAME.allow_non_finite" in answer["error"]["message"]
    status, answer = _predict(agent.port, [[0.0, 1.0, 4.0, 9.0]])  # 0 is the boundary: sqrt(0) = 0
    assert status == 200 and answer["outputs"]["y"] == [[0.0, 1.0, 2.0, 3.0]]
    assert "non_finite_outputs" not in answer
    status, answer = _predict(agent.port, [[TINY_NEGATIVE, 1.0, 4.0, 9.0]])  # the least negative float32
    assert status == 500 and "output y holds 1 NaN/infinite value(s) of 4" in answer["error"]["message"]
    lines = _metrics(agent.port)
    assert {
        'edgepack_requests_total{status="ok"} 1',
        'edgepack_requests_total{status="server_error"} 2',
        'edgepack_errors_total{kind="non_finite_output"} 2',
        "edgepack_non_finite_outputs_total 2",
        'edgepack_http_responses_total{class="5xx"} 2',
    } <= lines, sorted(lines)


def test_nan_outputs_on_the_open_inference_protocol_route_are_a_500(agent):
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": NEGATIVE[0]}]}
    status, answer, _ = _call(f"http://127.0.0.1:{agent.port}/v2/models/sqrt/infer", json.dumps(body).encode())
    assert status == 500 and set(answer) == {"error"}
    assert "output y holds 2 NaN/infinite value(s) of 4" in answer["error"]
    assert 'edgepack_errors_total{kind="non_finite_output"} 1' in _metrics(agent.port)


def test_nan_outputs_the_recipe_allows_are_served_flagged_and_still_counted(tmp_path, keypair, allowing):
    agent = AgentProcess(tmp_path, device="nan-02", broker_port=None, trust=keypair[1], artifact=allowing).start()
    try:
        status, answer = _predict(agent.port, NEGATIVE)
        assert status == 200 and answer["non_finite_outputs"] == ["y"]
        assert answer["outputs"]["y"] == [["NaN", 2.0, "NaN", 4.0]]
        status, answer = _predict(agent.port, [[0.0, 1.0, 4.0, 9.0]])
        assert status == 200 and "non_finite_outputs" not in answer
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": NEGATIVE[0]}]}
        status, v2, _ = _call(f"http://127.0.0.1:{agent.port}/v2/models/sqrt/infer", json.dumps(body).encode())
        assert status == 200 and v2["parameters"] == {"non_finite_outputs": "y"}
        buffer = io.BytesIO()
        np.save(buffer, np.array(NEGATIVE, np.float32))
        request = urllib.request.Request(
            f"http://127.0.0.1:{agent.port}/predict",
            data=buffer.getvalue(),
            headers={"Content-Type": "application/x-npy", "Accept": "application/x-npz"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.headers["X-Edgepack-Non-Finite-Outputs"] == "y"
        lines = _metrics(agent.port)
        assert {
            'edgepack_requests_total{status="ok"} 4',
            'edgepack_requests_total{status="server_error"} 0',
            "edgepack_non_finite_outputs_total 3",
        } <= lines, sorted(lines)
        assert not any(line.startswith('edgepack_errors_total{kind="non_finite_output"}') for line in lines)
    finally:
        agent.stop()


# ------------------------------------------------------------------ the Python API


def test_the_python_api_raises_the_typed_error_and_counts_it_for_telemetry(tmp_path, keypair, refusing):
    service = _loaded(refusing, keypair, tmp_path / "m")
    seen: list[tuple[float | None, str | None]] = []
    service.observers.append(lambda latency, kind: seen.append((latency, kind)))
    with pytest.raises(NonFiniteOutput) as caught:
        service.predict_tensors({"x": np.array(NEGATIVE, np.float32)})
    assert isinstance(caught.value, InferenceError) and caught.value.kind == "non_finite_output"
    assert caught.value.counts == {"y": 2}
    assert seen == [(None, "non_finite_output")]
    snapshot = service.stats.snapshot()
    assert snapshot["requests"]["server_error"] == 1 and snapshot["non_finite"] == 1


def test_a_batch_with_one_nan_answer_is_refused(tmp_path, keypair, refusing):
    service = _loaded(refusing, keypair, tmp_path / "m")
    with pytest.raises(NonFiniteOutput, match=r"y holds 1 NaN/infinite value\(s\) of 8"):
        service.predict_tensors({"x": np.array([[1.0, 4.0, 9.0, 16.0], [1.0, 1.0, -1.0, 1.0]], np.float32)})


def test_non_finite_counts_name_each_output_and_count_only_nan_and_inf():
    big = np.full(4, np.finfo(np.float32).max, np.float32)  # finite extremes
    assert non_finite_counts({"y": big}) == {}
    assert non_finite_counts({"y": np.array([1.0, np.inf, -np.inf, np.nan], np.float16)}) == {"y": 3}
    assert non_finite_counts({"labels": np.array([1, 2], np.int64), "e": np.zeros((0,), np.float32)}) == {}
    verdict = judge_outputs({"y": 1, "z": 2}, frozenset({"z"}))
    assert verdict.refused == {"y": 1} and verdict.flagged == ("z",) and verdict.non_finite


# ------------------------------------------------------------------ predict


def test_predict_exits_non_zero_on_nan_output(tmp_path, keypair, refusing, allowing):
    np.save(tmp_path / "negative.npy", np.array(NEGATIVE, np.float32))
    done = run_cli(
        "edgepack-agent",
        "predict",
        "--artifact",
        str(refusing),
        "--trust",
        str(keypair[1]),
        "--input",
        str(tmp_path / "negative.npy"),
        "--json",
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("edgepack-agent: error: output y holds 2 NaN/infinite value(s) of 4")
    done = run_cli(
        "edgepack-agent",
        "predict",
        "--artifact",
        str(allowing),
        "--trust",
        str(keypair[1]),
        "--input",
        str(tmp_path / "negative.npy"),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["non_finite_outputs"] == ["y"]
    human = run_cli(
        "edgepack-agent",
        "predict",
        "--artifact",
        str(allowing),
        "--trust",
        str(keypair[1]),
        "--input",
        str(tmp_path / "negative.npy"),
    )
    assert human.returncode == 0 and "  NaN/inf in y (the recipe allows it there)\n" in human.stdout


# ------------------------------------------------------------------ the recipe


def test_an_output_the_model_lacks_cannot_be_declared(tmp_path, keypair):
    folder = tmp_path / "a"
    folder.mkdir()
    sqrt_model(folder / "sqrt.onnx")
    (folder / "r.yaml").write_text(
        "name: sqrt\nversion: 1.0.0\nmodel: {path: sqrt.onnx}\n"
        "outputs: {score: {allow_non_finite: true}}\nvalidate: {data: synthetic}\n"
    )
    with pytest.raises(RecipeError, match=r"outputs\.score: the model has no output 'score' \(outputs: y\)"):
        build(load_recipe(folder / "r.yaml"), key_paths=[str(keypair[0])], output=folder / "a.edgepkg")


def test_golden_nan_answers_are_signed_only_in_outputs_the_recipe_allows(tmp_path, keypair):
    from sdk.errors import BuildError

    golden = np.array([[-1.0, 4.0, 9.0, 16.0]], np.float32)
    with pytest.raises(BuildError, match=r"output y holds 1 non-finite value\(s\).*outputs\.y\.allow_non_finite"):
        build_sqrt(tmp_path / "refused", keypair[0], golden=golden)
    artifact = build_sqrt(tmp_path / "allowed", keypair[0], allow=True, golden=golden)
    service = _loaded(artifact, keypair, tmp_path / "m")
    assert service.model is not None and service.model.smoke is not None and service.model.smoke.samples == 1
    assert service.model.non_finite_outputs == frozenset({"y"})


# ------------------------------------------------------------------ the health window


def test_refused_nan_answers_count_once_in_the_health_window(tmp_path, keypair, refusing):
    """The incident's verdict ("30 non-finite outputs in 59 requests") still reads so now that
    the answers are 500s: each refused one is a non-finite output, counted once, in the total."""
    from device_agent.updates.health import HealthPolicy, Probes, Traffic, judge, traffic_between

    service = _loaded(refusing, keypair, tmp_path / "m")
    before = service.stats.snapshot()
    for _ in range(29):
        service.predict_tensors({"x": np.array([[1.0, 4.0, 9.0, 16.0]], np.float32)})
    for _ in range(30):
        with pytest.raises(NonFiniteOutput):
            service.predict_tensors({"x": np.array(NEGATIVE, np.float32)})
    window = traffic_between(before, service.stats.snapshot())
    assert (window.ok, window.model_errors, window.non_finite, window.non_finite_refused) == (29, 0, 30, 30)
    assert window.total == 59 and window.answered == 59
    verdict = judge(window, Traffic(), Probes(), HealthPolicy())
    assert not verdict.healthy and verdict.reason.startswith("0 model errors and 30 non-finite outputs in 59 requests")
    # the boundary: 1 refused answer in 20 (5 %) passes the default 5 % limit, 2 in 21 do not
    assert judge(Traffic(ok=19, non_finite=1, non_finite_refused=1), Traffic(), Probes(), HealthPolicy()).healthy
    assert not judge(Traffic(ok=19, non_finite=2, non_finite_refused=2), Traffic(), Probes(), HealthPolicy()).healthy


# ------------------------------------------------------------------ the fleet's error chart


def test_fleet_error_chart_counts_non_finite_outputs(tmp_path, keypair, refusing, mosquitto_broker):
    """The incident: "the fleet's error chart read 0". A real agent over a real broker to a real
    fleet server: the NaN answers reach the API the device page's error chart reads, as errors
    and as the kind ``non_finite_output``."""
    import time

    from tests.fleet_server_process import FleetServerProcess, make_keys, wait_for

    keys = make_keys(tmp_path / "keys", release=keypair)
    server = FleetServerProcess(tmp_path / "server", broker=mosquitto_broker.address, keys=keys)
    server.start()
    agent = AgentProcess(
        tmp_path, device="nan-03", broker_port=mosquitto_broker.port, trust=keypair[1], artifact=refusing
    )
    try:
        agent.start()
        for _ in range(3):
            assert _predict(agent.port, NEGATIVE)[0] == 500
        assert _predict(agent.port, [[1.0, 4.0, 9.0, 16.0]])[0] == 200

        def chart() -> dict | None:
            since = int(time.time()) - 300
            status, doc = server.call("GET", f"/api/devices/nan-03/telemetry?since={since}&until={since + 301}&step=5")
            if status == 404:  # the server has not heard of the device yet
                return None
            assert status == 200, doc
            return doc if sum(p["errors"] for p in doc["points"]) >= 3 else None

        doc = wait_for(chart, 30)
        assert doc is not None, "the errors never reached the chart's API"
        kinds: dict[str, int] = {}
        for point in doc["points"]:
            for kind, count in point["error_kinds"].items():
                kinds[kind] = kinds.get(kind, 0) + count
        assert kinds == {"non_finite_output": 3}
        assert sum(p["errors"] for p in doc["points"]) == 3 and sum(p["inferences"] for p in doc["points"]) == 1
        assert server.get("/api/devices/nan-03")["errors_total"] == 3
    finally:
        agent.stop()
        server.stop()


def test_error_kinds_fold_into_buckets_and_rollups_bounded():
    from sdk.fleet_server.retention import MAX_ERROR_KINDS, Bucket, fold, kinds_json, rebucket

    samples = [
        ("a", 1.0, 1.0, 2.0, 5.0, 10, 3, '{"non_finite_output":3}'),
        ("a", 2.0, 1.0, 2.0, 5.0, 10, 2, '{"non_finite_output":1,"runtime":1}'),
        ("a", 3.0, 1.0, 2.0, 5.0, 10, 0, None),
        ("a", 61.0, 1.0, 2.0, 5.0, 10, 1, '{"runtime":1}'),
    ]
    minute = fold(samples, 60)
    assert [b.error_kinds for b in minute] == [{"non_finite_output": 4, "runtime": 1}, {"runtime": 1}]
    assert minute[0].point()["error_kinds"] == {"non_finite_output": 4, "runtime": 1}
    stored = Bucket.from_row(minute[0].row())  # the rollup row's JSON text and back
    assert stored.error_kinds == minute[0].error_kinds and stored.row() == minute[0].row()
    assert rebucket([*minute], 300)[0].error_kinds == {"non_finite_output": 4, "runtime": 2}
    assert fold([("a", 1.0, None, None, None, 1, 1)], 60)[0].error_kinds == {}  # a sample stored before 0006
    # the bound: 32 kinds are kept as they are, a 33rd sums under "other"
    many = Bucket("a", 0, 60)
    many.add_kinds({f"k{i:02d}": 1 for i in range(MAX_ERROR_KINDS)})
    assert len(many.error_kinds) == MAX_ERROR_KINDS and "other" not in many.error_kinds
    many.add_kinds({"k99": 2, "k00": 1})
    assert many.error_kinds["other"] == 2 and many.error_kinds["k00"] == 2
    assert kinds_json({}) is None


def test_a_refused_nan_answer_leaves_the_streams_state_as_it_was(tmp_path, keypair):
    """y = Sqrt(x + h), h_out = x + h carried into h: a NaN answer is refused before the
    stream keeps its state, so the stream's next call starts where it was, not from h = -5."""
    folder = tmp_path / "state"
    folder.mkdir()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1])
    h = helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, 1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])
    h_out = helper.make_tensor_value_info("h_out", TensorProto.FLOAT, [1, 1])
    nodes = [helper.make_node("Add", ["x", "h"], ["h_out"]), helper.make_node("Sqrt", ["h_out"], ["y"])]
    model = helper.make_model(
        helper.make_graph(nodes, "acc", [x, h], [y, h_out]), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    onnx.save(model, folder / "acc.onnx")
    np.savez(folder / "x.npz", x=np.array([[1.0]], np.float32))
    (folder / "acc.yaml").write_text(
        "name: acc\nversion: 1.0.0\nmodel: {path: acc.onnx}\ninputs: {h: {role: state, output: h_out}}\n"
        "validate: {data: {npz: x.npz}}\n"
    )
    artifact = build(load_recipe(folder / "acc.yaml"), key_paths=[str(keypair[0])], output=folder / "a.edgepkg")
    service = _loaded(artifact.output, keypair, tmp_path / "m")
    assert service.predict_tensors({"x": np.array([[9.0]], np.float32)}, stream="s").outputs["y"][0, 0] == 3.0
    with pytest.raises(NonFiniteOutput, match="output y holds 1 NaN"):  # h = 9 - 25 = -16
        service.predict_tensors({"x": np.array([[-25.0]], np.float32)}, stream="s")
    # h is still 9: 9 + 7 = 16; had the refused call kept its state it would be sqrt(-16 + 7) = NaN
    assert service.predict_tensors({"x": np.array([[7.0]], np.float32)}, stream="s").outputs["y"][0, 0] == 4.0
    snapshot = service.stats.snapshot()
    assert snapshot["errors"] == {"non_finite_output": 1} and snapshot["non_finite"] == 1
    assert snapshot["requests"] == {"ok": 2, "client_error": 0, "server_error": 1}
