"""``predict`` on a list of images: one session call per ``max_batch`` images when the model has
a dynamic batch dim its outputs follow, one by one otherwise; the same answers, in order, each
with its own geometry. Real artifacts of the digits demo, real onnxruntime sessions."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

from device_agent.errors import BadRequest
from device_agent.feeds import batch_refusal
from device_agent.runtime import DEFAULT_MAX_BATCH, InferenceService, LoadedModel, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.manifest import Manifest
from edgepack_core.postprocess import Postprocessor
from edgepack_core.preprocess import Preprocessor
from edgepack_core.signing import TrustStore, load_public_key
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tools.demos import build_all

REPO = Path(__file__).resolve().parent.parent
IMAGE = {"kind": "image", "resize": {"size": [8, 8]}}


# ----------------------------------------------------------------------------- the decision (pure)


def _model(*, preprocess: dict | None = None, inputs: list[dict] | None = None, outputs: list[dict] | None = None,
           states: dict | None = None) -> LoadedModel:
    inputs = inputs if inputs is not None else [{"name": "x", "dtype": "float32", "shape": ["batch", 3, 8, 8]}]
    manifest = Manifest({"name": "m", "version": "1.0.0", "inputs": inputs, "preprocess": preprocess or IMAGE,
                         "outputs": outputs if outputs is not None else
                         [{"name": "y", "dtype": "float32", "shape": ["batch", 10]}]})
    specs = {i["name"]: (np.dtype(i["dtype"]), tuple(i["shape"])) for i in inputs if i["name"] not in (states or {})}
    return LoadedModel(root=Path("."), manifest=manifest, session=None, provider="CPUExecutionProvider", fallbacks=[],
                       preprocessor=Preprocessor(manifest.preprocess), postprocessor=Postprocessor({"kind": "raw"}),
                       input_specs=specs, states=states or {})


@pytest.mark.parametrize(("model", "reason"), [
    (dict(), None),
    (dict(preprocess={"kind": "tensor"}), "the model takes no images"),
    (dict(preprocess={"kind": "image"}), "no fixed-size tensor"),
    (dict(preprocess={**IMAGE, "batch": False}, inputs=[{"name": "x", "dtype": "float32", "shape": [3, 8, 8]}]),
     "no fixed-size tensor with a batch dimension"),
    (dict(inputs=[{"name": "x", "dtype": "float32", "shape": [1, 3, 8, 8]}]), "input x has no dynamic batch dimension"),
    (dict(inputs=[{"name": "x", "dtype": "float32", "shape": [2, 3, 8, 8]}]), "shape [2, 3, 8, 8]"),
    (dict(outputs=[{"name": "y", "dtype": "float32", "shape": [1, 10]}]), "output y does not follow"),
    (dict(outputs=[{"name": "y", "dtype": "float32", "shape": ["batch", 10]},
                   {"name": "n", "dtype": "int64", "shape": ["detections"]}]), "output n does not follow"),
    (dict(outputs=[{"name": "y", "dtype": "float32", "shape": []}]), "output y does not follow"),
    (dict(inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 3, 8, 8]},
                  {"name": "k", "dtype": "float32", "shape": ["batch", 1]}]), "other inputs besides the image"),
    (dict(inputs=[{"name": "x", "dtype": "float32", "shape": ["batch", 3, 8, 8]},
                  {"name": "h", "dtype": "float32", "shape": ["batch", 4]}], states={"h": ("h_out", np.zeros(4))}),
     "carries state"),
])
def test_batch_refusal_says_why_or_allows(model: dict[str, Any], reason: str | None) -> None:
    got = batch_refusal(_model(**model))
    assert (got is None) if reason is None else (got is not None and reason in got)


# ----------------------------------------------------------------------------- real artifacts


class CountingSession:
    """The real session, its ``run`` calls counted (and the batch size of each)."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.batches: list[int] = []

    def run(self, names: list[str], feed: dict[str, np.ndarray], *options: Any) -> list[np.ndarray]:
        self.batches.append(next(iter(feed.values())).shape[0])
        return self.session.run(names, feed, *options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.session, name)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("batching")
    build_all(root / "demo", ["digits"])
    (root / "recipes").mkdir()
    return root


def _digits(workspace: Path, keypair: tuple[Path, Path], name: str, **changes: Any) -> LoadedModel:
    doc = yaml.safe_load((REPO / "recipes" / "digits.yaml").read_text())
    for key, value in changes.items():
        doc[key] = {**doc[key], **value} if isinstance(doc.get(key), dict) else value
    recipe = workspace / "recipes" / f"{name}.yaml"
    recipe.write_text(yaml.safe_dump(doc))
    artifact = build(load_recipe(recipe, allow_external_paths=True), key_paths=[str(keypair[0])],
                     output=workspace / f"{name}.edgepkg").output
    verified = extract_artifact(artifact, workspace / f"x-{name}", TrustStore([load_public_key(keypair[1])]))
    model = load_model(verified.root, verified.manifest)
    model.session = CountingSession(model.session)
    return model


@pytest.fixture(scope="module")
def dynamic(workspace, keypair) -> LoadedModel:
    return _digits(workspace, keypair, "dynamic")


def _items(workspace: Path) -> list[bytes | np.ndarray]:
    """Digits as PNG bytes, as JPEG bytes of another size, and as uint8 arrays (RGB, gray, BGR view)."""
    files = sorted((workspace / "demo" / "digits" / "val").glob("*.png"))[:6]
    items: list[bytes | np.ndarray] = [files[0].read_bytes(), files[1].read_bytes()]
    buffer = io.BytesIO()
    Image.open(files[2]).convert("RGB").resize((40, 24)).save(buffer, format="JPEG", quality=95)
    items.append(buffer.getvalue())
    rgb = np.asarray(Image.open(files[3]).convert("RGB").resize((30, 50)))
    items += [rgb, np.asarray(Image.open(files[4])), np.ascontiguousarray(rgb[:, :, ::-1])[:, :, ::-1]]
    return items


