"""One pipeline running: frames from its source's reader through its stages, tracker and rules
to its sinks, on its own thread.

The reader decodes on its thread (PyAV releases the GIL) and each stage runs on a thread of its
own (onnxruntime and Pillow release it too), frames handed on in order through small bounded
queues, so a stream's rate approaches 1 / its slowest stage, not 1 / their sum; the last
stage's thread runs the tracker, the rules and the sinks, in frame order. Each stage asks for
its model's service by name at every frame (``services``), so a model hot-swapped under a
running pipeline answers the next frame, with no failed frame and no restart of the source; a
stage whose model is missing or fails skips that frame, counted, and the pipeline goes on.
Detections become tracked objects (:mod:`.tracker`), the rules' events (:mod:`.rules`) become
typed :class:`~edgepack_core.protocol.events.Event`\\ s numbered per pipeline, and every sink
gets each event. Each stage's work on a frame (not its wait for the frame) and each frame's whole
way from the reader to the sinks are timed into fixed-bucket histograms (:mod:`.latency`).
"""

from __future__ import annotations

import io
import logging
import queue
import threading
import time
import wave
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_agent.errors import RequestError
from device_agent.pipelines.frames import FrameQueue, SourceFrame
from device_agent.pipelines.latency import LatencyRecorder
from device_agent.pipelines.rules import Frame, RuleEngine, RuleEvent, Seen, typed_rules
from device_agent.pipelines.sinks import Sink
from device_agent.pipelines.sources import SourceReader, SourceStatus
from device_agent.pipelines.spec import CropSpec, PipelineSpec, StageSpec
from device_agent.pipelines.tracker import Detection, Tracker
from device_agent.prediction import Array, Audio, PredictRequest
from edgepack_core.protocol.events import Event, EventKind, LineCount
from edgepack_core.protocol.payloads import EVENTS_SCHEMA_ID

log = logging.getLogger(__name__)

GET_TIMEOUT_S = 0.5
HANDOFF = 2  # frames waiting between two stages' threads (backpressure beyond)
AGE_SAMPLES = 10_000  # frame ages kept (how old a frame is when its inference starts): p50/p99


@dataclass
class PipelineCounters:
    frames: int = 0
    events: int = 0
    stage_errors: int = 0
    missing_model: int = 0
    by_kind: dict[tuple[str, str], int] = field(default_factory=dict)  # (rule, kind): /metrics, telemetry
    last_age_s: float = 0.0
    ages_s: deque[float] = field(default_factory=lambda: deque(maxlen=AGE_SAMPLES))  # the newest frames' ages


@dataclass
class _InFlight:
    """A frame on its way through the stages: what each stage found, or that one failed."""

    frame: SourceFrame
    by_stage: dict[str, list[Found]] = field(default_factory=dict)
    failed: bool = False


@dataclass(frozen=True)
class Found:
    """One object a stage found in a frame: its box in the frame's pixels, score and label,
    and what the crop stages said of it (stage name -> label)."""

    box: tuple[float, float, float, float]
    score: float
    label: str
    attributes: tuple[tuple[str, str], ...] = ()


def found_in(result: Any, width: int, height: int) -> list[Found]:
    """A stage's task result as objects: detections as they are; a classification (top-k or
    softmax rows) as its best label over the whole frame; an audio model's answer to each of a
    block's frames (a list per frame) as one object per frame, its best label (pure)."""
    if not isinstance(result, list) or not result:
        return []
    first = result[0]
    if isinstance(first, list):
        return [found for row in result for found in found_in(row, width, height)[:1]]
    if isinstance(first, dict) and "box" in first:
        return [Found(_box(d["box"]), float(d["score"]), str(d.get("label") or d["index"])) for d in result]
    if isinstance(first, dict) and "score" in first:
        best = max(result, key=lambda d: d["score"])
        return [Found((0.0, 0.0, float(width), float(height)), float(best["score"]),
                      str(best.get("label") or best["index"]))]
    return []


def _box(values: Sequence[Any]) -> tuple[float, float, float, float]:
    return float(values[0]), float(values[1]), float(values[2]), float(values[3])


