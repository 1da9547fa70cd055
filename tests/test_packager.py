"""The packager's optimization, quantization and validation on the real demo models."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from sdk.errors import ValidationFailed
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.conftest import run_cli
from tools.demos import build_all

REPO = Path(__file__).resolve().parent.parent
_MOBILENET_IMAGES = {"images": "../demo/mobilenet/images"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The repo's recipes next to freshly built demo data, as a user has them."""
    root = tmp_path_factory.mktemp("packager")
    build_all(root / "demo", ["digits", "mobilenet"])
    shutil.copytree(REPO / "recipes", root / "recipes")
    return root


def _build(workspace: Path, recipe: str, key: Path, **edits) -> tuple[dict, dict, Path]:
    path = workspace / "recipes" / recipe
    if edits:
        doc = yaml.safe_load(path.read_text())
        for section, value in edits.items():
            doc[section] = value
        path = path.with_name(f"edited-{recipe}")
        path.write_text(yaml.safe_dump(doc))
    # The repo's recipes name the demo data in ../demo, outside their folder: allowed here as
    # `edgepack build --allow-external-paths` allows it.
    result = build(load_recipe(path, allow_external_paths=True), key_paths=[str(key)],
                   output=workspace / "out" / f"{path.stem}.edgepkg")
    return result.manifest.raw, result.report, result.output


def _model_bytes(artifact: Path) -> bytes:
    with tarfile.open(artifact) as tar:
        return tar.extractfile("model/model.onnx").read()


def test_digits_static_int8_loses_at_most_one_point_and_says_so(workspace, keypair):
    manifest, report, _ = _build(workspace, "digits-int8.yaml", keypair[0])
    assert manifest["model"]["precision"] == "int8"
    quantize, validate = report["passes"]["quantize"], report["passes"]["validate"]
    assert quantize["applied"] is True and quantize["min_speedup"] == 0, "the recipe ships int8 for its size"
    assert validate["metric"] == "top1" and validate["samples"] == 450
    assert validate["accuracy_drop"] <= 0.01 and validate["accuracy_candidate"] >= 0.95
    assert validate["budget_met"] is True
    chosen = quantize["candidates"][-1]  # the report lists every candidate with its metric, size and latency
    assert chosen["metric"] == "top1" and chosen["budget_met"] is True and chosen["quantized_nodes"] > 0
    assert chosen["bytes"] == quantize["quantized_bytes"] and chosen["latency_ms"] == quantize["latency_int8_ms"] > 0


