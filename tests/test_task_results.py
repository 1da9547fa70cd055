"""Task results end to end: real builds of small graphs (a YOLOv8-style head behind a letterboxed
image input, a classifier ending in Softmax, a CTC recognizer with a charset), served by the
agent's runtime, HTTP API and CLI. Boxes come back in the original image's pixels (checked
against values computed by hand from the letterbox geometry), raw outputs only when asked."""

from __future__ import annotations

import io
import json
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from PIL import Image

from device_agent.http.results import prediction_json
from device_agent.http.server import ApiServer
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore, load_public_key
from sdk.errors import RecipeError
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.conftest import run_cli

# One YOLOv8 anchor per column: cx, cy, w, h (model-input pixels), then scores of cat and dog.
HEAD = np.array([[32, 32, 50], [32, 32, 50], [20, 20, 4], [10, 10, 4],
                 [0.9, 0.6, 0.1], [0.1, 0.2, 0.05]], dtype=np.float32)[None]


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def detector(path: Path) -> Path:
    """image [1, 3, 64, 64] -> output0 [1, 6, 3]: the fixed head above (+ 0 x the image's mean)."""
    image = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 64, 64])
    out = helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 6, 3])
    nodes = [helper.make_node("ReduceMean", ["images"], ["m"], keepdims=0),
             helper.make_node("Mul", ["m", "zero"], ["z"]), helper.make_node("Add", ["head", "z"], ["output0"])]
    inits = [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0]),
             onnx.numpy_helper.from_array(HEAD, "head")]
    return _save(helper.make_graph(nodes, "det", [image], [out], inits), path)


def softmax_classifier(path: Path) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, 4])
    nodes = [helper.make_node("Softmax", ["x"], ["p"], axis=-1, name="head_softmax"),
             helper.make_node("Identity", ["p"], ["probs"])]
    return _save(helper.make_graph(nodes, "cls", [x], [y]), path)


def recognizer(path: Path, classes: int = 4) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, classes])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, classes])
    return _save(helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "ctc", [x], [y]), path)


def _build(folder: Path, key: Path, recipe: str, name: str) -> Path:
    (folder / f"{name}.yaml").write_text(recipe)
    out = folder / f"{name}.edgepkg"
    build(load_recipe(folder / f"{name}.yaml"), key_paths=[str(key)], output=out)
    return out


def _artifact_json(artifact: Path, member: str) -> dict:
    with tarfile.open(artifact) as tar:
        return json.loads(tar.extractfile(member).read())


def _png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 150)).save(buffer, format="PNG")
    return buffer.getvalue()


DETECTOR_RECIPE = """name: det
version: 1.0.0
model: {{path: det.onnx}}
preprocess:
  kind: image
  resize: {{size: [64, 64], mode: letterbox, pad: {pad}, pad_value: 114}}
  scale: 0.00392156862745098
postprocess: {{kind: detection, format: yolov8, score_threshold: 0.3, labels: labels.txt}}
validate: {{data: synthetic}}
"""


@pytest.fixture(scope="module")
def detectors(tmp_path_factory, keypair) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("det")
    detector(folder / "det.onnx")
    (folder / "labels.txt").write_text("cat\ndog\n")
    return {pad: _build(folder, keypair[0], DETECTOR_RECIPE.format(pad=pad), f"det-{pad}")
            for pad in ("center", "top-left")}


def _service(artifact: Path, keypair, folder: Path) -> InferenceService:
    verified = extract_artifact(artifact, folder, TrustStore([load_public_key(keypair[1])]))
    return InferenceService(load_model(verified.root, verified.manifest))


# Image 128 wide, 64 high -> letterbox scale 0.5, resized 64 x 32, centred: pad_y (64 - 32) // 2 = 16.
# Anchor 0: input box [22, 27, 42, 37] -> x (22 - 0) / 0.5 = 44 .. 84, y (27 - 16) / 0.5 = 22 .. 42.
# Top-left: pad_y 0, y 54 .. 74, clipped to the image's height 64.
# Anchor 1 (same class, same place, 0.6) is suppressed; anchor 2 ([48, 48, 52, 52], 0.1) is under 0.3.
EXPECTED_BOX = {"center": [44.0, 22.0, 84.0, 42.0], "top-left": [44.0, 54.0, 84.0, 64.0]}