def crop_boxes(objects: Sequence[Found], crop: CropSpec, width: int, height: int) -> list[tuple[int, Found]]:
    """Which objects a crop stage runs on, best scores first, at most ``crop.max`` (pure):
    (index into ``objects``, the object with its box grown by ``pad`` and clipped to the frame)."""
    chosen = [(i, o) for i, o in enumerate(objects)
              if (not crop.classes or o.label in crop.classes) and o.score >= crop.min_score]
    chosen.sort(key=lambda item: -item[1].score)
    out = []
    for index, obj in chosen[:crop.max]:
        x1, y1, x2, y2 = obj.box
        pad_x, pad_y = (x2 - x1) * crop.pad, (y2 - y1) * crop.pad
        box = (max(0.0, x1 - pad_x), max(0.0, y1 - pad_y),
               min(float(width), x2 + pad_x), min(float(height), y2 + pad_y))
        if box[2] - box[0] >= 1 and box[3] - box[1] >= 1:
            out.append((index, Found(box, obj.score, obj.label)))
    return out


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes((np.clip(samples, -1.0, 1.0) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


class PipelineRunner:
    """Runs ``spec``; ``services(name)`` gives a model's current service (None: not installed),
    ``frames`` replaces the reader's decoding (tests), ``clock`` stamps live frames."""

    def __init__(self, spec: PipelineSpec, device_id: str, services: Callable[[str], Any], sinks: Sequence[Sink],
                 *, reader: SourceReader | None = None) -> None:
        self.spec, self.device_id, self._services, self.sinks = spec, device_id, services, list(sinks)
        self.queue = reader.queue if reader is not None else FrameQueue(spec.source.queue, spec.source.policy)
        self.reader = reader if reader is not None or spec.source.kind == "push" else \
            SourceReader(spec.source, self.queue, on_status=self._source_changed)
        self.tracker = Tracker(spec.tracker) if spec.tracker is not None else None
        self.engine = RuleEngine(typed_rules(spec.rules))
        self.counters = PipelineCounters()
        self.latency = LatencyRecorder(tuple((stage.stage_name, stage.model) for stage in spec.stages))
        self._tracked_stage = self._pick_tracked_stage()
        self._seq = 0
        self._attributes: dict[int, tuple[tuple[str, str], ...]] = {}
        self._lock = threading.Lock()
        self._pushed = 0
        count = len(spec.stages)
        self._handoffs: list[queue.Queue[_InFlight | None]] = [queue.Queue(HANDOFF) for _ in range(count - 1)]
        self._threads = [threading.Thread(target=self._stage_loop, args=(k,), name=f"pipeline-{spec.name}-{k}",
                                          daemon=True) for k in range(count)]
        self.finished = threading.Event()

    def _pick_tracked_stage(self) -> str:
        wanted = self.spec.tracker.stage if self.spec.tracker is not None else None
        return wanted or self.spec.stages[0].stage_name

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        if self.reader is not None:
            self.reader.start()
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self.reader is not None:
            self.reader.stop(timeout)
        self.queue.close()
        for thread in self._threads:
            thread.join(timeout)
        for sink in self.sinks:
            sink.close()

    def push(self, image: np.ndarray, ts: float | None = None) -> bool:
        """Hand a frame to a ``push: true`` pipeline (False once stopped)."""
        frame = SourceFrame(self._pushed, time.time() if ts is None else ts, image=image, read_at=time.monotonic())
        self._pushed += 1
        return self.queue.put(frame)

    def _stage_loop(self, k: int) -> None:
        """Stage ``k``'s thread: items in frame order from the source (k = 0) or the stage
        before, out to the next stage or, for the last, to the tracker, rules and sinks."""
        last = k == len(self.spec.stages) - 1
        try:
            while (item := self._next_item(k)) is not None:
                self._stage_step(k, item)
                if last:
                    self._finish(item)
                else:
                    self._handoffs[k].put(item)
        finally:
            if not last:
                self._handoffs[k].put(None)
            else:
                self.finished.set()

    def _next_item(self, k: int) -> _InFlight | None:
        if k > 0:
            return self._handoffs[k - 1].get()
        while True:
            frame = self.queue.get(GET_TIMEOUT_S)
            if frame is not None:
                return _InFlight(frame)
            if self.queue.closed:
                return None

    # ---------------------------------------------------------------- one frame

    def process(self, frame: SourceFrame) -> list[Event]:
        """Run one frame through every stage, the tracker, the rules and the sinks on the
        caller's thread; its events."""
        item = _InFlight(frame)
        for k in range(len(self.spec.stages)):
            self._stage_step(k, item)
        return self._finish(item)

    @staticmethod
    def _size(frame: SourceFrame) -> tuple[int, int]:
        if frame.image is not None:
            return int(frame.image.shape[0]), int(frame.image.shape[1])
        return 1, 1

    def _stage_step(self, k: int, item: _InFlight) -> None:
        """Run stage ``k`` on ``item``, unless an earlier stage failed on it; a missing model or a
        failing one marks the frame skipped (counted), never the pipeline."""
        if k == 0:
            age = time.monotonic() - item.frame.read_at if item.frame.read_at else 0.0
            self.counters.last_age_s = age
            self.counters.ages_s.append(age)
        if item.failed:
            return
        stage = self.spec.stages[k]
        service = self._services(stage.model)
        if service is None:
            self.counters.missing_model += 1
            item.failed = True
            return
        started = time.perf_counter()
        try:
            item.by_stage[stage.stage_name] = self._run_stage(stage, service, item.frame, item.by_stage)
        except RequestError as err:
            self.counters.stage_errors += 1
            item.failed = True
            log.warning("pipeline %s: stage %s failed on frame %d: %s", self.spec.name, stage.stage_name,
                        item.frame.index, err)
            return
        self.latency.by_stage[stage.stage_name].record(time.perf_counter() - started)

    def _finish(self, item: _InFlight) -> list[Event]:
        """The tracker, the rules and the sinks, in frame order (the last stage's thread)."""
        self.counters.frames += 1
        if item.failed:
            return []
        frame = item.frame
        height, width = self._size(frame)
        objects, live = self._track(item.by_stage.get(self._tracked_stage, []), width, height)
        rule_events = self.engine.step(Frame(frame.index, frame.ts, objects, live))
        events = [self._publish(e, frame, objects) for e in rule_events]
        if frame.read_at:  # from the reader's hand-over (or a push) to the sinks done
            self.latency.end_to_end.record(time.monotonic() - frame.read_at)
        return events

    def _run_stage(self, stage: StageSpec, service: Any, frame: SourceFrame,
                   by_stage: dict[str, list[Found]]) -> list[Found]:
        height, width = self._size(frame)
        if stage.crop is None:
            if frame.image is not None:
                request = PredictRequest(Array(frame.image))
            else:
                audio = frame.audio if frame.audio is not None else np.zeros(0, np.float32)
                request = PredictRequest(Audio(wav_bytes(audio, frame.sample_rate)), stream=self.spec.name)
            return found_in(service.predict(request).result, width, height)
        source = by_stage[stage.crop.source]
        chosen = crop_boxes(source, stage.crop, width, height)
        if not chosen or frame.image is None:
            return []
        crops = [frame.image[int(b.box[1]):int(np.ceil(b.box[3])), int(b.box[0]):int(np.ceil(b.box[2]))]
                 for _, b in chosen]
        results = service.predict_batch(crops)
        labelled = []
        for (index, _), result in zip(chosen, results, strict=True):
            best = found_in(result.result, 1, 1)
            if best:
                obj = source[index]
                said = (*obj.attributes, (stage.stage_name, best[0].label))
                source[index] = Found(obj.box, obj.score, obj.label, said)
                labelled.append(best[0])
        return labelled

    def _track(self, found: list[Found], width: int, height: int) -> tuple[list[Seen], frozenset[int] | None]:
        def seen(track: int | None, box: Sequence[float], score: float, label: str) -> Seen:
            return Seen(track, (box[0] / width, box[1] / height, box[2] / width, box[3] / height), score, label)

        if self.tracker is None:
            return [seen(None, f.box, f.score, f.label) for f in found], None
        tracked = self.tracker.update([Detection(f.box, f.score, f.label) for f in found])
        self._attributes = {o.track_id: self._attributes_of(o.box, found) for o in tracked if o.missed == 0}
        return [seen(o.track_id, o.box, o.score, o.label) for o in tracked if o.missed == 0], self.tracker.live_ids()

    @staticmethod
    def _attributes_of(box: Sequence[float], found: list[Found]) -> tuple[tuple[str, str], ...]:
        for f in found:
            if tuple(f.box) == tuple(box):
                return f.attributes
        return ()

    # ---------------------------------------------------------------- events out

    def _next_seq(self) -> int:
        """The pipeline's next event number (rule events and source events share the sequence)."""
        with self._lock:
            seq = self._seq
            self._seq += 1
        return seq

    def _emit(self, event: Event, image: np.ndarray | None, boxes: Sequence[Sequence[float]]) -> Event:
        """``event`` through every sink in order (a snapshot sink names its file in the event)."""
        for sink in self.sinks:
            event = sink.emit(event, image, boxes)
        return event

    def _publish(self, rule_event: RuleEvent, frame: SourceFrame, objects: Sequence[Seen]) -> Event:
        height, width = self._size(frame)
        boxes = [(s.box[0] * width, s.box[1] * height, s.box[2] * width, s.box[3] * height) for s in objects]
        event = self._emit(self._event(rule_event, self._next_seq()), frame.image, boxes)
        self.counters.events += 1
        key = (rule_event.rule, rule_event.kind)
        self.counters.by_kind[key] = self.counters.by_kind.get(key, 0) + 1
        return event

    def _event(self, e: RuleEvent, seq: int) -> Event:
        counts = None if e.counts is None else {label: LineCount(i, o) for label, i, o in e.counts}
        return Event(schema=EVENTS_SCHEMA_ID, device=self.device_id, pipeline=self.spec.name, rule=e.rule,
                     kind=e.kind, seq=seq, ts=max(0.0, e.ts), frame=e.frame, track=e.track, label=e.label,
                     score=None if e.score is None else min(1.0, max(0.0, e.score)),
                     box=None if e.box is None else tuple(min(1.0, max(0.0, v)) for v in e.box),
                     direction=e.direction, count=e.count, dwell_s=e.dwell_s, counts=counts,  # type: ignore[arg-type]
                     attributes=dict(self._attributes.get(e.track, ())) or None if e.track is not None else None)

    def _source_changed(self, status: SourceStatus) -> None:
        kind: EventKind = "source_up" if status.state == "up" else "source_down"
        self._emit(Event(schema=EVENTS_SCHEMA_ID, device=self.device_id, pipeline=self.spec.name, rule="", kind=kind,
                         seq=self._next_seq(), ts=time.time(), frame=0, detail=status.detail[:512] or None), None, ())
