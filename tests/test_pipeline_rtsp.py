"""Pipelines on a real RTSP camera: GStreamer's rtsp-server on loopback (tools/rtsp_server.py)
serving an H.264 clip, read by PyAV over TCP and UDP; the camera stopped and restarted, and
connections cut a thousand times through a proxy."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from device_agent.pipelines.frames import FrameQueue
from device_agent.pipelines.runner import PipelineRunner
from device_agent.pipelines.sinks import SinkCounters
from device_agent.pipelines.sources import SourceReader, SourceStatus
from device_agent.pipelines.spec import parse_pipelines
from device_agent.runtime import InferenceService, load_model
from tests.rtsp import CuttingProxy, RtspCamera, require_rtsp_server
from tests.stream_models import Path2D, moving_squares_clip
from tests.test_pipeline_streams import FPS, FRAMES, HEIGHT, PATHS, PIPELINE, WIDTH, expected_events, scene  # noqa: F401

LONG = (Path2D("person", (0, 100), (1, 0)),)  # a slow square, for a camera that keeps streaming
CYCLES = int(os.environ.get("EDGEPACK_RTSP_CYCLES", "1000"))


@pytest.fixture(autouse=True)
def _camera_parts() -> None:
    require_rtsp_server()


class Watch:
    """The reader's reports, and events to wait on."""

    def __init__(self) -> None:
        self.reports: list[SourceStatus] = []
        self.changed = threading.Condition()

    def __call__(self, status: SourceStatus) -> None:
        with self.changed:
            self.reports.append(SourceStatus(status.state, status.detail, status.frames, status.reconnects))
            self.changed.notify_all()

    def wait(self, predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self.reports), timeout)


class Recording:
    """A sink that keeps every event and tells when the source went down."""

    name = "recording"

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.down = threading.Event()
        self.counters = SinkCounters()

    def emit(self, event, image, boxes):  # type: ignore[no-untyped-def]
        self.events.append(event.to_json())
        if event.kind == "source_down":
            self.down.set()
        return event

    def close(self) -> None:
        return None


@pytest.mark.parametrize("transport", ["tcp", "udp"])
def test_a_pipeline_on_an_rtsp_camera_gives_the_events_of_the_clip(scene, transport):  # noqa: F811
    camera = RtspCamera(scene["clip"]).start()
    recording = Recording()
    try:
        verified = scene["verified"]
        service = InferenceService(load_model(verified.root, verified.manifest))
        document = {**PIPELINE, "source": {"url": camera.url, "transport": transport, "policy": "every"}}
        (spec,) = parse_pipelines([document])
        runner = PipelineRunner(spec, "pi-07", lambda name: service, [recording])
        runner.start()
        # the clip ends after FRAMES / FPS seconds: the camera's stream ends, the reader says so
        assert recording.down.wait(FRAMES / FPS + 20), recording.events[-3:]
        runner.stop()
    finally:
        camera.stop()
    got = Counter((e["rule"], e["kind"], e.get("label"), e.get("direction")) for e in recording.events
                  if e["kind"] in ("cross", "enter", "leave"))
    assert got == Counter((rule, kind, label, direction) for _, rule, kind, label, direction in expected_events())
    assert [e["kind"] for e in recording.events if e["rule"] == ""][:2] == ["source_up", "source_down"]


def test_a_camera_that_comes_back_is_read_again_within_5_s(tmp_path):
    clip = moving_squares_clip(tmp_path / "long.mp4", LONG, 600, width=WIDTH, height=HEIGHT, fps=FPS)
    camera = RtspCamera(clip).start()
    watch = Watch()
    (spec,) = parse_pipelines([{**PIPELINE, "source": {"url": camera.url}}])
    reader = SourceReader(spec.source, FrameQueue(2, "latest"), on_status=watch)
    reader.start()
    try:
        assert watch.wait(lambda r: r and r[-1].state == "up", timeout=20)
        camera.stop()  # the camera drops
        assert watch.wait(lambda r: r[-1].state == "down", timeout=20)
        outage = time.monotonic()
        while reader.status.reconnects < 3 and time.monotonic() - outage < 30:  # back off to a longer delay
            watch.wait(lambda r, n=reader.status.reconnects: reader.status.reconnects > n, timeout=10)
        camera.start()  # same port: the camera is back
        back = time.monotonic()
        assert watch.wait(lambda r: r[-1].state == "up", timeout=15)
        assert time.monotonic() - back < 5.0, watch.reports[-3:]
    finally:
        reader.stop()
        camera.stop()


def rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@pytest.mark.slow
def test_a_thousand_forced_disconnects_keep_memory_flat(tmp_path):
    """The proxy cuts the connection once RTP flows, 1,000 times; the reader reconnects each
    time; its process's RSS after the last 900 cycles is within 16 MiB of after the first 100."""
    clip = moving_squares_clip(tmp_path / "long.mp4", LONG, 600, width=WIDTH, height=HEIGHT, fps=FPS)
    camera = RtspCamera(clip).start()
    proxy = CuttingProxy(camera.port)
    (spec,) = parse_pipelines([{**PIPELINE, "source": {"url": f"rtsp://127.0.0.1:{proxy.port}/cam",
                                                        "reconnect_s": 0.01, "reconnect_max_s": 0.02}}])
    reader = SourceReader(spec.source, FrameQueue(2, "latest"))
    reader.start()
    marks: dict[int, int] = {}
    try:
        for cycle in range(1, CYCLES + 1):
            accepted = proxy.accepted
            assert proxy.flowing.wait(20), f"no RTP after {cycle - 1} cuts"
            proxy.cut()
            deadline = time.monotonic() + 20
            while proxy.accepted == accepted and time.monotonic() < deadline:
                proxy.flowing.wait(0.05)  # the next connection: the reader reconnected
            if cycle in (100, CYCLES):
                marks[cycle] = rss_kib()
    finally:
        reader.stop()
        proxy.close()
        camera.stop()
    assert reader.status.reconnects >= CYCLES - 1  # the last cut's reconnect may still be on its way
    assert marks[CYCLES] - marks[100] < 16 * 1024, marks
