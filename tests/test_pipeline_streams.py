"""Pipelines on real parts: an H.264 clip of moving squares decoded by PyAV, a real packaged
detector on onnxruntime, the tracker and rules, real sinks. The expected events are computed
from the squares' paths alone, so every crossing and zone visit is known exactly."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from PIL import Image

from device_agent.pipelines.frames import FrameQueue, SourceFrame
from device_agent.pipelines.rules import LINE_BAND, inside
from device_agent.pipelines.runner import PipelineRunner
from device_agent.pipelines.sinks import FileSink, make_sinks
from device_agent.pipelines.sources import SourceReader, SourceStatus
from device_agent.pipelines.spec import parse_pipelines
from device_agent.runtime import InferenceService, load_model
from edgepack_core.artifact import extract_artifact
from edgepack_core.signing import TrustStore
from sdk.packager.pipeline import build
from sdk.recipe import load_recipe
from tests.stream_models import Path2D, classifier_recipe, detector_recipe, draw, moving_squares_clip

WIDTH, HEIGHT, FRAMES, FPS = 320, 240, 60, 10
PATHS = (
    Path2D("person", (10, 100), (6, 0)),       # crosses the line at x=160 going right, through the zone
    Path2D("car", (300, 40), (-5, 0.5)),       # crosses going left
    Path2D("bicycle", (40, 190), (1, 0)),      # never reaches the line
)
LINE_X = 0.5
ZONE = ((0.25, 0.25), (0.75, 0.25), (0.75, 0.75), (0.25, 0.75))


def expected_events(paths: tuple[Path2D, ...] = PATHS, frames: int = FRAMES, min_hits: int = 3) -> list[tuple]:
    """(frame, rule, kind, label, direction) from the paths: a crossing when the centre has been
    LINE_BAND past the line on one side (from the min_hits-th frame on) and gets LINE_BAND past
    it on the other; a zone enter/leave when the centre goes in/out (first seen inside: enter)."""
    out: list[tuple] = []
    for path in paths:
        side, was_inside = None, False
        for t in range(min_hits - 1, frames):
            x, y = path.center(t)
            fx, fy = x / WIDTH, y / HEIGHT
            now_inside = inside((fx, fy), ZONE)
            if now_inside != was_inside:
                out.append((t, "hall", "enter" if now_inside else "leave", path.label, None))
                was_inside = now_inside
            distance = fx - LINE_X
            if abs(distance) >= LINE_BAND:
                new_side = 1 if distance > 0 else -1
                if side is not None and new_side != side:
                    # the line runs top to bottom: "in" is clockwise of its direction, to screen-left
                    out.append((t, "gate", "cross", path.label, "in" if new_side < 0 else "out"))
                side = new_side
    return sorted(out)


PIPELINE = {
    "name": "door-cam",
    "source": {"file": "CLIP", "policy": "every"},
    "stages": [{"model": "detector"}],
    "tracker": {"min_hits": 3},
    "rules": [
        {"zone": "hall", "polygon": [list(p) for p in ZONE]},
        {"line": "gate", "points": [[LINE_X, 0.0], [LINE_X, 1.0]]},
    ],
}


@pytest.fixture(scope="module")
def scene(tmp_path_factory, keypair) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("scene")
    recipe = detector_recipe(folder / "build")
    (folder / "build" / "val").mkdir()
    for index in range(0, FRAMES, 6):
        Image.fromarray(draw(PATHS, index, WIDTH, HEIGHT)).save(folder / "build" / "val" / f"f{index:03d}.png")
    artifact = folder / "detector.edgepkg"
    build(load_recipe(recipe), key_paths=[str(keypair[0])], output=artifact)
    colour_recipe = classifier_recipe(folder / "build")
    build(load_recipe(colour_recipe), key_paths=[str(keypair[0])], output=folder / "colour.edgepkg")
    colour = extract_artifact(folder / "colour.edgepkg", folder / "colour", TrustStore.from_paths([keypair[1]]))
    clip = moving_squares_clip(folder / "clip.mp4", PATHS, FRAMES, width=WIDTH, height=HEIGHT, fps=FPS)
    verified = extract_artifact(artifact, folder / "model", TrustStore.from_paths([keypair[1]]))
    return {"folder": folder, "artifact": artifact, "clip": clip, "verified": verified, "colour": colour}


def service_of(scene: dict[str, Any]) -> InferenceService:
    verified = scene["verified"]
    return InferenceService(load_model(verified.root, verified.manifest))


def spec(clip: Path, **source: Any) -> Any:
    document = json.loads(json.dumps(PIPELINE).replace("CLIP", str(clip)))
    document["source"].update(source)
    (parsed,) = parse_pipelines([document])
    return parsed


def as_tuples(events: list[dict]) -> list[tuple]:
    return sorted((e["frame"], e["rule"], e["kind"], e.get("label"), e.get("direction")) for e in events
                  if e["kind"] in ("cross", "enter", "leave"))


def run_to_end(runner: PipelineRunner) -> None:
    runner.start()
    assert runner.finished.wait(60), "the pipeline did not finish the clip"
    runner.stop()


def test_the_golden_clip_gives_exactly_the_events_of_its_paths(scene, tmp_path):
    expected = expected_events()
    assert {e[2] for e in expected} == {"cross", "enter", "leave"}
    assert len([e for e in expected if e[2] == "cross"]) == 2
    service = service_of(scene)
    sink = FileSink(tmp_path / "events.jsonl", 1 << 20, 2)
    runner = PipelineRunner(spec(scene["clip"]), "pi-07", lambda name: service, [sink])
    run_to_end(runner)
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert as_tuples(lines) == expected
    assert [e["seq"] for e in lines] == list(range(len(lines)))
    crossings = [e for e in lines if e["kind"] == "cross"]
    assert crossings[-1]["counts"] == {"person": {"in": 0, "out": 1}, "car": {"in": 1, "out": 0}}
    assert runner.counters.frames == FRAMES and runner.queue.dropped == 0


class HeldService:
    """The detector's service, holding its first answer until ``release`` is set."""

    def __init__(self, service: InferenceService, release: threading.Event) -> None:
        self.service, self.release = service, release

    def predict(self, request: Any) -> Any:
        self.release.wait(30)
        return self.service.predict(request)


