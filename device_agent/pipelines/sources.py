"""Sources of a pipeline: what opens a camera, a stream, a file or a microphone, and the reader
thread that keeps it open.

Decoding is PyAV's (FFmpeg's demuxers and decoders in one wheel, x86-64 and aarch64 alike,
RTSP over TCP or UDP, V4L2 and ALSA capture): ``pip install 'edgepack-agent[streams]'``. It
releases the GIL while it demuxes and decodes, so the reader thread decodes frame *n+1* while
the pipeline's thread runs the model on frame *n*. Image folders decode with Pillow; frames
pushed from Python need nothing.

The reader (:class:`SourceReader`) hands frames to the pipeline's :class:`~.frames.FrameQueue`
and never lets a failure escape: a source that cannot be opened, stops, or gives no frame for
``watchdog_s`` is reported (``on_status``) and reopened after a backoff that starts at
``reconnect_s`` and doubles to ``reconnect_max_s``; a file ends the stream (or starts again with
``loop``). Pure decisions (:func:`open_plan`, :func:`camera_backend`,
:func:`keep_frame`) are apart from the I/O, and tested alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from device_agent.errors import PipelineRefused
from device_agent.pipelines.frames import FrameQueue, SourceFrame
from device_agent.pipelines.spec import SourceSpec
from edgepack_core.mqtt_settings import backoff_delay

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".ppm", ".pgm")
MAX_FOLDER_IMAGES = 100_000
AUDIO_BLOCK_S = 0.5  # audio handed over in blocks of this length
OPEN_TIMEOUT_US = 5_000_000  # FFmpeg's network timeouts (microseconds): a dead camera cannot hang a reader
# How much of a live stream FFmpeg reads to learn its codec before the first frame: its default
# (5 s of analysis) made an RTSP camera's first frame, and every reconnect, take 2.1 s on loopback;
# half a second and 128 KiB take 0.3 s and still find H.264's parameters (sent in band).
PROBE_OPTIONS = (("analyzeduration", "500000"), ("probesize", "131072"))
# HTTP MJPEG cameras (mjpg-streamer, ESP32-CAM, IP cameras' /video.mjpg) send multipart/x-mixed-replace:
# FFmpeg's mpjpeg demuxer hands each part over as it arrives (measured on loopback: 5 frames in
# 0.05 s), while its raw mjpeg parser held every frame until the connection closed (3 s later).
HTTP_MJPEG_FORMAT = "mpjpeg"


@dataclass(frozen=True)
class OpenPlan:
    """How to open a source with PyAV: ``target`` (URL, path, device), the demuxer ``format``
    (None: probed) and its ``options``; or ``backend`` other than ``av`` (folder, push, picamera2)."""

    backend: str
    target: str = ""
    format: str | None = None
    options: tuple[tuple[str, str], ...] = ()
    audio: bool = False
    read_timeout_s: float = 10.0  # the watchdog: no packet for this long fails the read
    arrival_clock: bool = False  # stamp frames as they arrive (the stream has no clock of its own)
    live: bool = True  # a camera or microphone (its end is a drop: reconnect); False: a file, read once


def open_plan(spec: SourceSpec) -> OpenPlan:
    """How ``spec`` is opened (pure)."""
    kind = spec.kind
    if kind == "push":
        return OpenPlan("push")
    if kind == "camera":
        return OpenPlan("picamera2")
    if kind == "url":
        url = str(spec.url)
        if url.startswith(("rtsp://", "rtsps://")):
            options = (("rtsp_transport", spec.transport), ("timeout", str(OPEN_TIMEOUT_US)), *PROBE_OPTIONS)
            return OpenPlan("av", url, None, options, read_timeout_s=spec.watchdog_s)
        # multipart JPEGs carry no timestamps (FFmpeg numbers them at 25 FPS whatever the camera's
        # rate): stamped on arrival, so max_fps and dwell times follow the camera's real clock
        return OpenPlan("av", url, HTTP_MJPEG_FORMAT, (("timeout", str(OPEN_TIMEOUT_US)),),
                        read_timeout_s=spec.watchdog_s, arrival_clock=True)
    if kind == "device":
        return OpenPlan("av", str(spec.device), "v4l2", read_timeout_s=spec.watchdog_s)
    if kind == "audio":
        audio = str(spec.audio)
        if audio.lower().endswith(".wav"):
            return OpenPlan("av", audio, None, audio=True, live=False)
        rate = () if spec.sample_rate is None else (("sample_rate", str(spec.sample_rate)),)
        return OpenPlan("av", audio, "alsa", rate, audio=True, read_timeout_s=spec.watchdog_s)
    path = str(spec.file)
    if Path(path).is_dir():
        return OpenPlan("folder", path, live=False)
    return OpenPlan("av", path, None, audio=path.lower().endswith(".wav"), live=False)


def camera_backend(has_picamera2: bool, has_v4l2_device: bool) -> str:
    """Which backend reads ``camera: picamera2`` (pure): picamera2 where it imports (Raspberry
    Pi OS's python3-picamera2 with libcamera), else a refusal line naming what to install."""
    if has_picamera2:
        return "picamera2"
    hint = " (or use device: /dev/video0: the camera is a V4L2 device too)" if has_v4l2_device else ""
    raise PipelineRefused("source.camera", "picamera2 is not importable: install python3-picamera2 and run the "
                          f"agent with the system Python's site packages{hint}")


def keep_frame(ts: float, last_kept: float | None, max_fps: float | None) -> bool:
    """Whether a frame at ``ts`` passes ``max_fps`` after the last kept one (pure). A frame
    exactly one period later is kept; a stream whose clock went back starts again."""
    if max_fps is None or last_kept is None or ts < last_kept:
        return True
    return ts - last_kept >= (1.0 / max_fps) - 1e-9


def _import_av() -> Any:
    try:
        import av
    except ImportError as err:
        raise PipelineRefused("source", "this source needs PyAV: pip install 'edgepack-agent[streams]'") from err
    return av


def decode_av(plan: OpenPlan, stop: threading.Event) -> Iterator[tuple[float, np.ndarray, int]]:
    """(ts, pixels or samples, sample rate) of every frame of the source, as it decodes."""
    av = _import_av()
    container = av.open(plan.target, format=plan.format, options=dict(plan.options),
                        timeout=(OPEN_TIMEOUT_US / 1e6, plan.read_timeout_s))
    try:
        if plan.audio:
            yield from _audio_blocks(container, stop)
            return
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # FFmpeg's frame threads: decoding uses the cores inference leaves
        keyed = False
        for frame in container.decode(stream):
            if stop.is_set():
                return
            keyed = keyed or bool(frame.key_frame)
            if not keyed:  # joined mid-stream: frames before the first keyframe decode to garbage
                continue
            ts = time.time() if plan.arrival_clock or frame.time is None else float(frame.time)
            yield ts, frame.to_ndarray(format="rgb24"), 0
    finally:
        container.close()


def _audio_blocks(container: Any, stop: threading.Event) -> Iterator[tuple[float, np.ndarray, int]]:
    """Mono float32 blocks of :data:`AUDIO_BLOCK_S` at the stream's own rate."""
    stream = container.streams.audio[0]
    rate = int(stream.rate or stream.sample_rate)
    block = max(1, int(rate * AUDIO_BLOCK_S))
    held: list[np.ndarray] = []
    count = sent = 0
    for frame in container.decode(stream):
        if stop.is_set():
            return
        samples = frame.to_ndarray().astype(np.float32)
        held.append(samples.mean(axis=0) if samples.ndim == 2 else samples)
        count += held[-1].shape[0]
        while count >= block:
            joined = np.concatenate(held)
            yield sent / rate, joined[:block], rate
            sent += block
            held, count = [joined[block:]], joined.shape[0] - block
    if count:
        yield sent / rate, np.concatenate(held), rate


def decode_picamera2(stop: threading.Event) -> Iterator[tuple[float, np.ndarray, int]]:
    """Frames of the Raspberry Pi camera through picamera2 (libcamera), stamped as captured.
    Its ``RGB888`` format is laid out B, G, R in memory (libcamera's naming): flipped to RGB as a
    view, no copy."""
    try:
        from picamera2 import Picamera2  # type: ignore[import-not-found]
    except ImportError:
        Picamera2 = None
    camera_backend(Picamera2 is not None, Path("/dev/video0").exists())
    camera = Picamera2()
    try:
        camera.configure(camera.create_video_configuration(main={"format": "RGB888"}))
        camera.start()
        while not stop.is_set():
            pixels = camera.capture_array("main")
            yield time.time(), pixels[:, :, 2::-1], 0
    finally:
        camera.close()


def decode_folder(folder: Path, fps: float, stop: threading.Event) -> Iterator[tuple[float, np.ndarray, int]]:
    """The images of ``folder`` in name order, ``fps`` apart."""
    from PIL import Image

    names = sorted(p for p in folder.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:MAX_FOLDER_IMAGES]
    for index, path in enumerate(names):
        if stop.is_set():
            return
        with Image.open(path) as image:
            yield index / fps, np.asarray(image.convert("RGB")), 0


@dataclass
class SourceStatus:
    """What the reader reports: ``up`` or ``down`` with why, and its counters."""

    state: str = "starting"
    detail: str = ""
    frames: int = 0
    reconnects: int = 0
    failures: int = 0
    since: float = field(default_factory=time.time)


class SourceReader:
    """Reads one source into a queue on its own thread, reconnecting; never raises out."""

    def __init__(self, spec: SourceSpec, queue: FrameQueue, *,
                 on_status: Callable[[SourceStatus], None] | None = None,
                 frames: Callable[[OpenPlan, threading.Event], Iterator[tuple[float, np.ndarray, int]]] | None = None,
                 ) -> None:
        self.spec, self.queue = spec, queue
        self.plan = open_plan(spec)
        self.status = SourceStatus()
        self._on_status = on_status or (lambda status: None)
        self._frames = frames or self._default_frames
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"source-{spec.kind}", daemon=True)
        self._index = 0
        self._got_frame = False
        self._clock: tuple[float, float] | None = None  # (monotonic, stream ts) where pacing started

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.queue.close()
        self._thread.join(timeout)

    def _default_frames(self, plan: OpenPlan, stop: threading.Event) -> Iterator[tuple[float, np.ndarray, int]]:
        if plan.backend == "folder":
            return decode_folder(Path(plan.target), self.spec.max_fps or 10.0, stop)
        if plan.backend == "picamera2":
            return decode_picamera2(stop)
        return decode_av(plan, stop)

    def _run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            outcome = self._read_once()
            if self._stop.is_set() or (outcome == "ended" and not self.spec.loop and not self.plan.live):
                break
            if outcome == "ended" and self.spec.loop:
                continue
            attempt = 0 if self._got_frame else attempt + 1
            # the MQTT client's schedule, without its jitter: one reader per camera, no herd to spread
            delay = backoff_delay(attempt, self.spec.reconnect_s, self.spec.reconnect_max_s, 1.0)
            self.status.reconnects += 1
            if self._stop.wait(delay):
                break
        self.queue.close()

    def _read_once(self) -> str:
        """Open the source and hand over its frames: ``ended`` (the stream ended or the queue
        closed) or ``failed`` (reported as down, to be reopened)."""
        last_kept: float | None = None
        self._got_frame = False
        self._clock = None
        try:
            for ts, data, rate in self._frames(self.plan, self._stop):
                if not keep_frame(ts, last_kept, self.spec.max_fps):
                    continue
                last_kept = ts
                if not self._hand_over(ts, data, rate):
                    return "ended"
        except Exception as err:  # any decoder failure is the source's: reported, retried, never fatal
            self._set("down", f"{type(err).__name__}: {str(err)[:300]}")
            self.status.failures += 1
            log.warning("source %s failed: %s", self.plan.target or self.spec.kind, self.status.detail)
            return "failed"
        if self.plan.live:  # a live stream that ends has dropped: reconnect
            self._set("down", "the stream ended")
            return "failed"
        return "ended"

    def _pace(self, ts: float) -> bool:
        """``realtime``: wait until the frame's time comes, as a camera would deliver it (a
        stream's clock, not a synchronisation); False when stopped meanwhile."""
        now = time.monotonic()
        if self._clock is None or ts < self._clock[1]:
            self._clock = (now, ts)
        due = self._clock[0] + (ts - self._clock[1])
        return not (due > now and self._stop.wait(due - now))

    def _hand_over(self, ts: float, data: np.ndarray, rate: int) -> bool:
        if self.spec.realtime and not self._pace(ts):
            return False
        if self.status.state != "up":
            self._set("up", "")
        frame = SourceFrame(self._index, ts, image=None if self.plan.audio else data,
                            audio=data if self.plan.audio else None, sample_rate=rate, read_at=time.monotonic())
        self._index += 1
        self._got_frame = True
        self.status.frames += 1
        return self.queue.put(frame)

    def _set(self, state: str, detail: str) -> None:
        self.status.state, self.status.detail, self.status.since = state, detail, time.time()
        self._on_status(self.status)
