"""Task metrics of lossy builds, pinned at their boundaries against hand-computed references:
detection recall/precision against the fp32 model's detections, per-step sequence agreement
with CTC strings, classifier top-1, and raw outputs judged one by one."""

from __future__ import annotations

import numpy as np
import pytest

from edgepack_core.postprocess import Postprocessor, ctc_greedy
from edgepack_core.postprocess_spec import PostprocessSpec
from sdk.errors import MetricInputError
from sdk.packager.task_metrics import (
    Detections,
    ctc_labels,
    decode_yolov8,
    detection_agreement,
    evaluate,
    iou_matrix,
    match_detections,
    sequence_agreement,
    task_metric,
)
from tests.model_kinds import yolo_detections


def _d(*boxes_scores_classes: tuple[list[float], float, int]) -> Detections:
    if not boxes_scores_classes:
        return Detections.of(np.zeros((0, 4)), [], [])
    boxes, scores, classes = zip(*boxes_scores_classes, strict=True)
    return Detections.of(boxes, scores, classes)


def test_iou_of_hand_computed_boxes():
    # [0,0,2,2] vs [1,0,3,2]: intersection 1*2 = 2, union 4 + 4 - 2 = 6.
    assert iou_matrix(np.array([[0, 0, 2, 2]]), np.array([[1, 0, 3, 2], [5, 5, 6, 6]])).tolist() == [[2 / 6, 0.0]]


def test_a_match_at_exactly_the_iou_threshold_counts_and_just_below_does_not():
    ref = [_d(([0, 0, 2, 2], 0.9, 1))]
    exactly_half = [_d(([0, 0, 2, 1], 0.8, 1))]          # inter 2, union 4: IoU 0.5
    assert iou_matrix(ref[0].boxes, exactly_half[0].boxes)[0, 0] == 0.5
    found = detection_agreement(ref, exactly_half)
    assert (found.matched, found.recall, found.precision) == (1, 1.0, 1.0)
    assert found.mean_score_diff == pytest.approx(0.1)
    below = [_d(([0, 0, 2, 0.999], 0.8, 1))]               # IoU 0.4995
    missed = detection_agreement(ref, below)
    assert (missed.matched, missed.recall, missed.precision) == (0, 0.0, 0.0)
    assert missed.mean_score_diff is None


def test_a_box_of_another_class_is_a_miss_however_well_it_overlaps():
    found = detection_agreement([_d(([0, 0, 10, 10], 0.9, 3))], [_d(([0, 0, 10, 10], 0.9, 4))])
    assert (found.matched, found.recall, found.precision) == (0, 0.0, 0.0)


def test_greedy_matching_pairs_the_highest_iou_first_and_each_box_once():
    # Candidate 0 overlaps reference 0 (IoU 0.9) and reference 1 (IoU 1.0); greedy takes
    # (1, 0) first, then reference 0 may take candidate 1 (IoU 0.5) only.
    ref = _d(([0, 0, 10, 10], 0.9, 0), ([0, 0, 10, 9.0], 0.8, 0))
    cand = _d(([0, 0, 10, 9.0], 0.7, 0), ([0, 0, 10, 5], 0.6, 0))
    overlap = iou_matrix(ref.boxes, cand.boxes)
    assert overlap[1, 0] == pytest.approx(1.0) and overlap[0, 0] == pytest.approx(0.9)
    assert overlap[0, 1] == pytest.approx(0.5)
    assert match_detections(ref, cand) == [(1, 0), (0, 1)]
    found = detection_agreement([ref], [cand])
    assert (found.matched, found.recall, found.precision) == (2, 1.0, 1.0)
    assert found.mean_score_diff == pytest.approx((0.1 + 0.3) / 2)


def test_recall_and_precision_count_over_all_images():
    ref = [_d(([0, 0, 4, 4], 0.9, 0), ([10, 10, 14, 14], 0.9, 1)), _d(([0, 0, 4, 4], 0.5, 2))]
    cand = [_d(([0, 0, 4, 4], 0.9, 0)), _d(([0, 0, 4, 4], 0.5, 2), ([20, 20, 24, 24], 0.4, 2))]
    found = detection_agreement(ref, cand)
    assert (found.reference, found.candidate, found.matched) == (3, 3, 2)
    assert found.recall == pytest.approx(2 / 3) and found.precision == pytest.approx(2 / 3)


