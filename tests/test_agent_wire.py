"""Answers valid on the wire, end to end: a model whose outputs are NaN/±Infinity floats, int64
beyond 2**53, booleans and strings, packaged by the real packager, served by the real HTTP API
on a socket and by `edgepack-agent predict --json` as a subprocess."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from email.message import Message
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from device_agent.http.server import ApiServer
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore, load_public_key
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.conftest import run_cli

BIG = 2**53 + 1  # the first integer a float64 cannot hold
X = [[-1.0, 0.0, 2.0, 4.0]]
K = [[2**53, -(2**63)]]


def wire_model(path: Path) -> Path:
    """log(x), 1/x (NaN, -inf, inf for x <= 0), k + 1 (int64), x > 0 (bool), two constant strings."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [1, 2])
    outputs = [helper.make_tensor_value_info("log", TensorProto.FLOAT, [1, 4]),
               helper.make_tensor_value_info("inv", TensorProto.FLOAT, [1, 4]),
               helper.make_tensor_value_info("big", TensorProto.INT64, [1, 2]),
               helper.make_tensor_value_info("pos", TensorProto.BOOL, [1, 4]),
               helper.make_tensor_value_info("words", TensorProto.STRING, [2])]
    words = helper.make_tensor("w", TensorProto.STRING, [2], [b"NaN", "café".encode()])
    nodes = [helper.make_node("Log", ["x"], ["log"]), helper.make_node("Reciprocal", ["x"], ["inv"]),
             helper.make_node("Add", ["k", "one"], ["big"]), helper.make_node("Greater", ["x", "zero"], ["pos"]),
             helper.make_node("Constant", [], ["words"], value=words)]
    inits = [helper.make_tensor("one", TensorProto.INT64, [1], [1]),
             helper.make_tensor("zero", TensorProto.FLOAT, [1], [0.0])]
    model = helper.make_model(helper.make_graph(nodes, "wire", [x, k], outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def wire_artifact(tmp_path_factory, keypair) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("wire")
    model = wire_model(folder / "wire.onnx")
    # Validation and golden data with finite outputs; the float outputs answer NaN/inf by design
    # (allow_non_finite: served, flagged; otherwise a 500 non_finite_output).
    np.savez(folder / "data.npz", x=np.array([[0.5, 1, 2, 4]], np.float32), k=np.array([[1, 2]], np.int64))
    recipe = folder / "recipe.yaml"
    recipe.write_text(f"name: wire\nversion: 1.0.0\nmodel: {{path: {model.name}}}\npostprocess: {{kind: raw}}\n"
                      "outputs: {log: {allow_non_finite: true}, inv: {allow_non_finite: true}}\n"
                      "validate: {data: {npz: data.npz}}\n")
    artifact = build(load_recipe(recipe), key_paths=[str(keypair[0])], output=folder / "wire.edgepkg").output
    return artifact, model


@pytest.fixture()
def server(wire_artifact, keypair, tmp_path):
    verified = extract_artifact(wire_artifact[0], tmp_path / "m", TrustStore([load_public_key(keypair[1])]))
    service = InferenceService(load_model(verified.root, verified.manifest))
    api = ApiServer(("127.0.0.1", 0), service, max_body_bytes=1 << 16).start()
    yield f"http://127.0.0.1:{api.port}/predict", service
    api.stop()


def strict_loads(data: bytes) -> dict:
    """As strict as JavaScript's JSON.parse: a bare NaN/Infinity token fails the test."""

    def refuse(token: str) -> None:
        raise AssertionError(f"bare {token} on the wire")

    return json.loads(data, parse_constant=refuse)


def post(url: str, accept: str | None = None) -> tuple[int, Message, bytes]:
    """Status, headers (names case-insensitive, as HTTP has them) and body."""
    headers = {"Content-Type": "application/json", **({"Accept": accept} if accept else {})}
    body = json.dumps({"inputs": {"x": X, "k": K}}).encode()
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def reference(model: Path) -> dict[str, np.ndarray]:
    """The same model on bare onnxruntime: what the answer must carry exactly."""
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    values = session.run(None, {"x": np.array(X, np.float32), "k": np.array(K, np.int64)})
    return dict(zip([o.name for o in session.get_outputs()], values, strict=True))


def check_outputs(outputs: dict) -> None:
    assert outputs["log"][0][:2] == ["NaN", "-Infinity"]
    assert outputs["log"][0][2:] == [float(np.log(np.float32(2))), float(np.log(np.float32(4)))]
    assert outputs["inv"] == [[-1.0, "Infinity", 0.5, 0.25]]
    assert outputs["big"] == [[2**53 + 1, -(2**63) + 1]] and type(outputs["big"][0][0]) is int
    assert outputs["big"][0][0] == BIG  # one more than 2**53: lost if it had gone through a float
    assert outputs["pos"] == [[False, False, True, True]] and type(outputs["pos"][0][0]) is bool
    assert outputs["words"] == ["NaN", "café"]


def test_predict_answers_strict_json_with_typed_outputs(server):
    status, headers, body = post(server[0])
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert b"NaN," not in body.replace(b'"NaN",', b"")  # no bare token anywhere
    check_outputs(strict_loads(body)["outputs"])


def test_accept_npz_answers_the_exact_tensors(server, wire_artifact):
    status, headers, body = post(server[0], accept="application/x-npz")
    assert status == 200 and headers["Content-Type"] == "application/x-npz"
    assert headers["X-Edgepack-Model"] == "wire 1.0.0" and headers["X-Edgepack-Provider"] == "CPUExecutionProvider"
    assert float(headers["X-Edgepack-Latency-Ms"]) >= 0
    with np.load(io.BytesIO(body), allow_pickle=False) as loaded:
        got = {name: loaded[name] for name in loaded.files}
    expected = reference(wire_artifact[1])
    assert set(got) == set(expected)
    for name in ("log", "inv", "big", "pos"):
        assert got[name].dtype == expected[name].dtype, name
        assert got[name].tobytes() == expected[name].tobytes(), name  # bit for bit, NaN included
    assert got["words"].tolist() == expected["words"].tolist() == ["NaN", "café"]


def test_client_accepting_neither_json_nor_npz_gets_406_and_the_server_keeps_serving(server):
    status, _, body = post(server[0], accept="text/html")
    assert status == 406 and strict_loads(body)["error"]["kind"] == "not_acceptable"
    status, _, body = post(server[0], accept="application/json;q=0.1, application/x-npz;q=0.05")
    assert status == 200 and "outputs" in strict_loads(body)


def test_an_output_with_no_json_encoding_is_a_500_naming_it_and_npz_still_answers(server, monkeypatch):
    url, service = server
    real_predict = service.predict

    def with_complex_output(*args, **kwargs):
        # onnxruntime has no complex outputs on CPU: the one value no model here can produce.
        result = real_predict(*args, **kwargs)
        result.outputs["z"] = np.array([1 + 2j], np.complex64)
        return result

    monkeypatch.setattr(service, "predict", with_complex_output)
    status, _, body = post(url)
    error = strict_loads(body)["error"]
    assert status == 500 and error["kind"] == "encoding" and "complex" in error["message"]
    assert "application/x-npz" in error["message"]
    status, _, body = post(url, accept="application/x-npz")
    with np.load(io.BytesIO(body), allow_pickle=False) as loaded:
        assert status == 200 and loaded["z"].tolist() == [1 + 2j]


def test_predict_cli_json_is_strict_json_with_typed_outputs(wire_artifact, keypair, tmp_path):
    np.savez(tmp_path / "in.npz", x=np.array(X, np.float32), k=np.array(K, np.int64))
    result = run_cli("edgepack-agent", "predict", "--artifact", str(wire_artifact[0]), "--trust", str(keypair[1]),
                     "--input", str(tmp_path / "in.npz"), "--json")
    assert result.returncode == 0, result.stderr
    check_outputs(strict_loads(result.stdout.encode())["outputs"])
