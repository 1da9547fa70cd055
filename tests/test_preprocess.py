"""The preprocessing spec and executor, checked against independent numpy references.

Resampling is compared with references built from other primitives: exact index math where
Pillow's filters agree exactly (nearest with integer factors), block means for area, and a
separable-convolution implementation written here for bilinear/bicubic (within a tolerance,
since Pillow rounds its intermediate pass to 8 bits). Crop/letterbox geometry is checked
exactly on images of constant-colored blocks and coordinate-coded pixels.
"""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from edgepack_core.errors import PreprocessError, SchemaError
from edgepack_core.geometry import resize_plan
from edgepack_core.preprocess import Preprocessor
from edgepack_core.preprocess_spec import PREPROCESS_SCHEMA, normalize_preprocess, parse_preprocess
from edgepack_core.schema import validate

ROOT = Path(__file__).resolve().parent.parent
RNG = np.random.default_rng(1234)


def _image(height: int, width: int) -> np.ndarray:
    return RNG.integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def _spec(**overrides: object) -> dict:
    """An image spec that is the identity on pixel values unless overridden."""
    return {"kind": "image", "layout": "NHWC", "batch": False, **overrides}


# ----------------------------------------------------------------------------- references


def _triangle(x: np.ndarray) -> np.ndarray:
    return np.clip(1.0 - np.abs(x), 0.0, None)


def _keys_cubic(x: np.ndarray, a: float = -0.5) -> np.ndarray:
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1, near, np.where(x < 2, far, 0.0))


def _weights(size_in: int, size_out: int, kernel: Callable[[np.ndarray], np.ndarray], support: float) -> np.ndarray:
    """Resampling matrix (size_out x size_in): pixel centers at +0.5, the kernel widened by the
    shrink factor when downscaling (antialiasing), taps outside the image dropped and the
    remaining weights renormalized."""
    scale = size_in / size_out
    stretch = max(scale, 1.0)
    centers = (np.arange(size_out) + 0.5) * scale
    taps = np.arange(size_in) + 0.5
    matrix = kernel((taps[None, :] - centers[:, None]) / stretch)
    matrix[np.abs(taps[None, :] - centers[:, None]) >= support * stretch] = 0.0
    return matrix / matrix.sum(axis=1, keepdims=True)


def _resample(image: np.ndarray, height: int, width: int, kernel: Callable, support: float) -> np.ndarray:
    rows = _weights(image.shape[0], height, kernel, support)
    cols = _weights(image.shape[1], width, kernel, support)
    return np.einsum("ij,jkc,lk->ilc", rows, image.astype(np.float64), cols)


# ----------------------------------------------------------------------------- spec


def test_no_spec_means_raw_tensors() -> None:
    assert normalize_preprocess(None) == {"kind": "tensor", "version": 1, "batch": False}


def test_normalize_fills_every_default_and_is_idempotent() -> None:
    spec = normalize_preprocess({"kind": "image", "resize": {"size": [48, 192]}})
    assert spec == {
        "kind": "image", "version": 1, "color": "rgb",
        "resize": {"size": [48, 192], "mode": "stretch", "interpolation": "bilinear"},
        "scale": 1.0, "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0],
        "layout": "NCHW", "dtype": "float32", "batch": True,
    }
    assert normalize_preprocess(spec) == spec
    letterbox = normalize_preprocess({"kind": "image", "color": "gray",
                                      "resize": {"size": [8, 8], "mode": "letterbox"}})
    assert letterbox["resize"]["pad_value"] == 0
    assert letterbox["mean"] == [0.0] and letterbox["std"] == [1.0]
    crop = normalize_preprocess({"kind": "image", "resize": {"size": [8, 8], "mode": "center-crop"}})
    assert crop["resize"]["crop_fraction"] == 0.875


def test_normalize_does_not_modify_the_given_spec() -> None:
    given = {"kind": "image", "resize": {"size": [4, 4]}}
    normalize_preprocess(given)
    assert given == {"kind": "image", "resize": {"size": [4, 4]}}


