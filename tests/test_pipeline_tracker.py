"""The ByteTrack-style tracker: ids stay with moving objects (passing each other, hidden for a
while, scoring low when partly hidden); boundaries of min_hits, max_age and the score bands."""

from __future__ import annotations

import pytest

from device_agent.pipelines.spec import TrackerSpec
from device_agent.pipelines.tracker import Detection, Tracker, greedy_match

SPEC = TrackerSpec()  # high 0.5, low 0.1, iou 0.3, max_age 30, min_hits 3


def box(x: float, y: float, size: float = 40.0) -> tuple[float, float, float, float]:
    return (x, y, x + size, y + size)


def ids_by_label(objects: list) -> dict[str, int]:
    return {o.label: o.track_id for o in objects}


def test_a_track_is_reported_only_from_its_min_hits_th_match():
    tracker = Tracker(TrackerSpec(min_hits=3))
    reported = [tracker.update([Detection(box(10 + 5 * i, 10), 0.9, "car")]) for i in range(4)]
    assert [len(r) for r in reported] == [0, 0, 1, 1]
    assert reported[2][0].track_id == reported[3][0].track_id == 1


def test_two_objects_passing_each_other_keep_their_ids():
    """Two cars of the same label drive toward each other on one lane, half a box per frame,
    overlapping as they pass: each id stays on its own car (velocity prediction)."""
    tracker = Tracker(SPEC)
    first: dict[int, float] = {}
    for step in range(30):
        left = Detection(box(100 + 20 * step, 100), 0.9, "car")
        right = Detection(box(700 - 20 * step, 100), 0.9, "car")
        objects = tracker.update([left, right])
        for o in objects:
            first.setdefault(o.track_id, o.box[0])
            moved = o.box[0] - first[o.track_id]
            # the track that started on the left only ever moves right, and the other left
            assert (moved >= 0) if first[o.track_id] < 400 else (moved <= 0)
    assert {o.track_id for o in tracker.confirmed()} == {1, 2}


def test_a_hidden_object_keeps_its_id_up_to_max_age_frames_and_not_one_more():
    for hidden, same in ((5, True), (30, True), (31, False)):
        tracker = Tracker(TrackerSpec(max_age=30))
        for step in range(5):
            tracker.update([Detection(box(100 + 2 * step, 100), 0.9, "person")])
        before = tracker.confirmed()[0].track_id
        for _ in range(hidden):
            tracker.update([])
        for step in range(5 + hidden, 8 + hidden):  # it walked on behind the obstacle
            tracker.update([Detection(box(100 + 2 * step, 100), 0.9, "person")])
        after = [o.track_id for o in tracker.confirmed()]
        assert (after == [before]) is same, (hidden, after)


def test_low_score_detections_continue_a_track_but_never_start_one():
    tracker = Tracker(SPEC)
    for _ in range(3):
        assert tracker.update([Detection(box(500, 500), 0.3, "person")]) == []
    assert tracker.live_ids() == frozenset()
    for step in range(4):
        tracker.update([Detection(box(100 + 3 * step, 100), 0.9, "person")])
    (track,) = tracker.confirmed()
    for step in range(10):  # partly hidden: the score dips under high but stays over low
        (still,) = tracker.update([Detection(box(112 + 3 * step, 100), 0.2, "person")])
        assert (still.track_id, still.missed) == (track.track_id, 0)


@pytest.mark.parametrize(("score", "starts"), [(0.5, True), (0.4999, False)])
def test_the_high_threshold_is_where_a_track_may_start(score: float, starts: bool):
    tracker = Tracker(TrackerSpec(min_hits=1))
    assert bool(tracker.update([Detection(box(0, 0), score, "person")])) is starts


@pytest.mark.parametrize(("score", "continues"), [(0.1, True), (0.0999, False)])
def test_the_low_threshold_is_where_a_detection_still_continues_a_track(score: float, continues: bool):
    tracker = Tracker(TrackerSpec(min_hits=1))
    tracker.update([Detection(box(0, 0), 0.9, "person")])
    (track,) = tracker.update([Detection(box(1, 0), score, "person")])
    assert (track.missed == 0) is continues


def test_labels_never_match_each_other():
    tracker = Tracker(TrackerSpec(min_hits=1))
    tracker.update([Detection(box(0, 0), 0.9, "cat")])
    objects = tracker.update([Detection(box(0, 0), 0.9, "dog")])
    assert ids_by_label(objects) == {"cat": 1, "dog": 2}


def test_greedy_matching_takes_the_best_iou_first():
    tracker = Tracker(TrackerSpec(min_hits=1))
    tracker.update([Detection(box(0, 0), 0.9, "a"), Detection(box(30, 0), 0.9, "a")])
    tracks = tracker._tracks
    matches, left, new = greedy_match(tracks, [Detection(box(28, 0), 0.9, "a")], 0.1)
    assert matches == [(1, 0)] and left == [0] and new == []


def test_an_iou_below_the_threshold_starts_a_new_track():
    tracker = Tracker(TrackerSpec(min_hits=1, iou=0.5))
    tracker.update([Detection(box(0, 0, 30), 0.9, "a")])
    # offset 10 of a 30 box: IoU 20/40 = 0.5 matches; offset 11: 19/41 < 0.5 does not
    assert [o.track_id for o in tracker.update([Detection(box(10, 0, 30), 0.9, "a")])] == [1]
    tracker = Tracker(TrackerSpec(min_hits=1, iou=0.5))
    tracker.update([Detection(box(0, 0, 30), 0.9, "a")])
    assert sorted(o.track_id for o in tracker.update([Detection(box(11, 0, 30), 0.9, "a")])) == [1, 2]