@pytest.mark.parametrize("policy", ["every", "latest"])
def test_every_drops_nothing_and_latest_drops_the_oldest_counting_each(scene, policy: str):
    """The consumer holds the first frame until the reader has read the whole clip: under
    `every` the reader waits (nothing dropped); under `latest` only the newest `queue` frames
    are left and every other one is counted as dropped."""
    release = threading.Event()
    held = HeldService(service_of(scene), release)
    runner = PipelineRunner(spec(scene["clip"], policy=policy, queue=2), "pi-07", lambda name: held, [])
    processed: list[int] = []
    finish = runner._finish

    def counting(item: Any) -> list:
        processed.append(item.frame.index)
        return finish(item)

    runner._finish = counting  # type: ignore[method-assign]
    runner.start()
    if policy == "latest":
        reader = runner.reader._thread  # type: ignore[union-attr]
        reader.join(30)
        assert not reader.is_alive()
    release.set()
    assert runner.finished.wait(60)
    runner.stop()
    if policy == "every":
        assert processed == list(range(FRAMES)) and runner.queue.dropped == 0
    else:
        assert processed == [0, FRAMES - 2, FRAMES - 1]
        assert runner.queue.dropped == FRAMES - 3 == runner.queue.put_count - 2 - 1


def test_a_failing_source_is_reported_and_retried_and_does_not_stop_another(scene, tmp_path):
    statuses: list[SourceStatus] = []
    retried = threading.Event()

    def on_status(status: SourceStatus) -> None:
        statuses.append(SourceStatus(status.state, status.detail, status.frames, status.reconnects))
        if status.reconnects >= 2:
            retried.set()

    broken = parse_pipelines([{**PIPELINE, "name": "broken",
                               "source": {"url": "rtsp://127.0.0.1:9/none", "reconnect_s": 0.01,
                                          "reconnect_max_s": 0.02}}])[0]
    queue = FrameQueue(2, "latest")
    reader = SourceReader(broken.source, queue, on_status=on_status)
    service = service_of(scene)
    good = PipelineRunner(spec(scene["clip"]), "pi-07", lambda name: service,
                          [FileSink(tmp_path / "good.jsonl", 1 << 20, 2)])
    reader.start()
    run_to_end(good)
    assert retried.wait(30), statuses
    reader.stop()
    assert statuses[0].state == "down" and statuses[0].detail
    assert as_tuples([json.loads(x) for x in (tmp_path / "good.jsonl").read_text().splitlines()]) == expected_events()