@pytest.mark.parametrize(
    ("spec", "path", "fragment"),
    [
        ({"kind": "image", "resize": {"size": [4, 4], "foo": 1}}, "resize.foo", "unknown key"),
        ({"kind": "image", "resize": {"size": [4, 4], "pad_value": 3}}, "resize.pad_value", "unknown key"),
        ({"kind": "image", "resize": {"size": [4, 4], "mode": "letterbox", "crop_fraction": 0.5}},
         "resize.crop_fraction", "unknown key"),
        ({"kind": "image", "resize": {"size": [4, 4], "mode": "center-crop", "crop_fraction": 1.5}},
         "resize.crop_fraction", "above the maximum"),
        ({"kind": "image", "resize": {"size": [4]}}, "resize.size", "at least 2"),
        ({"kind": "image", "resize": {"size": [4, 4], "interpolation": "lanczos"}}, "resize.interpolation",
         "not one of"),
        ({"kind": "image", "std": [1, 0, 1]}, "std[1]", "greater than 0"),
        ({"kind": "image", "mean": [0.5]}, "mean", "color rgb has 3 channel(s)"),
        ({"kind": "image", "dtype": "float64"}, "dtype", "not one of"),
        ({"kind": "image", "shape": [1, 3]}, "shape", "unknown key"),
        ({"kind": "tensor", "mean": [0.5]}, "mean", "unknown key"),
        ({"kind": "tensor", "version": 2}, "version", "must be 1"),
        ({"color": "rgb"}, "kind", "is required"),
    ],
)
def test_bad_spec_is_refused_naming_the_key(spec: dict, path: str, fragment: str) -> None:
    with pytest.raises(SchemaError) as info:
        normalize_preprocess(spec, path="preprocess", document="recipe.yaml")
    assert info.value.path == f"preprocess.{path}"
    assert fragment in info.value.problem
    assert str(info.value).startswith(f"recipe.yaml: preprocess.{path}: ")


def test_schema_embeds_in_other_schemas_with_full_key_paths() -> None:
    recipe_like = {"type": "object", "additionalProperties": False, "properties": {"preprocess": PREPROCESS_SCHEMA}}
    validate({"preprocess": {"kind": "image", "resize": {"size": [2, 2], "mode": "letterbox", "pad_value": 9}}},
             recipe_like)
    with pytest.raises(SchemaError) as info:
        validate({"preprocess": {"kind": "image", "resize": {"size": [2, 2], "foo": 1}}}, recipe_like)
    assert info.value.path == "preprocess.resize.foo"
    assert "$ref" not in repr(PREPROCESS_SCHEMA)


# ----------------------------------------------------------------------------- resize


def test_nearest_integer_upscale_repeats_pixels_exactly() -> None:
    image = _image(5, 7)
    out = Preprocessor(_spec(resize={"size": [15, 14], "interpolation": "nearest"})).from_array(image)
    np.testing.assert_array_equal(out, np.repeat(np.repeat(image, 3, axis=0), 2, axis=1).astype(np.float32))


def test_nearest_integer_downscale_takes_the_center_pixel_of_each_block() -> None:
    image = _image(12, 16)
    out = Preprocessor(_spec(resize={"size": [4, 8], "interpolation": "nearest"})).from_array(image)
    np.testing.assert_array_equal(out, image[1::3, 1::2].astype(np.float32))


def test_area_downscale_is_the_block_mean() -> None:
    image = _image(24, 32)
    out = Preprocessor(_spec(resize={"size": [6, 8], "interpolation": "area"})).from_array(image)
    reference = image.astype(np.float64).reshape(6, 4, 8, 4, 3).mean(axis=(1, 3))
    # Pillow rounds to 8 bits after each of its two passes, so at most one level apart.
    assert np.abs(out - reference).max() <= 1.0
    assert np.abs(out - reference).mean() < 0.5


@pytest.mark.parametrize(
    ("interpolation", "kernel", "support", "size"),
    [
        ("bilinear", _triangle, 1.0, (37, 53)),   # upscale by non-integer factors
        ("bilinear", _triangle, 1.0, (9, 11)),    # antialiased downscale
        ("bicubic", _keys_cubic, 2.0, (37, 53)),
        ("bicubic", _keys_cubic, 2.0, (9, 11)),
    ],
)
def test_smooth_filters_match_an_independent_convolution(
    interpolation: str, kernel: Callable, support: float, size: tuple[int, int]
) -> None:
    # A smooth image, so the comparison measures the filter and not clipping of overshoot.
    yy, xx = np.mgrid[0:20, 0:24]
    image = np.stack([120 + 100 * np.sin(yy / 3.0), 120 + 100 * np.cos(xx / 4.0), (yy * 5 + xx * 4) % 256], axis=-1)
    image = image.astype(np.uint8)
    out = Preprocessor(_spec(resize={"size": list(size), "interpolation": interpolation})).from_array(image)
    reference = np.clip(_resample(image, *size, kernel, support), 0, 255)
    assert out.shape == (*size, 3)
    assert np.abs(out - reference).mean() < 1.0
    assert np.abs(out - reference).max() <= 3.0


