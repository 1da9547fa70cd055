"""The local HTTP API: ``POST /predict``, ``GET /healthz``, ``GET /metrics`` (Prometheus).

Standard library only (a device should not need a web framework). Each request runs on its
own thread; a bad request gets a 4xx JSON answer and never affects the server. Bodies are
bounded (``max_body_bytes``, 413 beyond it) and read with the declared length only.

POST /predict takes:
  - ``image/*`` (or ``application/octet-stream`` for an image model): raw image bytes
  - ``application/x-npy`` / ``application/x-npz``: one array / named arrays
  - ``application/json``: ``{"inputs": {name: nested list}}``
  - ``audio/wav`` (or any RIFF/WAVE body) for an audio model: run frame by frame, outputs stacked
With ``X-Edgepack-Stream: ID`` a stateful model continues that stream's state
(``X-Edgepack-Stream-Reset: 1`` restarts it first; ``DELETE /streams/ID`` forgets it).
and answers the ``predict --json`` object as strict JSON (``edgepack_core.wire_json``: a
non-finite float is the string "NaN", "Infinity" or "-Infinity", integers, booleans and strings
keep their type), or, when the request says ``Accept: application/x-npz``, the exact output
tensors as ``np.savez`` bytes with the model, provider and latency in ``X-Edgepack-*`` headers.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from device_agent.errors import BadRequest, NoModelError
from device_agent.runtime import LATENCY_BUCKETS, InferenceService, PredictResult, json_to_feed
from edgepack_core import wire_json

log = logging.getLogger("edgepack.agent.http")


JSON_MEDIA_TYPE = "application/json"
# What /predict can answer in, in the server's order of preference for a tie.
ANSWER_TYPES = (JSON_MEDIA_TYPE, wire_json.NPZ_MEDIA_TYPE)
MAX_ACCEPT_CHARS = 1024
# Stateful models: the stream whose state a request continues, and a header to restart it.
STREAM_HEADER = "X-Edgepack-Stream"
STREAM_RESET_HEADER = "X-Edgepack-Stream-Reset"


def _quality(parameters: list[str]) -> float:
    for parameter in parameters:
        key, _, value = parameter.partition("=")
        if key.strip().lower() == "q":
            try:
                return min(max(float(value.strip()), 0.0), 1.0)
            except ValueError:
                return 0.0
    return 1.0


def _matches(pattern: str, media_type: str) -> bool:
    if pattern in ("*/*", media_type):
        return True
    return pattern.endswith("/*") and media_type.startswith(pattern[:-1])


def choose_answer_type(accept: str | None) -> str | None:
    """The media type /predict answers in for an ``Accept`` header (pure; RFC 9110 q-values,
    the most specific matching range decides a type's quality). JSON when the header is absent;
    None when the client accepts neither JSON nor npz (the caller answers 406)."""
    if accept is None or not accept.strip():
        return JSON_MEDIA_TYPE
    ranges = []
    for item in accept[:MAX_ACCEPT_CHARS].split(","):
        media, *parameters = item.split(";")
        media = media.strip().lower()
        if media:
            ranges.append((media, _quality(parameters)))
    best, best_quality = None, 0.0
    for media_type in ANSWER_TYPES:
        matching = [(r.count("*"), q) for r, q in ranges if _matches(r, media_type)]
        quality = min(matching)[1] if matching else 0.0  # fewest wildcards = most specific
        if quality > best_quality:
            best, best_quality = media_type, quality
    return best


def outputs_wanted(query: str) -> bool | None:
    """The ``/predict`` query (pure): ``outputs=raw`` adds the raw output tensors to a JSON
    answer, ``outputs=result`` leaves them out, no query keeps the default (raw outputs only
    when the model has no task result). Anything else is a 400, never silently ignored."""
    if not query:
        return None
    choices = {"outputs=raw": True, "outputs=result": False}
    if query not in choices:
        raise BadRequest("bad_query", f"unknown query {query[:100]!r}: /predict takes ?outputs=raw or "
                         "?outputs=result")
    return choices[query]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(service: InferenceService) -> str:
    """Metrics in the Prometheus text exposition format (version 0.0.4)."""
    snap = service.stats.snapshot()
    lines = ["# HELP edgepack_requests_total Predict requests by outcome.", "# TYPE edgepack_requests_total counter"]
    for status, count in sorted(snap["requests"].items()):
        lines.append(f'edgepack_requests_total{{status="{status}"}} {count}')
    lines += ["# HELP edgepack_errors_total Failed requests by kind.", "# TYPE edgepack_errors_total counter"]
    for kind, count in sorted(snap["errors"].items()):
        lines.append(f'edgepack_errors_total{{kind="{_escape(kind)}"}} {count}')
    lines += ["# HELP edgepack_inference_latency_seconds Model run time per request.",
              "# TYPE edgepack_inference_latency_seconds histogram"]
    cumulative = 0
    for bound, count in zip(LATENCY_BUCKETS, snap["buckets"], strict=False):
        cumulative += count
        lines.append(f'edgepack_inference_latency_seconds_bucket{{le="{bound}"}} {cumulative}')
    cumulative += snap["buckets"][-1]
    lines.append(f'edgepack_inference_latency_seconds_bucket{{le="+Inf"}} {cumulative}')
    lines.append(f"edgepack_inference_latency_seconds_sum {snap['latency_sum']:.9f}")
    lines.append(f"edgepack_inference_latency_seconds_count {cumulative}")
    lines += ["# HELP edgepack_model_info The active model and the provider it runs on.",
              "# TYPE edgepack_model_info gauge"]
    model = service.model
    if model is not None:
        info = model.describe()
        lines.append(f'edgepack_model_info{{name="{_escape(info["name"])}",version="{_escape(info["version"])}",'
                     f'sha256="{info["sha256"]}",provider="{info["provider"]}"}} 1')
    return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    server: ApiServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str = JSON_MEDIA_TYPE,
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, document: Any) -> None:
        self._send(status, wire_json.dumps(document) + b"\n")

    def _answer(self, result: PredictResult, answer_type: str, raw_outputs: bool | None = None) -> None:
        """The 200 answer of /predict in the negotiated media type."""
        answer = result.to_json(outputs=raw_outputs)
        if answer_type != wire_json.NPZ_MEDIA_TYPE:
            self._json(200, answer)
            return
        headers = {"X-Edgepack-Model": f"{answer['model']['name']} {answer['model']['version']}",
                   "X-Edgepack-Provider": answer["provider"], "X-Edgepack-Latency-Ms": str(answer["latency_ms"])}
        self._send(200, wire_json.npz_bytes(result.outputs), wire_json.NPZ_MEDIA_TYPE, headers)

    def _error(self, status: int, kind: str, message: str) -> None:
        self._json(status, {"error": {"kind": kind, "message": message}})

    def do_GET(self) -> None:
        service = self.server.service
        if self.path == "/healthz":
            model = service.model
            extra = self.server.health() if self.server.health is not None else {}
            if model is None:
                self._json(503, {"status": "no model", **extra})
            else:
                self._json(200, {"status": "ok", "model": model.describe(), **extra})
        elif self.path == "/metrics":
            self._send(200, prometheus_text(service).encode(), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._error(404, "not_found", f"no such endpoint {self.path}")

    def do_DELETE(self) -> None:
        """``DELETE /streams/ID``: forget a stream's state (204; 404 when it is not kept)."""
        if not self.path.startswith("/streams/"):
            self._error(404, "not_found", f"no such endpoint {self.path}")
            return
        try:
            existed = self.server.service.reset_stream(self.path[len("/streams/"):])
        except BadRequest as err:
            self._error(err.http_status, err.kind, str(err))
            return
        if existed:
            self._send(204, b"")
        else:
            self._error(404, "no_stream", "no such stream (never opened, expired or dropped)")

    def do_POST(self) -> None:
        path, _, query = self.path.partition("?")
        if path != "/predict":
            self._error(404, "not_found", f"no such endpoint {self.path}")
            return
        try:
            raw_outputs = outputs_wanted(query)
        except BadRequest as err:
            self.close_connection = True  # the body is not read
            self._error(err.http_status, err.kind, str(err))
            return
        service = self.server.service
        answer_type = choose_answer_type(self.headers.get("Accept"))
        if answer_type is None:
            self.close_connection = True
            self._error(406, "not_acceptable", f"answers come as {' or '.join(ANSWER_TYPES)}")
            return
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.isdigit():
            self.close_connection = True
            self._error(411, "length_required", "send a Content-Length header")
            return
        length = int(length_text)
        if length > self.server.max_body_bytes:
            self.close_connection = True  # do not read the oversized body
            service.stats.error("too_large", client=True)
            self._error(413, "too_large", f"body of {length} bytes is over the limit of {self.server.max_body_bytes}")
            return
        body = self.rfile.read(length)
        content_type = (self.headers.get("Content-Type") or "application/octet-stream").split(";")[0].strip().lower()
        stream = self.headers.get(STREAM_HEADER)
        try:
            if stream is not None and self.headers.get(STREAM_RESET_HEADER, "").strip().lower() in ("1", "true"):
                service.reset_stream(stream)
            if content_type == "application/json":
                try:
                    document = json.loads(body)
                except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
                    # nested too deeply is malformed input (400), never a server error of the model
                    raise BadRequest("bad_json", f"body is not JSON: {str(err)[:200]}") from None
                model = service.model
                if model is None:
                    raise NoModelError("no model is active")
                inputs = document.get("inputs") if isinstance(document, dict) else None
                try:
                    feed = json_to_feed(model, inputs)
                except BadRequest as err:
                    # counted for the health window: an unknown input name is the contract's
                    # doing; values that do not convert are malformed input, never the model's
                    service.stats.error("unknown_input" if err.kind == "unknown_input" else "bad_input", client=True)
                    raise
                result = service.predict(feed, stream=stream)
            else:
                result = service.predict(body, content_type=content_type, stream=stream)
        except BadRequest as err:
            self._error(err.http_status, err.kind, str(err))
            return
        except NoModelError as err:
            self._error(503, "no_model", str(err))
            return
        except Exception as err:  # the server must survive anything a request triggers
            log.exception("predict failed")
            service.stats.error("internal", client=False)
            self._error(500, "internal", f"{type(err).__name__}: {err}")
            return
        try:
            self._answer(result, answer_type, raw_outputs)
        except wire_json.WireEncodingError as err:
            service.stats.error("encoding", client=False)
            self._error(500, "encoding", str(err))


class ApiServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], service: InferenceService, *, max_body_bytes: int,
                 health: Callable[[], dict[str, Any]] | None = None) -> None:
        super().__init__(address, _Handler)
        self.service = service
        self.health = health  # extra /healthz fields (the store's condition: read-only, recovered)
        self.max_body_bytes = max_body_bytes
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def start(self) -> ApiServer:
        self._thread = threading.Thread(target=self.serve_forever, name="http-api", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        if self._thread is not None:
            self._thread.join(5)