def test_no_detections_on_either_side_is_full_agreement_and_a_silent_candidate_is_not():
    assert (lambda f: (f.recall, f.precision))(detection_agreement([_d()], [_d()])) == (1.0, 1.0)
    silent = detection_agreement([_d(([0, 0, 1, 1], 0.9, 0))], [_d()])
    assert (silent.recall, silent.precision) == (0.0, 0.0)
    invented = detection_agreement([_d()], [_d(([0, 0, 1, 1], 0.9, 0))])
    assert (invented.recall, invented.precision) == (1.0, 0.0)


def _yolo_head(rows: list[tuple[float, float, float, float, list[float]]]) -> np.ndarray:
    """[1, 4 + classes, anchors] from per-anchor (cx, cy, w, h, scores)."""
    return np.array([[*r[:4], *r[4]] for r in rows], np.float32).T[None]


def test_yolov8_decoding_thresholds_and_suppresses_per_class():
    head = _yolo_head([
        (10, 10, 4, 4, [0.9, 0.1]),    # kept
        (10.2, 10, 4, 4, [0.8, 0.1]),  # same class, IoU ~0.9 with the first: suppressed
        (10, 10, 4, 4, [0.1, 0.7]),    # other class, same place: kept (NMS is class-wise)
        (50, 50, 2, 2, [0.2, 0.24]),   # below the 0.25 score threshold: dropped
    ])
    (image,) = decode_yolov8(head)
    assert image.classes.tolist() == [0, 1]
    assert image.scores.tolist() == pytest.approx([0.9, 0.7])
    assert image.boxes[0].tolist() == [8, 8, 12, 12]


def test_ctc_labels_collapse_repeats_and_drop_blanks():
    assert ctc_labels(np.array([0, 3, 3, 0, 3, 5, 5, 0]), blank=0) == (3, 3, 5)
    assert ctc_labels(np.array([], np.int64), blank=0) == ()


# --- One decoder per task: the metric decodes as the device does, and both as a brute force ---


def test_the_metric_decodes_yolov8_heads_as_a_brute_force_reference_and_the_device_do():
    rng = np.random.default_rng(22)
    for _ in range(40):
        anchors, classes = int(rng.integers(1, 30)), int(rng.integers(1, 4))
        centres = rng.uniform(0, 20, (2, anchors))
        sizes = rng.uniform(1, 8, (2, anchors))
        head = np.concatenate([centres, sizes, rng.uniform(0, 1, (classes, anchors))]).astype(np.float32)
        (image,) = decode_yolov8(head[None], score_threshold=0.3, iou_threshold=0.4)
        expected = yolo_detections(head.astype(np.float64), 0.3, 0.4)  # the e2e tests' brute force
        assert image.classes.tolist() == [e["index"] for e in expected]
        assert image.scores.tolist() == pytest.approx([e["score"] for e in expected])
        np.testing.assert_allclose(image.boxes, np.array([e["box"] for e in expected]).reshape(-1, 4))
        device = Postprocessor({"kind": "detection", "score_threshold": 0.3, "iou_threshold": 0.4,
                                "max_detections": 300})({"y": head[None]})
        assert [d["index"] for d in device] == image.classes.tolist()
        assert [d["box"] for d in device] == image.boxes.tolist()


def test_a_score_exactly_at_the_threshold_is_no_detection_for_the_metric_as_for_the_device():
    # The metric used to keep score >= threshold while the device reports score > threshold: a
    # box at exactly 0.25 was judged but never served. 0.25 and 0.5 are exact in float32.
    head = _yolo_head([(10, 10, 4, 4, [0.25]), (40, 40, 4, 4, [0.5])])
    (image,) = decode_yolov8(head, score_threshold=0.25)
    assert image.scores.tolist() == [0.5]
    (above,) = decode_yolov8(head, score_threshold=0.2499)
    assert above.scores.tolist() == [0.5, 0.25]
    device = Postprocessor({"kind": "detection", "score_threshold": 0.25})({"y": head})
    assert [d["score"] for d in device] == [0.5]


def test_a_head_the_metric_cannot_read_is_a_metric_input_error():
    with pytest.raises(MetricInputError, match="yolov8"):
        decode_yolov8(np.zeros((1, 4, 10), np.float32))  # no class row


def _brute_force_ctc(best: list[int], blank: int) -> tuple[int, ...]:
    out, previous = [], None
    for index in best:
        if index != previous and index != blank:
            out.append(index)
        previous = index
    return tuple(out)


