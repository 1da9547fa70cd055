"""device_agent/http/ and the runtime meet on typed values (device_agent/prediction.py): an
HTTP body's type is negotiated once and reaches ``InferenceService.predict`` as a frozen
request; the runtime gives back a typed result and only the HTTP layer (http/results.py)
decides the JSON answer's shape."""

from __future__ import annotations

import dataclasses
import io
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from device_agent import feeds
from device_agent.config import ApiSettings
from device_agent.errors import BadRequest
from device_agent.http import app as http_app
from device_agent.http.results import includes_outputs, prediction_json
from device_agent.http.server import ApiServer
from device_agent.prediction import Audio, EncodedImage, PredictRequest, PredictResult, Tensors
from device_agent.runtime import InferenceService, LoadedModel, load_model
from edgepack_core import jpeg_scans
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore, load_public_key
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.artifacts import build_artifact
from tests.test_http_attacks import image_model


def _png(size: int = 20) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.arange(size * size * 3, dtype=np.uint8).reshape(size, size, 3)).save(buffer, "PNG")
    return buffer.getvalue()


def _load(artifact: Path, folder: Path, keypair: tuple[Path, Path]) -> LoadedModel:
    verified = extract_artifact(artifact, folder, TrustStore([load_public_key(keypair[1])]))
    return load_model(verified.root, verified.manifest)


@pytest.fixture(scope="module")
def models(tmp_path_factory, keypair) -> dict[str, LoadedModel]:
    folder = tmp_path_factory.mktemp("typed")
    image_model(folder / "img.onnx")
    (folder / "img.yaml").write_text("name: img\nversion: 1.0.0\nmodel: {path: img.onnx}\n"
                                     "preprocess: {kind: image, resize: {size: [16, 16]}}\n"
                                     "postprocess: {kind: raw}\nvalidate: {data: synthetic}\n")
    image = build(load_recipe(folder / "img.yaml"), key_paths=[str(keypair[0])], output=folder / "img.edgepkg").output
    return {"image": _load(image, folder / "x-img", keypair),
            "scale": _load(build_artifact(folder, keypair[0]), folder / "x-scale", keypair)}


@pytest.fixture()
def image_api(models) -> Iterator[tuple[int, list[object]]]:
    """An API over the image model whose service records what ``predict`` was given."""
    service = InferenceService(models["image"])
    given: list[object] = []
    plain = service.predict

    def recording(data, **kwargs):
        given.append(data)
        return plain(data, **kwargs)

    service.predict = recording  # type: ignore[method-assign]
    server = ApiServer(("127.0.0.1", 0), service, settings=ApiSettings()).start()
    yield server.port, given
    server.stop()


@pytest.mark.parametrize("content_type", ["image/png", "application/octet-stream"])
def test_an_image_post_has_its_body_type_worked_out_once(image_api, monkeypatch, content_type):
    port, given = image_api
    calls = []
    negotiate = http_app.body_kind

    def counted(*args, **kwargs):
        calls.append(args[0])
        return negotiate(*args, **kwargs)

    def never(*args, **kwargs):
        raise AssertionError("the runtime told an HTTP body apart again")

    monkeypatch.setattr(http_app, "body_kind", counted)
    monkeypatch.setattr(feeds, "body_kind", never)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=_png(), method="POST",
                                     headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=30) as answer:
        document = json.loads(answer.read())
    assert calls == [content_type], "negotiated once: on the event loop for a typed body, else on the worker"
    assert len(given) == 1 and isinstance(given[0], PredictRequest) and isinstance(given[0].input, EncodedImage)
    assert np.asarray(document["outputs"]["mean"]).shape == (1, 3)


def test_an_image_post_has_its_header_read_once(image_api, monkeypatch):
    """The HTTP check opens the image (format, pixel cap, JPEG scans) and the preprocessing
    decodes that very image: Pillow opens it once, its scans are walked once."""
    port, given = image_api
    opened, walked = [], []
    plain_open, plain_walk = Image.open, jpeg_scans.count_scans
    monkeypatch.setattr(Image, "open", lambda *a, **k: opened.append(1) or plain_open(*a, **k))
    monkeypatch.setattr(jpeg_scans, "count_scans", lambda *a, **k: walked.append(1) or plain_walk(*a, **k))
    buffer = io.BytesIO()
    Image.fromarray(np.full((24, 32, 3), 90, np.uint8)).save(buffer, "JPEG", progressive=True)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/predict", data=buffer.getvalue(), method="POST",
                                     headers={"Content-Type": "image/jpeg"})
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200
    assert (len(opened), len(walked)) == (1, 1)
    assert given[0].input.header is not None, "the request carries the image its header was read into"


def test_a_typed_request_is_frozen_and_answers_as_the_loose_bytes_do(models):
    service = InferenceService(models["image"])
    png = _png()
    request = PredictRequest(EncodedImage(png))
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.stream = "cam-1"  # type: ignore[misc]
    typed, loose = service.predict(request), service.predict(png)
    np.testing.assert_array_equal(typed.outputs["mean"], loose.outputs["mean"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        typed.latency_s = 0.0  # type: ignore[misc]
    assert not hasattr(typed, "to_json"), "the JSON shape is the HTTP layer's (http/results.py)"


def test_a_typed_input_the_model_cannot_take_is_refused_as_unsupported_media(models):
    with pytest.raises(BadRequest) as caught:
        InferenceService(models["scale"]).predict(PredictRequest(EncodedImage(_png())))
    assert (caught.value.kind, caught.value.http_status) == ("unsupported_media", 415)
    with pytest.raises(BadRequest) as caught:
        InferenceService(models["image"]).predict(PredictRequest(Audio(b"RIFF\x00\x00\x00\x00WAVE")))
    assert (caught.value.kind, caught.value.http_status) == ("unsupported_media", 415)
    ok = InferenceService(models["scale"]).predict(PredictRequest(Tensors({"x": np.ones((1, 4), np.float32)})))
    np.testing.assert_allclose(ok.outputs["y"], 2.0)


def test_the_answer_carries_raw_outputs_as_asked_else_only_without_a_task_result(models):
    raw = InferenceService(models["scale"]).predict({"x": np.ones((1, 4), np.float32)})
    with_result = dataclasses.replace(raw, result=[{"index": 0}])
    assert isinstance(raw, PredictResult) and raw.result is None
    assert [includes_outputs(raw, asked) for asked in (None, True, False)] == [True, True, False]
    assert [includes_outputs(with_result, asked) for asked in (None, True, False)] == [False, True, False]
    answer = prediction_json(with_result)
    assert list(answer) == ["model", "provider", "provider_fallbacks", "result", "latency_ms"]
    assert answer["model"] == {"name": raw.model.manifest.name, "version": raw.model.manifest.version}
    assert prediction_json(raw)["outputs"] == {"y": [[2.0, 2.0, 2.0, 2.0]]}