@pytest.mark.parametrize("pad", ["center", "top-left"])
def test_detection_result_is_in_original_pixels(detectors, keypair, tmp_path, pad):
    service = _service(detectors[pad], keypair, tmp_path / "m")
    answer = prediction_json(service.predict(_png(128, 64), content_type="image/png"))
    assert answer["result"] == [{"box": EXPECTED_BOX[pad], "score": pytest.approx(0.9), "index": 0, "label": "cat"}]
    assert answer["geometry"] == {"original_size": [64, 128], "input_size": [64, 64], "scale_x": 0.5,
                                  "scale_y": 0.5, "pad_x": 0.0, "pad_y": 16.0 if pad == "center" else 0.0}
    assert "outputs" not in answer, "a task result leaves the raw head out"
    raw = prediction_json(service.predict(_png(128, 64), content_type="image/png"), outputs=True)
    np.testing.assert_array_equal(np.asarray(raw["outputs"]["output0"], np.float32), HEAD)


def test_the_manifest_keeps_the_resolved_letterbox_and_detection_specs(detectors):
    manifest = _artifact_json(detectors["top-left"], "manifest.json")
    assert manifest["preprocess"]["resize"]["pad"] == "top-left"
    assert manifest["postprocess"] == {"kind": "detection", "version": 1, "format": "yolov8",
                                       "score_threshold": 0.3, "iou_threshold": 0.45, "max_detections": 100,
                                       "labels": "assets/labels.txt"}


def _http(url: str, body: bytes, content_type: str, accept: str | None = None) -> tuple[int, bytes, str]:
    headers = {"Content-Type": content_type, **({"Accept": accept} if accept else {})}
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), response.headers.get("Content-Type")
    except urllib.error.HTTPError as err:
        return err.code, err.read(), err.headers.get("Content-Type")


def test_http_answers_the_result_and_raw_outputs_only_when_asked(detectors, keypair, tmp_path):
    api = ApiServer(("127.0.0.1", 0), _service(detectors["center"], keypair, tmp_path / "m"),
                    max_body_bytes=1 << 20).start()
    base = f"http://127.0.0.1:{api.port}/predict"
    try:
        status, body, _ = _http(base, _png(128, 64), "image/png")
        answer = json.loads(body)
        assert status == 200 and "outputs" not in answer and answer["geometry"]["pad_y"] == 16.0
        assert answer["result"][0]["box"] == EXPECTED_BOX["center"] and answer["result"][0]["label"] == "cat"
        assert set(answer) == {"model", "provider", "provider_fallbacks", "result", "geometry", "latency_ms"}
        status, body, _ = _http(f"{base}?outputs=raw", _png(128, 64), "image/png")
        assert status == 200 and np.asarray(json.loads(body)["outputs"]["output0"]).shape == (1, 6, 3)
        status, body, kind = _http(base, _png(128, 64), "image/png", accept="application/x-npz")
        assert (status, kind) == (200, "application/x-npz")
        np.testing.assert_array_equal(np.load(io.BytesIO(body))["output0"], HEAD)
        status, body, _ = _http(f"{base}?outputs=everything", _png(128, 64), "image/png")
        assert status == 400 and json.loads(body)["error"]["kind"] == "bad_query"
    finally:
        api.stop()


