"""Pipeline rules: zones, lines, counts and confidence bands, each rule's boundary pinned, and a
scene of moving objects with known paths whose events are computed independently."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from device_agent.pipelines.rules import (
    LINE_BAND,
    ConfidenceRule,
    CountRule,
    Frame,
    LineRule,
    RuleEngine,
    Seen,
    ZoneRule,
    crosses_segment,
    inside,
    signed_distance,
)
from device_agent.pipelines.spec import TrackerSpec
from device_agent.pipelines.tracker import Detection, Tracker

SQUARE = ((0.25, 0.25), (0.75, 0.25), (0.75, 0.75), (0.25, 0.75))


def at(x: float, y: float, track: int | None = 1, label: str = "person", score: float = 0.9,
       half: float = 0.02) -> Seen:
    """An object whose box is centred on (x, y)."""
    return Seen(track, (x - half, y - half, x + half, y + half), score, label)


def run(engine: RuleEngine, frames: list[list[Seen]], *, fps: float = 10.0, tracked: bool = True) -> list:
    events = []
    for index, objects in enumerate(frames):
        live = frozenset(s.track for s in objects if s.track is not None) if tracked else None
        events.extend(engine.step(Frame(index, index / fps, objects, live)))
    return events


# ---------------------------------------------------------------- geometry

def test_inside_owns_the_left_and_top_edges_and_not_the_right_and_bottom():
    assert inside((0.5, 0.5), SQUARE)
    assert inside((0.25, 0.5), SQUARE) and inside((0.5, 0.25), SQUARE)
    assert not inside((0.75, 0.5), SQUARE) and not inside((0.5, 0.75), SQUARE)
    assert not inside((0.1, 0.5), SQUARE)


def test_in_is_downward_for_a_line_drawn_left_to_right():
    assert signed_distance((0.5, 0.6), (0.0, 0.5), (1.0, 0.5)) == pytest.approx(0.1)
    assert signed_distance((0.5, 0.4), (0.0, 0.5), (1.0, 0.5)) == pytest.approx(-0.1)


def test_a_move_past_the_end_of_a_segment_does_not_cross_it():
    line = ((0.5, 0.2), (0.5, 0.4))
    assert crosses_segment((0.4, 0.3), (0.6, 0.3), *line)
    assert crosses_segment((0.4, 0.4), (0.6, 0.4), *line)  # through its end point: crosses
    assert not crosses_segment((0.4, 0.41), (0.6, 0.41), *line)


# ---------------------------------------------------------------- lines

LINE = LineRule("gate", (0.5, 0.0), (0.5, 1.0), frozenset(), "center", "both")


def test_an_object_walking_across_a_line_is_counted_once_with_its_direction():
    path = [[at(0.3 + 0.05 * step, 0.5)] for step in range(9)]  # x from 0.30 to 0.70
    events = run(RuleEngine([LINE]), path)
    assert [(e.kind, e.direction, e.track, e.frame) for e in events] == [("cross", "out", 1, 5)]
    assert events[0].counts == (("person", 0, 1),)


def test_jitter_on_the_line_is_never_counted():
    wobble = [[at(0.5 + 0.9 * LINE_BAND * math.sin(step), 0.5)] for step in range(200)]
    assert run(RuleEngine([LINE]), wobble) == []


@pytest.mark.parametrize(("offset", "counted"), [(LINE_BAND, True), (LINE_BAND * 0.99, False)])
def test_the_band_around_a_line_is_left_by_at_least_line_band(offset: float, counted: bool):
    frames = [[at(0.5 - offset, 0.5)], [at(0.5 + offset, 0.5)]]
    assert bool(run(RuleEngine([LINE]), frames)) is counted


def test_a_crossing_back_and_forth_counts_both_ways_and_keeps_per_label_totals():
    engine = RuleEngine([LINE])
    frames = [[at(0.4, 0.5), at(0.4, 0.2, track=2, label="car")],
              [at(0.6, 0.5), at(0.6, 0.2, track=2, label="car")],
              [at(0.4, 0.5), at(0.6, 0.2, track=2, label="car")]]
    events = run(engine, frames)
    assert [(e.label, e.direction) for e in events] == [("person", "out"), ("car", "out"), ("person", "in")]
    assert engine.line_totals() == {"gate": {"person": (1, 1), "car": (0, 1)}}


def test_a_direction_filter_drops_the_other_way_but_still_counts_it():
    engine = RuleEngine([LineRule("gate", (0.5, 0.0), (0.5, 1.0), frozenset(), "center", "in")])
    events = run(engine, [[at(0.4, 0.5)], [at(0.6, 0.5)], [at(0.4, 0.5)]])
    assert [e.direction for e in events] == ["in"]
    assert engine.line_totals()["gate"]["person"] == (1, 1)


def test_a_new_track_id_on_the_far_side_is_not_a_crossing():
    """An id switch (the tracker lost the object and started again on the other side) must not
    double-count: a track's first position only sets its side."""
    frames = [[at(0.4, 0.5, track=1)], [at(0.6, 0.5, track=2)], [at(0.65, 0.5, track=2)]]
    assert run(RuleEngine([LINE]), frames) == []