def test_mobilenet_int8_is_3_5x_smaller_with_cosine_over_0_99(workspace, keypair):
    # Size and cosine here: min_speedup 0 takes this machine's timing out of the outcome (the
    # speed rule is pinned with injected latencies in tests/test_quantize_search.py).
    recipe = yaml.safe_load((workspace / "recipes" / "mobilenet-int8.yaml").read_text())
    _, report, artifact = _build(workspace, "mobilenet-int8.yaml", keypair[0],
                                 quantize={**recipe["quantize"], "min_speedup": 0})
    fp32 = (workspace / "demo" / "mobilenet" / "model.onnx").stat().st_size
    int8 = len(_model_bytes(artifact))
    assert fp32 / int8 >= 3.5
    assert report["passes"]["validate"]["cosine"] >= 0.99
    ops = {n.op_type for n in onnx.load_from_string(_model_bytes(artifact)).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    assert "speedup" in report["passes"]["quantize"]


def test_unreachable_budget_ships_a_working_fp32_model_with_a_warning(workspace, keypair):
    manifest, report, artifact = _build(
        workspace, "digits-int8.yaml", keypair[0],
        validate={"data": {"images": "../demo/digits/val", "labels": "../demo/digits/val/labels.csv"},
                  "metric": "cosine", "min_cosine": 0.9999999})
    assert manifest["model"]["precision"] == "fp32"
    quantize = report["passes"]["quantize"]
    assert quantize["applied"] is False and len(quantize["candidates"]) >= 4, "it searched before giving up"
    assert any("could not meet the accuracy budget" in w for w in report["warnings"])
    session = ort.InferenceSession(_model_bytes(artifact), providers=["CPUExecutionProvider"])
    val = np.load(workspace / "demo" / "digits" / "val.npz")
    accuracy = (session.run(None, {"image": val["image"]})[0].argmax(1) == val["label"]).mean()
    assert accuracy >= 0.95


def test_dynamic_quantization_of_a_conv_model_is_never_silently_slower(workspace, keypair):
    _, report, artifact = _build(workspace, "mobilenet-dynamic.yaml", keypair[0])
    ops = {n.op_type for n in onnx.load_from_string(_model_bytes(artifact)).graph.node}
    assert "ConvInteger" not in ops
    quantize = report["passes"]["quantize"]
    if quantize["applied"] and quantize["speedup"] < 1.0:
        assert any("slower than fp32" in w for w in report["warnings"])
    assert any("Conv" in w for w in report["warnings"]) or "FusedConv" in ops or quantize["speedup"] >= 1.0


def test_a_missed_validation_threshold_fails_the_build_unless_allowed(workspace, keypair):
    with pytest.raises(ValidationFailed, match="max abs diff"):
        _build(workspace, "mobilenet.yaml", keypair[0],
               validate={"data": _MOBILENET_IMAGES, "metric": "max_abs", "max_abs": 0.0},
               optimize={"fold_batchnorm": True})
    _, report, _ = _build(workspace, "mobilenet.yaml", keypair[0],
                          validate={"data": _MOBILENET_IMAGES, "metric": "max_abs", "max_abs": 0.0,
                                    "allow_failure": True})
    assert any("allow_failure" in w for w in report["warnings"])
    recipe = workspace / "recipes" / "edited-mobilenet.yaml"
    recipe.write_text(recipe.read_text().replace("allow_failure: true", "allow_failure: false"))
    result = run_cli("edgepack", "build", str(recipe), "--allow-external-paths", "--key", str(keypair[0]),
                     "-o", str(workspace / "x.edgepkg"))
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "misses the accuracy budget" in result.stderr


def test_batchnorm_folding_and_fp32_optimization_keep_outputs(workspace, keypair):
    _, report, artifact = _build(workspace, "mobilenet.yaml", keypair[0])
    source = onnx.load(workspace / "demo" / "mobilenet" / "model.onnx")
    batchnorms = sum(1 for n in source.graph.node if n.op_type == "BatchNormalization")
    assert batchnorms > 10 and report["passes"]["fold_batchnorm"]["folded"] == batchnorms
    ops = {n.op_type for n in onnx.load_from_string(_model_bytes(artifact)).graph.node}
    assert "BatchNormalization" not in ops
    assert report["passes"]["validate"]["max_abs_diff"] < 1e-3 and report["passes"]["validate"]["budget_met"]
    assert report["passes"]["ort_optimize"]["level"] == "basic", "mixed targets keep the portable level"


def _big_weight_model(path: Path, weight: float) -> Path:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    w = numpy_helper.from_array(np.full((4, 4), weight, np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.mark.parametrize(("weight", "applied"), [(0.5, True), (1e6, False)])
def test_fp16_keeps_io_types_and_refuses_overflow(tmp_path, keypair, weight, applied):
    _big_weight_model(tmp_path / "m.onnx", weight)
    (tmp_path / "r.yaml").write_text("name: f\nversion: 1.0.0\nmodel: {path: m.onnx}\noptimize: {fp16: true}\n"
                                     "validate: {data: synthetic, metric: cosine, min_cosine: 0.999}\n")
    result = build(load_recipe(tmp_path / "r.yaml"), key_paths=[str(keypair[0])], output=tmp_path / "a.edgepkg")
    assert result.report["passes"]["fp16"]["applied"] is applied
    assert result.manifest.raw["model"]["precision"] == ("fp16" if applied else "fp32")
    assert [i.dtype for i in result.manifest.inputs] == ["float32"]
    if not applied:
        assert any("overflow fp16" in w for w in result.warnings)


def test_android_target_gets_static_shapes_and_an_nnapi_report(workspace, keypair):
    manifest, report, _ = _build(workspace, "mobilenet.yaml", keypair[0], targets=["android", "x86"])
    assert manifest["inputs"][0]["shape"] == [1, 3, 224, 224]
    android = report["passes"]["target_report"]["android"]
    assert android["nodes"] > 0 and android["accelerated_nodes"] > 0 and "unsupported_ops" in android


def test_bench_cli_measures_original_and_packaged_side_by_side(workspace, keypair):
    _, _, artifact = _build(workspace, "digits-int8.yaml", keypair[0])
    result = run_cli("edgepack", "bench", str(artifact), "--original",
                     str(workspace / "demo" / "digits" / "model.onnx"), "--runs", "20", "--json",
                     "--trust", str(keypair[1]))
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [r["label"].split()[0] for r in rows] == ["original", "packaged"]
    assert all(r["p50_ms"] > 0 and r["p95_ms"] >= r["p50_ms"] for r in rows)


def test_ort_format_for_mobile_targets_is_bundled_and_listed(tmp_path, keypair):
    _big_weight_model(tmp_path / "m.onnx", 0.5)
    (tmp_path / "r.yaml").write_text("name: m\nversion: 1.0.0\nmodel: {path: m.onnx}\noptimize: {ort_format: true}\n"
                                     "targets: [android]\nvalidate: {data: synthetic}\n")
    result = build(load_recipe(tmp_path / "r.yaml"), key_paths=[str(keypair[0])], output=tmp_path / "a.edgepkg")
    assert result.manifest.raw["model"]["ort_path"] == "model/model.ort"
    assert "model/model.ort" in result.manifest.files
    with tarfile.open(result.output) as tar:
        ort_bytes = tar.extractfile("model/model.ort").read()
    session = ort.InferenceSession(ort_bytes, providers=["CPUExecutionProvider"])
    x = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ np.full((4, 4), 0.5, np.float32))


def test_optimize_level_none_leaves_the_graph_alone(workspace, keypair):
    _, report, artifact = _build(workspace, "mobilenet.yaml", keypair[0], optimize={"level": "none"})
    assert not {"fold_batchnorm", "ort_optimize", "eliminate_identity"} & set(report["passes"])
    ops = [n.op_type for n in onnx.load_from_string(_model_bytes(artifact)).graph.node]
    assert "BatchNormalization" in ops


def test_recipe_templates_validate_and_jetson_gets_fp16_smoke_tolerances(tmp_path, keypair):
    templates = REPO / "recipes" / "templates"
    _big_weight_model(tmp_path / "model.onnx", 0.5)
    (tmp_path / "labels.txt").write_text("a\nb\nc\nd\n")
    (tmp_path / "charset.txt").write_text("0\n1\n")  # the ctc template's charset
    for folder in ("calib", "val"):
        (tmp_path / folder).mkdir()
    (tmp_path / "val" / "labels.csv").write_text("file,label\n")
    np.savez(tmp_path / "samples.npz", x=np.ones((4, 4), np.float32))
    names = sorted(p.name for p in templates.glob("*.yaml"))
    assert len(names) >= 4
    for name in names:
        (tmp_path / name).write_text((templates / name).read_text())
        recipe = load_recipe(tmp_path / name)  # every template is a valid recipe
        assert recipe.name.startswith("my-")
    (tmp_path / "jetson.yaml").write_text("name: j\nversion: 1.0.0\nmodel: {path: model.onnx}\ntargets: [jetson]\n"
                                         "validate: {data: synthetic}\n")
    result = build(load_recipe(tmp_path / "jetson.yaml"), key_paths=[str(keypair[0])], output=tmp_path / "j.edgepkg")
    assert result.manifest.golden["atol"] == 0.05 and result.manifest.golden["rtol"] == 0.01