def test_topk_of_a_graph_ending_in_softmax_scores_its_probabilities(tmp_path, keypair):
    softmax_classifier(tmp_path / "cls.onnx")
    base = "name: cls\nversion: 1.0.0\nmodel: {path: cls.onnx}\nvalidate: {data: synthetic}\n"
    artifact = _build(tmp_path, keypair[0], base + "postprocess: {kind: topk, k: 2}\n", "cls")
    assert _artifact_json(artifact, "manifest.json")["postprocess"]["apply_softmax"] is False
    note = _artifact_json(artifact, "report.json")["passes"]["io_spec"]["apply_softmax"]
    assert note["value"] is False and "Softmax node head_softmax" in note["why"]
    logits = np.array([[0.5, 3.0, 1.0, -1.0]], np.float32)
    probabilities = np.exp(logits) / np.exp(logits).sum()
    result = _service(artifact, keypair, tmp_path / "m").predict(logits).result
    assert [r["index"] for r in result] == [1, 2]
    assert result[0]["score"] == pytest.approx(float(probabilities[0, 1]), rel=1e-5)  # 0.82, not softmax again
    explicit = _build(tmp_path, keypair[0], base + "postprocess: {kind: topk, apply_softmax: false}\n", "cls2")
    assert _artifact_json(explicit, "manifest.json")["postprocess"]["apply_softmax"] is False
    assert _artifact_json(explicit, "report.json")["passes"]["io_spec"]["apply_softmax"]["why"] == "set in the recipe"
    # issue 23: a second softmax over the graph's probabilities is refused, not shipped
    with pytest.raises(RecipeError, match="output probs is already a probability distribution"):
        _build(tmp_path, keypair[0], base + "postprocess: {kind: topk, apply_softmax: true}\n", "cls3")


CTC_RECIPE = ("name: ocr\nversion: 1.0.0\nmodel: {path: ocr.onnx}\nvalidate: {data: synthetic}\n"
              "postprocess: {kind: ctc, charset: charset.txt}\n")


def test_ctc_recognizer_reads_its_bundled_charset(tmp_path, keypair):
    recognizer(tmp_path / "ocr.onnx")
    (tmp_path / "charset.txt").write_text("a\nb\nc\n")
    artifact = _build(tmp_path, keypair[0], CTC_RECIPE, "ocr")
    assert _artifact_json(artifact, "manifest.json")["postprocess"]["charset"] == "assets/charset.txt"
    # argmax per step: a a blank a b blank -> "aab"; the graph's Softmax gives the probabilities
    steps = np.array([[0, 1, 2, 3][i] for i in (1, 1, 0, 1, 2, 0)])
    logits = (np.eye(4, dtype=np.float32)[steps] * 4.0)[None]
    np.save(tmp_path / "x.npy", logits)
    result = run_cli("edgepack-agent", "predict", "--artifact", str(artifact), "--trust", str(keypair[1]),
                     "--input", str(tmp_path / "x.npy"), "--json")
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    expected = float(np.exp(4.0) / (np.exp(4.0) + 3))  # each kept step's top probability
    assert answer["result"] == {"text": "aab", "score": pytest.approx(expected, rel=1e-5)}
    assert "outputs" not in answer
    raw = run_cli("edgepack-agent", "predict", "--artifact", str(artifact), "--trust", str(keypair[1]),
                  "--input", str(tmp_path / "x.npy"), "--json", "--outputs", "raw")
    assert np.asarray(json.loads(raw.stdout)["outputs"]["y"]).shape == (1, 6, 4)


def test_a_charset_that_does_not_fit_the_output_is_refused_at_build(tmp_path, keypair):
    recognizer(tmp_path / "ocr.onnx")
    (tmp_path / "charset.txt").write_text("a\nb\nc\nd\n")
    with pytest.raises(RecipeError) as info:
        _build(tmp_path, keypair[0], CTC_RECIPE, "ocr")
    assert "postprocess.charset" in str(info.value) and "4 symbols" in str(info.value)


def test_charset_path_traversal_outside_the_recipe_folder_is_refused(tmp_path, keypair):
    inner = tmp_path / "inner"
    inner.mkdir()
    recognizer(inner / "ocr.onnx")
    (tmp_path / "secret.txt").write_text("a\nb\nc\n")
    with pytest.raises(RecipeError) as info:
        _build(inner, keypair[0], CTC_RECIPE.replace("charset.txt", "../secret.txt"), "ocr")
    assert "postprocess.charset" in str(info.value) and "outside the recipe's folder" in str(info.value)
