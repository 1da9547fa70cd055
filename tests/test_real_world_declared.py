"""Declarations checked against the model (issue 23, item 7): a recipe that declares what the
model contradicts is refused at build with one line naming what fits, never signed and then
ignored, never left to onnxruntime's wording."""

from __future__ import annotations

import numpy as np
import pytest

from edgepack_core.manifest import TensorSpec
from edgepack_core.preprocess_spec import PreprocessSpec
from sdk.errors import RecipeError
from sdk.packager.ctc_blank import blank_range_problem, likely_blank_problem
from sdk.packager.declared import dtype_problem, shape_problem
from sdk.packager.detection_heads import declared_format_problem, fitting_formats, format_problem, head_rows
from tests.real_world_declared import (
    SIDE,
    build_ctc,
    build_detector,
    build_half_image,
    build_wide_vector,
    decoded_yolov5_head,
    raw_yolox_grid,
)


def test_a_preprocess_shape_of_1024_on_a_2048_wide_input_is_refused_at_build(tmp_path, keypair):
    with pytest.raises(RecipeError) as caught:
        build_wide_vector(tmp_path, keypair[0], "[null, 1024]")
    assert caught.value.key == "preprocess.shape"
    assert "input x" in caught.value.problem and "2048" in caught.value.problem
    assert "\n" not in str(caught.value)


def test_a_preprocess_shape_of_the_wrong_rank_is_refused_at_build(tmp_path, keypair):
    with pytest.raises(RecipeError, match="rank") as caught:
        build_wide_vector(tmp_path, keypair[0], "[2048]")
    assert caught.value.key == "preprocess.shape"


def test_a_preprocess_shape_that_fits_the_input_builds(tmp_path, keypair):
    assert build_wide_vector(tmp_path / "full", keypair[0], "[null, 2048]").exists()
    assert build_wide_vector(tmp_path / "batched", keypair[0], "[2048]", batch=True).exists()


def test_float32_preprocessing_for_a_float16_input_is_refused_by_edgepacks_own_check(tmp_path, keypair):
    with pytest.raises(RecipeError) as caught:
        build_half_image(tmp_path, keypair[0], "float32")
    assert caught.value.key == "preprocess.dtype"
    assert "input x" in caught.value.problem and "float16" in caught.value.problem
    assert "ONNXRuntime" not in str(caught.value) and "\n" not in str(caught.value)


def test_float16_preprocessing_for_a_float16_input_builds(tmp_path, keypair):
    assert build_half_image(tmp_path, keypair[0], "float16").exists()


WIDE = TensorSpec("x", "float32", ("N", 2048))


@pytest.mark.parametrize(
    ("shape", "batch", "fits"),
    [
        ((None, 2048), False, True),
        (("N", 2048), False, True),
        ((4, 2048), False, True),  # a fixed dim declared on a symbolic one: the input allows it
        ((None, 2047), False, False),
        ((None, 2049), False, False),
        ((2048,), True, True),
        ((2048,), False, False),
        ((None, 2048), True, False),
        ((None, None, 2048), False, False),
    ],
)
def test_the_declared_shape_rule_at_its_boundaries(shape, batch, fits):
    spec = PreprocessSpec(kind="tensor", shape=shape, batch=batch)
    assert (shape_problem(spec, WIDE) is None) is fits


def test_the_declared_dtype_rule_names_the_input_and_both_dtypes():
    half = TensorSpec("pixels", "float16", (1, 3, 8, 8))
    assert dtype_problem(PreprocessSpec(kind="image", dtype="float16"), half) is None
    assert dtype_problem(PreprocessSpec(kind="tensor", dtype=None), half) is None
    problem = dtype_problem(PreprocessSpec(kind="image", dtype="float32"), half)
    assert problem is not None and "input pixels" in problem and "float16" in problem and "float32" in problem


def test_a_raw_yolox_grid_declared_as_yolov5_is_refused_as_an_undecoded_grid(tmp_path, keypair):
    with pytest.raises(RecipeError) as caught:
        build_detector(tmp_path, keypair[0], raw_yolox_grid(), "yolov5")
    assert caught.value.key == "postprocess.format"
    assert "output output0" in caught.value.problem and "raw, undecoded grid" in caught.value.problem
    assert "\n" not in str(caught.value)


def test_a_decoded_yolov5_head_declared_as_yolov8_is_refused_naming_yolov5(tmp_path, keypair):
    with pytest.raises(RecipeError, match="declare format: yolov5") as caught:
        build_detector(tmp_path, keypair[0], decoded_yolov5_head(), "yolov8")
    assert caught.value.key == "postprocess.format"


def test_a_decoded_yolov5_head_declared_as_yolov5_builds(tmp_path, keypair):
    assert build_detector(tmp_path, keypair[0], decoded_yolov5_head(), "yolov5").exists()