def test_stretch_ignores_the_aspect_ratio() -> None:
    out = Preprocessor(_spec(resize={"size": [10, 30]})).from_array(_image(50, 20))
    assert out.shape == (10, 30, 3)


def _blocks(height: int, width: int, color: tuple[int, int, int]) -> np.ndarray:
    return np.broadcast_to(np.array(color, dtype=np.uint8), (height, width, 3)).copy()


@pytest.mark.parametrize("interpolation", ["nearest", "bilinear", "area"])
def test_letterbox_centers_the_image_and_pads_with_pad_value(interpolation: str) -> None:
    color = (200, 10, 30)
    spec = _spec(resize={"size": [33, 32], "mode": "letterbox", "pad_value": 114, "interpolation": interpolation})
    out = Preprocessor(spec).from_array(_blocks(20, 40, color))
    # factor min(33/20, 32/40) = 0.8 -> 16 x 32; 17 rows of padding: 8 above, 9 below.
    assert resize_plan(20, 40, parse_preprocess(spec).resize) == ((16, 32), None, (0, 8))
    np.testing.assert_array_equal(out[:8], 114)
    np.testing.assert_array_equal(out[8:24], np.broadcast_to(np.array(color, np.float32), (16, 32, 3)))
    np.testing.assert_array_equal(out[24:], 114)


def test_letterbox_pads_left_and_right_of_a_tall_gray_image() -> None:
    spec = _spec(color="gray", resize={"size": [10, 10], "mode": "letterbox", "pad_value": 7,
                                       "interpolation": "nearest"})
    out = Preprocessor(spec).from_array(np.full((40, 12), 250, dtype=np.uint8))
    # factor 0.25 -> 10 x 3, centered: 3 columns of padding left, 4 right.
    assert out.shape == (10, 10, 1)
    np.testing.assert_array_equal(out[:, :3], 7)
    np.testing.assert_array_equal(out[:, 3:6], 250)
    np.testing.assert_array_equal(out[:, 6:], 7)


def test_keep_aspect_covers_the_target_and_crops_the_overflow() -> None:
    # Three vertical bands; a 20x20 target keeps exactly the middle (green) band.
    image = np.concatenate([_blocks(20, 20, (255, 0, 0)), _blocks(20, 20, (0, 255, 0)), _blocks(20, 20, (0, 0, 255))],
                           axis=1)
    out = Preprocessor(_spec(resize={"size": [20, 20], "mode": "keep-aspect"})).from_array(image)
    np.testing.assert_array_equal(out, np.broadcast_to(np.array([0, 255, 0], np.float32), (20, 20, 3)))
    # A tall image scaled by 0.5 (cover 10x10 from 40x20), rows 5..14 kept: the green middle.
    tall = np.concatenate([_blocks(10, 20, (255, 0, 0)), _blocks(20, 20, (0, 255, 0)), _blocks(10, 20, (0, 0, 255))])
    spec = _spec(resize={"size": [10, 10], "mode": "keep-aspect", "interpolation": "nearest"})
    out = Preprocessor(spec).from_array(tall)
    np.testing.assert_array_equal(out, np.broadcast_to(np.array([0, 255, 0], np.float32), (10, 10, 3)))


def test_center_crop_resizes_the_shorter_side_to_size_over_fraction_then_crops() -> None:
    resize = parse_preprocess(_spec(resize={"size": [224, 224], "mode": "center-crop"})).resize
    assert resize_plan(375, 500, resize) == ((256, 341), (58, 16, 282, 240), None)
    assert resize_plan(500, 375, resize)[0] == (341, 256)
    # Coordinate-coded pixels: R = row, G = column. 64x80 -> short side round(28/0.875) = 32,
    # i.e. an exact 2x nearest shrink (pixel 2i+1), then a crop offset by (left 6, top 2).
    rows, cols = np.mgrid[0:64, 0:80]
    image = np.stack([rows, cols, np.zeros_like(rows)], axis=-1).astype(np.uint8)
    spec = _spec(resize={"size": [28, 28], "mode": "center-crop", "interpolation": "nearest"})
    out = Preprocessor(spec).from_array(image)
    out_rows, out_cols = np.mgrid[0:28, 0:28]
    np.testing.assert_array_equal(out[..., 0], 2 * (out_rows + 2) + 1)
    np.testing.assert_array_equal(out[..., 1], 2 * (out_cols + 6) + 1)