def test_the_bottom_anchor_crosses_when_the_feet_do():
    line = LineRule("floor", (0.0, 0.5), (1.0, 0.5), frozenset(), "bottom", "both")
    # the centre stays above the line (y 0.47 -> 0.49) while the feet go from 0.48 to 0.52
    frames = [[Seen(1, (0.4, 0.46, 0.5, 0.48), 0.9, "person")], [Seen(1, (0.4, 0.46, 0.5, 0.52), 0.9, "person")]]
    assert [e.direction for e in run(RuleEngine([line]), frames)] == ["in"]


def test_a_line_ignores_classes_it_does_not_name():
    line = LineRule("gate", (0.5, 0.0), (0.5, 1.0), frozenset({"car"}), "center", "both")
    assert run(RuleEngine([line]), [[at(0.4, 0.5)], [at(0.6, 0.5)]]) == []


# ---------------------------------------------------------------- zones

def zone(dwell: float | None = None) -> ZoneRule:
    return ZoneRule("door", SQUARE, frozenset(), "center", dwell)


def test_a_zone_reports_enter_and_leave_with_the_time_inside():
    frames = [[at(0.1, 0.5)], [at(0.5, 0.5)], [at(0.6, 0.5)], [at(0.9, 0.5)]]
    events = run(RuleEngine([zone()]), frames, fps=10)
    assert [(e.kind, e.frame) for e in events] == [("enter", 1), ("leave", 3)]
    assert events[1].dwell_s == pytest.approx(0.2)


def test_an_object_first_seen_inside_enters():
    assert [e.kind for e in run(RuleEngine([zone()]), [[at(0.5, 0.5)]])] == ["enter"]


@pytest.mark.parametrize(("frames_inside", "dwells"), [(11, True), (10, False)])
def test_dwell_fires_once_at_dwell_s(frames_inside: int, dwells: bool):
    """At 10 frames/s, dwell_s 1.0 is reached at the 11th frame inside (1.0 s after the first)."""
    events = run(RuleEngine([zone(dwell=1.0)]), [[at(0.5, 0.5)]] * (frames_inside + 5 if dwells else frames_inside))
    assert [e.kind for e in events].count("dwell") == (1 if dwells else 0)


def test_a_track_lost_inside_a_zone_leaves_it():
    engine = RuleEngine([zone()])
    events = run(engine, [[at(0.5, 0.5)], [at(0.5, 0.5)], []])
    assert [(e.kind, e.track) for e in events] == [("enter", 1), ("leave", 1)]


# ---------------------------------------------------------------- counts and bands

def crowd(n: int) -> list[Seen]:
    return [at(0.3 + 0.01 * i, 0.5, track=i + 1) for i in range(n)]


