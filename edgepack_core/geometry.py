"""The image geometry of the preprocessing: how a resize maps an image onto the model input.

Pure maths on sizes, no pixels: the resized size, crop and letterbox paste of each mode
(:func:`resize_plan`), the source region the fast path resamples (:func:`source_region`), the
reductions it may take first (:func:`reduction_factor`, :func:`array_reduction`), and the
numbers that map a model-input pixel back to the original image (:func:`image_geometry`,
inverted by the detection postprocessing). Sizes are rounded half up; crops and pads are
centered with the odd pixel at the bottom/right; keep-aspect-height rounds its width up and pads
on the right only.
"""

from __future__ import annotations

import math
from typing import Any

from edgepack_core.preprocess_spec import Resize

# A JPEG is decoded at 1/s (s in 1, 2, 4, 8; libjpeg's DCT scaling) with s at most
# floor(ratio / REDUCING_GAP), ratio being full size over target size: the spec's filter then still
# shrinks by REDUCING_GAP or more. Measured (docs/packager.md, "Image preprocessing"): 1.0, i.e.
# decoding straight to the target, changed the digits demo's answer on 4% of 64x64 JPEGs (1/8 is
# a block mean); 1.4 on 1.1%, 2.0 on 1.1%; 1.4 still decodes a 1280x720 frame at 1/2 for 224x224.
REDUCING_GAP = 1.4


def _round_half_up(value: float) -> int:
    return math.floor(value + 0.5)


