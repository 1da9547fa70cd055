"""HTTP(S) artifact download, bounded in every dimension: only from allowed origins, no
redirects to another origin or scheme, an overall deadline and a minimum rate, bounded memory
and size, resumable with Range requests, cancellable, checked against the command's sha256.

Errors are fixed texts: nothing the remote side sends (a status line, an SSH banner, a
header) is ever put into a message, so URL delivery cannot be used to read other services'
first bytes through the published job events. More than that, every way a fetch can fail
(a closed port, a port that accepts and stays silent, a port that speaks something other than
HTTP, an HTTP error status, a short answer) is reported as the same one text, ``FETCH_FAILED``,
after the same time: each failed attempt is held to ``Bounds.stall_s`` plus the back-off, and
the head of an answer (connect, status line, headers) must arrive within ``stall_s`` in all,
not per read. Otherwise anyone allowed to send a deploy could scan the ports of the broker's
host (the default allowed origin) by reading job events. The detail goes to the local log at
debug level only.

Certificate failures are named: a certificate the device cannot verify (``certificate verify
failed: <OpenSSL's reason> (host:port)``, edgepack_core/tls.py), or a server that refuses the
device's own certificate (mutual TLS), at once and without the retries, since no retry can
change either. The operator needs it (a private CA not in ``updates.ca``), and it
tells a prober only that a port on an allowed origin speaks TLS with a certificate this device
does not trust; OpenSSL's reasons are fixed texts with the host name the device asked for.

The command's sha256 is not what makes the artifact trusted (the signature check after the
download does that); it makes a corrupt or swapped download fail early and lets a resumed
download prove that its two halves belong together.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import logging
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO

from device_agent.errors import DownloadCancelled, DownloadError
from device_agent.updates.origins import STALL_S, Bounds, allowed_origins, origin_allowed, origin_of  # noqa: F401  (re-exported)
from edgepack_core.fsutil import sha256_file
from edgepack_core.tls import client_context, tls_failure

log = logging.getLogger("edgepack.agent.download")

CHUNK = 256 * 1024
FETCH_FAILED = "could not fetch from the server"
"""The one text for every failed attempt: which way it failed is a port oracle (module docstring)."""
_POLL_S = 0.05
RATE_GRACE_S = 10.0
"""The minimum rate is enforced over the download so far, after this much time."""
MAX_REDIRECTS = 3


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to the same origin; anything else ends the download."""

    max_redirections = MAX_REDIRECTS

    def redirect_request(self, req: urllib.request.Request, fp: IO[bytes], code: int, msg: str,
                         headers: http.client.HTTPMessage, newurl: str) -> urllib.request.Request | None:
        if origin_of(newurl) != origin_of(req.full_url):
            raise DownloadError("the server redirected to another origin or scheme; refused")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _HeadDeadline(http.client.HTTPConnection):
    """For ``http.client`` connections: the whole head of the answer (connect, request, status
    line, headers) within ``timeout`` seconds. A socket timeout alone bounds each read, so a
    peer that drips one byte of a status line per read would hold the attempt for hours."""

    def connect(self) -> None:
        if not isinstance(self.timeout, (int, float)):
            raise DownloadError("a download needs a timeout")  # every request here sets one
        self._expired = threading.Event()
        self._watchdog = threading.Timer(self.timeout, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()
        super().connect()
        if self._expired.is_set():
            self._expire()

    def _expire(self) -> None:
        self._expired.set()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                # The plain socket's shutdown also for TLS: it wakes a blocked read at once.
                socket.socket.shutdown(self.sock, socket.SHUT_RDWR)

    def _disarm(self) -> None:
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.cancel()

    def getresponse(self) -> http.client.HTTPResponse:
        try:
            return super().getresponse()
        finally:
            self._disarm()

    def close(self) -> None:
        self._disarm()
        super().close()


class _BoundedHTTPConnection(_HeadDeadline, http.client.HTTPConnection):
    pass


class _BoundedHTTPSConnection(_HeadDeadline, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_BoundedHTTPConnection, req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        # HTTPSHandler keeps the TLS context it was given in a private attribute typeshed omits.
        return self.do_open(_BoundedHTTPSConnection, req, context=self._context)  # type: ignore[attr-defined]


_OPENER = urllib.request.build_opener(_SameOriginRedirects, _HTTPHandler, _HTTPSHandler)


@functools.lru_cache(maxsize=4)
def _opener_with(ca: Path | None, client: tuple[str, str] | None) -> urllib.request.OpenerDirector:
    """An opener that verifies https:// with ``ca`` (else the system's CAs) and presents
    ``client`` when the server asks for a certificate (made once per pair)."""
    cert, key = client if client is not None else (None, None)
    https = _HTTPSHandler(context=client_context(str(ca) if ca else None, cert, key))
    return urllib.request.build_opener(_SameOriginRedirects, _HTTPHandler, https)


def _opener(bounds: Bounds) -> urllib.request.OpenerDirector:
    if bounds.ca is None and bounds.client is None:
        return _OPENER
    return _opener_with(bounds.ca, bounds.client)


def certificate_failure(err: BaseException, url: str) -> str | None:
    """The job reason for a certificate problem, or None: a server certificate this device cannot
    verify, or a server that refused (or wanted) the device's. Only these are named (module
    docstring); every other failure stays ``FETCH_FAILED``."""
    line = tls_failure(err, (origin_of(url) or "").split("://", 1)[-1])
    if line is None:
        return None
    if "client's certificate" in line:
        return f"{line}; the device presents mqtt.tls.cert and mqtt.tls.key when a server asks for one"
    if not line.startswith("certificate verify failed"):
        return None
    if "local issuer" in line or "self-signed" in line or "self signed" in line:
        return f"{line}; set updates.ca to the CA that signed it"
    return line


def _detail(err: BaseException) -> str:
    """Which way a fetch failed, for the local debug log only (never the remote side's bytes)."""
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP status {int(err.code)}"
    if isinstance(err, (http.client.HTTPException, ValueError)):
        return "the answer is not valid HTTP (or the head took too long)"
    if isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError):
        return "no data within the stall timeout"
    return f"connection failed ({type(getattr(err, 'reason', err)).__name__})"


class _Progress:
    """Deadline, minimum rate and cancellation over one download (all attempts together)."""

    def __init__(self, bounds: Bounds, cancelled: Callable[[], bool], clock: Callable[[], float]) -> None:
        self.bounds = bounds
        self.cancelled = cancelled
        self.clock = clock
        self.started = clock()
        self.received = 0

    def remaining(self) -> float:
        return self.bounds.deadline_s - (self.clock() - self.started)

    def pause_until(self, moment: float) -> None:
        """Wait until ``moment`` on the clock (never past the deadline), seeing a cancel at once."""
        while (left := min(moment - self.clock(), self.remaining())) > 0:
            if self.cancelled():
                raise DownloadCancelled("download cancelled")
            time.sleep(min(_POLL_S, left))

    def check(self, *, rate: bool = True) -> None:
        """Cancel, deadline and (while bytes flow, ``rate``) the minimum rate. Not the rate
        between attempts: failed attempts all take the same time, and a rate refusal there would
        end every failing download after ``RATE_GRACE_S`` with a text of its own."""
        if self.cancelled():
            raise DownloadCancelled("download cancelled")
        elapsed = self.clock() - self.started
        if elapsed > self.bounds.deadline_s:
            raise DownloadError(f"download deadline of {self.bounds.deadline_s:g} s passed")
        if rate and elapsed > RATE_GRACE_S and self.received / elapsed < self.bounds.min_rate_bytes_s:
            raise DownloadError(f"download slower than the minimum of {self.bounds.min_rate_bytes_s:g} bytes/s")


def _attempt(url: str, partial: Path, have: int, size: int, progress: _Progress) -> int:
    """One HTTP request appending to ``partial``; returns the bytes now held."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    timeout = max(0.1, min(progress.bounds.stall_s, progress.remaining()))
    with _opener(progress.bounds).open(request, timeout=timeout) as response:
        if have and response.status != 206:
            have = 0  # the server ignored Range: start over
        with open(partial, "ab" if have else "wb") as sink:
            while True:
                progress.check()
                block = response.read1(CHUNK)
                if not block:
                    return have
                have += len(block)
                progress.received += len(block)
                if have > size:
                    raise DownloadError(f"server sent more than the declared {size} bytes")
                sink.write(block)


def download(
    url: str,
    target: Path,
    *,
    size: int,
    sha256: str,
    bounds: Bounds,
    attempts: int = 5,
    cancelled: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
) -> Path:
    """Fetch ``url`` into ``target`` within ``bounds``; resume a partial ``target`` with Range."""
    if not origin_allowed(url, bounds):
        raise DownloadError("the artifact URL is not on an origin this device allows")
    if size > bounds.max_bytes:
        raise DownloadError(f"artifact of {size} bytes is over the download limit of {bounds.max_bytes}")
    partial = target.with_name(target.name + ".part")
    if target.exists() and target.stat().st_size == size and sha256_file(target) == sha256:
        return target
    progress = _Progress(bounds, cancelled, clock)
    for attempt in range(attempts):
        progress.check(rate=False)
        started = clock()
        if _fetched(url, partial, size, progress, attempt):
            if sha256_file(partial) != sha256:
                partial.unlink()
                raise DownloadError("downloaded file does not match the command's sha256")
            partial.replace(target)
            return target
        # Every failed attempt takes the same time, however it failed (module docstring); the
        # back-off spaces the retries, and none follows the last attempt.
        backoff = min(0.2 * 2**attempt, 2.0) if attempt + 1 < attempts else 0.0
        progress.pause_until(started + bounds.stall_s + backoff)
    raise DownloadError(f"download failed: {FETCH_FAILED}")


def _fetched(url: str, partial: Path, size: int, progress: _Progress, attempt: int) -> bool:
    """One attempt at the missing part of ``partial``; whether it now holds exactly ``size`` bytes."""
    have = partial.stat().st_size if partial.exists() else 0
    if have > size:
        partial.unlink()
        have = 0
    if have < size:
        try:
            have = _attempt(url, partial, have, size, progress)
        except DownloadError:
            raise
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as err:
            certificate = certificate_failure(err, url)
            if certificate is not None:
                log.warning("download of %s refused: %s", url, certificate)
                raise DownloadError(certificate) from err
            log.debug("download attempt %d failed at %d bytes: %s", attempt + 1, have, _detail(err))
            return False
    if have != size:
        log.debug("download attempt %d ended at %d of %d bytes", attempt + 1, have, size)
        return False
    return True