def test_a_model_swapped_under_a_running_pipeline_fails_no_frame_and_double_counts_nothing(scene, tmp_path):
    """Frames pushed one by one; half way the detector's service swaps to a freshly loaded copy
    (what an update's hot swap does): no stage error, the crossings equal the paths'."""
    service = service_of(scene)
    verified = scene["verified"]
    document = {**PIPELINE, "source": {"push": True, "policy": "every", "queue": 4}}
    (push_spec,) = parse_pipelines([document])
    sink = FileSink(tmp_path / "swap.jsonl", 1 << 20, 2)
    runner = PipelineRunner(push_spec, "pi-07", lambda name: service, [sink])
    runner.start()
    for index in range(FRAMES):
        if index == FRAMES // 2:
            service.swap(load_model(verified.root, verified.manifest))
        assert runner.push(draw(PATHS, index, WIDTH, HEIGHT), ts=index / FPS)
    runner.queue.close()
    assert runner.finished.wait(60)
    runner.stop()
    lines = [json.loads(line) for line in (tmp_path / "swap.jsonl").read_text().splitlines()]
    assert runner.counters.stage_errors == 0 and runner.counters.frames == FRAMES
    assert as_tuples(lines) == expected_events()


def test_a_chain_labels_each_tracked_object_with_its_crop_and_a_crop_model_swaps_alone(scene, tmp_path):
    """Detector -> colour classifier on each box's crop, each stage on its own thread: every
    crossing carries the colour its square is painted; the classifier's model is swapped alone
    half way, with no failed frame and the same events."""
    detector, classifier = service_of(scene), InferenceService(load_model(scene["colour"].root,
                                                                          scene["colour"].manifest))
    services = {"detector": detector, "colour": classifier}
    document = {**PIPELINE, "source": {"push": True, "policy": "every", "queue": 4},
                "stages": [{"model": "detector"}, {"model": "colour", "crop": {"from": "detector", "max": 8}}]}
    (chain,) = parse_pipelines([document])
    runner = PipelineRunner(chain, "pi-07", services.get, [FileSink(tmp_path / "chain.jsonl", 1 << 20, 2)])
    runner.start()
    for index in range(FRAMES):
        if index == FRAMES // 2:
            classifier.swap(load_model(scene["colour"].root, scene["colour"].manifest))
        runner.push(draw(PATHS, index, WIDTH, HEIGHT), ts=index / FPS)
    runner.queue.close()
    assert runner.finished.wait(60)
    runner.stop()
    lines = [json.loads(line) for line in (tmp_path / "chain.jsonl").read_text().splitlines()]
    assert as_tuples(lines) == expected_events()
    painted = {"person": "red", "car": "green", "bicycle": "blue"}
    assert [e["attributes"] for e in lines if e["kind"] == "cross"] == \
        [{"colour": painted[e["label"]]} for e in lines if e["kind"] == "cross"]
    assert runner.counters.stage_errors == 0 and runner.counters.frames == FRAMES


