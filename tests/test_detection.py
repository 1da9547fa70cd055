"""Detection postprocessing (pure): YOLOv8/YOLOv5/boxes_scores decoding, class-wise NMS against
hand-computed cases and a brute-force reference, and boxes mapped back through the real
preprocessor's resize/letterbox geometry."""

from __future__ import annotations

import re

import numpy as np
import pytest

from edgepack_core.errors import PostprocessError, SchemaError
from edgepack_core.geometry import image_geometry
from edgepack_core.postprocess import Postprocessor, box_iou, nms, to_original
from edgepack_core.postprocess_spec import normalize_postprocess
from edgepack_core.preprocess import Preprocessor
from edgepack_core.preprocess_spec import Resize

LABELS = ["cat", "dog"]


def _yolov8(anchors: list[tuple[float, float, float, float, list[float]]]) -> np.ndarray:
    """[1, 4 + classes, anchors] from (cx, cy, w, h, class scores) per anchor."""
    rows = [[cx, cy, w, h, *scores] for cx, cy, w, h, scores in anchors]
    return np.asarray(rows, dtype=np.float32).T[None]


# ----------------------------------------------------------------------------- spec


def test_detection_defaults_are_written_out_and_idempotent() -> None:
    spec = normalize_postprocess({"kind": "detection"})
    assert spec == {"kind": "detection", "version": 1, "format": "yolov8", "score_threshold": 0.25,
                    "iou_threshold": 0.45, "max_detections": 100, "labels": None}
    assert normalize_postprocess(spec) == spec


@pytest.mark.parametrize(
    ("spec", "path", "fragment"),
    [
        ({"kind": "detection", "format": "boxes_scores"}, "outputs", "needs outputs"),
        ({"kind": "detection", "outputs": {"boxes": "b", "scores": "s"}}, "outputs", "only format boxes_scores"),
        ({"kind": "detection", "format": "boxes_scores", "output": "y",
          "outputs": {"boxes": "b", "scores": "s"}}, "output", "not output"),
        ({"kind": "detection", "format": "boxes_scores", "outputs": {"boxes": "b"}}, "outputs.scores", "required"),
        ({"kind": "detection", "format": "yolov7"}, "format", "not one of"),
        ({"kind": "detection", "score_threshold": 1.01}, "score_threshold", "above the maximum"),
        ({"kind": "detection", "iou_threshold": -0.1}, "iou_threshold", "below the minimum"),
        ({"kind": "detection", "max_detections": 0}, "max_detections", "below the minimum"),
        ({"kind": "detection", "max_detections": 10_001}, "max_detections", "above the maximum"),
        ({"kind": "detection", "k": 3}, "k", "unknown key"),
        ({"kind": "detection", "blank": 0}, "blank", "unknown key"),
    ],
)
def test_bad_detection_spec_is_refused_naming_the_key(spec: dict, path: str, fragment: str) -> None:
    with pytest.raises(SchemaError) as info:
        normalize_postprocess(spec, path="postprocess")
    assert info.value.path == f"postprocess.{path}"
    assert fragment in info.value.problem


# ----------------------------------------------------------------------------- NMS


def test_iou_of_hand_computed_boxes() -> None:
    ious = box_iou(np.array([0.0, 0, 10, 10]), np.array([[1.0, 1, 11, 11], [10, 10, 20, 20], [0, 0, 10, 10],
                                                         [5, 5, 5, 9]]))
    np.testing.assert_allclose(ious, [81 / 119, 0.0, 1.0, 0.0])


def test_nms_hand_computed_case_is_class_wise() -> None:
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [1, 1, 11, 11], [20, 20, 30, 30]], dtype=np.float64)
    scores = np.array([0.9, 0.8, 0.7, 0.6])
    classes = np.array([0, 0, 1, 0])
    # box 1 overlaps box 0 (IoU 81/119 = 0.68) in the same class: dropped; box 2 is of another class.
    assert nms(boxes, scores, classes, 0.45, 100).tolist() == [0, 2, 3]
    assert nms(boxes, scores, classes, 0.69, 100).tolist() == [0, 1, 2, 3]
    assert nms(boxes, scores, classes, 0.45, 2).tolist() == [0, 2]


