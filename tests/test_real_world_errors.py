"""Client errors are 4xx with the useful part (issue 23, item 11): an input the model rejects is
a 400 naming the input, the index, what was sent and what fits, never a 500 nor a server error
in /metrics or the health window; the CLI words a wrong kind of input as HTTP does."""

from __future__ import annotations

import contextlib
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import numpy as np
import pytest

from device_agent.errors import BadRequest, InferenceError
from device_agent.http.server import ApiServer
from device_agent.run_failures import MAX_DETAIL_CHARS, batch_symbols, judge_run_failure, ort_detail
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore, load_public_key
from tests.conftest import run_cli
from tests.real_world_errors import build_audio, build_dynamic_width, png

RESHAPE_ERROR = (
    "[ONNXRuntimeError] : 1 : FAIL : Non-zero status code returned while running Reshape node. Name:'fold_width' "
    "Status Message: /onnxruntime_src/onnxruntime/core/providers/cpu/tensor/reshape_helper.h:84 "
    "onnxruntime::ReshapeHelper::ReshapeHelper(const onnxruntime::TensorShape&, onnxruntime::TensorShapeVector&, "
    "bool) size != 0 && (input_shape_size % size) == 0 was false. The input tensor cannot be reshaped to the "
    "requested shape. Input shape:{1,4,32,37}, requested shape:{1,4,32,-1,32}\n"
)
DIMS_ERROR = (
    "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: x for the following "
    "indices\n index: 2 Got: 37 Expected: 32\n Please fix either the inputs/outputs or the model."
)
DECLARED = {"x": (1, 1, 32, "width")}
PROVEN = ({"x": (1, 1, 32, 32)}, {"x": (1, 1, 32, 64)})


@pytest.fixture(scope="module")
def built(tmp_path_factory, keypair):
    folder = tmp_path_factory.mktemp("realworld")
    trust = TrustStore([load_public_key(keypair[1])])
    artifacts = {
        "wide": build_dynamic_width(folder / "wide", keypair[0]),
        "audio": build_audio(folder / "audio", keypair[0]),
    }
    models = {
        name: load_model(
            extract_artifact(path, folder / f"x-{name}", trust).root,
            extract_artifact(path, folder / f"y-{name}", trust).manifest,
        )
        for name, path in artifacts.items()
    }
    return folder, artifacts, models


@contextlib.contextmanager
def serving(service: InferenceService) -> Iterator[str]:
    server = ApiServer(("127.0.0.1", 0), service).start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.stop()