def test_a_file_sink_rotates_and_keeps_its_files(tmp_path):
    from edgepack_core.protocol.events import Event
    from edgepack_core.protocol.payloads import EVENTS_SCHEMA_ID

    sink = FileSink(tmp_path / "e.jsonl", 4096, 2)
    event = Event(schema=EVENTS_SCHEMA_ID, device="pi-07", pipeline="p", rule="r", kind="enter", seq=0, ts=1.0,
                  frame=0, label="x" * 100)
    size = len(event.to_payload()) + 1
    for _ in range(3 * 4096 // size + 3):
        sink.emit(event, None, ())
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["e.jsonl", "e.jsonl.1", "e.jsonl.2"]
    assert all(p.stat().st_size <= 4096 for p in tmp_path.iterdir())


def test_sinks_are_made_snapshots_first_so_events_name_their_snapshot(tmp_path):
    (parsed,) = parse_pipelines([{**PIPELINE, "source": {"push": True},
                                  "sinks": [{"file": str(tmp_path / "e.jsonl")},
                                            {"snapshots": str(tmp_path / "snaps"), "keep": 2}]}])
    sinks = make_sinks(parsed.sinks, None)
    assert [s.name for s in sinks] == ["snapshots", "file"]
    from edgepack_core.protocol.events import Event
    from edgepack_core.protocol.payloads import EVENTS_SCHEMA_ID

    image = np.zeros((40, 60, 3), np.uint8)
    for seq in range(4):
        event = Event(schema=EVENTS_SCHEMA_ID, device="pi-07", pipeline="p", rule="r", kind="enter", seq=seq,
                      ts=1.0, frame=seq)
        for sink in sinks:
            event = sink.emit(event, image, [(1, 1, 20, 20)])
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["p-00000002-enter.jpg", "p-00000003-enter.jpg"]
    last = json.loads((tmp_path / "e.jsonl").read_text().splitlines()[-1])
    assert last["snapshot"] == "p-00000003-enter.jpg"


def test_a_source_frame_is_numbered_from_the_source(scene):
    queue = FrameQueue(256, "every")
    (parsed,) = parse_pipelines([{**PIPELINE, "source": {"file": str(scene["clip"]), "policy": "every",
                                                         "queue": 256, "max_fps": 5}}])
    reader = SourceReader(parsed.source, queue)
    reader.start()
    frames: list[SourceFrame] = []
    while (frame := queue.get(10)) is not None:
        frames.append(frame)
    assert [f.index for f in frames] == list(range(FRAMES // 2))  # max_fps 5 of a 10 FPS clip: every other
    assert [round(f.ts, 3) for f in frames[:3]] == [0.0, 0.2, 0.4]
    assert frames[0].image is not None and frames[0].image.shape == (HEIGHT, WIDTH, 3)


def test_the_pipeline_document_in_agent_yaml_round_trips(tmp_path, scene):
    from device_agent.config import load_config

    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"device_id": "pi-07", "store": str(tmp_path / "store"), "trust": ["k.pub"],
                                    "pipelines": [json.loads(json.dumps(PIPELINE).replace("CLIP", "c.mp4"))]}))
    config = load_config(path)
    assert config.pipelines[0].name == "door-cam" and config.pipelines[0].tracker is not None


def test_realtime_waits_for_each_frames_time_and_restarts_its_clock_when_the_stream_does(monkeypatch):
    (parsed,) = parse_pipelines([{**PIPELINE, "source": {"file": "clip.mp4", "realtime": True, "loop": True}}])
    reader = SourceReader(parsed.source, FrameQueue(2, "latest"))
    waits: list[float] = []

    class Stop:
        def wait(self, seconds: float) -> bool:
            waits.append(round(seconds, 6))
            return False

        def is_set(self) -> bool:
            return False

    monkeypatch.setattr("device_agent.pipelines.sources.time.monotonic", lambda: 100.0)
    reader._stop = Stop()  # type: ignore[assignment]
    assert [reader._pace(ts) for ts in (5.0, 5.1, 5.25, 0.0, 0.2)] == [True] * 5
    assert waits == [0.1, 0.25, 0.2]  # 5.0 starts the clock; the loop back to 0.0 starts it again
