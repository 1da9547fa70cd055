"""The built-in artifact server of ``edgepack deploy``: one file over HTTP, with Range requests
so a device whose download broke resumes where it stopped.

Serves only ``/<sha256>.edgepkg`` (nothing else on the operator's disk is reachable) and
streams the file in 1 MiB blocks, never the whole artifact in memory. The device checks the
sha256 and the signature, so the server needs no trust.
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

BLOCK = 1 << 20
MAX_RANGE_HEADER = 200

Span = tuple[int, int]
_RANGE = re.compile(r"bytes=([0-9]{0,18})-([0-9]{0,18})")


def parse_range(header: str, size: int) -> Span | str | None:
    """The byte span a ``Range`` header asks for, as (first, last) inclusive. Pure.

    None: serve the whole file (no header, or one this server does not honour, as RFC 9110
    allows: other units, several ranges). ``"unsatisfiable"``: a 416 answer (the start is past
    the end). Suffix ranges (``bytes=-500``) give the last bytes.
    """
    match = _RANGE.fullmatch(header.strip()) if len(header) <= MAX_RANGE_HEADER else None
    if match is None or not (match[1] or match[2]):
        return None
    first, last = match[1], match[2]
    if not first:  # suffix: the last N bytes
        count = int(last)
        if count == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - count), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if end < start:  # also a start at or past the end, since end is at most size - 1
        return "unsatisfiable"
    return start, end


class ArtifactServer(ThreadingHTTPServer):
    """Serves one file at ``/<sha256>.edgepkg`` with Range support (for resumed downloads)."""

    daemon_threads = True

    def __init__(self, artifact: Path, sha256: str, host: str = "127.0.0.1", port: int = 0) -> None:
        self.artifact = artifact
        self.host = host
        self.path_name = f"/{sha256}.edgepkg"
        self.size = artifact.stat().st_size
        super().__init__((host, port), _ArtifactHandler)
        threading.Thread(target=self.serve_forever, name="artifact-server", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.server_port}{self.path_name}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _ArtifactHandler(BaseHTTPRequestHandler):
    server: ArtifactServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != self.server.path_name:
            self.send_error(404)
            return
        size = self.server.size
        span = parse_range(self.headers.get("Range", ""), size)
        if span == "unsatisfiable":
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        start, end = span if isinstance(span, tuple) else (0, size - 1)
        self.send_response(206 if isinstance(span, tuple) else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start + 1))
        if isinstance(span, tuple):
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.end_headers()
        self._send_file(start, end - start + 1)

    def _send_file(self, start: int, remaining: int) -> None:
        with open(self.server.artifact, "rb") as handle:
            handle.seek(start)
            while remaining > 0:
                block = handle.read(min(BLOCK, remaining))
                if not block:
                    break
                try:
                    self.wfile.write(block)
                except (BrokenPipeError, ConnectionResetError):
                    return
                remaining -= len(block)