def test_nms_keeps_a_box_whose_iou_equals_the_threshold() -> None:
    boxes = np.array([[0, 0, 2, 1], [1, 0, 3, 1]], dtype=np.float64)  # IoU exactly 1/3
    assert nms(boxes, np.array([0.9, 0.8]), np.array([0, 0]), 1 / 3, 10).tolist() == [0, 1]
    assert nms(boxes, np.array([0.9, 0.8]), np.array([0, 0]), 0.333, 10).tolist() == [0]


def _reference_nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, threshold: float) -> list[int]:
    """Brute force, written independently: per class, visit boxes best first and keep one when
    no kept box of the class overlaps it by more than the threshold."""
    def iou(a: np.ndarray, b: np.ndarray) -> float:
        w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
        h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
        union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - w * h
        return w * h / union if union > 0 else 0.0

    kept: list[int] = []
    for cls in set(classes.tolist()):
        members = sorted((i for i in range(len(boxes)) if classes[i] == cls), key=lambda i: -scores[i])
        mine: list[int] = []
        for i in members:
            if all(iou(boxes[i], boxes[j]) <= threshold for j in mine):
                mine.append(i)
        kept += mine
    return sorted(kept, key=lambda i: -scores[i])


@pytest.mark.parametrize("seed", range(8))
def test_nms_matches_a_brute_force_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 120
    corners = rng.uniform(0, 60, (n, 2))
    boxes = np.concatenate([corners, corners + rng.uniform(5, 40, (n, 2))], axis=1)
    scores = rng.permutation(n) / n + 0.001  # distinct scores: one right order
    classes = rng.integers(0, 3, n)
    threshold = float(rng.uniform(0.1, 0.5))
    expected = _reference_nms(boxes, scores, classes, threshold)
    assert 3 < len(expected) < n, "the case must suppress some boxes and keep several"
    assert nms(boxes, scores, classes, threshold, 10_000).tolist() == expected


# ----------------------------------------------------------------------------- decoders


def test_yolov8_hand_computed_detections() -> None:
    output = _yolov8([
        (50, 50, 20, 10, [0.9, 0.1]),   # cat [40, 45, 60, 55]
        (52, 50, 20, 10, [0.8, 0.3]),   # a worse cat over the same place: suppressed
        (52, 50, 20, 10, [0.2, 0.7]),   # a dog there: kept (another class)
        (10, 10, 4, 4, [0.25, 0.1]),    # score equal to the threshold: not kept
    ])
    result = Postprocessor({"kind": "detection"}, labels=LABELS)({"output0": output})
    assert result == [
        {"box": [40.0, 45.0, 60.0, 55.0], "score": pytest.approx(0.9), "index": 0, "label": "cat"},
        {"box": [42.0, 45.0, 62.0, 55.0], "score": pytest.approx(0.7), "index": 1, "label": "dog"},
    ]


def test_yolov5_score_is_objectness_times_class_score() -> None:
    rows = np.array([[[30, 30, 10, 10, 0.5, 0.6, 0.2],    # 0.5 * 0.6 = 0.30: kept, class 0
                      [80, 80, 10, 10, 0.9, 0.2, 0.25],   # best 0.9 * 0.25 = 0.225 < 0.25: dropped
                      [60, 20, 8, 4, 0.8, 0.1, 0.95]]], dtype=np.float32)  # 0.76, class 1
    result = Postprocessor({"kind": "detection", "format": "yolov5"})({"y": rows})
    assert [(d["box"], d["index"], d["label"]) for d in result] == [([56.0, 18.0, 64.0, 22.0], 1, None),
                                                                   ([25.0, 25.0, 35.0, 35.0], 0, None)]
    assert [d["score"] for d in result] == pytest.approx([0.8 * 0.95, 0.5 * 0.6], rel=1e-6)


