"""Raw YOLOv5 and YOLOv8 heads, one undecoded output per grid level (issue 23, item 12): main
refused them at build ("raw grid"); ``format: yolov5-raw`` and ``yolov8-raw`` decode them as the
Detect layers do. The heads (tests/real_world_heads.py) put exactly known boxes on a synthetic
scene; Edgepack's answer from the built artifact equals an independent decode and NMS written
here on bare onnxruntime output of the original model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import yaml

from edgepack_core.errors import PostprocessError, SchemaError
from edgepack_core.postprocess import Postprocessor
from edgepack_core.postprocess_spec import parse_postprocess
from edgepack_core.raw_heads import decode_yolov5_raw, decode_yolov8_raw, level_problem
from sdk.errors import RecipeError
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests import real_world_heads as heads
from tests.model_kinds import artifact_member
from tests.test_real_world_corpus import reference_raw_detections

IMAGE = {"kind": "image", "resize": {"size": [heads.SIDE, heads.SIDE]}, "scale": 1 / 255}


def bare_outputs(model: onnx.ModelProto, pixels: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs: list[np.ndarray] = session.run(None, {"images": heads.image_tensor(pixels)})
    return outputs


def _write(folder: Path, model: onnx.ModelProto, postprocess: dict, labels: int | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    if labels is not None:
        (folder / "labels.txt").write_text("".join(f"class{i}\n" for i in range(labels)))
        postprocess = {**postprocess, "labels": "labels.txt"}
    onnx.save(model, folder / "model.onnx")
    heads.save_png(heads.scene(), folder / "val" / "scene.png")
    heads.save_png(heads.scene(heads.TARGETS[:1]), folder / "val" / "red.png")
    heads.save_png(np.zeros((heads.SIDE, heads.SIDE, 3), np.uint8), folder / "val" / "black.png")
    recipe = {
        "name": "raw-head",
        "version": "1.0.0",
        "model": {"path": "model.onnx"},
        "preprocess": IMAGE,
        "postprocess": {"kind": "detection", **postprocess},
        "validate": {"data": {"images": "val"}},
    }
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    return folder / "recipe.yaml"


def _build(folder: Path, key: Path, model: onnx.ModelProto, postprocess: dict) -> Path:
    labels = 3 if "labels" in postprocess else None
    recipe = _write(folder, model, {k: v for k, v in postprocess.items() if k != "labels"}, labels)
    build(load_recipe(recipe), key_paths=[str(key)], output=folder / "model.edgepkg")
    return folder / "model.edgepkg"


def _refused(
    folder: Path, key: Path, model: onnx.ModelProto, postprocess: dict, labels: int | None = None
) -> RecipeError:
    recipe = _write(folder, model, postprocess, labels)
    with pytest.raises(RecipeError) as refused:
        build(load_recipe(recipe), key_paths=[str(key)], output=folder / "model.edgepkg")
    assert not (folder / "model.edgepkg").exists()
    return refused.value


RAW_CASES = [
    ("yolov5", "conv", False),  # the Detect layer's convolutions, logits
    ("yolov5", "view", True),  # its [1, na, H, W, 5+C] view, the Sigmoid in the graph
    ("yolov8", "conv", False),  # DFL bins and class logits
]


def test_the_raw_heads_put_exactly_the_known_boxes_on_the_scene():
    for family, layout, sigmoid in RAW_CASES:
        model = heads.raw_level_model(family, layout, sigmoid)
        found = reference_raw_detections(family, bare_outputs(model, heads.scene()), sigmoid)
        assert [(tuple(np.round(box, 3)), label) for box, _, label in found] == [
            (tuple(np.round(box, 3)), label) for box, label in heads.KNOWN
        ], (family, layout)
        assert reference_raw_detections(family, bare_outputs(model, np.zeros_like(heads.scene())), sigmoid) == []


@pytest.mark.parametrize(("family", "layout", "sigmoid"), RAW_CASES)
def test_a_raw_per_level_head_builds_and_answers_like_an_independent_decode_and_nms(
    tmp_path, keypair, family, layout, sigmoid
):
    model = heads.raw_level_model(family, layout, sigmoid)
    artifact = _build(tmp_path, keypair[0], model, {"format": f"{family}-raw"})
    manifest = json.loads(artifact_member(artifact, "manifest.json"))
    post = manifest["postprocess"]
    assert post["outputs"] == ["p3", "p4", "p5"] and post["strides"] == [8, 16, 32]
    assert post["apply_sigmoid"] is (not sigmoid) and post["input_size"] == [64, 64]
    shipped = onnx.load_from_string(artifact_member(artifact, "model/model.onnx"))
    outputs = bare_outputs(shipped, heads.scene())
    got = Postprocessor(post)(dict(zip(["p3", "p4", "p5"], outputs, strict=True)))
    expected = reference_raw_detections(family, bare_outputs(model, heads.scene()), sigmoid)
    assert [d["index"] for d in got] == [label for _, _, label in expected]
    for detection, (box, score, _) in zip(got, expected, strict=True):
        np.testing.assert_allclose(detection["box"], box, atol=1e-3)
        assert detection["score"] == pytest.approx(score, abs=1e-5)


@pytest.mark.parametrize(
    ("family", "declared", "fits"), [("yolov5", "yolov5", "yolov5-raw"), ("yolov8", "yolov8", "yolov8-raw")]
)
def test_a_raw_per_level_head_declared_decoded_is_refused_naming_the_raw_format(
    tmp_path, keypair, family, declared, fits
):
    refused = _refused(tmp_path, keypair[0], heads.raw_level_model(family), {"format": declared})
    assert refused.key == "postprocess.format" and f"declare format: {fits}" in str(refused)
    assert "\n" not in str(refused)


def test_a_raw_v8_head_declared_v5_raw_is_refused_naming_yolov8_raw(tmp_path, keypair):
    refused = _refused(tmp_path, keypair[0], heads.raw_level_model("yolov8"), {"format": "yolov5-raw"})
    assert refused.key == "postprocess.format" and "declare format: yolov8-raw" in str(refused)


def test_strides_unlike_the_levels_grids_are_refused_naming_strides(tmp_path, keypair):
    refused = _refused(
        tmp_path, keypair[0], heads.raw_level_model("yolov5"), {"format": "yolov5-raw", "strides": [8, 32, 16]}
    )
    assert refused.key == "postprocess.strides" and "level 1 is a 4x4 grid" in str(refused)


def test_a_sigmoid_declared_over_the_graphs_own_is_refused_naming_apply_sigmoid(tmp_path, keypair):
    refused = _refused(
        tmp_path,
        keypair[0],
        heads.raw_level_model("yolov5", "view", sigmoid=True),
        {"format": "yolov5-raw", "apply_sigmoid": True},
    )
    assert refused.key == "postprocess.apply_sigmoid" and "applied the Sigmoid already" in str(refused)


@pytest.mark.parametrize(
    ("family", "declared", "key", "fits"),
    [
        ("yolov8", {"reg_max": 8}, "postprocess.reg_max", "reg_max 16 reads exactly 3"),  # 67 - 32: 35 classes
        ("yolov5", {"anchors": [[10, 13, 16, 30]] * 3}, "postprocess.anchors", "anchors per cell 3 reads exactly 3"),
    ],
)
def test_a_reg_max_or_anchor_count_that_splits_the_channels_unlike_the_labels_is_refused_naming_the_key(
    tmp_path, keypair, family, declared, key, fits
):
    model = heads.raw_level_model(family)
    refused = _refused(tmp_path / "wrong", keypair[0], model, {"format": f"{family}-raw", **declared}, labels=3)
    assert refused.key == key and fits in str(refused)
    artifact = _build(tmp_path / "right", keypair[0], model, {"format": f"{family}-raw", "labels": "labels.txt"})
    assert artifact.exists()  # the same head with its own reg_max / anchors and the 3 labels builds


# ---------------------------------------------------------------- the spec and the decoders' boundaries


def test_the_raw_formats_keys_parse_round_trip_and_belong_to_them():
    spec = parse_postprocess({"kind": "detection", "format": "yolov5-raw", "outputs": ["a", "b", "c"]})
    assert spec.levels == ("a", "b", "c") and spec.anchors == (
        (10, 13, 16, 30, 33, 23),
        (30, 61, 62, 45, 59, 119),
        (116, 90, 156, 198, 373, 326),
    )
    assert parse_postprocess(spec.to_json()) == spec
    v8 = parse_postprocess({"kind": "detection", "format": "yolov8-raw", "reg_max": 1, "apply_sigmoid": False})
    assert parse_postprocess(v8.to_json()) == v8 and "anchors" not in v8.to_json()
    for key, value in (("anchors", [[1, 2]]), ("reg_max", 8), ("apply_sigmoid", True)):
        with pytest.raises(SchemaError, match=rf"postprocess\.{key}: only format"):
            parse_postprocess({"kind": "detection", "format": "yolov8", key: value}, path="postprocess")
    with pytest.raises(SchemaError, match=r"postprocess\.reg_max: only format yolov8-raw"):
        parse_postprocess({"kind": "detection", "format": "yolov5-raw", "reg_max": 8}, path="postprocess")
    with pytest.raises(SchemaError, match=r"postprocess\.output: format yolov5-raw reads one output per level"):
        parse_postprocess({"kind": "detection", "format": "yolov5-raw", "output": "p3"}, path="postprocess")
    with pytest.raises(SchemaError, match="outputs: only formats yolov5-raw and yolov8-raw take a list"):
        parse_postprocess({"kind": "detection", "format": "yolov8", "outputs": ["p3"]})


def test_anchor_and_stride_tables_of_the_wrong_length_are_refused_naming_the_key():
    three = [[10, 13, 16, 30, 33, 23]] * 3
    parse_postprocess({"kind": "detection", "format": "yolov5-raw", "anchors": three})  # 3 levels, 3 strides
    with pytest.raises(SchemaError, match=r"postprocess\.anchors: has 2 levels but strides has 3"):
        parse_postprocess({"kind": "detection", "format": "yolov5-raw", "anchors": three[:2]}, path="postprocess")
    with pytest.raises(SchemaError, match=r"postprocess\.anchors: has 3 levels but strides has 4"):
        parse_postprocess(
            {"kind": "detection", "format": "yolov5-raw", "anchors": three, "strides": [8, 16, 32, 64]},
            path="postprocess",
        )
    with pytest.raises(SchemaError, match=r"postprocess\.anchors: the default anchors are YOLOv5's 3 levels"):
        parse_postprocess({"kind": "detection", "format": "yolov5-raw", "strides": [8, 16]}, path="postprocess")
    with pytest.raises(SchemaError, match=r"postprocess\.anchors\[1\]: has 5 numbers"):
        parse_postprocess(
            {"kind": "detection", "format": "yolov5-raw", "anchors": [three[0], [1, 2, 3, 4, 5], three[0]]},
            path="postprocess",
        )
    with pytest.raises(SchemaError, match=r"postprocess\.anchors\[2\]: has 2 anchors but level 0 has 3"):
        parse_postprocess(
            {"kind": "detection", "format": "yolov5-raw", "anchors": [*three[:2], [1, 2, 3, 4]]}, path="postprocess"
        )
    with pytest.raises(SchemaError, match=r"postprocess\.outputs: names 2 level outputs but strides has 3"):
        parse_postprocess({"kind": "detection", "format": "yolov8-raw", "outputs": ["a", "b"]}, path="postprocess")


V5 = ((10, 13, 16, 30, 33, 23),) * 3


def test_a_level_holds_its_anchors_5_plus_classes_channels_exactly():
    shapes = [[1, 18, 8, 8], [1, 18, 4, 4], [1, 18, 2, 2]]  # 3 anchors of 5 + 1 class: the least
    assert level_problem("yolov5-raw", shapes, strides=(8, 16, 32), anchors=V5, input_size=(64, 64)) is None
    fewer = [[1, 15, 8, 8], [1, 15, 4, 4], [1, 15, 2, 2]]  # 3 anchors of 5: no class
    key, why = level_problem("yolov5-raw", fewer, strides=(8, 16, 32), anchors=V5)
    assert key == "anchors" and "does not hold 3 anchors" in why
    view = [[1, 2, 8, 8, 8], [1, 3, 4, 4, 8], [1, 3, 2, 2, 8]]
    assert level_problem("yolov5-raw", view, strides=(8, 16, 32), anchors=V5)[0] == "anchors"


def test_reg_max_that_leaves_no_class_channel_is_refused_naming_reg_max():
    shapes = [[1, 65, 8, 8], [1, 65, 4, 4], [1, 65, 2, 2]]  # 4 x 16 bins + 1 class
    assert level_problem("yolov8-raw", shapes, strides=(8, 16, 32), reg_max=16) is None
    key, why = level_problem("yolov8-raw", [[1, 64, 8, 8]] * 3, strides=(8, 16, 32), reg_max=16)
    assert key == "reg_max" and "4 x reg_max 16 = 64 box bins leave no class channel" in why
    with pytest.raises(PostprocessError, match="reg_max"):
        decode_yolov8_raw([np.zeros((1, 67, 8, 8))] * 3, (8, 16, 32), reg_max=17)


def test_a_grid_covers_the_input_at_its_stride_floor_or_ceil_and_no_further():
    ok = [[1, 67, 8, 8]]
    assert level_problem("yolov8-raw", ok, strides=(8,), input_size=(57, 71)) is None  # ceil 8; floor 8
    assert level_problem("yolov8-raw", ok, strides=(8,), input_size=(64, 64)) is None
    assert level_problem("yolov8-raw", ok, strides=(8,), input_size=(72, 64))[0] == "strides"  # 9 rows
    assert level_problem("yolov8-raw", ok, strides=(8,), input_size=(64, 56))[0] == "strides"  # 7 columns
    assert level_problem("yolov8-raw", ok * 2, strides=(8,))[0] == "strides"  # 2 outputs, 1 stride


def test_yolov5_raw_decodes_one_cell_as_the_detect_layer_does():
    level = np.full((1, 3, 2, 2, 7), -30.0)  # na 3, 2x2 grid, 2 classes; logits
    level[0, 1, 1, 0] = [0.0, 0.0, 0.0, 0.0, 30.0, 30.0, -30.0]  # anchor 1, row 1, col 0
    others = [np.full((1, 21, 1, 1), -30.0)] * 2
    ((boxes, scores, classes),) = decode_yolov5_raw([level, *others], (8, 16, 32), V5)
    index = 1 * 4 + 1 * 2 + 0  # anchor-major, then rows, then columns
    np.testing.assert_allclose(boxes[index], [4 - 8, 12 - 15, 4 + 8, 12 + 15])  # centre (0.5, 1.5) * 8; 16x30
    assert scores[index] == pytest.approx(1.0) and classes[index] == 0
    conv = level.transpose(0, 1, 4, 2, 3).reshape(1, 21, 2, 2)  # the same head as the convolution gives it
    np.testing.assert_allclose(decode_yolov5_raw([conv, *others], (8, 16, 32), V5)[0][0], boxes)


def test_yolov8_raw_reads_each_side_as_the_expected_bin_and_reg_max_1_as_the_distance():
    level = np.zeros((1, 4 * 16 + 1, 1, 2))
    for side, distance in enumerate((0.25, 0.5, 0.75, 0.5)):
        level[0, side * 16 : side * 16 + 16, 0, 1] = heads.dfl_logits(distance)
    ((boxes, _, _),) = decode_yolov8_raw([level], (8,), 16)
    np.testing.assert_allclose(
        boxes[1], [(1.5 - 0.25) * 8, (0.5 - 0.5) * 8, (1.5 + 0.75) * 8, (0.5 + 0.5) * 8], atol=1e-9
    )
    plain = np.zeros((1, 5, 1, 1))
    plain[0, :4, 0, 0] = [1, 2, 3, 4]
    ((boxes, scores, _),) = decode_yolov8_raw([plain], (8,), 1, apply_sigmoid=False)
    np.testing.assert_allclose(boxes[0], [(0.5 - 1) * 8, (0.5 - 2) * 8, (0.5 + 3) * 8, (0.5 + 4) * 8])
    assert scores[0] == 0.0  # the graph's own score, no sigmoid over it


def test_the_device_reads_the_named_levels_in_the_specs_order():
    model = heads.raw_level_model("yolov5")
    p3, p4, p5 = bare_outputs(model, heads.scene())
    spec = {"kind": "detection", "format": "yolov5-raw", "outputs": ["p3", "p4", "p5"]}
    answer = Postprocessor(spec)({"p5": p5, "p3": p3, "p4": p4})
    assert [d["index"] for d in answer] == [label for _, _, label in reference_raw_detections("yolov5", [p3, p4, p5])]
    with pytest.raises(PostprocessError, match="no model output named 'p3'"):
        Postprocessor(spec)({"p4": p4, "p5": p5})


def test_an_int8_search_judges_a_graph_sigmoided_raw_head_without_a_second_sigmoid(tmp_path, keypair):
    recipe = _write(tmp_path, heads.raw_level_model("yolov5", "view", sigmoid=True), {"format": "yolov5-raw"})
    doc = yaml.safe_load(recipe.read_text())
    doc["quantize"] = {"mode": "static", "calibration": {"images": "val"}}
    recipe.write_text(yaml.safe_dump(doc))
    passes = build(load_recipe(recipe), key_paths=[str(keypair[0])], output=tmp_path / "model.edgepkg").report["passes"]
    assert passes["io_spec"]["apply_sigmoid"]["value"] is False
    (judged,) = passes["quantize"]["candidates"][0]["task"]["outputs"]
    assert judged["reference_detections"] == len(heads.KNOWN) + 1  # the scene's 3 boxes, the red square alone
