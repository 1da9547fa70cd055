"""Sources other than files and RTSP, on real parts where they can exist here: an HTTP MJPEG
camera (a loopback server writing multipart/x-mixed-replace JPEGs of the moving squares, read
by PyAV), a folder of PNG frames, and capture devices PyAV really opens and refuses (a missing
/dev/video, a file that is no V4L2 device, an unknown ALSA PCM). What cannot exist here (a
camera that is busy, picamera2) is faked at the boundary, raising what PyAV raises."""

from __future__ import annotations

import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
from PIL import Image

from device_agent.errors import PipelineRefused
from device_agent.pipelines.frames import FrameQueue
from device_agent.pipelines.runner import PipelineRunner
from device_agent.pipelines.sources import (
    HTTP_MJPEG_FORMAT,
    OpenPlan,
    SourceReader,
    camera_backend,
    open_plan,
)
from device_agent.pipelines.spec import SourceSpec, parse_pipelines
from tests.stream_models import draw
from tests.test_pipeline_rtsp import Recording, Watch
from tests.test_pipeline_streams import (  # noqa: F401
    FRAMES,
    HEIGHT,
    PATHS,
    PIPELINE,
    WIDTH,
    as_tuples,
    expected_events,
    scene,
    service_of,
)

BOUNDARY = b"edgepackframe"


def jpeg(index: int) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(draw(PATHS, index, WIDTH, HEIGHT)).save(buffer, "JPEG", quality=95, subsampling=0)
    return buffer.getvalue()