def test_center_crop_with_a_non_square_target_still_covers_it() -> None:
    resize = parse_preprocess(_spec(resize={"size": [48, 192], "mode": "center-crop", "crop_fraction": 0.5}))
    (height, width), crop, _ = resize_plan(100, 100, resize.resize)
    assert height >= 48 and width >= 192
    assert crop is not None and crop[2] - crop[0] == 192 and crop[3] - crop[1] == 48


def test_no_resize_keeps_the_image_size() -> None:
    out = Preprocessor(_spec()).from_array(_image(13, 17))
    assert out.shape == (13, 17, 3)


# ----------------------------------------------------------------------------- color, values, layout


def test_bgr_is_the_exact_channel_reverse_of_rgb() -> None:
    image = _image(9, 11)
    rgb = Preprocessor(_spec(layout="NCHW", color="rgb", resize={"size": [5, 6]})).from_array(image)
    bgr = Preprocessor(_spec(layout="NCHW", color="bgr", resize={"size": [5, 6]})).from_array(image)
    np.testing.assert_array_equal(bgr, rgb[::-1])


def test_bgr_mean_and_std_apply_in_bgr_order() -> None:
    image = _image(4, 5)
    mean, std = [103.94, 116.78, 123.68], [57.4, 57.1, 58.4]
    out = Preprocessor(_spec(color="bgr", mean=mean, std=std)).from_array(image)
    reference = (image[..., ::-1].astype(np.float64) - mean) / std
    np.testing.assert_allclose(out, reference, rtol=0, atol=1e-5)


def test_gray_is_itu_r_601_luma() -> None:
    image = _image(32, 32)
    out = Preprocessor(_spec(color="gray")).from_array(image)
    r, g, b = (image[..., c].astype(np.int64) for c in range(3))
    luma = np.floor((r * 299 + g * 587 + b * 114) / 1000 + 0.5)
    assert out.shape == (32, 32, 1)
    assert np.abs(out[..., 0] - luma).max() <= 1  # Pillow uses 16-bit fixed-point weights
    assert (out[..., 0] == luma).mean() > 0.99


def test_gray_input_array_becomes_rgb_for_an_rgb_spec() -> None:
    gray = RNG.integers(0, 256, size=(6, 7), dtype=np.uint8)
    out = Preprocessor(_spec()).from_array(gray)
    np.testing.assert_array_equal(out, np.repeat(gray[..., None], 3, axis=2).astype(np.float32))


def test_scale_mean_std_follow_the_formula_to_1e_6() -> None:
    image = _image(8, 9)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    out = Preprocessor(_spec(scale=1 / 255, mean=mean, std=std)).from_array(image)
    reference = (image.astype(np.float64) / 255 - mean) / std
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, reference, rtol=0, atol=1e-6)
    out = Preprocessor(_spec(scale=1 / 255, mean=[0.5] * 3, std=[0.5] * 3)).from_array(image)
    np.testing.assert_allclose(out, image / 127.5 - 1.0, rtol=0, atol=1e-6)


def test_layouts_are_transposes_and_batch_adds_a_leading_dim() -> None:
    image = _image(6, 10)
    nhwc = Preprocessor(_spec(layout="NHWC", batch=True)).from_array(image)
    nchw = Preprocessor(_spec(layout="NCHW", batch=True)).from_array(image)
    unbatched = Preprocessor(_spec(layout="NCHW")).from_array(image)
    assert nhwc.shape == (1, 6, 10, 3) and nchw.shape == (1, 3, 6, 10) and unbatched.shape == (3, 6, 10)
    np.testing.assert_array_equal(nchw, nhwc.transpose(0, 3, 1, 2))
    np.testing.assert_array_equal(nchw[0], unbatched)
    assert nchw.flags.c_contiguous
    gray = Preprocessor(_spec(layout="NCHW", color="gray", batch=True)).from_array(image)
    assert gray.shape == (1, 1, 6, 10)


