"""The OpenAPI 3.1 description of the agent's HTTP API: its own routes and the Open Inference
Protocol (KServe v2) routes, served at ``GET /openapi.json``.

Data, independent of the request (no server URL, nothing from the Host header), so the copy
committed as ``schemas/agent-openapi.json`` is the document every agent serves
(``python -m device_agent.http.openapi > schemas/agent-openapi.json`` writes it; a test fails when
it is stale), and schemathesis fuzzes a running agent from it (tests/test_openapi_fuzz_agent.py).
The bounds it states are the ones the agent enforces (``bodies.py``, ``oip.py``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from device_agent.http.oip import DATATYPES, HEADER_LENGTH_HEADER, MAX_RANK
from edgepack_core import __version__
from edgepack_core.protocol.ids import ID_PATTERN

_ERROR_KINDS = ("bad_input, bad_json, bad_query, bad_image, bad_stream, dtype, shape, unknown_input, "
                "non_finite_input, too_large, image_too_large, timeout, unsupported_media, not_acceptable, "
                "not_found, method_not_allowed, no_stream, no_model, busy, bad_http; the model's failures (500): "
                "runtime, postprocess, non_finite_output, encoding, internal")

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object", "required": ["error"], "additionalProperties": False,
        "properties": {"error": {"type": "object", "required": ["kind", "message"], "additionalProperties": False,
                                 "properties": {"kind": {"type": "string", "description": _ERROR_KINDS},
                                                "message": {"type": "string", "maxLength": 500}}}},
    },
    "V2Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
    "Model": {"type": "object", "required": ["name", "version"],
              "properties": {"name": {"type": "string"}, "version": {"type": "string"}}},
    "Health": {
        "type": "object", "required": ["status"],
        "properties": {"status": {"type": "string", "description": "ok; degraded (serving, the reasons in "
                                                                  "degraded: a full disk); or why not (no model)"},
                       "degraded": {"type": "array", "items": {"type": "string"},
                                    "description": "why the device is degraded (no space: ...)"},
                       "model": {"type": "object", "description": "the active model, its provider and hash "
                                                                  "(the first of models)"},
                       "memory": {"type": "object", "description": "the agent's resident memory: rss_bytes, "
                                  "anonymous_bytes (its own), file_bytes (libraries' pages), release (on, off or "
                                  "unsupported: why) and released_bytes (what the last release gave back)",
                                  "properties": {"rss_bytes": {"type": "integer"},
                                                 "anonymous_bytes": {"type": "integer"},
                                                 "file_bytes": {"type": "integer"},
                                                 "release": {"type": "string"},
                                                 "released_bytes": {"type": "integer"}}},
                       "models": {"type": "array", "description": "every model installed: name, version, "
                                                                  "provider, state, model_bytes",
                                  "items": {"type": "object", "required": ["name", "state"],
                                            "properties": {"name": {"type": "string"},
                                                           "state": {"enum": ["serving", "no model"]}}}}},
    },
    "PredictRequest": {
        "type": "object", "required": ["inputs"],
        "properties": {"inputs": {"type": "object", "description": "input name -> nested list of values",
                                  "additionalProperties": {"type": "array"}}},
    },
    "PredictAnswer": {
        "type": "object", "required": ["model", "provider", "result", "latency_ms"],
        "properties": {
            "model": {"$ref": "#/components/schemas/Model"},
            "provider": {"type": "string"},
            "provider_fallbacks": {"type": "array", "items": {"type": "object"}},
            "outputs": {"type": "object", "description": "raw output tensors (?outputs=raw, or a model without a "
                                                         "task result), at most api.max_json_output_bytes"},
            "result": {"description": "the task result (classification, detection, ...); null for raw models"},
            "geometry": {"type": "object", "description": "detection: model-input pixels to the image's"},
            "non_finite_outputs": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                   "description": "the outputs holding NaN/inf that the recipe allows "
                                                  "(allow_non_finite); absent when every output is finite"},
            "latency_ms": {"type": "number"},
        },
    },
    "ServerMetadata": {"type": "object", "required": ["name", "version", "extensions"],
                       "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                                      "extensions": {"type": "array", "items": {"type": "string"}}}},
    "TensorMetadata": {"type": "object", "required": ["name", "datatype", "shape"],
                       "properties": {"name": {"type": "string"}, "datatype": {"type": "string"},
                                      "shape": {"type": "array", "items": {"type": "integer", "minimum": -1}}}},
    "ModelMetadata": {
        "type": "object", "required": ["name", "versions", "platform", "inputs", "outputs"],
        "properties": {"name": {"type": "string"}, "versions": {"type": "array", "items": {"type": "string"}},
                       "platform": {"type": "string"},
                       "inputs": {"type": "array", "items": {"$ref": "#/components/schemas/TensorMetadata"}},
                       "outputs": {"type": "array", "items": {"$ref": "#/components/schemas/TensorMetadata"}}},
    },
    "Parameters": {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}},
    "InferRequest": {
        "type": "object", "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"$ref": "#/components/schemas/Parameters"},
            "inputs": {"type": "array", "items": {
                "type": "object", "required": ["name", "shape", "datatype"],
                "properties": {
                    "name": {"type": "string"},
                    "shape": {"type": "array", "maxItems": MAX_RANK,
                              "items": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}},
                    "datatype": {"enum": sorted(set(DATATYPES.values()))},
                    "parameters": {"$ref": "#/components/schemas/Parameters"},
                    "data": {"type": "array", "description": "flat or nested; absent with binary_data_size"}}}},
            "outputs": {"type": "array", "items": {
                "type": "object", "required": ["name"],
                "properties": {"name": {"type": "string"},
                               "parameters": {"$ref": "#/components/schemas/Parameters"}}}},
        },
    },
    "InferResponse": {
        "type": "object", "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"}, "model_version": {"type": "string"}, "id": {"type": "string"},
            "outputs": {"type": "array", "items": {
                "type": "object", "required": ["name", "datatype", "shape"],
                "properties": {"name": {"type": "string"}, "datatype": {"type": "string"},
                               "shape": {"type": "array", "items": {"type": "integer"}},
                               "parameters": {"$ref": "#/components/schemas/Parameters"},
                               "data": {"type": "array"}}}},
        },
    },
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: str, v2: bool = False) -> dict[str, Any]:
    """The error answers of an operation, in the documented JSON shape (v2: the protocol's)."""
    what = {"400": "malformed request (body, query, headers)", "404": "no such model, stream or path",
            "405": "method not allowed (Allow names the methods)", "406": "Accept takes neither JSON nor npz",
            "408": "the body did not arrive within api.read_timeout_s", "413": "over a size bound (api.max_*)",
            "415": "a media type the model does not take",
            "500": "the model's failure: runtime, postprocess, non_finite_output (NaN/inf in an output the "
                   "recipe does not allow), encoding, internal",
            "503": "busy (Retry-After) or no model"}
    return {status: _json(what[status], _ref("V2Error" if v2 else "Error")) for status in statuses}


_BINARY = {"schema": {"type": "string", "format": "binary"}}
_INFER_ERRORS = ("400", "404", "408", "413", "415", "500", "503")
_MODEL_PARAMETERS = [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]
_VERSION = {"name": "version", "in": "path", "required": True, "schema": {"type": "string"}}


def _v2_model_operations(prefix: str, parameters: list[dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        ("get", prefix, {"summary": "Model metadata (v2): inputs a caller feeds, every output, symbolic dims -1",
                         "parameters": parameters,
                         "responses": {"200": _json("metadata", _ref("ModelMetadata")), **_errors("404", v2=True)}}),
        ("get", prefix + "/ready", {"summary": "Whether this model is the one being served (v2)",
                                    "parameters": parameters,
                                    "responses": {"200": {"description": "ready"},
                                                  "404": {"description": "not this agent's model"}}}),
        ("post", prefix + "/infer", {
            "summary": "Inference (v2), JSON tensors or the binary tensor data extension",
            "parameters": [*parameters, {"name": HEADER_LENGTH_HEADER, "in": "header", "required": False,
                                         "schema": {"type": "string", "pattern": "^[0-9]{1,20}$"},
                                         "description": "bytes of JSON before the binary tensor data"}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("InferRequest")},
                                                          "application/octet-stream": _BINARY}},
            "responses": {"200": {"description": "outputs (binary data after the JSON when any is binary)",
                                  "content": {"application/json": {"schema": _ref("InferResponse")},
                                              "application/octet-stream": _BINARY}},
                          **_errors(*_INFER_ERRORS, v2=True)}}),
    ]


