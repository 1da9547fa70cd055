"""An RTSP camera on loopback (GStreamer's rtsp-server, tools/rtsp_server.py, run by Debian's
python3 with PyGObject) and a TCP proxy in front of it that cuts every connection on demand."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from tests.broker import free_port

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PYTHON = "/usr/bin/python3"


def rtsp_server_available() -> bool:
    """Whether the system python3 has GStreamer's rtsp-server (Debian: gir1.2-gst-rtsp-server-1.0)."""
    probe = "import gi; gi.require_version('Gst', '1.0'); gi.require_version('GstRtspServer', '1.0')"
    try:
        return subprocess.run([SYSTEM_PYTHON, "-c", probe], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def require_rtsp_server() -> None:
    """Skip without the camera's parts outside CI; under CI (which installs them) fail instead."""
    if rtsp_server_available():
        return
    message = "GStreamer's rtsp-server is not installed for /usr/bin/python3 (apt-get install python3-gi " \
              "gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-good gstreamer1.0-plugins-bad)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


class RtspCamera:
    """``rtsp://127.0.0.1:{port}/cam`` serving ``clip``; stop it to drop the camera."""

    def __init__(self, clip: Path, port: int | None = None) -> None:
        self.clip, self.port = clip, port or free_port()
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"rtsp://127.0.0.1:{self.port}/cam"

    def start(self) -> RtspCamera:
        self.proc = subprocess.Popen([SYSTEM_PYTHON, str(ROOT / "tools" / "rtsp_server.py"), "--port", str(self.port),
                                      "--file", str(self.clip)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until the server says it listens (or dies)
        if not line.startswith("ready"):
            problem = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"rtsp server did not start: {line}{problem}")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class CuttingProxy:
    """Forwards 127.0.0.1:{port} to ``target``; :meth:`cut` closes every open connection.
    ``flowing`` is set once media flows to a client over RTSP's TCP interleaving (``$`` frames)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.lock = threading.Lock()
        self.pairs: list[tuple[socket.socket, socket.socket]] = []
        self.downstream_bytes = 0
        self.flowing = threading.Event()
        self.accepted = 0
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.pairs.append((client, upstream))
                self.accepted += 1
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: socket.socket) -> None:
        sockets = [client, upstream]
        try:
            while True:
                readable, _, _ = select.select(sockets, [], [], 1.0)
                for sock in readable:
                    data = sock.recv(65536)
                    if not data:
                        return
                    (upstream if sock is client else client).sendall(data)
                    if sock is upstream:
                        with self.lock:
                            self.downstream_bytes += len(data)
                        if data[:1] == b"$":  # an interleaved RTP frame (RFC 2326 10.12): PLAY answered, media flows
                            self.flowing.set()
        except (OSError, ValueError):
            return
        finally:
            for sock in sockets:
                sock.close()

    def cut(self) -> None:
        with self.lock:
            pairs, self.pairs = self.pairs, []
            self.downstream_bytes = 0
            self.flowing.clear()
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def close(self) -> None:
        self._stop = True
        self.listener.close()
        self.cut()