def post(url: str, body: bytes, content_type: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.read().decode()


# ------------------------------------------------------------------ the pure verdict


def test_onnxruntimes_useful_part_keeps_index_got_and_expected_without_source_paths():
    assert ort_detail(DIMS_ERROR) == (
        "Got invalid dimensions for input: x for the following indices index: 2 Got: 37 Expected: 32"
    )
    detail = ort_detail(RESHAPE_ERROR)
    assert "reshape_helper.h" not in detail and "Input shape:{1,4,32,37}, requested shape:{1,4,32,-1,32}" in detail
    assert detail.startswith("Non-zero status code returned while running Reshape node. Name:'fold_width'")


def test_onnxruntimes_detail_is_bounded():
    assert len(ort_detail("x" * MAX_DETAIL_CHARS)) == MAX_DETAIL_CHARS
    bounded = ort_detail("x" * (MAX_DETAIL_CHARS + 1))
    assert len(bounded) == MAX_DETAIL_CHARS and bounded.endswith("...")


def test_a_shape_error_at_a_width_no_golden_sample_ran_is_the_clients():
    verdict = judge_run_failure(RESHAPE_ERROR, {"x": (1, 1, 32, 37)}, DECLARED, PROVEN)
    assert verdict.client
    assert "input x: index 3 got 37, expected 32 or 64 (as its golden samples)" in verdict.message
    assert "requested shape:{1,4,32,-1,32}" in verdict.message


def test_the_same_shapes_the_golden_samples_ran_are_the_models_failure():
    assert not judge_run_failure(RESHAPE_ERROR, {"x": (1, 1, 32, 64)}, DECLARED, PROVEN).client
    # one dim off a proven shape is enough to be the client's
    assert judge_run_failure(RESHAPE_ERROR, {"x": (1, 1, 32, 65)}, DECLARED, PROVEN).client


def test_an_error_that_is_not_about_shapes_is_the_models_even_at_a_new_width():
    verdict = judge_run_failure(
        "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : CUDA failure 2: out of memory",
        {"x": (1, 1, 32, 37)},
        DECLARED,
        PROVEN,
    )
    assert not verdict.client and verdict.message == "inference failed: CUDA failure 2: out of memory"


def test_a_shape_error_at_a_new_batch_size_is_the_models_a_new_width_the_clients():
    """A model that declares a dynamic batch must run any batch (a Reshape to batch 1 is its
    bug); a width its graph cannot fold is the client's to fix."""
    declared = {"x": ("batch", 1, 32, "width")}
    batch = batch_symbols(declared, [("batch", 4, 32)])
    assert batch == frozenset({"batch"})
    proven = ({"x": (1, 1, 32, 32)},)
    assert not judge_run_failure(RESHAPE_ERROR, {"x": (2, 1, 32, 32)}, declared, proven, batch).client
    verdict = judge_run_failure(RESHAPE_ERROR, {"x": (2, 1, 32, 37)}, declared, proven, batch)
    assert verdict.client and "index 0" not in verdict.message and "index 3 got 37" in verdict.message
    # a leading symbol no output repeats is no batch
    assert batch_symbols(declared, [(4, 32)]) == frozenset()
    assert judge_run_failure(RESHAPE_ERROR, {"x": (2, 1, 32, 32)}, declared, proven).client


def test_a_shape_error_on_a_model_with_only_fixed_dims_is_the_models():
    verdict = judge_run_failure(RESHAPE_ERROR, {"x": (1, 1, 32, 32)}, {"x": (1, 1, 32, 32)}, ())
    assert not verdict.client


def test_without_golden_samples_a_dynamic_dim_is_named_by_its_symbol():
    verdict = judge_run_failure(RESHAPE_ERROR, {"x": (1, 1, 32, 37)}, DECLARED, ())
    assert verdict.client and "index 3 got 37, expected 'width'" in verdict.message


def test_onnxruntimes_input_check_on_a_dim_declared_dynamic_is_the_models_with_index_got_and_expected():
    """The manifest admits the size and the graph does not: the package's fault, not the client's."""
    verdict = judge_run_failure(DIMS_ERROR, {"x": (1, 1, 37, 32)}, {"x": (1, 1, "h", "w")}, ())
    assert not verdict.client
    assert verdict.message.endswith("index: 2 Got: 37 Expected: 32")


def test_a_fixed_dim_onnxruntime_refuses_is_the_clients_with_its_index_got_and_expected():
    verdict = judge_run_failure(DIMS_ERROR, {"x": (1, 1, 37, 64)}, DECLARED, PROVEN)
    assert verdict.client and verdict.message.startswith("input x: index 2 got 37, expected 32 (onnxruntime: Got")
    assert verdict.message.endswith("index: 2 Got: 37 Expected: 32)")


def test_a_declared_fixed_dim_or_rank_broken_is_the_clients():
    fixed = judge_run_failure("anything", {"x": (1, 1, 31, 64)}, DECLARED, PROVEN)
    assert fixed.client and fixed.message.startswith("input x: index 2 got 31, expected 32")
    rank = judge_run_failure("anything", {"x": (1, 32, 64)}, DECLARED, PROVEN)
    assert rank.client and rank.message.startswith("input x: its rank got 3, expected 4")


# ------------------------------------------------------------------ the runtime, HTTP and the CLI


def test_a_wrong_size_image_to_a_dynamic_width_model_is_a_400_naming_index_got_and_expected(built, tmp_path):
    model = built[2]["wide"]
    service = InferenceService(model)
    assert service.predict(png(tmp_path / "96.png", 96).read_bytes()).outputs["y"].shape == (1, 4, 32)
    with pytest.raises(BadRequest) as caught:
        service.predict(png(tmp_path / "37.png", 37).read_bytes())
    assert (caught.value.kind, caught.value.http_status) == ("shape", 400)
    assert "input x: index 3 got 37, expected 32 or 64" in str(caught.value)
    assert "Input shape:{1,4,32,37}" in str(caught.value)
    assert service.stats.snapshot()["requests"] == {"ok": 1, "client_error": 1, "server_error": 0}


def test_a_model_that_fails_on_its_own_golden_shapes_is_still_a_server_error(built):
    model = built[2]["wide"]

    class Broken:
        def run(self, names, feed, options=None):
            raise RuntimeError(RESHAPE_ERROR)

    service = InferenceService(type(model)(**{**model.__dict__, "session": Broken()}))
    with pytest.raises(InferenceError):
        service.predict({"x": np.zeros((1, 1, 32, 64), np.float32)})
    assert service.stats.snapshot()["requests"]["server_error"] == 1


def test_a_wrong_size_image_over_http_is_a_400_and_not_a_server_error_in_metrics(built, tmp_path):
    service = InferenceService(built[2]["wide"])
    with serving(service) as base:
        status, answer = post(f"{base}/predict", png(tmp_path / "37.png", 37).read_bytes(), "image/png")
        metrics = get_text(f"{base}/metrics")
    assert status == 400
    error = answer["error"]
    assert error["kind"] == "shape" and "index 3 got 37, expected 32 or 64" in error["message"]
    assert 'edgepack_requests_total{status="server_error"} 0' in metrics
    assert 'edgepack_requests_total{status="client_error"} 1' in metrics


def test_an_audio_model_given_a_png_on_the_cli_gets_the_same_wording_as_https_415(built, tmp_path, keypair):
    _, artifacts, models = built
    image = png(tmp_path / "photo.png", 40)
    cli = run_cli(
        "edgepack-agent",
        "predict",
        "--artifact",
        str(artifacts["audio"]),
        "--trust",
        str(keypair[1]),
        "--input",
        str(image),
    )
    with serving(InferenceService(models["audio"])) as base:
        status, answer = post(f"{base}/predict", image.read_bytes(), "image/png")
    assert status == 415
    assert cli.returncode == 1 and cli.stderr.count("\n") == 1
    assert cli.stderr.strip() == f"edgepack-agent: error: {answer['error']['message']}"
    assert "this model does not take image/png" in cli.stderr and "audio/wav" in cli.stderr


def test_the_cli_words_a_wrong_size_image_like_http(built, tmp_path, keypair):
    cli = run_cli(
        "edgepack-agent",
        "predict",
        "--artifact",
        str(built[1]["wide"]),
        "--trust",
        str(keypair[1]),
        "--input",
        str(png(tmp_path / "37.png", 37)),
    )
    assert cli.returncode == 1 and "input x: index 3 got 37, expected 32 or 64" in cli.stderr
    assert cli.stderr.count("\n") == 1  # one line: onnxruntime's own log of the failed kernel is off


def test_concurrent_wrong_sizes_leave_the_model_serving(built, tmp_path):
    service = InferenceService(built[2]["wide"])
    bad = png(tmp_path / "33.png", 33).read_bytes()
    errors: list[Exception] = []

    def send() -> None:
        try:
            service.predict(bad)
        except BadRequest as err:
            errors.append(err)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(errors) == 4
    assert service.predict(png(tmp_path / "64.png", 64).read_bytes()).outputs["y"].shape == (1, 4, 32)


def test_wrong_size_images_in_a_health_window_do_not_roll_back_the_release(built, tmp_path):
    """The health rule counts server errors against a new model: one client's wrong-size images
    are client errors (the contract rule needs several clients), never model errors."""
    from device_agent.updates.health import HealthPolicy, Probes, judge, traffic_between

    service = InferenceService(built[2]["wide"])
    before = service.stats.snapshot()
    good, bad = png(tmp_path / "64.png", 64).read_bytes(), png(tmp_path / "37.png", 37).read_bytes()
    with serving(service) as base:
        statuses = [post(f"{base}/predict", good, "image/png")[0] for _ in range(20)]
        statuses += [post(f"{base}/predict", bad, "image/png")[0] for _ in range(10)]
    assert statuses == [200] * 20 + [400] * 10
    window = traffic_between(before, service.stats.snapshot())
    assert (window.model_errors, window.contract_errors, window.contract_clients) == (0, 10, 1)
    verdict = judge(window, traffic_between(before, before), Probes(), HealthPolicy(min_requests=20))
    assert verdict.healthy, verdict.reason


def test_a_wrong_width_tensor_on_the_v2_infer_endpoint_is_a_400_with_the_useful_part(built):
    service = InferenceService(built[2]["wide"])
    body = {"inputs": [{"name": "x", "shape": [1, 1, 32, 37], "datatype": "FP32", "data": [0.5] * (32 * 37)}]}
    with serving(service) as base:
        status, answer = post(f"{base}/v2/models/wide/infer", json.dumps(body).encode(), "application/json")
        good = dict(body, inputs=[dict(body["inputs"][0], shape=[1, 1, 32, 32], data=[0.5] * (32 * 32))])
        ok, _ = post(f"{base}/v2/models/wide/infer", json.dumps(good).encode(), "application/json")
    assert (status, ok) == (400, 200)
    assert "input x: index 3 got 37, expected 32 or 64" in answer["error"]
    assert service.stats.snapshot()["requests"] == {"ok": 1, "client_error": 1, "server_error": 0}


def test_at_most_four_mismatched_dims_are_named():
    declared = {"x": (1, 2, 3, 4, 5)}
    four = judge_run_failure("e", {"x": (9, 9, 9, 9, 5)}, declared, ())
    five = judge_run_failure("e", {"x": (9, 9, 9, 9, 9)}, declared, ())
    assert four.message.count("got 9") == 4 and five.message.count("got 9") == 4
    assert "index 3 got 9" in five.message and "index 4" not in five.message


def test_a_typed_image_to_an_audio_model_names_audio_wav_as_http_does(built, tmp_path):
    """A library caller's typed image to an audio model is worded as HTTP's 415 (it used to say
    "this model takes tensors")."""
    from device_agent.prediction import EncodedImage, PredictRequest

    with pytest.raises(BadRequest) as caught:
        InferenceService(built[2]["audio"]).predict(
            PredictRequest(EncodedImage(png(tmp_path / "a.png", 8).read_bytes()))
        )
    assert caught.value.http_status == 415
    assert str(caught.value) == (
        "this model does not take image/*: send application/json, application/x-npy, application/x-npz, audio/wav"
    )
