"""Image preprocessing lowered into the graph (``preprocess.in_graph``): the spec key, the
rewrite on small graphs run by onnxruntime, and the demo recipes built both ways by the real
packager and served by the real agent."""

from __future__ import annotations

import shutil
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper

from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.errors import SchemaError
from edgepack_core.preprocess import Preprocessor
from edgepack_core.preprocess_spec import normalize_preprocess, parse_preprocess
from edgepack_core.signing import TrustStore, load_public_key
from sdk.errors import RecipeError
from sdk.packager.passes.preprocess_graph import lower_preprocessing
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tools.demos import build_all

REPO = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- the spec key


def test_in_graph_is_written_only_when_true() -> None:
    assert normalize_preprocess({"kind": "image", "in_graph": True})["in_graph"] is True
    assert "in_graph" not in normalize_preprocess({"kind": "image", "in_graph": False})
    assert "in_graph" not in normalize_preprocess({"kind": "image"})  # older agents read these manifests


@pytest.mark.parametrize(("spec", "path", "fragment"), [
    ({"kind": "image", "dtype": "uint8", "in_graph": True}, "preprocess.in_graph", "dtype uint8 has none"),
    ({"kind": "image", "dtype": "int8", "in_graph": True}, "preprocess.in_graph", "dtype int8 has none"),
    ({"kind": "image", "in_graph": "yes"}, "preprocess.in_graph", "boolean"),
    ({"kind": "tensor", "in_graph": True}, "preprocess.in_graph", "unknown key"),
])
def test_in_graph_refusals_name_the_key(spec: dict, path: str, fragment: str) -> None:
    with pytest.raises(SchemaError) as info:
        normalize_preprocess(spec, path="preprocess")
    assert info.value.path == path and fragment in info.value.problem


# ----------------------------------------------------------------------------- the rewrite


def _identity_model(shape: list, dtype: int = TensorProto.FLOAT, *, subgraph: bool = False,
                    taken: str | None = None) -> onnx.ModelProto:
    """y = x (Identity, or an If whose branch reads the outer x), opset 17."""
    x = helper.make_tensor_value_info("x", dtype, shape)
    y = helper.make_tensor_value_info("y", dtype, shape)
    if subgraph:
        branch = helper.make_graph([helper.make_node("Identity", ["x"], ["inner"])], "branch", [],
                                   [helper.make_tensor_value_info("inner", dtype, shape)])
        nodes = [helper.make_node("Constant", [], ["cond"], value=helper.make_tensor("c", TensorProto.BOOL, [], [1])),
                 helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)]
    else:
        nodes = [helper.make_node("Identity", ["x"], [taken or "y"])]
        if taken:  # a tensor already named like the one the rewrite would create
            nodes.append(helper.make_node("Identity", [taken], ["y"]))
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y]), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.mark.parametrize(("layout", "batch", "color", "dtype"), [
    ("NCHW", True, "rgb", "float32"), ("NHWC", True, "bgr", "float32"), ("NCHW", False, "gray", "float32"),
    ("NHWC", False, "rgb", "float32"), ("NCHW", True, "rgb", "float16"),
])
def test_the_lowered_graph_computes_the_python_path_bit_for_bit(layout: str, batch: bool, color: str,
                                                                dtype: str) -> None:
    channels = 1 if color == "gray" else 3
    spec = parse_preprocess({"kind": "image", "color": color, "resize": {"size": [12, 10]}, "layout": layout,
                                 "dtype": dtype, "batch": batch, "scale": 1 / 255,
                                 "mean": [0.485, 0.456, 0.406][:channels], "std": [0.229, 0.224, 0.225][:channels]})
    hw = [12, 10]
    shape = ([channels, *hw] if layout == "NCHW" else [*hw, channels])
    shape = ["batch", *shape] if batch else shape
    model = _identity_model(shape, TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT)
    lowered = lower_preprocessing(model, "x", spec)
    onnx.checker.check_model(model)
    assert lowered.dtype == "uint8" and list(lowered.shape) == (["batch", *hw, channels] if batch else [*hw, channels])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    image = np.random.default_rng(0).integers(0, 256, (37, 29, 3), dtype=np.uint8)
    pixels = Preprocessor(replace(spec, in_graph=True)).from_array(image)
    assert pixels.dtype == np.uint8 and list(pixels.shape) == [1 if d == "batch" else d for d in lowered.shape]
    got = session.run(None, {"x": pixels})[0]
    want = Preprocessor(spec).from_array(image)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_subgraphs_are_rewired_and_taken_names_are_not_reused() -> None:
    spec = parse_preprocess({"kind": "image", "resize": {"size": [4, 4]}, "scale": 0.5})
    image = np.random.default_rng(1).integers(0, 256, (4, 4, 3), dtype=np.uint8)
    pixels, want = Preprocessor(replace(spec, in_graph=True)).from_array(image), Preprocessor(spec).from_array(image)
    for model in (_identity_model(["n", 3, 4, 4], subgraph=True),
                  _identity_model(["n", 3, 4, 4], taken="edgepack_pre/x_normalized")):
        lower_preprocessing(model, "x", spec)
        onnx.checker.check_model(model)
        names = [o for n in model.graph.node for o in n.output]
        assert len(names) == len(set(names))
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        np.testing.assert_array_equal(session.run(None, {"x": pixels})[0], want)


