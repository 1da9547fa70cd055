"""OCR-style "fixed height, any width" (issue 23, items 6 and 12): the ``keep-aspect-height``
resize for CTC recognisers, its spec, geometry and boundaries, host/device parity, the build's
check against the model's width, and a recogniser with a dynamic width built by ``edgepack
build`` from the recipe a user writes and served by ``edgepack-agent predict`` with the strings
bare onnxruntime reads on the original model (tests/real_world_ocr.py)."""

from __future__ import annotations

import io
import json
import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from PIL import Image

from device_agent import feeds
from device_agent.prediction import EncodedImage
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.errors import SchemaError
from edgepack_core.geometry import image_geometry, resize_plan
from edgepack_core.manifest import TensorSpec
from edgepack_core.preprocess import Preprocessor
from edgepack_core.preprocess_spec import PreprocessSpec, Resize, normalize_preprocess, parse_preprocess
from edgepack_core.signing import TrustStore, load_public_key
from sdk.errors import RecipeError
from sdk.packager.data import load_samples
from sdk.packager.declared import height_resize_problem
from sdk.packager.onnx_graph import graph_io
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.conftest import run_cli
from tests.real_world_ocr import (
    HEIGHT,
    VALIDATION,
    greedy_ctc,
    line_image,
    reference_tensor,
    save_line,
    write_workspace,
)


def _spec(max_width: int = 64, pad_to: int = 1, pad_value: int = 0, **extra: object) -> PreprocessSpec:
    resize = {
        "mode": "keep-aspect-height",
        "height": HEIGHT,
        "max_width": max_width,
        "pad_to": pad_to,
        "pad_value": pad_value,
    }
    return parse_preprocess({"kind": "image", "color": "gray", "resize": resize, **extra})


def _ramp(height: int, width: int) -> np.ndarray:
    """A gray image whose every column differs, so a resample or a squeeze shows."""
    return (np.arange(width, dtype=np.int64)[None, :] * 7 + np.arange(height)[:, None] * 3).astype(np.uint8)


# ----------------------------------------------------------------------------- spec


def test_keep_aspect_height_defaults_are_written_out_and_idempotent():
    spec = normalize_preprocess(
        {"kind": "image", "resize": {"mode": "keep-aspect-height", "height": 32, "max_width": 320}}
    )
    assert spec["resize"] == {
        "mode": "keep-aspect-height",
        "height": 32,
        "max_width": 320,
        "pad_to": 1,
        "pad_value": 0,
        "interpolation": "bilinear",
    }
    assert normalize_preprocess(spec) == spec
    parsed = parse_preprocess(spec)
    assert parsed.resize == Resize((32, 320), mode="keep-aspect-height")
    assert parse_preprocess(parsed.to_json()) == parsed


@pytest.mark.parametrize(
    ("resize", "path", "fragment"),
    [
        ({"height": 32, "max_width": 64}, "resize.size", "is required"),  # no mode: stretch, which needs a size
        ({"mode": "keep-aspect-height", "max_width": 64}, "resize.height", "is required"),
        ({"mode": "keep-aspect-height", "height": 32}, "resize.max_width", "is required"),
        ({"mode": "keep-aspect-height", "height": 32, "max_width": 64, "size": [32, 64]}, "resize.size", "unknown key"),
        ({"mode": "keep-aspect-height", "height": 32, "max_width": 64, "pad": "center"}, "resize.pad", "unknown key"),
        (
            {"mode": "keep-aspect-height", "height": 32, "max_width": 64, "crop_fraction": 0.5},
            "resize.crop_fraction",
            "unknown key",
        ),
        (
            {"mode": "keep-aspect-height", "height": 32, "max_width": 64, "min_width": 8},
            "resize.min_width",
            "unknown key",
        ),
        ({"mode": "keep-aspect-height", "height": 0, "max_width": 64}, "resize.height", "below the minimum"),
        ({"mode": "keep-aspect-height", "height": 32, "max_width": 65537}, "resize.max_width", "above the maximum"),
        (
            {"mode": "keep-aspect-height", "height": 32, "max_width": 64, "pad_to": 0},
            "resize.pad_to",
            "below the minimum",
        ),
        (
            {"mode": "keep-aspect-height", "height": 32, "max_width": 64, "pad_to": 24},
            "resize.pad_to",
            "does not divide max_width 64",
        ),
        (
            {"mode": "keep-aspect-height", "height": 32, "max_width": 64, "pad_to": 128},
            "resize.pad_to",
            "does not divide max_width 64",
        ),
        ({"size": [32, 64], "mode": "letterbox", "pad_to": 8}, "resize.pad_to", "unknown key"),
        ({"size": [32, 64], "height": 32}, "resize.height", "unknown key"),
    ],
)
def test_a_bad_keep_aspect_height_spec_is_refused_naming_the_key(resize, path, fragment):
    with pytest.raises(SchemaError) as caught:
        parse_preprocess({"kind": "image", "resize": resize}, path="preprocess")
    assert caught.value.path == f"preprocess.{path}" and fragment in caught.value.problem