def resize_plan(
    height: int, width: int, resize: Resize
) -> tuple[tuple[int, int], tuple[int, int, int, int] | None, tuple[int, int] | None]:
    """Decide, without touching pixels, how an ``height`` x ``width`` image becomes the target.

    Returns ``(resized (h, w), crop box (left, top, right, bottom) or None, paste offset
    (left, top) into the padded canvas or None)``. Kept pure so the geometry of every mode
    can be checked exactly, apart from the resampling filter.
    """
    target_h, target_w = resize.size
    mode = resize.mode
    if mode == "keep-aspect-height":
        return _height_plan(height, width, resize)
    if mode == "stretch":
        return (target_h, target_w), None, None
    if mode == "letterbox":
        factor = min(target_h / height, target_w / width)
        new_h = min(target_h, max(1, _round_half_up(height * factor)))
        new_w = min(target_w, max(1, _round_half_up(width * factor)))
        if resize.pad == "top-left":
            return (new_h, new_w), None, (0, 0)
        return (new_h, new_w), None, ((target_w - new_w) // 2, (target_h - new_h) // 2)
    fraction = resize.crop_fraction if mode == "center-crop" else 1.0
    factor = max(target_h / height, target_w / width) / fraction
    new_h = max(target_h, _round_half_up(height * factor))
    new_w = max(target_w, _round_half_up(width * factor))
    left, top = (new_w - target_w) // 2, (new_h - target_h) // 2
    return (new_h, new_w), (left, top, left + target_w, top + target_h), None


def _height_plan(height: int, width: int, resize: Resize) -> tuple[tuple[int, int], None, tuple[int, int] | None]:
    """keep-aspect-height: the height becomes ``size[0]``, the width ``ceil(width * size[0] /
    height)`` (integer arithmetic: exact; ceil as PaddleOCR's and EasyOCR's recognisers round),
    at least 1 and at most ``size[1]`` (max_width: a wider line is squeezed to it). Padding to
    a multiple of ``pad_to`` goes on the right: paste (0, 0), or None when none is needed."""
    target_h, max_w = resize.size
    new_w = min(max_w, max(1, -(-width * target_h // height)))
    return (target_h, new_w), None, (0, 0) if padded_size(target_h, new_w, resize)[1] > new_w else None


def padded_size(resized_h: int, resized_w: int, resize: Resize) -> tuple[int, int]:
    """The size (h, w) of the canvas a resized ``resized_h`` x ``resized_w`` image is pasted into:
    a letterbox's ``size``; keep-aspect-height's width rounded up to a multiple of ``pad_to``
    (never past max_width, which ``pad_to`` divides); the image's own size otherwise. Pure."""
    if resize.mode == "letterbox":
        return resize.size
    if resize.mode == "keep-aspect-height":
        return resized_h, -(-resized_w // resize.pad_to) * resize.pad_to
    return resized_h, resized_w


def image_geometry(height: int, width: int, resize: Resize | None) -> dict[str, Any]:
    """Where an ``height`` x ``width`` (upright) image lands in the model input, as the numbers
    that map a model-input pixel back: ``x_original = (x_input - pad_x) / scale_x`` (the same
    for y). ``pad`` is the paste offset of a letterbox, minus the crop offset of a crop mode;
    ``scale`` is per axis because resized sizes are rounded. Pure; the detection
    postprocessing (:func:`edgepack_core.postprocess.to_original`) inverts it."""
    if resize is None:
        return {
            "original_size": [height, width],
            "input_size": [height, width],
            "scale_x": 1.0,
            "scale_y": 1.0,
            "pad_x": 0.0,
            "pad_y": 0.0,
        }
    (new_h, new_w), crop, paste = resize_plan(height, width, resize)
    pad_x, pad_y = paste if paste is not None else (-crop[0], -crop[1]) if crop is not None else (0, 0)
    return {
        "original_size": [height, width],
        "input_size": list(padded_size(new_h, new_w, resize) if crop is None else resize.size),
        "scale_x": new_w / width,
        "scale_y": new_h / height,
        "pad_x": float(pad_x),
        "pad_y": float(pad_y),
    }


def source_region(
    height: int, width: int, resize: Resize
) -> tuple[tuple[float, float, float, float], tuple[int, int], tuple[int, int] | None]:
    """The part of an ``height`` x ``width`` image the resize keeps, as Pillow's ``resize(box=)``
    takes it: ``(box (left, top, right, bottom) in source pixels, the size (h, w) it is resampled
    to, the paste offset (left, top) of a letterbox or None)``. Resampling the box straight to
    that size reads the same filter taps as :func:`resize_plan`'s resize-then-crop. Pure."""
    (new_h, new_w), crop, paste = resize_plan(height, width, resize)
    if crop is None:
        return (0.0, 0.0, float(width), float(height)), (new_h, new_w), paste
    sx, sy = width / new_w, height / new_h
    left, top, right, bottom = crop
    return (left * sx, top * sy, right * sx, bottom * sy), (bottom - top, right - left), None


def reduction_factor(box_size: float, out_size: int) -> int:
    """The largest JPEG reduction the fast path may ask for when ``box_size`` source pixels
    become ``out_size``: ``floor(ratio / REDUCING_GAP)``, at least 1 (libjpeg then takes the
    largest of 1, 2, 4, 8 not above it). Pure."""
    return max(1, int(box_size / out_size / REDUCING_GAP))


def array_reduction(box: tuple[float, float, float, float], out_h: int, out_w: int, interpolation: str) -> int:
    """The integer factor a raw array is reduced by (Pillow's ``Image.reduce``: the mean of each
    factor x factor block, blocks from the frame's top-left corner) before the spec's filter
    resamples ``box`` to ``out_h`` x ``out_w``: a JPEG's reduced-scale rule (the same
    :func:`reduction_factor` on both axes, the smaller kept; any integer where libjpeg has 1, 2,
    4, 8), for the bilinear and bicubic filters. Not for ``area``, itself a block mean that a
    reduction would round twice, nor ``nearest``, whose point samples it would turn into block
    means: both stay exact. Pure."""
    if interpolation not in ("bilinear", "bicubic"):
        return 1
    return min(reduction_factor(box[2] - box[0], out_w), reduction_factor(box[3] - box[1], out_h))
