"""The answers of the HTTP API: JSON documents and the one error shape,
``{"error": {"kind", "message"}}`` (the v2 endpoints: the protocol's ``{"error": message}``)."""

from __future__ import annotations

import re
from typing import Any

from device_agent.errors import BadRequest, InferenceError, NoModelError, RequestError
from device_agent.http.negotiation import JSON_MEDIA_TYPE
from device_agent.http.web import Response
from edgepack_core import wire_json

MAX_MESSAGE_CHARS = 500
_REPR = re.compile(r"<[^<>]{0,200}? at 0x[0-9a-fA-F]+>")


def clean_message(message: str) -> str:
    """An error message for the wire: one line, bounded, no Python object reprs (pure)."""
    return _REPR.sub("<object>", " ".join(str(message).split()))[:MAX_MESSAGE_CHARS]


def status_of(err: RequestError | NoModelError) -> int:
    """The HTTP status of a request's failure, decided here from its class (pure): a client's
    mistake its own 4xx, the model's failure 500, busy or no model 503 (retry later)."""
    if isinstance(err, BadRequest):
        return err.http_status
    return 500 if isinstance(err, InferenceError) else 503


def json_response(status: int, document: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(wire_json.dumps(document) + b"\n", status, headers, JSON_MEDIA_TYPE)


def error_response(status: int, kind: str, message: str, *, v2: bool = False,
                   headers: dict[str, str] | None = None) -> Response:
    """The documented error shape: ``{"error": {"kind", "message"}}``; on the v2 endpoints the
    protocol's ``{"error": message}``."""
    text = clean_message(message)
    return json_response(status, {"error": text} if v2 else {"error": {"kind": kind, "message": text}}, headers)