def test_boxes_scores_reads_the_named_outputs_with_or_without_a_batch_axis() -> None:
    spec = {"kind": "detection", "format": "boxes_scores", "score_threshold": 0.5,
            "outputs": {"boxes": "dets", "scores": "conf", "classes": "cls"}}
    boxes = np.array([[0, 0, 10, 10], [1, 1, 10, 10], [50, 50, 60, 70]], dtype=np.float32)
    outputs = {"dets": boxes, "conf": np.array([0.6, 0.9, 0.4], np.float32), "cls": np.array([3, 3, 1])}
    expected = [{"box": [1.0, 1.0, 10.0, 10.0], "score": pytest.approx(0.9), "index": 3, "label": None}]
    assert Postprocessor(spec)(outputs) == expected
    batched = {k: v[None] for k, v in outputs.items()}
    assert Postprocessor(spec)(batched) == expected
    no_classes = {"kind": "detection", "format": "boxes_scores", "outputs": {"boxes": "dets", "scores": "conf"}}
    result = Postprocessor(no_classes)(outputs)  # class 0 for all; box 0 suppressed by box 1
    assert [(d["box"], d["index"]) for d in result] == [([1.0, 1.0, 10.0, 10.0], 0), ([50.0, 50.0, 60.0, 70.0], 0)]


def test_a_batch_of_two_gives_one_list_per_image() -> None:
    one = _yolov8([(50, 50, 20, 10, [0.9, 0.1])])
    two = np.concatenate([one, _yolov8([(10, 10, 4, 4, [0.1, 0.8])])])
    result = Postprocessor({"kind": "detection"})({"y": two})
    assert [[d["index"] for d in image] for image in result] == [[0], [1]]


@pytest.mark.parametrize(
    ("spec", "outputs", "fragment"),
    [
        ({"kind": "detection"}, {"y": np.zeros((1, 4, 10), np.float32)}, "4 + classes"),
        ({"kind": "detection", "format": "yolov5"}, {"y": np.zeros((1, 10, 5), np.float32)}, "5 + classes"),
        ({"kind": "detection"}, {"y": np.zeros((10,), np.float32)}, "rank 3"),
        ({"kind": "detection", "format": "boxes_scores", "outputs": {"boxes": "b", "scores": "s"}},
         {"b": np.zeros((3, 4)), "s": np.zeros(2)}, "do not match"),
        ({"kind": "detection", "format": "boxes_scores", "outputs": {"boxes": "b", "scores": "s"}},
         {"b": np.zeros((3, 5)), "s": np.zeros(3)}, "boxes must be"),
        ({"kind": "detection", "format": "boxes_scores", "outputs": {"boxes": "b", "scores": "nope"}},
         {"b": np.zeros((3, 4)), "s": np.zeros(3)}, "no model output named 'nope'"),
    ],
)
def test_outputs_that_do_not_fit_the_format_are_one_error(spec: dict, outputs: dict, fragment: str) -> None:
    with pytest.raises(PostprocessError, match=re.escape(fragment)):
        Postprocessor(spec)(outputs)


# ----------------------------------------------------------------------------- geometry


def test_geometry_of_each_mode_hand_computed() -> None:
    letterbox = Resize((64, 64), mode="letterbox", pad="center")
    # 100 high, 50 wide: scale 0.64, resized 64 x 32, pasted at x = (64 - 32) // 2 = 16
    assert image_geometry(100, 50, letterbox) == {"original_size": [100, 50], "input_size": [64, 64],
                                                  "scale_x": 0.64, "scale_y": 0.64, "pad_x": 16.0, "pad_y": 0.0}
    top_left = image_geometry(100, 50, Resize((64, 64), mode="letterbox", pad="top-left"))
    assert (top_left["pad_x"], top_left["pad_y"]) == (0.0, 0.0)
    stretch = image_geometry(100, 50, Resize((64, 64), mode="stretch"))
    assert (stretch["scale_x"], stretch["scale_y"], stretch["pad_x"]) == (64 / 50, 0.64, 0.0)
    crop = image_geometry(100, 50, Resize((64, 64), mode="keep-aspect"))  # 128 x 64, crop top 32
    assert (crop["scale_y"], crop["pad_x"], crop["pad_y"]) == (1.28, 0.0, -32.0)
    assert image_geometry(7, 9, None)["scale_x"] == 1.0


