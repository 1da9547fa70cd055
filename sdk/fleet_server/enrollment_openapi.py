"""The OpenAPI operations and request schemas of device enrollment (:mod:`.enrollment_api`),
listed by :mod:`.openapi` (kept apart so neither module grows past its size)."""

from __future__ import annotations

from typing import Any

from edgepack_core.protocol.ids import ID_PATTERN
from sdk.fleet_server.ca import MAX_CSR_BYTES
from sdk.fleet_server.enrollment import MAX_TOKEN_TTL_S, MIN_TOKEN_TTL_S
from sdk.fleet_server.enrollment_tables import MAX_LISTED_CERTIFICATES

MAX_GROUPS = 64  # as PUT /api/devices/{id}/groups
_GROUP = {"type": "string", "pattern": ID_PATTERN, "maxLength": 64}
_ERROR = {"$ref": "#/components/schemas/Error"}
TOKEN_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "groups": {
            "type": "array",
            "maxItems": MAX_GROUPS,
            "items": _GROUP,
            "description": "every group the device belongs to once enrolled (held by the server)",
        },
        "password": {"type": "boolean", "description": "a broker password (delivered once) instead of a certificate"},
        "expires_in_s": {
            "type": "number",
            "minimum": MIN_TOKEN_TTL_S,
            "maximum": MAX_TOKEN_TTL_S,
            "description": "how long the token may be used (default 24 h)",
        },
        "reason": {"type": "string", "maxLength": 500},
    },
}
ENROLL_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["token"],
    "properties": {
        "token": {
            "type": "string",
            "minLength": 16,
            "maxLength": 128,
            "pattern": "^[A-Za-z0-9_-]+$",
            "description": "the one-time token edgepack fleet enroll printed",
        },
        "csr": {
            "type": "string",
            "description": f"PEM CSR whose subject CN is the device id; over {MAX_CSR_BYTES} bytes (UTF-8) it is "
            "refused with 413 before it is parsed",
        },
    },
}
REVOKE_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"reason": {"type": "string", "maxLength": 500}},
}
_DEVICE = {
    "name": "device_id",
    "in": "path",
    "required": True,
    "description": "device id",
    "schema": {"type": "string", "pattern": ID_PATTERN},
}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _body(schema: dict[str, Any], required: bool) -> dict[str, Any]:
    return {"required": required, "content": {"application/json": {"schema": schema}}}


OPERATIONS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "post",
        "/api/devices/{device_id}/enrollment",
        {
            "summary": "A one-time enrollment token for a device (admins; audited as device.enroll_identity): "
            "the device redeems it with a CSR (edgepack-agent enroll) or, with password, for a broker password",
            "parameters": [_DEVICE],
            "requestBody": _body(TOKEN_REQUEST_SCHEMA, False),
            "responses": {
                "201": _json(
                    "the token (shown once)",
                    {
                        "type": "object",
                        "properties": {
                            "device": {"type": "string"},
                            "token": {"type": "string"},
                            "kind": {"type": "string"},
                            "groups": {"type": "array", "items": {"type": "string"}},
                            "expires_at": {"type": "number"},
                        },
                    },
                ),
                "503": _json("this server enrolls no devices", _ERROR),
            },
        },
    ),
    (
        "post",
        "/api/enroll",
        {
            "summary": "A device redeems its one-time token (no bearer token: the one-time token is the "
            "authentication): a certificate for its CSR, or a broker password, with the CA bundle, the "
            "broker address and its groups",
            "security": [],
            "requestBody": _body(ENROLL_REQUEST_SCHEMA, True),
            "responses": {
                "200": _json(
                    "the device's credentials",
                    {
                        "type": "object",
                        "properties": {
                            "device": {"type": "string"},
                            "certificate": {"type": "string"},
                            "ca": {"type": "string"},
                            "serial": {"type": "string"},
                            "not_after": {"type": "number"},
                            "username": {"type": "string"},
                            "password": {"type": "string"},
                            "broker": {"type": "object"},
                            "groups": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                ),
                "403": _json("the token is unknown, used, expired, or for another device than the CSR's CN", _ERROR),
                "413": _json("the body or the CSR is over its limit", _ERROR),
                "422": _json("the CSR is not one, or its signature or key is refused", _ERROR),
            },
        },
    ),
    (
        "post",
        "/api/devices/{device_id}/revoke",
        {
            "summary": "Revoke a device's certificates (into the CRL the broker reads) and broker password (admins; "
            "audited as device.revoke); a decommission does it too",
            "parameters": [_DEVICE],
            "requestBody": _body(REVOKE_REQUEST_SCHEMA, False),
            "responses": {
                "200": _json(
                    "revoked",
                    {
                        "type": "object",
                        "properties": {
                            "device": {"type": "string"},
                            "revoked": {"type": "array", "items": {"type": "string"}},
                            "password_removed": {"type": "boolean"},
                            "reason": {"type": "string"},
                        },
                    },
                ),
                "404": _json("the device holds no certificate or password", _ERROR),
            },
        },
    ),
    (
        "get",
        "/api/devices/{device_id}/credentials",
        {
            "summary": "A device's newest certificates (serial and validity, never the certificate) and whether it "
            "holds a broker password; empty for a device never enrolled through the server",
            "parameters": [_DEVICE],
            "responses": {
                "200": _json(
                    "the device's credentials",
                    {
                        "type": "object",
                        "required": ["device", "certificates", "password"],
                        "properties": {
                            "device": {"type": "string"},
                            "certificates": {
                                "type": "array",
                                "maxItems": MAX_LISTED_CERTIFICATES,
                                "items": {
                                    "type": "object",
                                    "properties": {
                                        "serial": {"type": "string"},
                                        "issued_at": {"type": "number"},
                                        "not_before": {"type": "number"},
                                        "not_after": {"type": "number"},
                                        "revoked_at": {"type": ["number", "null"]},
                                        "renewal_from": {
                                            "type": "number",
                                            "description": "when the server starts rotating it (past 2/3 of "
                                            "its life); the dashboard warns from then",
                                        },
                                    },
                                },
                            },
                            "password": {"type": "boolean"},
                        },
                    },
                ),
            },
        },
    ),
]