def test_the_metric_reads_ctc_labels_as_a_brute_force_reference_and_the_device_do():
    rng = np.random.default_rng(22)
    for _ in range(50):
        steps, classes, blank = int(rng.integers(1, 25)), int(rng.integers(2, 6)), int(rng.integers(0, 2))
        probs = rng.uniform(0, 1, (steps, classes))
        best = np.argmax(probs, axis=1)
        labels = ctc_labels(best, blank)
        assert labels == _brute_force_ctc(best.tolist(), blank)
        symbols = [f"<{i}>" for i in range(classes) if i != blank]
        text = ctc_greedy(probs, blank, symbols, apply_softmax=True)["text"]
        assert text == "".join(f"<{i}>" for i in labels)


def test_top1_ranks_as_the_devices_topk_a_nan_last_and_ties_to_the_lower_class():
    # The device answers class 1 for [nan, 0.8, 0.1] (topk ranks a NaN last); the metric judges
    # that answer, where np.argmax would have read class 0.
    ref = {"y": np.array([[0.1, 0.9, 0.0]], np.float32)}
    cand = {"y": np.array([[np.nan, 0.8, 0.1]], np.float32)}
    result = evaluate([ref], [cand], metric="agreement", outputs=["y"])
    assert result.met and result.scores[0].figures["top1_agreement"] == 1.0
    device = Postprocessor({"kind": "topk", "k": 1, "apply_softmax": False})(cand)
    assert device[0]["index"] == 1
    tie = {"y": np.array([[0.5, 0.5, 0.1]], np.float32)}
    assert evaluate([tie], [{"y": np.array([[0.9, 0.1, 0.1]], np.float32)}], metric="agreement",
                    outputs=["y"]).met


def test_sequence_agreement_is_per_step_not_one_argmax_over_the_flattened_output():
    steps, classes = 40, 10
    ref = np.zeros((1, steps, classes), np.float32)
    ref[0, np.arange(steps), np.arange(steps) % classes] = 1.0
    cand = ref.copy()
    cand[0, 0, :] = 0.0
    cand[0, 0, 9] = 1.0  # one step of forty changed
    result = sequence_agreement([ref], [cand], blank=0)
    assert result.steps == 40 and result.agreement == pytest.approx(39 / 40)
    assert result.sequences == 1 and result.string_match == 0.0
    assert sequence_agreement([ref], [ref.copy()], blank=0).string_match == 1.0


def test_sequence_budget_boundary_at_min_agreement():
    ref = np.eye(4, dtype=np.float32)[None].repeat(25, axis=1)  # [1, 100, 4]
    cand = ref.copy()
    cand[0, 0] = [0, 0, 0, 1]  # 99 of 100 steps agree
    at = evaluate([{"y": ref}], [{"y": cand}], metric="sequence", outputs=["y"], budget={"min_agreement": 0.99})
    assert at.met and at.scores[0].value == pytest.approx(0.99)
    past = evaluate([{"y": ref}], [{"y": cand}], metric="sequence", outputs=["y"], budget={"min_agreement": 0.991})
    assert not past.met and "output y: per-step agreement 0.99" in past.summary()


def _twenty_strings_one_changed() -> tuple[np.ndarray, np.ndarray]:
    """[20, 5, 4] rows reading "123" (steps 1,0,2,0,3; blank 0); the candidate's row 0 reads
    "323": one step of 100 (agreement 0.99), one string of 20 (string match 0.95)."""
    ref = np.zeros((20, 5, 4), np.float32)
    ref[:, np.arange(5), [1, 0, 2, 0, 3]] = 1.0
    cand = ref.copy()
    cand[0, 0] = [0, 0, 0, 1]
    return ref, cand


def test_min_string_match_gates_the_decoded_strings_at_exactly_the_limit():
    ref, cand = _twenty_strings_one_changed()

    def judged(**budget: float):
        return evaluate([{"y": ref}], [{"y": cand}], metric="sequence", outputs=["y"], blank=0,
                        budget={"min_agreement": 0.99, **budget})

    reported = judged()  # unset: reported, never gated
    figures = reported.scores[0].figures
    assert reported.met and figures["string_match"] == pytest.approx(0.95) and figures["step_agreement"] == 0.99
    assert "decoded strings equal 95.00%" in reported.summary()
    at = judged(min_string_match=0.95)
    assert at.met and "string match 0.95 (required >= 0.95)" in at.summary()
    past = judged(min_string_match=0.951)
    assert not past.met and past.scores[0].value == pytest.approx(0.95) and past.scores[0].limit == 0.951
    assert past.summary() == "output y: string match 0.95 (required >= 0.951), short by 0.001"