# ----------------------------------------------------------------------------- real builds


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("in-graph")
    build_all(root / "demo", ["digits", "mobilenet"])
    shutil.copytree(REPO / "recipes", root / "recipes")
    return root


def _build(workspace: Path, recipe: str, key: Path, *, in_graph: bool, **edits: object) -> Path:
    doc = yaml.safe_load((workspace / "recipes" / recipe).read_text())
    doc["preprocess"] = {**doc["preprocess"], **({"in_graph": True} if in_graph else {})}
    doc.update(edits)
    path = workspace / "recipes" / f"{'ig' if in_graph else 'py'}-{len(edits)}-{recipe}"
    path.write_text(yaml.safe_dump(doc))
    return build(load_recipe(path, allow_external_paths=True), key_paths=[str(key)],
                 output=workspace / "out" / f"{path.stem}.edgepkg").output


def _serve(artifact: Path, public: Path, folder: Path) -> InferenceService:
    verified = extract_artifact(artifact, folder, TrustStore([load_public_key(public)]))
    return InferenceService(load_model(verified.root, verified.manifest))


@pytest.fixture(scope="module")
def mobilenet_both(workspace, keypair) -> tuple[Path, Path]:
    return (_build(workspace, "mobilenet.yaml", keypair[0], in_graph=False),
            _build(workspace, "mobilenet.yaml", keypair[0], in_graph=True))


def test_mobilenet_in_graph_takes_uint8_nhwc_and_proves_the_rewrite(mobilenet_both) -> None:
    import json

    with tarfile.open(mobilenet_both[1]) as tar:
        manifest = json.loads(tar.extractfile("manifest.json").read())
        report = json.loads(tar.extractfile("report.json").read())
        golden = np.load(tar.extractfile("golden/000.inputs.npz"))["input"]
    assert manifest["inputs"] == [{"name": "input", "dtype": "uint8", "shape": ["batch", 224, 224, 3]}]
    assert manifest["preprocess"]["in_graph"] is True and manifest["preprocess"]["layout"] == "NCHW"
    lowered = report["passes"]["preprocess_graph"]
    assert lowered["nodes"] == ["Constant", "Constant", "Transpose", "Cast", "Mul", "Add"]
    assert lowered["check"]["ok"] is True and lowered["check"]["samples"] == 8
    assert lowered["check"]["outputs"][0]["max_abs_diff"] == 0.0  # the same tensor to the bit
    assert golden.dtype == np.uint8 and golden.shape == (1, 224, 224, 3)  # the smoke test runs the served path


def test_mobilenet_in_graph_answers_as_the_python_path_on_the_demo_images(workspace, mobilenet_both, keypair,
                                                                        tmp_path) -> None:
    python, in_graph = (_serve(a, keypair[1], tmp_path / n) for a, n in zip(mobilenet_both, ("py", "ig"), strict=True))
    assert in_graph.model.smoke is not None and in_graph.model.smoke.samples == 2
    images = sorted((workspace / "demo" / "mobilenet" / "images").glob("*.png"))
    for path in images:
        a, b = python.predict(path.read_bytes()), in_graph.predict(path.read_bytes())
        assert [r["index"] for r in a.result] == [r["index"] for r in b.result]
        np.testing.assert_allclose(b.outputs["logits"], a.outputs["logits"], rtol=0, atol=1e-5)
    # A camera pipeline feeds its resized uint8 frame as the model's own input.
    frame = Preprocessor(in_graph.model.manifest.preprocess).from_image_bytes(images[0].read_bytes())
    direct = in_graph.predict_tensors({"input": frame})
    np.testing.assert_array_equal(direct.outputs["logits"], in_graph.predict(images[0].read_bytes()).outputs["logits"])


