"""The Open Inference Protocol (KServe v2 REST) spoken to the agent by the official client,
``tritonclient[http]``, against a real ApiServer on a free port: health, metadata, inference with
numpy inputs, binary and JSON tensors both ways, every datatype the wire model has, errors; and
the binary tensor extension's bounds with raw requests a client library would not send."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path

import numpy as np
import pytest

from device_agent.http.server import ApiServer
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore, load_public_key
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.artifacts import build_artifact
from tests.test_agent_wire import K, X, reference, wire_model

httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient[http] is in the dev extra")
from tritonclient.utils import InferenceServerException  # noqa: E402


def _serve(artifact: Path, keypair, folder: Path) -> tuple[ApiServer, InferenceService]:
    verified = extract_artifact(artifact, folder, TrustStore([load_public_key(keypair[1])]))
    service = InferenceService(load_model(verified.root, verified.manifest))
    return ApiServer(("127.0.0.1", 0), service).start(), service


@pytest.fixture(scope="module")
def scale_artifact(tmp_path_factory, keypair) -> Path:
    return build_artifact(tmp_path_factory.mktemp("scale"), keypair[0])


@pytest.fixture(scope="module")
def wire_artifact(tmp_path_factory, keypair) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("wire")
    model = wire_model(folder / "wire.onnx")
    np.savez(folder / "data.npz", x=np.array([[0.5, 1, 2, 4]], np.float32), k=np.array([[1, 2]], np.int64))
    # The float outputs answer NaN/inf by design: declared, so served flagged (else a 500).
    (folder / "recipe.yaml").write_text("name: wire\nversion: 1.0.0\nmodel: {path: wire.onnx}\n"
                                        "postprocess: {kind: raw}\nvalidate: {data: {npz: data.npz}}\n"
                                        "outputs: {log: {allow_non_finite: true}, inv: {allow_non_finite: true}}\n")
    artifact = build(load_recipe(folder / "recipe.yaml"), key_paths=[str(keypair[0])],
                     output=folder / "wire.edgepkg").output
    return artifact, model


@pytest.fixture()
def scale(scale_artifact, keypair, tmp_path):
    server, service = _serve(scale_artifact, keypair, tmp_path / "m")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    yield client, server, service
    client.close()
    server.stop()


@pytest.fixture()
def wire(wire_artifact, keypair, tmp_path):
    server, _ = _serve(wire_artifact[0], keypair, tmp_path / "w")
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    yield client, wire_artifact[1]
    client.close()
    server.stop()


def _input(name: str, array: np.ndarray, datatype: str, *, binary: bool = True) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def test_tritonclient_reads_health_and_metadata(scale):
    client, _, _ = scale
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("scale") and client.is_model_ready("scale", "1.0.0")
    assert not client.is_model_ready("nope") and not client.is_model_ready("scale", "9.9.9")
    server = client.get_server_metadata()
    assert server["name"] == "edgepack-agent" and "binary_tensor_data" in server["extensions"]
    assert client.get_model_metadata("scale") == {
        "name": "scale", "versions": ["1.0.0"], "platform": "onnxruntime_onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 4]}]}
    assert client.get_model_metadata("scale", "1.0.0")["name"] == "scale"


def test_tritonclient_infers_with_binary_tensors_both_ways_by_default(scale):
    client, _, service = scale
    x = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    result = client.infer("scale", [_input("x", x, "FP32")])
    response = result.get_response()
    assert response["outputs"][0]["parameters"] == {"binary_data_size": 48} and "data" not in response["outputs"][0]
    np.testing.assert_array_equal(result.as_numpy("y"), x * np.float32(2))
    assert service.stats.snapshot()["requests"]["ok"] == 1


def test_tritonclient_infers_with_json_tensors_and_gets_its_request_id_back(scale):
    client, _, _ = scale
    x = np.array([[1.5, -2, 3, 4]], np.float32)
    result = client.infer("scale", [_input("x", x, "FP32", binary=False)], request_id="req-42",
                          outputs=[httpclient.InferRequestedOutput("y", binary_data=False)], model_version="1.0.0")
    response = result.get_response()
    assert response["id"] == "req-42" and response["model_version"] == "1.0.0"
    assert response["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [1, 4], "data": [3.0, -4.0, 6.0, 8.0]}]
    np.testing.assert_array_equal(result.as_numpy("y"), x * 2)


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_gets_every_datatype_exactly(wire, binary):
    client, model = wire
    x, k = np.array(X, np.float32), np.array(K, np.int64)
    outputs = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in ("log", "inv", "big", "pos",
                                                                                      "words")]
    result = client.infer("wire", [_input("x", x, "FP32", binary=binary), _input("k", k, "INT64", binary=binary)],
                          outputs=outputs)
    expected = reference(model)
    datatypes = {o["name"]: o["datatype"] for o in result.get_response()["outputs"]}
    assert datatypes == {"log": "FP32", "inv": "FP32", "big": "INT64", "pos": "BOOL", "words": "BYTES"}
    for name in ("log", "inv"):  # NaN and infinities, bit for bit in binary; by value in JSON
        got = result.as_numpy(name)
        assert got.dtype == np.float32
        if binary:
            assert got.tobytes() == expected[name].tobytes()
        else:
            np.testing.assert_array_equal(got, expected[name])
    assert result.as_numpy("big").tolist() == [[2**53 + 1, -(2**63) + 1]]  # every digit of int64
    assert result.as_numpy("pos").tolist() == [[False, False, True, True]]
    words = [w.decode() if isinstance(w, bytes) else w for w in result.as_numpy("words").tolist()]
    assert words == ["NaN", "café"]


def test_only_the_requested_outputs_come_back(wire):
    client, _ = wire
    result = client.infer("wire", [_input("x", np.array(X, np.float32), "FP32"),
                                   _input("k", np.array(K, np.int64), "INT64")],
                          outputs=[httpclient.InferRequestedOutput("big")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["big"]


@pytest.mark.parametrize(
    ("inputs", "model", "status", "needle"),
    [
        ([("x", np.ones((2, 3), np.float32), "FP32")], "scale", "400", "must have shape [-1, 4], got [2, 3]"),
        ([("x", np.ones((1, 4), np.int32), "INT32")], "scale", "400", "x is FP32, got datatype INT32"),
        ([("waveform", np.ones((1, 4), np.float32), "FP32")], "scale", "400", "unknown input 'waveform'"),
        ([("x", np.array([[np.nan, 1, 2, 3]], np.float32), "FP32")], "scale", "400", "NaN or infinite"),
        ([], "scale", "400", "missing input(s) x"),
        ([("x", np.ones((1, 4), np.float32), "FP32")], "nope", "404", "unknown model nope"),
    ],
)
def test_errors_reach_tritonclient_with_their_status_and_message(scale, inputs, model, status, needle):
    client, _, _ = scale
    with pytest.raises(InferenceServerException) as caught:
        client.infer(model, [_input(name, array, datatype) for name, array, datatype in inputs])
    assert caught.value.status() == status and needle in caught.value.message()
    client.infer("scale", [_input("x", np.ones((1, 4), np.float32), "FP32")])  # and it keeps serving


def test_unknown_output_is_a_400(scale):
    client, _, _ = scale
    with pytest.raises(InferenceServerException, match="unknown output 'z'") as caught:
        client.infer("scale", [_input("x", np.ones((1, 4), np.float32), "FP32")],
                     outputs=[httpclient.InferRequestedOutput("z")])
    assert caught.value.status() == "400"


# ------------------------------------------------------------------ raw requests: the extension's bounds


def _raw(port: int, path: str, body: bytes = b"", headers: str = "", method: str = "POST") -> tuple[int, str, bytes]:
    request = (f"{method} {path} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\nContent-Length: {len(body)}\r\n"
               f"{headers}\r\n").encode() + body
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), head.decode("latin1").lower(), payload


def _binary_request(inputs: list[dict], data: bytes, header_length: int | None = None) -> tuple[bytes, str]:
    header = json.dumps({"inputs": inputs}).encode()
    size = len(header) if header_length is None else header_length
    return header + data, f"Inference-Header-Content-Length: {size}\r\n"


X14 = {"name": "x", "shape": [1, 4], "datatype": "FP32"}


@pytest.mark.parametrize(
    ("inputs", "data", "header_length", "needle"),
    [
        ([{**X14, "parameters": {"binary_data_size": 16}}], bytes(16), 10**6, "must be a byte count within the body"),
        ([{**X14, "parameters": {"binary_data_size": 16}}], bytes(20), None, "4 bytes of binary data"),
        ([{**X14, "parameters": {"binary_data_size": 12}}], bytes(12), None, "is not 4 x 4 bytes"),
        ([{**X14, "parameters": {"binary_data_size": 64}}], bytes(16), None, "does not fit the 16 bytes left"),
        ([{**X14, "parameters": {"binary_data_size": 16}, "data": [1, 2, 3, 4]}], bytes(16), None, "both data"),
        ([{**X14, "data": [1, 2, 3]}], b"", None, "3 values for shape [1, 4]"),
        ([{**X14, "shape": [1, -4]}], b"", None, "non-negative integers"),
        ([X14, X14], b"", None, "must be a list"),
    ],
)
def test_binary_extension_and_json_tensors_are_bounded(scale, inputs, data, header_length, needle):
    _, server, _ = scale
    body, headers = _binary_request(inputs, data, header_length)
    status, _, payload = _raw(server.port, "/v2/models/scale/infer", body, headers)
    error = json.loads(payload)
    assert status == 400 and set(error) == {"error"} and needle in error["error"], error


def test_v2_bytes_inputs_are_parsed_with_their_lengths_bounded():
    from device_agent.http import bodies, oip

    specs = {"s": (np.dtype(object), (2,))}
    good = struct.pack("<I", 3) + b"abc" + struct.pack("<I", 2) + "é".encode()
    header = json.dumps({"inputs": [{"name": "s", "shape": [2], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(good)}}]}).encode()
    parsed = oip.parse_infer_request(header + good, str(len(header)), specs, ["out"], bodies.BodyLimits())
    assert parsed.inputs["s"].tolist() == ["abc", "é"]
    lying = struct.pack("<I", 1000) + b"abc" + struct.pack("<I", 2) + b"zz"
    header = json.dumps({"inputs": [{"name": "s", "shape": [2], "datatype": "BYTES",
                                     "parameters": {"binary_data_size": len(lying)}}]}).encode()
    with pytest.raises(oip.BadRequest, match="runs past the data"):
        oip.parse_infer_request(header + lying, str(len(header)), specs, ["out"], bodies.BodyLimits())


def test_v2_declared_tensor_bytes_over_max_decoded_bytes_is_413_before_allocating(scale):
    _, server, _ = scale
    body = json.dumps({"inputs": [{**X14, "shape": [2**40, 4], "data": [1, 2, 3, 4]}]}).encode()
    status, head, payload = _raw(server.port, "/v2/models/scale/infer", body)
    assert status == 413 and "connection: close" in head and "over the limit" in json.loads(payload)["error"]


def test_v2_errors_use_the_protocol_shape_for_paths_and_methods(scale):
    _, server, _ = scale
    status, head, payload = _raw(server.port, "/v2/models/scale/infer", method="GET")
    assert status == 405 and "allow: post" in head and set(json.loads(payload)) == {"error"}
    status, _, payload = _raw(server.port, "/v2/nothing/here", method="GET")
    assert status == 404 and json.loads(payload) == {"error": "no such endpoint /v2/nothing/here"}
    status, _, payload = _raw(server.port, "/v2/models/scale/infer", b"{not json")
    assert status == 400 and json.loads(payload)["error"].startswith("body is not JSON")
    status, _, payload = _raw(server.port, "/v2/health/live", method="GET")
    assert (status, payload) == (200, b"")  # the protocol's health answers have no body


def test_without_a_model_the_server_is_live_but_not_ready():
    server = ApiServer(("127.0.0.1", 0), InferenceService()).start()
    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.port}")
    try:
        assert client.is_server_live() and not client.is_server_ready() and not client.is_model_ready("scale")
        with pytest.raises(InferenceServerException) as caught:
            client.get_model_metadata("scale")
        assert caught.value.status() == "404" and "no model" in caught.value.message()
    finally:
        client.close()
        server.stop()