class MjpegCamera:
    """An HTTP MJPEG camera on loopback: the first GET gets the clip's frames as a
    multipart/x-mixed-replace stream (each part with its Content-Length, as mjpg-streamer sends
    them), then the connection closes; later GETs (the reader reconnecting) get 503 and are
    counted, so the test knows the reader saw the stream end."""

    def __init__(self) -> None:
        camera = self
        self.requests = 0
        self.reconnected = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                camera.requests += 1
                if camera.requests > 1:
                    camera.reconnected.set()
                    self.send_error(503, "camera busy")
                    return
                self.send_response(200)
                self.send_header("Content-Type", f"multipart/x-mixed-replace; boundary={BOUNDARY.decode()}")
                self.end_headers()
                for index in range(FRAMES):
                    data = jpeg(index)
                    self.wfile.write(
                        b"--"
                        + BOUNDARY
                        + b"\r\nContent-Type: image/jpeg\r\nContent-Length: "
                        + str(len(data)).encode()
                        + b"\r\n\r\n"
                        + data
                        + b"\r\n"
                    )

            def log_message(self, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/video.mjpg"

    def __enter__(self) -> MjpegCamera:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def source(**keys: Any) -> SourceSpec:
    (parsed,) = parse_pipelines([{**PIPELINE, "source": keys}])
    return parsed.source


# ------------------------------------------------------------------------------ decisions (pure)


def test_an_http_url_is_read_as_multipart_jpeg_stamped_on_arrival_and_rtsp_keeps_its_own_clock():
    plan = open_plan(source(url="http://10.0.0.9/video.mjpg", watchdog_s=3))
    assert (plan.backend, plan.format, plan.arrival_clock, plan.read_timeout_s) == ("av", "mpjpeg", True, 3)
    assert open_plan(source(url="https://cam.local/mjpg")).format == HTTP_MJPEG_FORMAT
    rtsp = open_plan(source(url="rtsp://10.0.0.9/s1", transport="udp"))
    assert rtsp.format is None and not rtsp.arrival_clock and ("rtsp_transport", "udp") in rtsp.options


def test_capture_devices_open_with_their_demuxer_and_a_folder_with_pillow(tmp_path):
    assert open_plan(source(device="/dev/video0")) == OpenPlan("av", "/dev/video0", "v4l2", read_timeout_s=10.0)
    alsa = open_plan(source(audio="hw:1,0", watchdog_s=2))
    assert (alsa.format, alsa.audio, alsa.read_timeout_s, alsa.options) == ("alsa", True, 2, ())
    assert open_plan(source(audio="hw:1,0", sample_rate=16000)).options == (("sample_rate", "16000"),)
    wav = open_plan(source(audio="/data/doorbell.wav"))
    assert (wav.format, wav.audio) == (None, True)
    assert open_plan(source(file=str(tmp_path))) == OpenPlan("folder", str(tmp_path), live=False)
    assert open_plan(source(camera="picamera2")).backend == "picamera2"
    assert open_plan(source(push=True)).backend == "push"


def test_the_pi_camera_is_read_by_picamera2_where_it_imports_and_refused_with_what_to_install():
    assert camera_backend(True, False) == "picamera2"
    assert camera_backend(True, True) == "picamera2"
    with pytest.raises(PipelineRefused, match="install python3-picamera2") as without:
        camera_backend(False, False)
    assert "/dev/video0" not in str(without.value)
    with pytest.raises(PipelineRefused, match="device: /dev/video0"):
        camera_backend(False, True)


# ------------------------------------------------------------------------------ real sources


def test_an_http_mjpeg_camera_gives_exactly_the_events_of_the_clip(scene):  # noqa: F811
    service = service_of(scene)
    recording = Recording()
    with MjpegCamera() as camera:
        document = {**PIPELINE, "source": {"url": camera.url, "policy": "every", "reconnect_s": 0.05}}
        (spec,) = parse_pipelines([document])
        runner = PipelineRunner(spec, "pi-07", lambda name: service, [recording])
        runner.start()
        assert camera.reconnected.wait(30), "the reader never saw the stream end"
        runner.stop()
    assert as_tuples(recording.events) == expected_events()
    assert runner.counters.frames == FRAMES and runner.queue.dropped == 0
    assert runner.reader is not None and runner.reader.status.frames == FRAMES
    kinds = [e["kind"] for e in recording.events if e["kind"].startswith("source_")]
    assert kinds[:2] == ["source_up", "source_down"]


def test_a_folder_of_png_frames_gives_exactly_the_events_of_the_clip(scene, tmp_path):  # noqa: F811
    folder = tmp_path / "frames"
    folder.mkdir()
    for index in range(FRAMES):
        Image.fromarray(draw(PATHS, index, WIDTH, HEIGHT)).save(folder / f"frame-{index:04d}.png")
    (folder / "notes.txt").write_text("not an image: skipped")
    service = service_of(scene)
    recording = Recording()
    (spec,) = parse_pipelines([{**PIPELINE, "source": {"file": str(folder), "policy": "every"}}])
    runner = PipelineRunner(spec, "pi-07", lambda name: service, [recording])
    runner.start()
    assert runner.finished.wait(60)
    runner.stop()
    assert as_tuples(recording.events) == expected_events()
    assert runner.counters.frames == FRAMES and runner.counters.stage_errors == 0


@pytest.mark.parametrize(
    ("keys", "reason"),
    [
        ({"device": "/dev/video63"}, "FileNotFoundError: [Errno 2] No such file or directory: '/dev/video63'"),
        ({"device": "/dev/null"}, "Inappropriate ioctl for device"),  # a file that is no V4L2 camera
        ({"audio": "hw:63,0"}, "Input/output error: 'hw:63,0'"),  # ALSA: no such card
    ],
)
def test_a_capture_device_pyav_cannot_open_is_reported_down_with_the_reason_and_retried(keys, reason):
    watch = Watch()
    reader = SourceReader(
        source(**keys, reconnect_s=0.01, reconnect_max_s=0.02), FrameQueue(2, "latest"), on_status=watch
    )
    reader.start()
    try:
        assert watch.wait(lambda reports: len(reports) >= 3, 30), watch.reports
    finally:
        reader.stop()
    assert all(r.state == "down" and reason in r.detail for r in watch.reports[:3]), watch.reports[0].detail
    assert reader.status.failures >= 3 and reader.status.reconnects >= 2


def test_a_busy_camera_is_retried_until_it_frees_and_then_read(tmp_path):
    """V4L2 allows one reader: a camera another program holds fails to open with EBUSY (PyAV's
    av.error.OSError, errno 16), then gives frames once freed; the reader reports each failure
    and goes up with the first frame."""
    import av

    attempts: list[int] = []

    def camera(plan: OpenPlan, stop: threading.Event) -> Iterator[tuple[float, np.ndarray, int]]:
        attempts.append(len(attempts))
        if len(attempts) <= 2:
            raise av.error.OSError(16, "Device or resource busy", plan.target)
        for index in range(3):
            yield float(index), draw(PATHS, index, WIDTH, HEIGHT), 0
        stop.wait()  # a camera keeps streaming: nothing more until the reader stops

    queue = FrameQueue(8, "every")
    watch = Watch()
    spec = source(device="/dev/video0", reconnect_s=0.01, reconnect_max_s=0.02, policy="every", queue=8)
    reader = SourceReader(spec, queue, on_status=watch, frames=camera)
    reader.start()
    got = [queue.get(10) for _ in range(3)]
    reader.stop()
    assert [f.index for f in got if f is not None] == [0, 1, 2]
    states = [(r.state, r.detail) for r in watch.reports]
    assert states[:3] == [("down", "OSError: [Errno 16] Device or resource busy: '/dev/video0'")] * 2 + [("up", "")]
    assert reader.status.failures == 2 and reader.status.frames == 3


class FakePicamera2:
    """picamera2's Picamera2 as the reader uses it (configure, start, capture_array, close),
    giving BGR-ordered RGB888 frames as libcamera lays them out."""

    closed = threading.Event()

    def create_video_configuration(self, main: dict[str, Any]) -> dict[str, Any]:
        assert main == {"format": "RGB888"}
        return {"main": main}

    def configure(self, config: dict[str, Any]) -> None:
        self.config = config

    def start(self) -> None:
        self.index = 0

    def capture_array(self, stream: str) -> np.ndarray:
        self.index += 1
        return np.ascontiguousarray(draw(PATHS, self.index - 1, WIDTH, HEIGHT)[:, :, ::-1])  # B, G, R

    def close(self) -> None:
        FakePicamera2.closed.set()


def test_the_pi_camera_gives_rgb_frames_through_picamera2_and_is_closed_on_stop(monkeypatch):
    import sys
    import types

    module = types.ModuleType("picamera2")
    module.Picamera2 = FakePicamera2  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "picamera2", module)
    queue = FrameQueue(4, "every")
    reader = SourceReader(source(camera="picamera2", policy="every", queue=4), queue)
    reader.start()
    first = queue.get(10)
    reader.stop()
    assert first is not None and first.image is not None
    assert np.array_equal(first.image, draw(PATHS, 0, WIDTH, HEIGHT))  # red is red again
    assert FakePicamera2.closed.wait(10) and reader.status.state == "up"


def test_without_picamera2_the_pi_camera_is_reported_down_naming_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "picamera2", None)  # not importable, as on a desktop
    watch = Watch()
    reader = SourceReader(
        source(camera="picamera2", reconnect_s=0.01, reconnect_max_s=0.02), FrameQueue(2, "latest"), on_status=watch
    )
    reader.start()
    try:
        assert watch.wait(lambda reports: len(reports) >= 2, 30)
    finally:
        reader.stop()
    assert watch.reports[0].state == "down" and "install python3-picamera2" in watch.reports[0].detail