def _predict(summary: str, parameters: list[dict[str, Any]]) -> dict[str, Any]:
    """``POST /predict`` and ``POST /predict/{model}``: one body, one answer; the path may name the model."""
    return {
        "summary": summary,
        "parameters": [
            *parameters,
            {"name": "outputs", "in": "query", "required": False, "schema": {"enum": ["raw", "result"]},
             "description": "raw: add the raw output tensors to a JSON answer; result: leave them out"},
            {"name": "X-Edgepack-Stream", "in": "header", "required": False,
             "schema": {"type": "string", "pattern": ID_PATTERN}, "description": "stateful models: the stream"},
            {"name": "X-Edgepack-Stream-Reset", "in": "header", "required": False, "schema": {"enum": ["0", "1"]},
             "description": "1: restart the stream first"}],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": _ref("PredictRequest")},
            "application/x-npy": _BINARY, "application/x-npz": _BINARY, "application/octet-stream": _BINARY,
            "image/jpeg": _BINARY, "image/png": _BINARY, "audio/wav": _BINARY}},
        "responses": {"200": {"description": "the answer: JSON, or exact tensors as npz on Accept: "
                                             "application/x-npz (model, provider, latency in X-Edgepack-*)",
                              "content": {"application/json": {"schema": _ref("PredictAnswer")},
                                          "application/x-npz": _BINARY}},
                      **_errors("400", "404", "406", "408", "413", "415", "500", "503")}}


OPERATIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("get", "/healthz", {"summary": "Health: 200 with the active model, 503 without one",
                         "responses": {"200": _json("serving", _ref("Health")),
                                       "503": _json("not serving (the reason in status)", _ref("Health"))}}),
    ("get", "/metrics", {"summary": "Prometheus text (version 0.0.4): requests, errors, latency, load",
                         "responses": {"200": {"description": "metrics", "content": {
                             "text/plain": {"schema": {"type": "string"}}}}}}),
    ("get", "/openapi.json", {"summary": "This document",
                              "responses": {"200": _json("the OpenAPI document", {"type": "object"})}}),
    ("post", "/predict", _predict("Inference on the only model: an image, a WAV file, npy/npz tensors or JSON "
                                  "tensors (400 model_required when several are installed)", [])),
    ("post", "/predict/{model}", _predict("Inference on the named model (404 naming the installed ones otherwise)",
                                          [{"name": "model", "in": "path", "required": True,
                                            "schema": {"type": "string"}}])),
    ("delete", "/streams/{stream}", {
        "summary": "Forget a stream's state (its next call starts from init)",
        "parameters": [{"name": "stream", "in": "path", "required": True,
                        "schema": {"type": "string", "pattern": ID_PATTERN}}],
        "responses": {"204": {"description": "forgotten"}, **_errors("400", "404")}}),
    ("get", "/v2", {"summary": "Server metadata (v2)",
                    "responses": {"200": _json("metadata", _ref("ServerMetadata"))}}),
    ("get", "/v2/health/live", {"summary": "Liveness (v2)", "responses": {"200": {"description": "live"}}}),
    ("get", "/v2/health/ready", {"summary": "Readiness (v2): a model is active",
                                 "responses": {"200": {"description": "ready"},
                                               "400": {"description": "no model"}}}),
    *_v2_model_operations("/v2/models/{name}", _MODEL_PARAMETERS),
    *_v2_model_operations("/v2/models/{name}/versions/{version}", [*_MODEL_PARAMETERS, _VERSION]),
]


def describe() -> dict[str, Any]:
    """The whole document (the same for every agent of this version)."""
    paths: dict[str, dict[str, Any]] = {}
    for method, path, operation in OPERATIONS:
        paths.setdefault(path, {})[method] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "Edgepack agent", "version": __version__,
                 "description": "The device agent's local HTTP API (docs/agent.md, \"HTTP API\") and the Open "
                                "Inference Protocol (KServe v2 REST). No authentication: put a reverse proxy or a "
                                "firewall in front when it listens beyond localhost. Errors are "
                                "{\"error\": {\"kind\", \"message\"}}; on /v2 routes {\"error\": message}."},
        "components": {"schemas": SCHEMAS},
        "paths": paths,
    }


def document_bytes() -> bytes:
    """The document as the committed copy and ``GET /openapi.json`` carry it."""
    return json.dumps(describe(), indent=2, sort_keys=True).encode() + b"\n"


if __name__ == "__main__":
    sys.stdout.buffer.write(document_bytes())
