"""Detection ``format: yolox`` (issue 23, item 12): YOLOX's own ONNX export leaves a raw grid
(grid offsets, log sizes, sigmoid scores) that the postprocessor decodes over one grid per
stride, exactly as YOLOX's demo_postprocess; the packager writes the grid's input size into the
manifest, and a raw grid whose log sizes happen to be positive is no longer read as decoded
pixels (every centre within a few pixels of the corner)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml

from edgepack_core.errors import PostprocessError, SchemaError
from edgepack_core.postprocess import Postprocessor, decode_yolox, yolox_grid
from edgepack_core.postprocess_spec import parse_postprocess
from sdk.errors import RecipeError
from sdk.packager.detection_heads import CORNER, declared_format_problem, rows_problem
from sdk.packager.passes.base import BuildContext
from sdk.packager.pipeline import run_passes
from sdk.recipe import load_recipe
from tests import real_world_heads as heads


def test_the_grid_is_each_strides_cells_row_by_row_the_levels_in_order():
    cells, strides = yolox_grid((16, 32), (8, 16))
    assert cells.tolist() == [[c, r] for r in range(2) for c in range(4)] + [[0, 0], [1, 0]]
    assert strides.ravel().tolist() == [8] * 8 + [16] * 2


def test_a_raw_yolox_row_decodes_as_yolox_demo_postprocess_does():
    output = np.zeros((1, 5, 7), np.float32)  # 16x16 input, strides 8, 16: 4 + 1 anchors, 2 classes
    output[0, 3] = [0.25, 0.5, np.log(2.0), 0.0, 0.9, 0.5, 0.2]  # cell (1, 1) of stride 8
    ((boxes, scores, classes),) = decode_yolox(output, (8, 16), (16, 16))
    np.testing.assert_allclose(boxes[3], [10 - 8, 12 - 4, 10 + 8, 12 + 4])  # cx (0.25 + 1) * 8, w 2 * 8
    assert scores[3] == pytest.approx(0.45) and classes[3] == 0
    spec = {"kind": "detection", "format": "yolox", "strides": [8, 16], "input_size": [16, 16]}
    (found,) = Postprocessor(spec)({"output0": output})
    assert found["box"] == pytest.approx([2.0, 8.0, 18.0, 16.0]) and found["score"] == pytest.approx(0.45)


def test_a_yolox_output_whose_anchors_are_not_the_grids_cells_is_refused_naming_the_count():
    with pytest.raises(PostprocessError, match="has 5 anchors, got shape"):
        decode_yolox(np.zeros((1, 6, 7), np.float32), (8, 16), (16, 16))
    with pytest.raises(PostprocessError, match="needs input_size"):
        decode_yolox(np.zeros((1, 5, 7), np.float32), (8, 16), None)


def test_strides_and_input_size_belong_to_format_yolox_only():
    spec = parse_postprocess({"kind": "detection", "format": "yolox"})
    assert spec.strides == (8, 16, 32) and spec.input_size is None
    assert parse_postprocess(spec.to_json()) == spec
    with pytest.raises(SchemaError, match=r"postprocess\.strides: only format yolox"):
        parse_postprocess({"kind": "detection", "format": "yolov5", "strides": [8]}, path="postprocess")
    with pytest.raises(SchemaError):
        parse_postprocess({"kind": "detection", "format": "yolox", "input_size": [64]})


def _context(folder: Path, model: onnx.ModelProto, preprocess: dict) -> BuildContext:
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    recipe = {
        "name": "x",
        "version": "1.0.0",
        "model": {"path": "model.onnx"},
        "preprocess": preprocess,
        "postprocess": {"kind": "detection", "format": "yolox"},
        "validate": {"data": "synthetic"},
    }
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    ctx = BuildContext(recipe=load_recipe(folder / "recipe.yaml"), workdir=folder)
    run_passes(ctx, ["load", "check", "shape_inference", "io_spec"])
    return ctx


def test_the_packager_lays_the_grid_on_the_inputs_fixed_dims_or_refuses_naming_input_size(tmp_path):
    model = heads.head_model("yolox", decoded=False)
    assert _context(tmp_path / "fixed", model, {"kind": "tensor"}).postprocess.input_size == (64, 64)
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "height", "width"
    with pytest.raises(RecipeError, match="give input_size") as refused:
        _context(tmp_path / "open", model, {"kind": "tensor"})
    assert refused.value.key == "postprocess.input_size"
    image = {"kind": "image", "resize": {"size": [64, 64]}}
    assert _context(tmp_path / "resized", model, image).postprocess.input_size == (64, 64)


def _rows(centre: float, count: int = 8) -> np.ndarray:
    rows = np.full((count, 6), 0.5)
    rows[:, 0:2] = centre
    rows[:, 2:4] = 4.0
    return rows


def test_every_centre_within_3_pixels_of_the_corner_is_a_raw_grid_and_a_step_further_is_not():
    assert "grid offsets, not pixels" in rows_problem(_rows(CORNER), (32, 32))
    assert rows_problem(_rows(CORNER + 0.01), (32, 32)) is None
    assert rows_problem(_rows(CORNER), (31, 32)) is None  # a small image: centres near the corner are plausible
    assert rows_problem(_rows(CORNER, count=7), (32, 32)) is None  # too few anchors to judge


def test_a_yolox_grid_of_other_strides_is_refused_naming_the_key():
    head = np.zeros((1, 84, 8), np.float32)  # 64x64 over strides 8, 16, 32
    problem = declared_format_problem("yolox", [head], (64, 64), (16, 32))
    assert problem is not None and "set postprocess.strides" in problem and "[batch, 20, 5 + classes]" in problem
