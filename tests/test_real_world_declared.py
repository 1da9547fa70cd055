"""Declarations checked against the model (issue 23, item 7): a recipe that declares what the
model contradicts is refused at build with one line naming what fits, never signed and then
ignored, never left to onnxruntime's wording."""

from __future__ import annotations

import pytest

from edgepack_core.manifest import TensorSpec
from edgepack_core.preprocess_spec import PreprocessSpec
from sdk.errors import RecipeError
from sdk.packager.declared import dtype_problem, shape_problem
from tests.real_world_declared import build_half_image, build_wide_vector


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
