"""The HTTP client of the ``rollout`` and ``target`` commands and ``fleet status --server``.

Standard library only (``urllib``), so these commands work with the ``host`` extra alone: the
operator's laptop does not need the server's database drivers. Every answer is bounded before
it is parsed; an error answer becomes :class:`~sdk.errors.ApiError` with the server's own
one-line message, an unreachable server one line naming the address, and a TLS failure one line
saying what failed and which flag fixes it (``--ca``, ``--client-cert``; docs/tls.md).
"""

from __future__ import annotations

import json
import shutil
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from edgepack_core.tls import client_context, tls_failure
from sdk.errors import ApiError, FleetServerError, ServerConfigError

MAX_ANSWER_BYTES = 64 * 1024 * 1024
TIMEOUT_S = 30.0
UPLOAD_TIMEOUT_S = 600.0


def check_server_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ServerConfigError(f"--server must be the server's http(s) URL, e.g. http://127.0.0.1:8760, got {url!r}")
    return url.rstrip("/")


@dataclass(frozen=True)
class ClientTls:
    """``--ca`` (instead of the system's CAs) and a client certificate for mutual TLS."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None

    def context(self) -> ssl.SSLContext:
        try:
            return client_context(str(self.ca) if self.ca else None, str(self.cert) if self.cert else None,
                                  str(self.key) if self.key else None)
        except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
            files = ", ".join(str(path) for path in (self.ca, self.cert, self.key) if path)
            raise ServerConfigError(f"cannot load the TLS files ({files}): "
                                    f"{getattr(err, 'reason', None) or err}") from err


def tls_hint(line: str, tls: ClientTls | None) -> str:
    """What to do about a TLS failure line, for the CLI's user. Pure."""
    if "local issuer" in line or "self-signed" in line or "self signed" in line:
        return f"{line}; pass --ca FILE or set EDGEPACK_SERVER_CA"
    if "Hostname mismatch" in line or "IP address mismatch" in line:
        return f"{line}; use a host name the server's certificate names"
    if "client's certificate" in line and (tls is None or tls.cert is None):
        return f"{line}; pass --client-cert FILE and --client-key FILE"
    return line


class FleetClient:
    """Calls on one fleet server with one bearer token."""

    def __init__(self, server: str, token: str, tls: ClientTls | None = None) -> None:
        self.server = check_server_url(server)
        self.token = token
        self.tls = tls
        self._context = tls.context() if tls is not None else None

    def _request(self, method: str, path: str, *, body: Any = None, data: Any = None, length: int | None = None,
                 timeout: float = TIMEOUT_S, content_type: str = "application/json",
                 sink: BinaryIO | None = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        payload = data
        if body is not None:
            payload = json.dumps(body).encode()
            length = len(payload)
        if payload is not None:
            headers["Content-Type"] = content_type
            headers["Content-Length"] = str(length)
        request = urllib.request.Request(self.server + path, data=payload, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout, context=self._context) as answer:
                if sink is not None:  # a stream (an export): copied as it comes, never held whole
                    shutil.copyfileobj(answer, sink, 64 * 1024)
                    return None
                return self._decode(answer.read(MAX_ANSWER_BYTES + 1), answer.status)
        except urllib.error.HTTPError as err:
            raise self._error(err) from err
        except (TimeoutError, urllib.error.URLError, OSError) as err:
            line = tls_failure(err, self.server)
            if line is not None:
                raise FleetServerError(tls_hint(line, self.tls)) from err
            reason = getattr(err, "reason", None) or err
            raise FleetServerError(f"cannot reach the fleet server at {self.server}: {reason}") from err

    @staticmethod
    def _decode(raw: bytes, status: int) -> Any:
        if len(raw) > MAX_ANSWER_BYTES:
            raise FleetServerError(f"the server's answer is over {MAX_ANSWER_BYTES} bytes")
        try:
            return json.loads(raw) if raw else None
        except (UnicodeDecodeError, ValueError) as err:
            raise FleetServerError(f"the server answered {status} with something that is not JSON") from err

    @staticmethod
    def _error(err: urllib.error.HTTPError) -> ApiError:
        code, message = "error", f"HTTP {err.code}"
        try:
            doc = json.loads(err.read(64 * 1024))
            code, message = str(doc["error"]["code"]), str(doc["error"]["message"])
        except (ValueError, KeyError, TypeError, OSError):
            pass
        failure = ApiError(err.code, code, f"the server refused ({err.code} {code}): {message}")
        if err.code == 400:
            failure.exit_code = 2  # the request itself was wrong: bad usage
        return failure

    # ---------------------------------------------------------------- calls

    def get(self, path: str, **query: Any) -> Any:
        params = {key: str(value).lower() if isinstance(value, bool) else value
                  for key, value in query.items() if value is not None}
        return self._request("GET", path + (f"?{urllib.parse.urlencode(params)}" if params else ""))

    def download(self, path: str, sink: BinaryIO, **query: Any) -> None:
        """GET ``path`` and copy the answer into ``sink`` as it arrives (an audit export)."""
        params = {key: value for key, value in query.items() if value is not None}
        self._request("GET", path + (f"?{urllib.parse.urlencode(params)}" if params else ""), sink=sink)

    def post(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._request("POST", path, body=body if body is not None else {})

    def delete(self, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._request("DELETE", path, body=body if body is not None else {})
    def put(self, path: str, body: dict[str, Any]) -> Any:
        return self._request("PUT", path, body=body)

    def artifact(self, sha256: str) -> dict[str, Any] | None:
        """The server's record of an artifact, or None when it does not have it."""
        try:
            return self.get(f"/api/artifacts/{sha256}")
        except ApiError as err:
            if err.status == 404:
                return None
            raise

    def upload(self, path: Path) -> dict[str, Any]:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            return self._request("POST", "/api/artifacts", data=handle, length=size, timeout=UPLOAD_TIMEOUT_S,
                                 content_type="application/octet-stream")
