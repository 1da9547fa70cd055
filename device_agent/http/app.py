"""The local HTTP API: ``POST /predict``, ``GET /healthz``, ``GET /metrics`` (Prometheus),
``DELETE /streams/ID`` and the Open Inference Protocol (KServe v2 REST, ``oip.py``).

Routes on the agent's own small router (``web.py``: no web framework on a device) behind the
guard (``guards.py``), served by the agent's HTTP/1.1 server on h11 (``server.py``, with the
connection cap, the head deadline, JSON protocol errors and lingering close). Everything from
the network is bounded here, so the API can face a network (docs/agent.md, "HTTP API"):

- read timeouts: a request's head must arrive within ``read_timeout_s`` of the connection (or of
  the previous answer), and its body within ``read_timeout_s`` of its head, or the client gets
  ``408`` and the connection closes; idle kept-alive connections close after ``keep_alive_s``;
- at most ``max_connections`` connections and a few more kept for health checks (the one
  waiting longest for its head is evicted for a new one; ``admission.py``), at
  most ``workers`` requests decoding and inferring at once in a thread pool (never on the event
  loop), ``max_queue`` more waiting, and ``max_buffered_bytes`` of bodies held, counted as their
  bytes arrive (a declared length reserves nothing); beyond, ``503``;
- a body is either consumed or the connection closed with ``Connection: close`` (a body
  left unread is never parsed as the next request), and a closing connection lingers to
  discard what the client still sends, so it reads the answer rather than a reset;
- every body is bounded before it is decoded (``bodies.py``), a batch by
  ``max_batch_bytes``, and raw outputs by ``max_json_output_bytes`` before they are encoded
  as JSON (413 pointing to npz);
- every error is ``{"error": {"kind", "message"}}`` (the v2 endpoints answer the protocol's
  ``{"error": message}``) with its status, also for protocol errors h11 refuses, and every
  answer is counted by status class in ``/metrics``.

POST /predict takes:
  - ``image/*`` (or ``application/octet-stream`` for an image model): raw image bytes
  - ``application/x-npy`` / ``application/x-npz``: one array / named arrays
  - ``application/json``: ``{"inputs": {name: nested list}}``
  - ``audio/wav`` (or any RIFF/WAVE body) for an audio model: run frame by frame, outputs stacked
With ``X-Edgepack-Stream: ID`` a stateful model continues that stream's state
(``X-Edgepack-Stream-Reset: 1`` restarts it first; ``DELETE /streams/ID`` forgets it),
and answers the ``predict --json`` object as strict JSON (``edgepack_core.wire_json``), or, when
the request says ``Accept: application/x-npz``, the exact output tensors as ``np.savez`` bytes
with the model, provider and latency in ``X-Edgepack-*`` headers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from device_agent import models
from device_agent.config import ApiSettings
from device_agent.errors import AgentError, BadRequest, Busy, NoModelError, RequestError
from device_agent.http import admission, bodies
from device_agent.http.answers import error_response, json_response, status_of
from device_agent.http.guards import Guard
from device_agent.http.negotiation import (
    ANSWER_TYPES,
    JSON_MEDIA_TYPE,
    BodyKind,
    body_kind,
    choose_answer_type,
    media_type,
    outputs_wanted,
)
from device_agent.http.prometheus import (
    HttpStats,
    load_gauges,
    pipeline_latency_metrics,
    pipeline_metrics,
    prometheus_text,
)
from device_agent.http.results import includes_outputs, npz_headers, prediction_json
from device_agent.http.web import Request, Response, Route, Router
from device_agent.prediction import Array, Audio, EncodedImage, Input, PredictRequest, PredictResult, Tensors
from device_agent.runtime import InferenceService, LoadedModel
from device_agent.updates.health import CONTRACT_ERROR_KINDS
from edgepack_core import __version__, wire_json
from edgepack_core.errors import WireEncodingError

if TYPE_CHECKING:
    from device_agent.pipelines.host import PipelineReading

log = logging.getLogger("edgepack.agent.http")

# Stateful models: the stream whose state a request continues, and a header to restart it.
STREAM_HEADER = "X-Edgepack-Stream"
STREAM_RESET_HEADER = "X-Edgepack-Stream-Reset"
# Answers after which the connection closes: the body was refused unread, or never came.
CLOSING_STATUSES = (408, 413, 503)


@dataclass(frozen=True)
class _Exchange:
    """One inference request between the event loop and a worker (its body travels beside it)."""

    content_type: str
    stream: str | None
    reset_stream: bool
    kind: BodyKind | None = None  # how the body decodes, when its media type says it (else its first bytes)
    answer_type: str = JSON_MEDIA_TYPE
    raw_outputs: bool | None = None
    header_length: str | None = None  # v2: Inference-Header-Content-Length
    peer: str = ""  # the client's address, for the health window's contract-error rule
    service: InferenceService | None = None  # the model's service the request is for (None: the app's)


# ---------------------------------------------------------------------------------------- the app


class AgentApp:
    """The app over one ``InferenceService``: routes, admission, bounded body reads;
    decoding and inference in a bounded thread pool."""

    def __init__(self, service: InferenceService, settings: ApiSettings,
                 health: Callable[[], dict[str, Any]] | None = None,
                 models: Callable[[], Mapping[str, InferenceService]] | None = None,
                 pipelines: Callable[[], Sequence[PipelineReading]] | None = None) -> None:
        self.service = service
        self.pipelines = pipelines or (lambda: ())  # the pipelines read once (/metrics)
        # The services of the models installed, by name (several named models: the daemon's
        # ModelSet); without it, ``service`` alone, named by the model it serves.
        self.models = models or self._single
        self.settings = settings
        self.health = health  # extra /healthz fields (the store's condition: read-only, recovered)
        pixels = settings.max_image_pixels or bodies.default_max_image_pixels()
        self.limits = bodies.BodyLimits(max_body_bytes=settings.max_body_bytes,
                                        max_json_bytes=settings.max_json_bytes,
                                        max_decoded_bytes=settings.max_decoded_bytes, max_image_pixels=pixels,
                                        max_batch_bytes=settings.max_batch_bytes,
                                        max_json_output_bytes=settings.max_json_output_bytes)
        self.images = bodies.ImageGate(pixels, settings.max_image_decodes)
        self.http_stats = HttpStats()
        self._openapi: bytes | None = None  # made with the first request for it (openapi.py)
        self.pool = ThreadPoolExecutor(max_workers=settings.workers, thread_name_prefix="http-worker")
        self._admitted = 0  # requests holding a slot (event loop only: no lock)
        self.buffered = admission.BodyBudget(settings.max_buffered_bytes)  # body bytes held (event loop only)
        routes = [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/openapi.json", self.openapi, methods=["GET"]),
            Route("/predict", self.predict, methods=["POST"]),
            Route("/predict/{model}", self.predict, methods=["POST"]),
            Route("/streams/{stream}", self.delete_stream, methods=["DELETE"]),
            Route("/v2", self.v2_server, methods=["GET"]),
            Route("/v2/health/live", self.v2_live, methods=["GET"]),
            Route("/v2/health/ready", self.v2_ready, methods=["GET"]),
        ]
        for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            routes += [Route(prefix, self.v2_metadata, methods=["GET"]),
                       Route(prefix + "/ready", self.v2_model_ready, methods=["GET"]),
                       Route(prefix + "/infer", self.v2_infer, methods=["POST"])]
        self.router = Router(routes, miss=self._miss, crash=self._crash)
        self.asgi = Guard(self.router, self.http_stats, settings.read_timeout_s)

    # ------------------------------------------------------------ errors

    def _miss(self, request: Request, allowed: frozenset[str] | None) -> Response:
        """No route: 404 for the path, 405 naming the methods its route allows."""
        v2 = request.path.startswith("/v2")
        if allowed is not None:
            allow = ", ".join(sorted(allowed))
            return error_response(405, "method_not_allowed", f"{request.method} is not allowed on "
                                  f"{request.path[:200]}; allowed: {allow}", v2=v2, headers={"Allow": allow})
        return error_response(404, "not_found", f"no such endpoint {request.path[:200]}", v2=v2)

    def _crash(self, request: Request, exc: Exception) -> Response:
        log.error("request to %s failed", request.path[:200], exc_info=exc)
        return error_response(500, "internal", f"{type(exc).__name__}: {exc}", v2=request.path.startswith("/v2"))

    def _refuse(self, err: RequestError | NoModelError, *, v2: bool = False, counted: bool = False,
                metric_kind: str | None = None, peer: str = "", service: InferenceService | None = None) -> Response:
        """An inference request's error answer; counted in the request metrics of ``service``
        (the model it was for; None: the only model, if one) as ``metric_kind`` when given,
        unless the runtime already counted it. A contract error's ``peer`` is remembered: the
        health window counts distinct clients (updates/health.py)."""
        status = status_of(err)
        kind = err.kind if isinstance(err, RequestError) else "no_model"
        counter = service or self._only_service()
        if not counted and counter is not None:
            counter.stats.error(metric_kind or kind, client=status < 500)
        if peer and (metric_kind or kind) in CONTRACT_ERROR_KINDS and counter is not None:
            counter.stats.contract_error_from(peer)
        headers = {"Retry-After": "1"} if kind == "busy" else {}
        if status in CLOSING_STATUSES:  # the body is not (or no longer) read: nothing more to frame
            headers["Connection"] = "close"
        return error_response(status, kind, str(err), v2=v2, headers=headers)

    # ------------------------------------------------------------ models

    def _single(self) -> dict[str, InferenceService]:
        model = self.service.model
        return {} if model is None else {model.manifest.name: self.service}

    def _only_service(self) -> InferenceService | None:
        """The service of the only model installed (None with none or several): where a request
        that names no model, or names one not installed, is counted."""
        services = self.models()
        if not services:
            return self.service
        return next(iter(services.values())) if len(services) == 1 else None

    def _service_for(self, name: str | None) -> InferenceService:
        """The service of model ``name`` (None: the only one); BadRequest (404 naming the
        installed models, or 400 when several are and none is named) or NoModelError."""
        services = self.models()
        return services[models.choose(tuple(services), name)]

    # ------------------------------------------------------------ plain endpoints

    async def healthz(self, request: Request) -> Response:
        """The first model as ``model`` (for readers that know one) and every model in ``models``."""
        services = self.models()
        extra = self.health() if self.health is not None else {}
        described = [models.describe_service(name, service) for name, service in services.items()]
        serving = [entry for entry in described if entry["state"] == "serving"]
        if not serving:
            return json_response(503, {**extra, "status": "no model", "models": described})
        # serving, but ``extra`` may say "degraded" and why (a full disk: updates/disk.py)
        first = {key: value for key, value in serving[0].items() if key not in ("state", "model_bytes")}
        return json_response(200, {"status": "ok", "model": first, "models": described, **extra})

    async def metrics(self, request: Request) -> Response:
        readings = self.pipelines()  # one snapshot: the counters and histograms agree
        text = prometheus_text(self.models() or {"": self.service}, self.http_stats) + load_gauges(
            self._admitted, self.buffered.held) + pipeline_metrics([r.figures() for r in readings]) + \
            pipeline_latency_metrics({r.name: r.latency for r in readings if r.latency is not None})
        return Response(text.encode(), 200, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def openapi(self, request: Request) -> Response:
        """This API's OpenAPI document (``openapi.py``; the same for every request), made when
        first asked for: an idle agent does not hold its 36 kB nor the module."""
        if self._openapi is None:
            from device_agent.http import openapi

            self._openapi = openapi.document_bytes()
        return Response(self._openapi, 200, media_type=JSON_MEDIA_TYPE)

    async def delete_stream(self, request: Request) -> Response:
        """``DELETE /streams/ID``: forget a stream's state (204; 404 when it is not kept)."""
        try:
            # stream ids are the clients': forgotten in every model that keeps one of that id
            existed = any([service.reset_stream(request.path_params["stream"])
                           for service in (self.models() or {"": self.service}).values()])
        except BadRequest as err:
            return error_response(err.http_status, err.kind, str(err))
        if existed:
            return Response(status_code=204)
        return error_response(404, "no_stream", "no such stream (never opened, expired or dropped)")

    # ------------------------------------------------------------ /predict

    async def predict(self, request: Request) -> Response:
        """Refuse what the head already rules out (the query, ``Accept``, a body type the model
        cannot take: 415 before a byte of the body), then serve on a worker. ``/predict/{model}``
        names the model; ``/predict`` is for the only one."""
        service: InferenceService | None = None
        try:
            service = self._service_for(request.path_params.get("model"))
            model = service.model
            raw_outputs = outputs_wanted(request.query)
            answer_type = choose_answer_type(request.headers.get("accept"))
            if answer_type is None:
                raise BadRequest("not_acceptable", f"answers come as {' or '.join(ANSWER_TYPES)}", http_status=406)
            if model is None:
                raise NoModelError("no model is active")
            content_type = media_type(request.headers.get("content-type"))
            kind = None
            if content_type not in ("", "application/octet-stream"):  # known before a byte of the body
                kind = body_kind(content_type, b"", image_model=model.image_input is not None,
                                 audio_model=model.audio_input is not None)
        except (BadRequest, NoModelError) as err:
            return self._refuse(err, peer=peer_address(request), service=service)
        exchange = _exchange(request, content_type, kind=kind, answer_type=answer_type, raw_outputs=raw_outputs,
                             service=service)
        return await self._serve(request, exchange, self._predict_work)

    def _predict_work(self, exchange: _Exchange, body: bytes) -> Response:
        """Decode, infer and encode one /predict request (a worker thread)."""
        service = exchange.service or self.service
        try:
            request = self._request(exchange, body)
        except _JsonInputError as err:
            # counted for the health window: an unknown input name is the contract's doing;
            # values that do not convert are malformed input, never the model's
            return self._refuse(err.error, metric_kind="unknown_input" if err.error.kind == "unknown_input"
                                else "bad_input", peer=exchange.peer, service=service)
        except (BadRequest, NoModelError) as err:
            return self._refuse(err, peer=exchange.peer, service=service)
        try:
            if isinstance(request.input, EncodedImage):
                with self.images.slot():  # at most max_image_decodes decoded images in memory
                    result = service.predict(request)
            else:
                result = service.predict(request)
        except RequestError as err:  # the runtime counted its own
            return self._refuse(err, counted=True, peer=exchange.peer, service=service)
        except NoModelError as err:
            return self._refuse(err, service=service)
        except Exception as err:  # the server must survive anything a request triggers
            log.exception("predict failed")
            service.stats.error("internal", client=False)
            return error_response(500, "internal", f"{type(err).__name__}: {err}")
        return self._answer(result, exchange)

    def _model_for(self, exchange: _Exchange) -> LoadedModel:
        """The active model a worker serves ``exchange`` on, its stream restarted first when asked."""
        service = exchange.service or self.service
        model = service.model
        if model is None:
            raise NoModelError("no model is active")
        if exchange.stream is not None and exchange.reset_stream:
            service.reset_stream(exchange.stream)
        return model

    def _request(self, exchange: _Exchange, body: bytes) -> PredictRequest:
        """The typed request of a /predict body: its kind as negotiated on the event loop, or
        (``application/octet-stream``, no type) from its first bytes, decided here once."""
        model = self._model_for(exchange)
        kind = exchange.kind or body_kind(exchange.content_type, body[:8], image_model=model.image_input is not None,
                                          audio_model=model.audio_input is not None)
        return PredictRequest(self._decode(kind, body, model), exchange.stream)

    def _decode(self, kind: BodyKind, body: bytes, model: LoadedModel) -> Input:
        """The body as a typed input: arrays for JSON and numpy bodies (bounded, checked against
        the model's inputs), the bytes themselves for images (with their header, read and checked) and audio."""
        if kind == "json":
            document = bodies.parse_json(body, self.limits)
            inputs = document.get("inputs") if isinstance(document, dict) else None
            try:
                return Tensors(bodies.json_to_feed(model.input_specs, inputs, self.limits))
            except BadRequest as err:
                raise _JsonInputError(err) from err
        if kind == "numpy":
            decoded = bodies.decode_numpy(body, model.input_specs, self.limits, image_input=model.image_input)
            return Array(decoded) if isinstance(decoded, np.ndarray) else Tensors(decoded)
        if kind == "audio":
            return Audio(body)
        return EncodedImage(body, self.images.open(body))  # the header only: format and pixel count

    def _answer(self, result: PredictResult, exchange: _Exchange) -> Response:
        """The 200 answer of /predict in the negotiated media type; raw outputs in JSON bounded
        before they are encoded (413 pointing to npz)."""
        try:
            if exchange.answer_type != wire_json.NPZ_MEDIA_TYPE:
                if includes_outputs(result, exchange.raw_outputs):
                    bodies.check_json_outputs(sum(value.nbytes for value in result.outputs.values()), self.limits,
                                              f"ask for them as npz (Accept: {wire_json.NPZ_MEDIA_TYPE})")
                return json_response(200, prediction_json(result, outputs=exchange.raw_outputs))
            return Response(wire_json.npz_bytes(result.outputs), 200, npz_headers(result), wire_json.NPZ_MEDIA_TYPE)
        except WireEncodingError as err:
            (exchange.service or self.service).stats.error("encoding", client=False)
            return error_response(500, "encoding", str(err))
        except BadRequest as err:
            return self._refuse(err, service=exchange.service)

    # ------------------------------------------------------------ admission and bodies

    async def _serve(self, request: Request, exchange: _Exchange, work: Callable[[_Exchange, bytes], Response], *,
                     v2: bool = False) -> Response:
        """Admit the request (503 beyond the queue or the buffer), read its body within the
        limits and the read timeout, then run ``work`` on a worker thread."""
        settings = self.settings
        declared = request.headers.get("content-length")
        size = int(declared) if declared is not None and declared.isdigit() else None
        if size is not None and size > settings.max_body_bytes:
            return self._refuse(bodies.too_large("body", size, settings.max_body_bytes), v2=v2)
        if self._admitted >= settings.workers + settings.max_queue:
            return self._refuse(Busy("the agent is busy (api.workers and api.max_queue are taken): retry later"),
                                v2=v2)
        self._admitted += 1
        held = [0]  # body bytes this request holds in the budget, counted as they arrive
        try:
            body = await self._read_body(request, held)
            return await asyncio.get_running_loop().run_in_executor(self.pool, work, exchange, body)
        except RequestError as err:  # a body refused or too many held (Busy)
            return self._refuse(err, v2=v2)
        finally:
            self._admitted -= 1
            self.buffered.give(held[0])

    async def _read_body(self, request: Request, held: list[int]) -> bytes:
        """The whole body, at most ``max_body_bytes`` (413), within ``read_timeout_s`` (408).
        The deadline is one timer that cancels this task (``asyncio.wait_for`` would start a
        task per read; ``asyncio.timeout`` needs Python 3.11)."""
        timeout = self.settings.read_timeout_s
        task = asyncio.current_task()
        assert task is not None
        expired: list[bool] = []

        def expire() -> None:
            expired.append(True)
            task.cancel()

        timer = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            return await self._receive_all(request, held)
        except asyncio.CancelledError:
            if not expired:
                raise
            if hasattr(task, "uncancel"):  # Python 3.11+: this cancellation was ours, and is handled
                task.uncancel()
            raise BadRequest("timeout", f"the body did not arrive within {timeout:g} s (api.read_timeout_s)",
                             http_status=408) from None  # the cancellation has nothing more to say
        finally:
            timer.cancel()

    async def _receive_all(self, request: Request, held: list[int]) -> bytes:
        """The body's chunks as they arrive, each held in the body budget (``held[0]``: what
        this request holds) only once its bytes are here: 503 ``busy`` when they do not fit."""
        limit = self.settings.max_body_bytes
        chunks, size = [], 0
        while True:
            chunk, more = await request.chunk()
            size += len(chunk)
            if size > limit:
                raise bodies.too_large("body", size, limit)
            if not self.buffered.take(len(chunk)):
                raise Busy("the agent holds api.max_buffered_bytes of request bodies: retry later")
            held[0] += len(chunk)
            chunks.append(chunk)
            if not more:
                return b"".join(chunks)

    # ------------------------------------------------------------ Open Inference Protocol (v2)

    async def v2_server(self, request: Request) -> Response:
        from device_agent.http import oip  # with the first v2 request: /predict alone never loads it

        return json_response(200, oip.server_metadata(__version__))

    async def v2_live(self, request: Request) -> Response:
        return Response(status_code=200)

    async def v2_ready(self, request: Request) -> Response:
        ready = any(service.model is not None for service in self.models().values())
        return Response(status_code=200 if ready else 400)

    def _v2_model(self, request: Request) -> tuple[InferenceService, LoadedModel]:
        """The service and active model the URL names (and its version, when given)."""
        services = self.models()
        name, version = request.path_params["name"], request.path_params.get("version")
        service = services.get(name)
        model = None if service is None else service.model
        if service is None or model is None or version not in (None, model.manifest.version):
            serving = ", ".join(f"{s.model.manifest.name} {s.model.manifest.version}"
                                for s in services.values() if s.model is not None) or "no model"
            wanted = name + (f" version {version}" if version else "")
            raise BadRequest("unknown_model", f"unknown model {wanted[:200]} (this agent serves {serving})",
                             http_status=404)
        return service, model

    async def v2_metadata(self, request: Request) -> Response:
        from device_agent.http import oip  # with the first v2 request: /predict alone never loads it

        try:
            return json_response(200, oip.model_metadata(self._v2_model(request)[1]))
        except BadRequest as err:
            return error_response(err.http_status, err.kind, str(err), v2=True)

    async def v2_model_ready(self, request: Request) -> Response:
        """200 for the model served; 404 for any other (the protocol's 4xx for false, KServe's
        status for a model it does not serve)."""
        try:
            self._v2_model(request)
        except BadRequest:
            return Response(status_code=404)
        return Response(status_code=200)

    async def v2_infer(self, request: Request) -> Response:
        from device_agent.http import oip  # with the first v2 request: /predict alone never loads it

        try:
            service, _ = self._v2_model(request)
        except BadRequest as err:
            return self._refuse(err, v2=True)
        exchange = _exchange(request, media_type(request.headers.get("content-type")),
                             header_length=request.headers.get(oip.HEADER_LENGTH_HEADER), service=service)
        return await self._serve(request, exchange, self._v2_work, v2=True)

    def _v2_work(self, exchange: _Exchange, body: bytes) -> Response:
        """Parse, infer and encode one v2 infer request (a worker thread)."""
        from device_agent.http import oip

        service = exchange.service or self.service
        try:
            model = self._model_for(exchange)
            parsed = oip.parse_infer_request(body, exchange.header_length, model.input_specs,
                                             model.output_names, self.limits)
        except (BadRequest, NoModelError) as err:
            return self._refuse(err, v2=True, peer=exchange.peer, service=service)
        try:
            result = service.predict(PredictRequest(Tensors(parsed.inputs), exchange.stream, postprocess=False))
        except RequestError as err:
            return self._refuse(err, v2=True, counted=True, peer=exchange.peer, service=service)
        except NoModelError as err:
            return self._refuse(err, v2=True, service=service)
        except Exception as err:  # the server must survive anything a request triggers
            log.exception("v2 infer failed")
            service.stats.error("internal", client=False)
            return error_response(500, "internal", f"{type(err).__name__}: {err}", v2=True)
        try:
            body, headers = oip.encode_infer_response(result.model.manifest.name, result.model.manifest.version,
                                                      parsed, result.outputs, self.limits, result.non_finite)
        except BadRequest as err:
            return self._refuse(err, v2=True)
        media = "application/octet-stream" if oip.HEADER_LENGTH_HEADER in headers else JSON_MEDIA_TYPE
        return Response(body, 200, headers, media)


class _JsonInputError(AgentError):
    """A JSON body's inputs that do not fit the model (counted apart from other client errors)."""

    def __init__(self, error: BadRequest) -> None:
        super().__init__(str(error))
        self.error = error


def _exchange(request: Request, content_type: str, **fields: Any) -> _Exchange:
    """An inference request's exchange, with its stream headers (the body comes later)."""
    reset = request.headers.get(STREAM_RESET_HEADER, "").strip().lower() in ("1", "true")
    return _Exchange(content_type, request.headers.get(STREAM_HEADER), reset, peer=peer_address(request), **fields)


def peer_address(request: Request) -> str:
    """The client's IP address ("" when unknown); an IPv4-mapped IPv6 address as plain IPv4."""
    host = request.client
    return host[7:] if host.lower().startswith("::ffff:") and "." in host else host