def test_dtype_casts() -> None:
    image = _image(5, 5)
    as_f16 = Preprocessor(_spec(dtype="float16", scale=1 / 255)).from_array(image)
    assert as_f16.dtype == np.float16
    np.testing.assert_array_equal(as_f16, (image.astype(np.float32) * np.float32(1 / 255)).astype(np.float16))
    as_u8 = Preprocessor(_spec(dtype="uint8")).from_array(image)
    assert as_u8.dtype == np.uint8
    np.testing.assert_array_equal(as_u8, image)
    clipped = Preprocessor(_spec(dtype="uint8", scale=2.0)).from_array(image)
    np.testing.assert_array_equal(clipped, np.minimum(image.astype(np.int64) * 2, 255))
    as_i8 = Preprocessor(_spec(dtype="int8", mean=[128.0] * 3)).from_array(image)
    assert as_i8.dtype == np.int8
    np.testing.assert_array_equal(as_i8, np.clip(image.astype(np.int64) - 128, -128, 127))
    halves = Preprocessor(_spec(dtype="int8", scale=0.5)).from_array(np.array([[[1, 3, 5]]], dtype=np.uint8))
    np.testing.assert_array_equal(halves, [[[0, 2, 2]]])  # round half to even


# ----------------------------------------------------------------------------- decoding


def test_exif_orientation_is_applied() -> None:
    # 20 wide, 10 high: left half red, right half blue. Orientation 6 means "rotate 90° clockwise
    # to view", which puts the left half on top.
    image = np.concatenate([_blocks(10, 10, (255, 0, 0)), _blocks(10, 10, (0, 0, 255))], axis=1)
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=95, exif=exif)
    out = Preprocessor(_spec()).from_image_bytes(buffer.getvalue())
    assert out.shape == (20, 10, 3)
    np.testing.assert_allclose(out[2:8].mean(axis=(0, 1)), [255, 0, 0], atol=12)
    np.testing.assert_allclose(out[12:18].mean(axis=(0, 1)), [0, 0, 255], atol=12)


def test_decoded_png_equals_the_array_path() -> None:
    image = _image(21, 17)
    spec = {"kind": "image", "resize": {"size": [8, 8]}, "scale": 1 / 255}
    pre = Preprocessor(spec)
    np.testing.assert_array_equal(pre.from_image_bytes(_png(image)), pre.from_array(image))
    np.testing.assert_array_equal(pre.from_image(Image.fromarray(image)), pre.from_array(image))


def test_rgba_and_palette_images_decode_to_rgb() -> None:
    image = _image(6, 6)
    rgba = np.concatenate([image, np.full((6, 6, 1), 17, np.uint8)], axis=2)
    pre = Preprocessor(_spec())
    np.testing.assert_array_equal(pre.from_image_bytes(_png(rgba)), image.astype(np.float32))
    palette = Image.fromarray(image).convert("P")
    np.testing.assert_array_equal(pre.from_image(palette), np.asarray(palette.convert("RGB"), dtype=np.float32))