def test_the_worse_of_step_agreement_and_string_match_is_the_line_a_miss_prints():
    ref, cand = _twenty_strings_one_changed()
    both = evaluate([{"y": ref}], [{"y": cand}], metric="sequence", outputs=["y"], blank=0,
                    budget={"min_agreement": 0.995, "min_string_match": 1.0})
    assert not both.met and both.summary() == "output y: string match 0.95 (required >= 1), short by 0.05"
    steps = evaluate([{"y": ref}], [{"y": cand}], metric="sequence", outputs=["y"], blank=0,
                     budget={"min_agreement": 1.0, "min_string_match": 0.955})
    assert steps.summary().startswith("output y: per-step agreement 0.99 (required >= 1), decoded strings equal 95.00%")
    # Without a ctc blank there are no strings to gate: the key has nothing to judge here (the
    # build refuses it naming validate.min_string_match, tests/test_quantize_search.py).
    plain = evaluate([{"y": ref}], [{"y": cand}], metric="sequence", outputs=["y"],
                     budget={"min_agreement": 0.99, "min_string_match": 1.0})
    assert plain.met and "string_match" not in plain.scores[0].figures


def test_a_collapsed_score_channel_fails_detection_though_the_whole_tensor_cosine_passes():
    """The YOLOv8 case: boxes in pixels dominate the cosine of the concatenated head."""
    rng = np.random.default_rng(0)
    anchors, classes = 200, 4
    boxes = rng.uniform(20, 600, (1, 4, anchors)).astype(np.float32)
    scores = np.full((1, classes, anchors), 0.01, np.float32)
    scores[0, rng.integers(0, classes, 12), rng.choice(anchors, 12, replace=False)] = 0.9
    ref = np.concatenate([boxes, scores], axis=1)
    collapsed = ref.copy()
    collapsed[0, 4:] = np.where(ref[0, 4:] > 0.5, 0.0, 0.01)  # every confident score gone
    whole = evaluate([{"out": ref}], [{"out": collapsed}], metric="cosine", outputs=["out"])
    assert whole.met and whole.scores[0].value > 0.99
    task = evaluate([{"out": ref}], [{"out": collapsed}], metric="detection", outputs=["out"])
    assert not task.met
    assert task.summary().startswith("output out: detection recall 0 (required >= 0.95), short by 0.95")


def test_detection_budget_keys_move_the_boundary():
    ref = _yolo_head([(10, 10, 4, 4, [0.9]), (40, 40, 4, 4, [0.9]), (80, 80, 4, 4, [0.9]), (120, 120, 4, 4, [0.9])])
    cand = ref.copy()
    cand[0, 4, 3] = 0.0  # one of four detections lost: recall 0.75, precision 1
    sample = ([{"y": ref}], [{"y": cand}])
    assert not evaluate(*sample, metric="detection", outputs=["y"]).met
    assert evaluate(*sample, metric="detection", outputs=["y"], budget={"min_recall": 0.75}).met
    missed = evaluate(*sample, metric="detection", outputs=["y"], budget={"min_recall": 0.76})
    assert not missed.met and missed.scores[0].shortfall == pytest.approx(0.01)


def test_scores_collapsed_onto_one_quantization_step_fail_though_every_box_still_matches():
    """The int8 case seen on a YOLOv8-style head: one Concat scale for pixel boxes and sigmoid
    scores puts every score on one step (1.213); every box keeps its place and class."""
    ref = _yolo_head([(10, 10, 4, 4, [0.9]), (40, 40, 4, 4, [0.8]), (80, 80, 4, 4, [0.95]), (120, 120, 4, 4, [0.7])])
    collapsed = ref.copy()
    collapsed[0, 4:] = np.where(ref[0, 4:] > 0.25, 1.213, 0.0)
    result = evaluate([{"y": ref}], [{"y": collapsed}], metric="detection", outputs=["y"])
    figures = result.scores[0].figures
    assert (figures["recall"], figures["precision"]) == (1.0, 1.0)
    assert not result.met
    expected = np.mean([1.213 - s for s in (0.9, 0.8, 0.95, 0.7)])  # 0.3755
    assert result.summary().startswith(
        f"output y: mean score shift of matched detections {expected:.4g} (allowed <= 0.05)")


def test_the_score_shift_budget_boundary_is_max_score_diff():
    ref = _yolo_head([(10, 10, 4, 4, [0.75]), (40, 40, 4, 4, [0.5])])
    shifted = ref.copy()
    shifted[0, 4:] = np.where(ref[0, 4:] > 0.25, ref[0, 4:] + 0.0625, 0.0)  # exact in binary: mean shift 0.0625
    sample = ([{"y": ref}], [{"y": shifted}])
    assert not evaluate(*sample, metric="detection", outputs=["y"]).met          # default 0.05
    assert evaluate(*sample, metric="detection", outputs=["y"], budget={"max_score_diff": 0.0625}).met
    missed = evaluate(*sample, metric="detection", outputs=["y"], budget={"max_score_diff": 0.0624})
    assert not missed.met and missed.scores[0].shortfall == pytest.approx(0.0001)
    met = evaluate(*sample, metric="detection", outputs=["y"], budget={"max_score_diff": 0.07})
    assert "mean score shift 0.0625 (allowed <= 0.07)" in met.summary()