def test_pad_to_dividing_max_width_is_taken_up_to_max_width_itself():
    assert _spec(max_width=64, pad_to=32).resize.variable_width
    assert not _spec(max_width=64, pad_to=64).resize.variable_width


# ----------------------------------------------------------------------------- geometry


def test_the_width_is_rounded_up_exactly_for_every_small_size():
    """ceil(w * 32 / h) in integer arithmetic (no float error), at least 1, capped at max_width."""
    resize = _spec(max_width=40).resize
    for height in range(1, 70):
        for width in range(1, 70):
            (new_h, new_w), crop, _ = resize_plan(height, width, resize)
            expected = min(40, max(1, math.ceil(Fraction(width * HEIGHT, height))))
            assert (new_h, new_w, crop) == (HEIGHT, expected, None), (height, width)


def test_a_width_of_exactly_max_width_keeps_the_aspect_and_one_more_is_squeezed():
    pre = Preprocessor(_spec(max_width=64))
    exact, over = _ramp(HEIGHT, 64), _ramp(HEIGHT, 65)
    assert np.array_equal(pre.from_array(exact)[0, 0], exact.astype(np.float32))  # nothing resampled
    geometry = pre.image_with_geometry(exact)[1]
    assert geometry["input_size"] == [HEIGHT, 64] and geometry["scale_x"] == geometry["scale_y"] == 1.0
    squeezed, geometry = pre.image_with_geometry(over)
    assert squeezed.shape == (1, 1, HEIGHT, 64) and geometry["input_size"] == [HEIGHT, 64]
    assert geometry["scale_x"] == pytest.approx(64 / 65) and geometry["scale_y"] == 1.0
    expected = np.asarray(Image.fromarray(over, "L").resize((64, HEIGHT), Image.Resampling.BILINEAR))
    assert np.array_equal(squeezed[0, 0], expected.astype(np.float32))


def test_a_width_on_a_multiple_of_pad_to_is_not_padded_and_one_more_pads_to_the_next():
    pre = Preprocessor(_spec(max_width=64, pad_to=8, pad_value=200, scale=0.5))
    on = pre.from_array(_ramp(HEIGHT, 48))
    assert on.shape == (1, 1, HEIGHT, 48) and np.array_equal(on[0, 0], _ramp(HEIGHT, 48) * np.float32(0.5))
    over = pre.from_array(_ramp(HEIGHT, 49))
    assert over.shape == (1, 1, HEIGHT, 56)
    assert np.array_equal(over[0, 0, :, :49], _ramp(HEIGHT, 49) * np.float32(0.5))
    assert np.all(over[0, 0, :, 49:] == 100.0)  # the pad value through the same arithmetic: 200 * 0.5
    assert resize_plan(HEIGHT, 48, pre.spec.resize)[2] is None and resize_plan(HEIGHT, 49, pre.spec.resize)[2] == (0, 0)
    assert image_geometry(HEIGHT, 49, pre.spec.resize)["input_size"] == [HEIGHT, 56]


def test_pad_to_max_width_gives_one_fixed_shape_and_a_varying_width_none():
    fixed = Preprocessor(_spec(max_width=64, pad_to=64))
    assert fixed.tensor_shape() == (1, 1, HEIGHT, 64)
    for width in (1, 30, 64, 65, 500):
        assert fixed.from_array(_ramp(HEIGHT, width)).shape == (1, 1, HEIGHT, 64)
    assert Preprocessor(_spec(max_width=64, pad_to=8)).tensor_shape() is None