@pytest.mark.parametrize(
    "data", [b"", b"definitely not an image", b"\x89PNG\r\n\x1a\n" + bytes(40), None], ids=["empty", "text", "png-junk",
                                                                                            "truncated"]
)
def test_corrupt_bytes_raise_preprocess_error(data: bytes | None) -> None:
    if data is None:
        whole = _png(_image(64, 64))
        data = whole[: len(whole) // 2]
    with pytest.raises(PreprocessError) as info:
        Preprocessor(_spec()).from_image_bytes(data)
    assert "cannot decode image" in str(info.value)
    assert "\n" not in str(info.value)


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    pixels = chunk(b"IDAT", zlib.compress(b"\0" * 64))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + pixels + chunk(b"IEND", b"")


def test_decompression_bomb_is_refused_before_decoding() -> None:
    # 9000 x 9000 declared in a few bytes (under Pillow's own bomb warning at 89 MP): refused
    # from the header by the 50 MP default, before anything is allocated.
    with pytest.raises(PreprocessError) as info:
        Preprocessor(_spec()).from_image_bytes(_png_header_only(9_000, 9_000))
    assert "9000x9000 = 81000000 pixels, over the limit of 50000000" in str(info.value)
    # Past Pillow's own hard limit the refusal is still a PreprocessError, whatever max_pixels says.
    with pytest.raises(PreprocessError, match="decompression bomb"):
        Preprocessor(_spec(), max_pixels=10**10).from_image_bytes(_png_header_only(20_000, 20_000))


def test_max_pixels_is_configurable_and_applies_to_every_entry_point() -> None:
    image = _image(100, 100)
    pre = Preprocessor(_spec(), max_pixels=5_000)
    for call in (lambda: pre.from_image_bytes(_png(image)), lambda: pre.from_array(image),
                 lambda: pre.from_image(Image.fromarray(image))):
        with pytest.raises(PreprocessError, match="100x100 = 10000 pixels, over the limit of 5000"):
            call()
    assert Preprocessor(_spec(), max_pixels=10_000).from_array(image).shape == (100, 100, 3)


def test_bad_image_arrays_are_refused() -> None:
    pre = Preprocessor(_spec())
    with pytest.raises(PreprocessError, match="must be uint8, got float32"):
        pre.from_array(np.zeros((4, 4, 3), np.float32))
    with pytest.raises(PreprocessError, match=r"got shape \[4, 4, 2\]"):
        pre.from_array(np.zeros((4, 4, 2), np.uint8))


def test_paths_and_batches(tmp_path: Path) -> None:
    spec = {"kind": "image", "resize": {"size": [8, 10]}, "scale": 1 / 255}
    pre = Preprocessor(spec)
    images = [_image(12 + i, 15) for i in range(3)]
    paths = []
    for i, image in enumerate(images):
        paths.append(tmp_path / f"{i}.png")
        paths[-1].write_bytes(_png(image))
    batch = pre.batch_from_paths(paths)
    assert batch.shape == (3, 3, 8, 10)
    for i, image in enumerate(images):
        np.testing.assert_array_equal(batch[i], pre.from_array(image)[0])
    unbatched = Preprocessor({**spec, "batch": False}).batch_from_paths(paths)
    np.testing.assert_array_equal(unbatched, batch)
    with pytest.raises(PreprocessError, match="no input files"):
        pre.batch_from_paths([])
    with pytest.raises(PreprocessError, match="different shapes"):
        Preprocessor({"kind": "image"}).batch_from_paths(paths)
    with pytest.raises(PreprocessError, match=r"missing\.png: cannot read"):
        pre.from_path(tmp_path / "missing.png")


# ----------------------------------------------------------------------------- tensors


def test_tensor_shape_mismatch_names_expected_and_got() -> None:
    pre = Preprocessor({"kind": "tensor", "shape": ["batch", 3, 4], "dtype": "float32"})
    with pytest.raises(PreprocessError) as info:
        pre.from_array(np.zeros((2, 3, 5), np.float32))
    assert "expected ['batch', 3, 4], got [2, 3, 5]" in str(info.value)
    with pytest.raises(PreprocessError, match=r"got \[3, 4\]"):
        pre.from_array(np.zeros((3, 4), np.float32))


def test_tensor_symbolic_dims_match_anything_and_dtype_is_cast() -> None:
    pre = Preprocessor({"kind": "tensor", "shape": ["n", None, 4], "dtype": "float32"})
    data = RNG.standard_normal((5, 2, 4))
    out = pre.from_array(data)
    assert out.dtype == np.float32 and out.shape == (5, 2, 4)
    np.testing.assert_array_equal(out, data.astype(np.float32))
    ints = Preprocessor({"kind": "tensor", "dtype": "int64"}).from_array(np.arange(6, dtype=np.int32))
    assert ints.dtype == np.int64


def test_tensor_float_to_int_cast_is_refused() -> None:
    with pytest.raises(PreprocessError, match="float64 cannot be cast to int64"):
        Preprocessor({"kind": "tensor", "dtype": "int64"}).from_array(np.array([1.5, 2.5]))


def test_tensor_batch_adds_a_leading_dim_after_the_check(tmp_path: Path) -> None:
    pre = Preprocessor({"kind": "tensor", "shape": [4], "batch": True})
    assert pre.from_array(np.arange(4)).shape == (1, 4)
    np.save(tmp_path / "x.npy", np.arange(4, dtype=np.float32))
    np.testing.assert_array_equal(pre.from_path(tmp_path / "x.npy"), [[0, 1, 2, 3]])
    (tmp_path / "bad.npy").write_bytes(b"not numpy")
    with pytest.raises(PreprocessError, match=r"not a readable \.npy"):
        pre.from_path(tmp_path / "bad.npy")


def test_tensor_spec_refuses_images() -> None:
    with pytest.raises(PreprocessError, match="raw tensors"):
        Preprocessor(None).from_image_bytes(_png(_image(4, 4)))


def test_tensor_only_use_does_not_import_pillow() -> None:
    code = (
        "import sys, numpy as np\n"
        "from edgepack_core.preprocess import Preprocessor\n"
        "from edgepack_core.postprocess import Postprocessor\n"
        "Preprocessor({'kind': 'tensor', 'shape': [2]}).from_array(np.zeros(2))\n"
        "Postprocessor({'kind': 'topk', 'k': 1})({'y': np.zeros((1, 3))})\n"
        "assert 'PIL' not in sys.modules, 'PIL imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert result.returncode == 0, result.stderr