def test_raw_outputs_are_judged_one_by_one_and_the_summary_names_the_one_that_missed():
    rng = np.random.default_rng(1)
    big = rng.normal(0, 100, (1, 1000)).astype(np.float32)
    small = rng.normal(0, 1, (1, 10)).astype(np.float32)
    ref = [{"big": big, "small": small}]
    cand = [{"big": big, "small": -small}]
    result = evaluate(ref, cand, metric="cosine", outputs=["big", "small"])
    assert [s.met for s in result.scores] == [True, False]
    assert result.worst is not None and result.worst.output == "small"
    assert result.summary().startswith("output small: cosine -1 (required >= 0.99), short by 1.99")
    concatenated = np.concatenate([big, small], axis=1), np.concatenate([big, -small], axis=1)
    joined = evaluate([{"x": concatenated[0]}], [{"x": concatenated[1]}], metric="cosine", outputs=["x"])
    assert joined.met, "the figure one concatenated tensor gives is exactly what must not be used"


def test_top1_agreement_per_row_and_accuracy_drop_with_labels():
    ref = [{"p": np.array([[0.1, 0.9], [0.8, 0.2]])} for _ in range(50)]
    cand = [{"p": np.array([[0.1, 0.9], [0.8, 0.2]])} for _ in range(49)] + [{"p": np.array([[0.9, 0.1],
                                                                                        [0.8, 0.2]])}]
    agreement = evaluate(ref, cand, metric="top1", outputs=["p"])
    assert agreement.met and agreement.scores[0].value == pytest.approx(0.01)  # 1 of 100 rows: at the limit
    assert not evaluate(ref, cand, metric="top1", outputs=["p"], budget={"max_drop": 0.009}).met
    single = [{"p": np.array([0.2, 0.8])}] * 4
    labels = [1, 1, 0, 1]  # the reference is right on 3 of 4
    wrong = [{"p": np.array([0.2, 0.8])}] * 3 + [{"p": np.array([0.8, 0.2])}]
    drop = evaluate(single, wrong, metric="top1", outputs=["p"], labels=labels, budget={"max_drop": 0.25})
    assert drop.met and drop.scores[0].figures["accuracy_drop"] == pytest.approx(0.25)


def test_integer_outputs_must_match_exactly_and_a_shape_change_is_a_miss():
    ref = [{"ids": np.array([1, 2, 3])}]
    assert not evaluate(ref, [{"ids": np.array([1, 2, 4])}], metric="cosine", outputs=["ids"]).met
    shape = evaluate([{"y": np.zeros((1, 3))}], [{"y": np.zeros((1, 4))}], metric="cosine", outputs=["y"])
    assert not shape.met and "shape [1, 4], expected [1, 3]" in shape.summary()


@pytest.mark.parametrize(("named", "kind", "labels", "expected"), [
    (None, "detection", False, "detection"), (None, "ctc", False, "sequence"), (None, "topk", False, "top1"),
    (None, "softmax", True, "top1"), (None, "raw", False, "cosine"), (None, "raw", True, "top1"),
    ("max_abs", "detection", False, "max_abs"),
])
def test_the_metric_follows_the_task_unless_the_recipe_names_one(named, kind, labels, expected):
    assert task_metric(named, PostprocessSpec(kind=kind), labels) == expected


def test_a_tnc_ctc_output_is_read_with_time_first():
    # [T=3, batch=2, classes=3]: row 0 reads 1,1,2 -> "12"; row 1 reads 2,0,2 -> "22".
    ref = np.zeros((3, 2, 3), np.float32)
    for t, (a, b) in enumerate([(1, 2), (1, 0), (2, 2)]):
        ref[t, 0, a] = ref[t, 1, b] = 1.0
    cand = ref.copy()
    cand[1, 1] = [0, 0, 1]  # row 1 now reads 2,2,2 -> "2": one step of six, one string of two
    result = evaluate([{"y": ref}], [{"y": cand}], metric="sequence", outputs=["y"], blank=0, layout="TNC",
                      budget={"min_agreement": 0.8})
    figures = result.scores[0].figures
    assert figures["step_agreement"] == pytest.approx(5 / 6) and figures["string_match"] == 0.5 and result.met