def test_the_fast_path_and_the_literal_steps_give_identical_tensors():
    """RGB and gray specs, layouts, padding and squeezing: the executor's fast path (what the
    device runs on PNGs, and on arrays it need not reduce first) equals docs/packager.md's
    literal steps. An array shrunk by 2.8x or more is reduced by an integer factor first, within
    the bounds tests/test_image_fast_path.py holds every mode to."""
    rng = np.random.default_rng(3)
    specs = [
        _spec(max_width=64, pad_to=8, pad_value=9, scale=1 / 255),
        parse_preprocess(
            {
                "kind": "image",
                "resize": {"mode": "keep-aspect-height", "height": 24, "max_width": 96, "pad_to": 96, "pad_value": 255},
                "mean": [1.0, 2.0, 3.0],
                "layout": "NHWC",
            }
        ),
    ]
    for spec in specs:
        fast, literal = Preprocessor(spec), Preprocessor(spec, reference=True)
        for height, width in ((48, 20), (17, 200), (32, 64), (5, 3), (90, 91)):
            image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            encoded = io.BytesIO()
            Image.fromarray(image).save(encoded, "PNG")
            if height < 2.8 * spec.resize.size[0]:
                assert np.array_equal(fast.from_array(image), literal.from_array(image)), (height, width)
            assert np.array_equal(
                fast.from_image_bytes(encoded.getvalue()), literal.from_image_bytes(encoded.getvalue())
            ), (height, width)


# ----------------------------------------------------------------------------- build check


def _input(width: int | str, height: int | str = HEIGHT) -> TensorSpec:
    return TensorSpec("x", "float32", ("N", 1, height, width))


@pytest.mark.parametrize(
    ("spec", "model_input", "key"),
    [
        (_spec(max_width=64, pad_to=8), _input("W"), None),
        (_spec(max_width=64, pad_to=64), _input(64), None),  # every image 64 wide
        (_spec(max_width=64, pad_to=32), _input(64), "preprocess.resize.pad_to"),
        (_spec(max_width=64, pad_to=1), _input(64), "preprocess.resize.pad_to"),
        (_spec(max_width=128, pad_to=128), _input(64), "preprocess.resize.max_width"),
        (_spec(max_width=32, pad_to=32), _input(64), "preprocess.resize.max_width"),
        (_spec(max_width=64, pad_to=8), _input("W", 48), "preprocess.resize.height"),
        (_spec(max_width=64, pad_to=8), _input("W", "H"), None),
    ],
)
def test_the_model_width_rule_at_its_boundaries(spec, model_input, key):
    problem = height_resize_problem(spec, model_input)
    assert (problem[0] if problem else None) == key
    if problem:
        assert "input x" in problem[1] and "\n" not in problem[1]


def test_a_fixed_width_recogniser_with_varying_widths_is_refused_naming_the_key(tmp_path, keypair):
    recipe = write_workspace(tmp_path, width=96, max_width=96, pad_to=4)
    run = run_cli("edgepack", "build", str(recipe), "--key", str(keypair[0]), "--output", str(tmp_path / "out.edgepkg"))
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr  # a recipe error: usage
    assert "preprocess.resize.pad_to" in run.stderr and "fixed width of 96" in run.stderr
    assert "pad_to: 96" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "out.edgepkg").exists()


def test_a_recipe_height_unlike_the_models_is_refused_naming_the_key(tmp_path, keypair):
    recipe = write_workspace(tmp_path, max_width=96, pad_to=4)
    recipe.write_text(recipe.read_text().replace("height: 32", "height: 48"))
    with pytest.raises(RecipeError) as caught:
        build(load_recipe(recipe), key_paths=[str(keypair[0])], output=tmp_path / "out.edgepkg")
    assert caught.value.key == "preprocess.resize.height" and "height: 32" in caught.value.problem