def _rows(*values: float) -> np.ndarray:
    return np.array([[list(values)]], np.float64)


@pytest.mark.parametrize(("row", "fits"), [
    ((16, 16, 0.0, 4, 0.5, 0.5), True),
    ((16, 16, -0.5, 4, 0.5, 0.5), True),  # a rounding error in a size is no raw grid
    ((16, 16, -0.51, 4, 0.5, 0.5), False),
    ((-16, 48, 4, 4, 0.5, 0.5), True),  # centres up to half an image off it
    ((-16.01, 16, 4, 4, 0.5, 0.5), False),
    ((16, 48.01, 4, 4, 0.5, 0.5), False),
    ((16, 16, 64, 64, 0.5, 0.5), True),  # sizes up to twice the image
    ((16, 16, 64.01, 4, 0.5, 0.5), False),
    ((16, 16, 4, 4, 0.0, 1.0), True),
    ((16, 16, 4, 4, 1.01, 0.5), False),
    ((16, 16, 4, 4, 0.5, -0.01), False),
])
def test_the_yolov5_head_rule_at_its_boundaries(row, fits):
    assert (format_problem("yolov5", [_rows(*row)], (32, 32)) is None) is fits


def test_a_head_whose_layout_is_not_the_formats_is_left_to_the_decoder():
    assert format_problem("yolov5", [np.zeros((1, 3, 5))], (32, 32)) is None
    assert head_rows("yolov5", np.zeros((1, 3, 5))) is None
    assert head_rows("yolov8", np.zeros((1, 4, 9))) is None


def test_the_classifier_names_each_format_that_fits():
    v5 = decoded_yolov5_head()
    assert fitting_formats([v5], (SIDE, SIDE)) == ["yolov5"]
    assert fitting_formats([v5.transpose(0, 2, 1)], (SIDE, SIDE)) == ["yolov8"]
    assert fitting_formats([raw_yolox_grid()], (SIDE, SIDE)) == []
    assert declared_format_problem("yolov5", [v5], (SIDE, SIDE)) is None
    assert declared_format_problem("boxes_scores", [raw_yolox_grid()], (SIDE, SIDE)) is None


def test_logits_that_fit_no_format_are_left_to_the_scores_check_which_names_the_sigmoid():
    logits = raw_yolox_grid()
    logits[0, :, 4:] = 8.0
    assert declared_format_problem("yolov5", [logits], (SIDE, SIDE)) is None
    assert declared_format_problem("yolov5", [raw_yolox_grid()], (SIDE, SIDE)) is not None


def test_a_ctc_blank_outside_the_class_axis_is_refused_at_build(tmp_path, keypair):
    with pytest.raises(RecipeError, match=r"blank 4 is outside the class axis of output y \(4 classes") as caught:
        build_ctc(tmp_path, keypair[0], 4)
    assert caught.value.key == "postprocess.blank"


def test_a_ctc_blank_that_is_never_the_argmax_is_refused_naming_the_class_that_acts_as_the_blank(tmp_path, keypair):
    with pytest.raises(RecipeError, match="declare blank: 3") as caught:
        build_ctc(tmp_path, keypair[0], 0)
    assert caught.value.key == "postprocess.blank" and "\n" not in str(caught.value)


def test_the_ctc_blank_the_model_emits_builds(tmp_path, keypair):
    assert build_ctc(tmp_path, keypair[0], 3).exists()


def _frames(*winners: int, classes: int = 4, times: int = 8) -> list[np.ndarray]:
    steps = list(winners) * times
    frames = np.zeros((1, len(steps), classes))
    frames[0, np.arange(len(steps)), steps] = 1.0
    return [frames]


@pytest.mark.parametrize(("winners", "times", "refused"), [
    ((3, 3, 1, 2), 8, True),  # class 3 wins exactly half of 32 frames, the blank none
    ((3, 3, 1, 2, 1), 8, False),  # 2 of 5: below half, no class acts as the blank
    ((3, 3, 3, 0), 8, False),  # the declared blank wins frames: it may be the blank
    ((3, 3, 1, 2), 7, False),  # 28 frames: too few to judge
])
def test_the_likely_blank_rule_at_its_boundaries(winners, times, refused):
    assert (likely_blank_problem(0, _frames(*winners, times=times), "y") is not None) is refused


def test_31_frames_are_not_judged_and_32_are():
    assert likely_blank_problem(0, _frames(*([3] * 31), times=1), "y") is None
    assert likely_blank_problem(0, _frames(*([3] * 32), times=1), "y") is not None


def test_the_blank_range_rule_at_its_boundaries():
    assert blank_range_problem(3, 4, "y") is None
    assert blank_range_problem(0, 4, "y") is None
    assert blank_range_problem(4, 4, "y") is not None
