"""Runtime: predict on every kind of input, typed errors for bad input, hot-swap under load."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
import pytest

from device_agent.errors import BadRequest, NoModelError
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore, load_public_key
from tests.artifacts import build_artifact

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trust(keypair):
    return TrustStore([load_public_key(keypair[1])])


@pytest.fixture(scope="module")
def scale_models(tmp_path_factory, keypair, trust):
    folder = tmp_path_factory.mktemp("runtime")
    models = {}
    for version, factor in (("1.0.0", 2.0), ("1.1.0", 3.0)):
        artifact = build_artifact(folder, keypair[0], version=version, factor=factor)
        verified = extract_artifact(artifact, folder / f"x-{version}", trust)
        models[version] = load_model(verified.root, verified.manifest)
    return models


@pytest.fixture(scope="module")
def digits(tmp_path_factory, keypair, trust):
    """The real digits demo, packaged by the real recipe."""
    from sdk.packager.pipeline import build
    from sdk.recipe import load_recipe
    from tools.demos import build_all

    folder = tmp_path_factory.mktemp("digits")
    build_all(folder / "demo", ["digits"])
    recipe = folder / "recipes" / "digits.yaml"
    recipe.parent.mkdir()
    recipe.write_text((REPO / "recipes" / "digits.yaml").read_text())
    # The repo's recipe names its data in ../demo: allowed as --allow-external-paths allows it.
    artifact = build(load_recipe(recipe, allow_external_paths=True), key_paths=[str(keypair[0])],
                     output=folder / "d.edgepkg").output
    verified = extract_artifact(artifact, folder / "x", trust)
    return load_model(verified.root, verified.manifest), folder / "demo" / "digits"


def test_smoke_test_ran_at_load(scale_models):
    model = scale_models["1.0.0"]
    assert model.smoke is not None and model.smoke.samples == 4 and model.smoke.max_abs_diff < 1e-6


def test_predict_on_named_tensors_and_on_one_array(scale_models):
    service = InferenceService(scale_models["1.0.0"])
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_allclose(service.predict({"x": x}).outputs["y"], x * 2)
    np.testing.assert_allclose(service.predict(x).outputs["y"], x * 2)
    np.testing.assert_allclose(service.predict_tensors({"x": x}).outputs["y"], x * 2)
    buffer = io.BytesIO()
    np.save(buffer, x)
    np.testing.assert_allclose(service.predict(buffer.getvalue()).outputs["y"], x * 2)


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        ({"x": np.zeros((1, 5), np.float32)}, "shape"),
        ({"x": np.zeros((1, 4), np.float64)}, "dtype"),
        ({"z": np.zeros((1, 4), np.float32)}, "unknown_input"),
        ({}, "missing_input"),
        (b"\x89PNG\r\n\x1a\n not really", "unsupported_media"),
        (b"\x93NUMPY garbage", "bad_input"),
        ("a string", "bad_input"),
    ],
)
def test_bad_input_raises_a_typed_error_and_the_service_keeps_serving(scale_models, data, kind):
    service = InferenceService(scale_models["1.0.0"])
    with pytest.raises(BadRequest) as caught:
        service.predict(data)
    assert caught.value.kind == kind and caught.value.http_status in (400, 415)
    ok = service.predict({"x": np.ones((1, 4), np.float32)})
    assert ok.outputs["y"].tolist() == [[2.0] * 4]
    assert service.stats.snapshot()["errors"][kind] == 1


def test_no_model_is_a_typed_error():
    with pytest.raises(NoModelError):
        InferenceService().predict({"x": np.ones((1, 4), np.float32)})


def test_digits_predict_from_png_bytes_is_right_on_real_images(digits):
    model, folder = digits
    service = InferenceService(model)
    labels = dict(line.split(",") for line in (folder / "val" / "labels.csv").read_text().splitlines()[1:])
    correct = 0
    names = sorted(labels)[:40]
    for name in names:
        result = service.predict((folder / "val" / name).read_bytes())
        correct += result.result[0]["label"] == labels[name].strip()
    assert correct >= 38
    with pytest.raises(BadRequest) as caught:
        service.predict(b"\x89PNG\r\n\x1a\n\x00\x00corrupt")
    assert caught.value.kind == "bad_image"


def test_hot_swap_under_concurrent_load_fails_no_request(scale_models):
    """Four threads predict without pause while the model is swapped 40 times between two
    versions: no request fails, and both versions answer."""
    v1, v2 = scale_models["1.0.0"], scale_models["1.1.0"]
    service = InferenceService(v1)
    x = np.ones((1, 4), np.float32)
    stop = threading.Event()
    failures: list[BaseException] = []
    answers: set[float] = set()
    counts = [0] * 4

    def client(index: int) -> None:
        while not stop.is_set():
            try:
                result = service.predict_tensors({"x": x}, postprocess=False)
                value = float(result.outputs["y"][0, 0])
                assert value == {"1.0.0": 2.0, "1.1.0": 3.0}[result.model.manifest.version]
                answers.add(value)
                counts[index] += 1
            except BaseException as err:  # any failure is what the test counts
                failures.append(err)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for i in range(40):
        service.swap(v2 if i % 2 == 0 else v1)
        threading.Event().wait(0.005)
    stop.set()
    for thread in threads:
        thread.join(10)
    assert failures == []
    assert answers == {2.0, 3.0}
    assert sum(counts) > 100


def _fixed_batch_model(path: Path) -> Path:
    """y = Reshape(x * 2, [1, 4]) behind the scale model's contract (x, y float32 [batch, 4]):
    batch 1 runs (its golden samples pass), batch 2 makes onnxruntime fail at run time."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    inits = [helper.make_tensor("k", TensorProto.FLOAT, [1], [2.0]),
             helper.make_tensor("shape", TensorProto.INT64, [2], [1, 4])]
    nodes = [helper.make_node("Mul", ["x", "k"], ["m"]), helper.make_node("Reshape", ["m", "shape"], ["y"])]
    model = helper.make_model(helper.make_graph(nodes, "scale", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_a_failed_inference_is_an_inference_error_not_a_client_refusal(tmp_path, keypair, trust):
    """A request the contract admits that onnxruntime fails on is the model's failure:
    InferenceError (answered 500), counted against the model, never a BadRequest (a 4xx)."""
    from device_agent.errors import InferenceError, RequestError
    from tests.artifacts import resign_with_changes

    built = build_artifact(tmp_path / "build", keypair[0])
    model = _fixed_batch_model(tmp_path / "fixed.onnx").read_bytes()
    artifact = resign_with_changes(built, tmp_path / "fixed.edgepkg", keypair[0], replace={"model/model.onnx": model})
    verified = extract_artifact(artifact, tmp_path / "x", trust)
    service = InferenceService(load_model(verified.root, verified.manifest))
    assert service.predict({"x": np.ones((1, 4), np.float32)}).outputs["y"].tolist() == [[2.0] * 4]
    with pytest.raises(InferenceError) as caught:
        service.predict({"x": np.ones((2, 4), np.float32)})
    assert isinstance(caught.value, RequestError) and not isinstance(caught.value, BadRequest)
    assert caught.value.kind == "runtime" and str(caught.value).startswith("inference failed: ")
    assert caught.value.__cause__ is not None  # onnxruntime's own error, for -v and the logs
    assert service.stats.snapshot()["errors"] == {"runtime": 1}


def test_the_http_layer_picks_the_status_from_the_class():
    """A client's refusal carries its own 4xx (400 to 499, nothing else); the model's failure
    is 500; busy and no model are 503."""
    from device_agent.errors import Busy, InferenceError
    from device_agent.http.answers import status_of

    assert status_of(BadRequest("bad_input", "x")) == 400
    assert status_of(BadRequest("too_large", "x", http_status=413)) == 413
    assert status_of(BadRequest("edge", "x", http_status=499)) == 499
    for outside in (399, 500, 503):
        with pytest.raises(ValueError, match="4xx"):
            BadRequest("bad_input", "x", http_status=outside)
    assert status_of(InferenceError("runtime", "x")) == 500
    assert status_of(Busy("retry later")) == 503 and status_of(NoModelError("no model")) == 503