def test_a_fixed_width_recogniser_with_every_image_padded_to_it_builds(tmp_path, keypair):
    recipe = write_workspace(tmp_path, width=96, max_width=96, pad_to=96)
    build(load_recipe(recipe), key_paths=[str(keypair[0])], output=tmp_path / "out.edgepkg")
    model = _load(tmp_path / "out.edgepkg", tmp_path, keypair)
    assert model.preprocessor.tensor_shape() == (1, 1, HEIGHT, 96)
    feed = feeds.input_feed(model, EncodedImage(save_line(tmp_path / "a.png", "a", 64).read_bytes()))
    assert feed["x"].shape == (1, 1, HEIGHT, 96)
    # a batch is refused for the steps-first output alone, not for the preprocessing
    assert "output logprobs" in (feeds.batch_refusal(model) or "")


def _load(artifact: Path, folder: Path, keypair: tuple[Path, Path]):
    verified = extract_artifact(artifact, folder / "device", TrustStore([load_public_key(keypair[1])]))
    return load_model(verified.root, verified.manifest)


# ----------------------------------------------------------------------------- host/device parity


def test_host_and_device_give_identical_tensors_for_the_same_image(tmp_path, keypair):
    """The build's validation samples (host, from the recipe's spec) and the agent's image feed
    (device, from the signed manifest's spec) for the same files are the same tensors, and both
    equal an independent computation of the documented steps; the device reads every line."""
    recipe_path = write_workspace(tmp_path, max_width=96, pad_to=8)
    recipe = load_recipe(recipe_path)
    build(recipe, key_paths=[str(keypair[0])], output=tmp_path / "crnn.edgepkg")
    model = _load(tmp_path / "crnn.edgepkg", tmp_path, keypair)
    save_line(tmp_path / "val" / "ccccccc.png", "ccccccc", 64)  # 240 wide at height 32: squeezed to 96
    inputs, _ = graph_io(onnx.load(tmp_path / "crnn.onnx"))
    host = load_samples(recipe.validate.data, recipe.preprocess, inputs, key="validate.data")
    assert host.names == sorted(f"{text}.png" for text in [*VALIDATION, "ccccccc"])
    widths = set()
    for name, feed in zip(host.names, host.feeds, strict=True):
        device = feeds.input_feed(model, EncodedImage((tmp_path / "val" / name).read_bytes()))
        assert device["x"].dtype == feed["x"].dtype and np.array_equal(device["x"], feed["x"]), name
        image = np.asarray(Image.open(tmp_path / "val" / name))
        assert np.allclose(feed["x"], reference_tensor(image, max_width=96, pad_to=8), atol=1e-6), name
        widths.add(feed["x"].shape[3])
    assert len(widths) > 2 and max(widths) == 96
    # lines of different widths sent as one list: read one by one, each right
    images = [(tmp_path / "val" / name).read_bytes() for name in host.names]
    results = InferenceService(model).predict_batch(images)
    assert [r.result["text"] for r in results] == [name.removesuffix(".png") for name in host.names]


# ----------------------------------------------------------------------------- corpus, through the CLIs


def test_a_ctc_recogniser_with_a_dynamic_width_builds_and_reads_like_bare_onnxruntime(tmp_path, keypair):
    """Before the mode, the recipe was refused (no resize for a fixed height and any width)."""
    recipe = write_workspace(tmp_path, max_width=256, pad_to=4)
    artifact = tmp_path / "crnn.edgepkg"
    run = run_cli("edgepack", "build", str(recipe), "--key", str(keypair[0]), "--output", str(artifact))
    assert run.returncode == 0, run.stderr
    bare = ort.InferenceSession(str(tmp_path / "crnn.onnx"), providers=["CPUExecutionProvider"])
    max_width = 256
    # the second line is 344 wide at height 32: squeezed to 256, its glyphs 6 columns, still read
    for text, height in (("cabbac", 56), ("abcabcabcabcabcabcabc", 32)):
        image = line_image(text, height)
        path = save_line(tmp_path / f"{text}.png", text, height)
        answer = run_cli(
            "edgepack-agent",
            "predict",
            "--artifact",
            str(artifact),
            "--trust",
            str(keypair[1]),
            "--input",
            str(path),
            "--json",
        )
        assert answer.returncode == 0, answer.stderr
        expected = greedy_ctc(bare.run(None, {"x": reference_tensor(image, max_width=max_width, pad_to=4)})[0])
        assert json.loads(answer.stdout)["result"]["text"] == expected[0] == text