def test_a_count_above_fires_once_when_it_rises_past_the_threshold_and_once_when_back():
    rule = CountRule("crowd", frozenset(), None, 2, None)
    events = run(RuleEngine([rule]), [crowd(2), crowd(3), crowd(4), crowd(3), crowd(2), crowd(2)])
    assert [(e.kind, e.count, e.frame) for e in events] == [("count_above", 3, 1), ("count_normal", 2, 4)]


def test_a_count_below_and_in_zone_counts_only_the_zones_occupants():
    rule = CountRule("few", frozenset(), zone(), None, 2)
    outside = [at(0.1, 0.1, track=9)]
    events = run(RuleEngine([zone(), rule]), [crowd(2) + outside, crowd(1) + outside])
    assert [(e.kind, e.count) for e in events if e.rule == "few"] == [("count_below", 1)]


def test_a_confidence_band_reports_each_track_once_and_includes_low_excludes_high():
    rule = ConfidenceRule("unsure", frozenset(), 0.3, 0.5)
    frames = [[at(0.2, 0.2, track=1, score=0.3), at(0.6, 0.6, track=2, score=0.5)]] * 3
    events = run(RuleEngine([rule]), frames)
    assert [(e.track, e.score) for e in events] == [(1, 0.3)]


def test_without_a_tracker_a_band_reports_the_best_detection_per_frame():
    rule = ConfidenceRule("unsure", frozenset(), 0.3, 0.5)
    frames = [[at(0.2, 0.2, track=None, score=0.35), at(0.6, 0.6, track=None, score=0.45)]] * 2
    events = run(RuleEngine([rule]), frames, tracked=False)
    assert [e.score for e in events] == [0.45, 0.45]


# ---------------------------------------------------------------- a scene with known paths

def test_a_scene_of_moving_objects_gives_exactly_the_crossings_of_their_paths():
    """Twelve objects on straight paths at different speeds and heights, some crossing a line,
    some turning back before it, detections jittered by a pixel and one frame in seven missed:
    through the real tracker, the events equal the crossings computed from the paths alone."""
    rng = np.random.default_rng(7)
    width, height, frames = 640, 480, 160
    paths = []
    for k in range(12):
        x0 = rng.uniform(40, 200) if k % 2 == 0 else rng.uniform(440, 600)
        speed = rng.uniform(2.0, 6.0) * (1 if k % 2 == 0 else -1)
        turn = frames if k % 3 else int(rng.integers(10, 30))  # every third turns back early
        paths.append((x0, 30.0 + 36.0 * k, speed, turn, "person" if k % 4 else "bicycle"))

    def x_at(path: tuple, t: int) -> float:
        x0, _, speed, turn, _ = path
        return x0 + speed * min(t, turn) - speed * max(0, t - turn)

    line = LineRule("gate", (0.5, 0.0), (0.5, 1.0), frozenset(), "center", "both")
    engine, tracker = RuleEngine([line]), Tracker(TrackerSpec(min_hits=2))
    expected: list[tuple[str, str]] = []
    for path in paths:
        sides = [x_at(path, t) + 15 > width / 2 for t in range(frames)]  # box centre right of the line
        expected += [(path[4], "in" if now else "out") for before, now in itertools.pairwise(sides)
                     if before != now]
    seen_events = []
    for t in range(frames):
        detections = [Detection((x_at(p, t) + j, p[1] + j, x_at(p, t) + 30 + j, p[1] + 30 + j), 0.9, p[4])
                      for p in paths if (t + int(p[1])) % 7 for j in [float(rng.uniform(-1, 1))]]
        objects = [Seen(o.track_id, (o.box[0] / width, o.box[1] / height, o.box[2] / width, o.box[3] / height),
                        o.score, o.label) for o in tracker.update(detections) if o.missed == 0]
        seen_events += engine.step(Frame(t, t / 30, objects, tracker.live_ids()))
    # "in" is clockwise of the line's direction (downward line: in is to screen-left)
    got = sorted((e.label, e.direction) for e in seen_events)
    flipped = sorted((label, "out" if d == "in" else "in") for label, d in expected)
    assert got == flipped and len(got) >= 6, (got, flipped)
