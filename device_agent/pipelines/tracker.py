"""A ByteTrack-style IoU tracker: detections in, objects with ids that stay with them out.

Why this shape (after ByteTrack, Zhang et al. 2022): a detector's score dips when an object is
partly hidden, and dropping those low-score boxes breaks the object's track, so the next good box
starts a new id and every line crossing is counted again (the id switches users of DeepStream's
analytics report). So the match runs twice: tracks against confident detections first, then the
tracks still unmatched against the low-score ones, which only continue tracks and never start
one. Each track's box is predicted forward by its smoothed velocity before matching, so objects
that move several box widths between frames, or pass each other, keep their ids. A track is
reported only once confirmed (``min_hits`` matches) and forgotten after ``max_age`` frames
without one. Matching is greedy by IoU, same label only; pure (numpy, no I/O, no clock).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from device_agent.pipelines.spec import TrackerSpec
from edgepack_core.postprocess import box_iou

# Weight of the newest displacement in a track's velocity (an exponential moving average).
VELOCITY_SMOOTHING = 0.5


@dataclass(frozen=True)
class Detection:
    """One box of a frame, in the frame's pixels (x1, y1, x2, y2)."""

    box: tuple[float, float, float, float]
    score: float
    label: str


@dataclass(frozen=True)
class TrackedObject:
    """A confirmed track as the rules see it after a frame."""

    track_id: int
    box: tuple[float, float, float, float]
    score: float
    label: str
    age: int  # frames since the track started
    missed: int  # frames since its last match (0: matched in this frame)


@dataclass
class _Track:
    track_id: int
    box: np.ndarray
    score: float
    label: str
    velocity: np.ndarray = field(default_factory=lambda: np.zeros(4))
    hits: int = 1
    age: int = 0
    missed: int = 0

    def predicted(self) -> np.ndarray:
        return self.box + self.velocity * (self.missed + 1)

    def update(self, detection: Detection) -> None:
        new = np.asarray(detection.box, dtype=np.float64)
        step = (new - self.box) / (self.missed + 1)
        self.velocity = VELOCITY_SMOOTHING * step + (1 - VELOCITY_SMOOTHING) * self.velocity
        self.box, self.score, self.hits, self.missed = new, detection.score, self.hits + 1, 0


def greedy_match(tracks: Sequence[_Track], detections: Sequence[Detection], threshold: float
                 ) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Pairs (track index, detection index) by IoU of predicted box and detection, best first,
    same label only, IoU at least ``threshold``; then the unmatched track and detection indices."""
    pairs: list[tuple[float, int, int]] = []
    if tracks and detections:
        boxes = np.asarray([d.box for d in detections], dtype=np.float64)
        for t_index, track in enumerate(tracks):
            ious = box_iou(track.predicted(), boxes)
            pairs.extend((float(ious[d_index]), t_index, d_index) for d_index in range(len(detections))
                         if ious[d_index] >= threshold and detections[d_index].label == track.label)
    pairs.sort(key=lambda item: (-item[0], item[1], item[2]))
    used_t: set[int] = set()
    used_d: set[int] = set()
    matches: list[tuple[int, int]] = []
    for _, t_index, d_index in pairs:
        if t_index not in used_t and d_index not in used_d:
            matches.append((t_index, d_index))
            used_t.add(t_index)
            used_d.add(d_index)
    return (matches, [i for i in range(len(tracks)) if i not in used_t],
            [i for i in range(len(detections)) if i not in used_d])


class Tracker:
    """Tracks one stream's objects; :meth:`update` once per frame, in order."""

    def __init__(self, spec: TrackerSpec) -> None:
        self.spec = spec
        self._tracks: list[_Track] = []
        self._next_id = 1

    def update(self, detections: Sequence[Detection]) -> list[TrackedObject]:
        """Match this frame's detections; the confirmed tracks after it (matched or coasting)."""
        high = [d for d in detections if d.score >= self.spec.high]
        low = [d for d in detections if self.spec.low <= d.score < self.spec.high]
        for track in self._tracks:
            track.age += 1
        matches, left, new = greedy_match(self._tracks, high, self.spec.iou)
        for t_index, d_index in matches:
            self._tracks[t_index].update(high[d_index])
        remaining = [self._tracks[i] for i in left]
        second, unmatched, _ = greedy_match(remaining, low, self.spec.iou)
        for t_index, d_index in second:
            remaining[t_index].update(low[d_index])
        for t_index in unmatched:
            remaining[t_index].missed += 1
        self._tracks = [t for t in self._tracks if t.missed <= self.spec.max_age]
        for d_index in new:
            self._start(high[d_index])
        return self.confirmed()

    def _start(self, detection: Detection) -> None:
        self._tracks.append(_Track(self._next_id, np.asarray(detection.box, dtype=np.float64), detection.score,
                                   detection.label))
        self._next_id += 1

    def confirmed(self) -> list[TrackedObject]:
        return [TrackedObject(t.track_id, (float(t.box[0]), float(t.box[1]), float(t.box[2]), float(t.box[3])),
                              t.score, t.label, t.age, t.missed)
                for t in self._tracks if t.hits >= self.spec.min_hits]

    def live_ids(self) -> frozenset[int]:
        """Ids of every track still held (confirmed or not): the rules forget the others."""
        return frozenset(t.track_id for t in self._tracks)