def _same(batched: list, single: list) -> None:
    assert len(batched) == len(single)
    for got, want in zip(batched, single, strict=True):
        assert got.result == want.result and got.geometry == want.geometry
        for name, value in want.outputs.items():
            assert got.outputs[name].shape == value.shape
            np.testing.assert_allclose(got.outputs[name], value, rtol=1e-5, atol=1e-6)


def test_a_list_runs_as_one_session_call_in_order_each_with_its_geometry(workspace, dynamic) -> None:
    service = InferenceService(dynamic)
    service.max_batch = 6
    items = _items(workspace)
    single = [service.predict(item) for item in items]
    dynamic.session.batches.clear()
    batched = service.predict(items)
    assert dynamic.session.batches == [6] == [len(items)]
    _same(batched, single)
    assert [r.geometry["original_size"] for r in batched] == [[8, 8], [8, 8], [24, 40], [50, 30], [8, 8], [50, 30]]
    assert len({r.result[0]["index"] for r in batched}) > 1  # not one answer repeated
    assert service.predict(tuple(items[:2]))[1].result == single[1].result
    assert service.predict([]) == [] and dynamic.session.batches == [len(items), 2]


@pytest.mark.parametrize(("size", "count", "calls"), [(3, 3, [3]), (3, 4, [3, 1]), (3, 7, [3, 3, 1]), (1, 2, [1, 1])])
def test_max_batch_bounds_every_session_call(workspace, dynamic, size: int, count: int, calls: list[int]) -> None:
    service = InferenceService(dynamic)
    items = (_items(workspace) * 2)[:count]
    single = [service.predict(item) for item in items]
    service.max_batch = size
    dynamic.session.batches.clear()
    batched = service.predict_batch(items)
    assert dynamic.session.batches == calls
    _same(batched, single)
    assert InferenceService().max_batch == DEFAULT_MAX_BATCH == 4


def test_a_fixed_batch_model_runs_one_by_one_with_the_same_answers(workspace, keypair, dynamic) -> None:
    fixed = _digits(workspace, keypair, "fixed", inputs={"image": {"shape": [1, 1, 8, 8]}})
    assert "no dynamic batch dimension" in (batch_refusal(fixed) or "")
    items = _items(workspace)
    batched = InferenceService(fixed).predict(items)
    assert fixed.session.batches == [1] * len(items)
    _same(batched, [InferenceService(dynamic).predict(item) for item in items])


def test_a_bad_item_refuses_the_whole_list_naming_it_before_anything_runs(workspace, dynamic) -> None:
    service = InferenceService(dynamic)
    items = _items(workspace)
    dynamic.session.batches.clear()
    npy = io.BytesIO()
    np.save(npy, np.zeros((1, 1, 8, 8), np.float32))
    for bad, kind, fragment in ((b"\x89PNG\r\n\x1a\n broken", "bad_image", "item 2: cannot decode image"),
                                (npy.getvalue(), "bad_input", "item 2: a batch takes images, not .npy/.npz"),
                                (np.zeros((8, 8), np.float32), "bad_input", "item 2: a batch takes images"),
                                ("digit.png", "bad_input", "got a str")):
        before = service.stats.snapshot()["requests"]["client_error"]
        with pytest.raises(BadRequest) as info:
            service.predict([*items[:2], bad, *items[2:]])
        assert info.value.kind == kind and fragment in str(info.value)
        assert service.stats.snapshot()["requests"]["client_error"] == before + 1
    assert dynamic.session.batches == []


def test_every_image_counts_as_one_request_with_its_share_of_the_call(workspace, dynamic) -> None:
    service = InferenceService(dynamic)
    seen: list[float | None] = []
    service.observers.append(lambda latency, error: seen.append(latency))
    results = service.predict(_items(workspace)[:4])
    assert service.stats.snapshot()["requests"]["ok"] == 4 and len(seen) == 4
    assert len({r.latency_s for r in results}) == 1 and results[0].latency_s == seen[0] > 0


def test_an_in_graph_model_batches_its_uint8_rows(workspace, keypair, dynamic) -> None:
    lowered = _digits(workspace, keypair, "in-graph", preprocess={"in_graph": True})
    items = _items(workspace)
    batched = InferenceService(lowered).predict(items)
    assert lowered.session.batches == [4, 2]  # max_batch's default, then the rest
    _same(batched, [InferenceService(dynamic).predict(item) for item in items])


def test_outputs_that_do_not_follow_the_batch_after_all_fall_back_to_one_by_one() -> None:
    """A manifest whose symbolic output dim is not the batch (a sum over everything, declared
    ["batch", 1]): the batched call's outputs come back with 1 row, so the answers are those of
    one call per image."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=1)], "sum",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 1, 1])])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model = _model(outputs=[{"name": "y", "dtype": "float32", "shape": ["batch", 1, 1, 1]}])
    model.session = CountingSession(ort.InferenceSession(onnx_model.SerializeToString(),
                                                         providers=["CPUExecutionProvider"]))
    model.output_names = ["y"]
    assert batch_refusal(model) is None
    images = [np.full((8, 8, 3), value, np.uint8) for value in (1, 2, 3)]
    results = InferenceService(model).predict(images)
    assert model.session.batches == [3, 1, 1, 1]
    assert [float(r.outputs["y"].ravel()[0]) for r in results] == [192.0, 384.0, 576.0]