def test_boxes_map_back_to_the_original_and_clip_to_it() -> None:
    geometry = image_geometry(100, 50, Resize((64, 64), mode="letterbox"))
    boxes = np.array([[16.0, 0.0, 48.0, 64.0], [0.0, -5.0, 80.0, 70.0]])
    np.testing.assert_allclose(to_original(boxes, geometry), [[0, 0, 50, 100], [0, 0, 50, 100]])
    np.testing.assert_allclose(to_original(np.array([[24.0, 16.0, 32.0, 32.0]]), geometry), [[12.5, 25, 25, 50]])


@pytest.mark.parametrize("pad", ["center", "top-left"])
def test_a_drawn_box_comes_back_in_original_pixels_through_the_real_preprocessor(pad: str) -> None:
    """Draw a white rectangle on a 192 x 384 image, letterbox it to 96 x 96 with the device's own
    code (scale 1/4, so every edge lands on an input pixel), find the rectangle in the tensor,
    decode that box and map it back: the drawn rectangle, exactly."""
    image = np.zeros((192, 384, 3), np.uint8)
    x1, y1, x2, y2 = 96, 48, 288, 144
    image[y1:y2, x1:x2] = 255
    pre = Preprocessor({"kind": "image", "resize": {"size": [96, 96], "mode": "letterbox", "pad": pad,
                                                    "pad_value": 0, "interpolation": "nearest"}})
    tensor, geometry = pre.image_with_geometry(image)
    assert tensor.shape == (1, 3, 96, 96)
    ys, xs = np.nonzero(tensor[0, 0] > 127)
    found = [float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1)]
    assert geometry["pad_y"] == (24.0 if pad == "center" else 0.0)  # resized 48 high in a 96 canvas
    assert found[1] == 12 + geometry["pad_y"], "the image sits where the geometry says"
    output = _yolov8([((found[0] + found[2]) / 2, (found[1] + found[3]) / 2,
                       found[2] - found[0], found[3] - found[1], [0.9])])
    (detection,) = Postprocessor({"kind": "detection"})({"y": output}, geometry)
    np.testing.assert_allclose(detection["box"], [x1, y1, x2, y2], atol=1e-9)


def test_geometry_of_encoded_bytes_is_that_of_the_upright_image() -> None:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees: a 40 x 20 (w x h) file is a 20 x 40 upright image
    Image.new("RGB", (40, 20)).save(buffer, format="JPEG", exif=exif)
    pre = Preprocessor({"kind": "image", "resize": {"size": [32, 32], "mode": "letterbox"}})
    _, geometry = pre.image_with_geometry(buffer.getvalue())
    assert geometry["original_size"] == [40, 20]
    assert (geometry["pad_x"], geometry["scale_x"]) == (8.0, 0.8)


def test_letterbox_pad_is_refused_with_another_mode() -> None:
    from edgepack_core.preprocess_spec import normalize_preprocess

    with pytest.raises(SchemaError) as info:
        normalize_preprocess({"kind": "image", "resize": {"size": [4, 4], "mode": "stretch", "pad": "center"}},
                             path="preprocess")
    assert (info.value.path, info.value.problem) == ("preprocess.resize.mode", "must be 'letterbox'")
    spec = normalize_preprocess({"kind": "image", "resize": {"size": [4, 4], "mode": "letterbox"}})
    assert spec["resize"]["pad"] == "center"