def test_a_static_qdq_model_keeps_the_lowered_arithmetic_float_in_front_of_its_first_quantize(workspace,
                                                                                           tmp_path) -> None:
    """What the pipeline's order gives: onnxruntime's static quantizer calibrated on the Python
    path's float tensors, then the lowering. The QuantizeLinear that used to read the input reads
    the lowered tensor, nothing of the arithmetic is quantized, and the lowered model fed uint8
    pixels answers exactly as the QDQ model fed the Python path."""
    from onnxruntime.quantization import QuantFormat, quantize_static

    spec = parse_preprocess(yaml.safe_load((REPO / "recipes" / "digits-int8.yaml").read_text())["preprocess"])
    images = sorted((workspace / "demo" / "digits" / "val").glob("*.png"))[:40]
    floats = [Preprocessor(spec).from_path(p) for p in images]

    class Reader:
        def __init__(self) -> None:
            self.feeds = iter([{"image": f} for f in floats])

        def get_next(self) -> dict | None:
            return next(self.feeds, None)

    qdq = tmp_path / "qdq.onnx"
    quantize_static(str(workspace / "demo" / "digits" / "model.onnx"), str(qdq), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True)
    model = onnx.load(qdq)
    assert [n.op_type for n in model.graph.node if "image" in n.input] == ["QuantizeLinear"]
    lower_preprocessing(model, "image", spec)
    lowered = [n for n in model.graph.node if n.name.startswith("edgepack_pre/")]
    assert [n.op_type for n in lowered] == ["Constant", "Constant", "Transpose", "Cast", "Mul", "Add"]
    assert [n.op_type for n in model.graph.node if lowered[-1].output[0] in n.input] == ["QuantizeLinear"]
    before = ort.InferenceSession(str(qdq), providers=["CPUExecutionProvider"])
    after = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    pixels = Preprocessor(replace(spec, in_graph=True))
    for path, tensor in zip(images, floats, strict=True):
        np.testing.assert_array_equal(after.run(None, {"image": pixels.from_path(path)})[0],
                                      before.run(None, {"image": tensor})[0])


def test_digits_int8_in_graph_builds_proves_the_rewrite_and_keeps_its_accuracy(workspace, keypair,
                                                                               tmp_path) -> None:
    """The real pipeline on a quantized recipe: the quantizer and validation ran on the float
    model (the report says which candidate shipped), the rewrite is proven on 8 golden-source
    images to the bit, and the served answers keep the recipe's budget on the labelled digits."""
    import json

    artifact = _build(workspace, "digits-int8.yaml", keypair[0], in_graph=True)
    with tarfile.open(artifact) as tar:
        report = json.loads(tar.extractfile("report.json").read())
        manifest = json.loads(tar.extractfile("manifest.json").read())
    assert report["passes"]["validate"]["samples"] == 450 and report["passes"]["validate"]["budget_met"] is True
    check = report["passes"]["preprocess_graph"]["check"]
    assert check["ok"] is True and check["outputs"][0]["max_abs_diff"] == 0.0
    assert manifest["inputs"][0]["dtype"] == "uint8" and manifest["inputs"][0]["shape"] == ["batch", 8, 8, 1]
    service = _serve(artifact, keypair[1], tmp_path / "x")
    folder = workspace / "demo" / "digits" / "val"
    labels = dict(line.split(",") for line in (folder / "labels.csv").read_text().splitlines()[1:])
    right = sum(service.predict((folder / name).read_bytes()).result[0]["index"] == int(label)
                for name, label in labels.items())
    assert right >= 0.95 * len(labels)


def test_golden_samples_from_float_tensors_are_refused_before_the_long_passes(workspace, keypair) -> None:
    with pytest.raises(RecipeError) as info:
        _build(workspace, "digits.yaml", keypair[0], in_graph=True, golden={"count": 2, "data": {
            "npz": "../demo/digits/val.npz", "sample_axis": {"image": 0}}})
    assert info.value.key == "preprocess.in_graph" and "golden.data (npz)" in info.value.problem
