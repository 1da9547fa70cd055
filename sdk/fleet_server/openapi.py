"""The OpenAPI 3.1 description of the fleet server's REST API, served at ``/openapi.json``.

Written as data next to the request schemas the API validates with (the rollout request is
the same dict), and checked by a test against the routes the application really has, in
both directions, so the description cannot drift from the server.
"""

from __future__ import annotations

from typing import Any

from edgepack_core.protocol.ids import ID_PATTERN
from sdk.fleet_server import alerts_http, settings_api
from sdk.fleet_server.actions import ACTION_REQUEST_SCHEMA, ACTIONS
from sdk.fleet_server.bad_releases import REQUEST_SCHEMA as BAD_REQUEST_SCHEMA
from sdk.fleet_server.desired import MAX_MODELS, TARGET_REQUEST_SCHEMA
from sdk.fleet_server.device_logs import OPENAPI_OPERATIONS as LOG_OPERATIONS
from sdk.fleet_server.device_pipelines import PIPELINES_PROPERTY
from sdk.fleet_server.enrollment_openapi import OPERATIONS as ENROLLMENT_OPERATIONS
from sdk.fleet_server.history import DEFAULT_PAGE as HISTORY_DEFAULT_PAGE
from sdk.fleet_server.history import MAX_PAGE as HISTORY_MAX_PAGE
from sdk.fleet_server.history import OUTCOMES as HISTORY_OUTCOMES
from sdk.fleet_server.queries import (
    GROUPS_REQUEST_SCHEMA,
    MAX_DEAD_LETTER_PAGE,
    MAX_ROW_ID,
    ROLLOUT_REQUEST_SCHEMA,
    SHA256_PATTERN,
)
from sdk.fleet_server.report_cards import CARD_SCHEMA as REPORT_CARD_SCHEMA
from sdk.fleet_server.report_cards import OPENAPI_OPERATIONS as REPORT_CARD_OPERATIONS
from sdk.fleet_server.rollouts import STATES

API_VERSION = "1"

_NUMBER_OR_NULL = {"type": ["number", "null"]}
_STRING_OR_NULL = {"type": ["string", "null"]}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object", "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["status", "code", "message"], "properties": {
            "status": {"type": "integer"},
            "code": {"type": "string", "description": "unauthorized, forbidden, not_found, invalid, too_large, "
                                                      "refused, conflict, method_not_allowed, internal"},
            "message": {"type": "string", "description": "one line for a human"},
            "needs": {"type": "string", "description": "forbidden (403) only: the least role that may"}}}},
    },
    "Device": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": ID_PATTERN},
            "online": {"type": "boolean", "description": "last state online and heard from within the silence "
                                                         "window (--silence)"},
            "status": {"type": "string", "enum": ["online", "offline", "unknown"]},
            "status_reason": {"type": "string"},
            "update_status": {"type": ["string", "null"], "enum": ["updating", "failed", "ok", None],
                              "description": "the newest deploy job the device reported: updating (not final), "
                                             "failed (failed, rejected or rolled back), ok; null: none"},
            "model": {"type": ["object", "null"], "properties": {"name": _STRING_OR_NULL, "version": _STRING_OR_NULL,
                                                                  "sha256": _STRING_OR_NULL}},
            "version": _STRING_OR_NULL, "provider": _STRING_OR_NULL, "profile": _STRING_OR_NULL,
            "groups": {"type": "array", "items": {"type": "string"},
                       "description": "the groups the server enrolled the device in (what rollouts target)"},
            "unenrolled_groups": {"type": "array", "items": {"type": "string"},
                                  "description": "groups the device claims that the server did not enroll "
                                                 "(ignored; PUT /api/devices/{device_id}/groups enrolls)"},
            "last_seen": {"type": "number", "description": "unix seconds (server clock)"},
            "first_seen": {"type": "number"},
            "latency_ms": {"type": "object", "properties": {"p50": _NUMBER_OR_NULL, "p90": _NUMBER_OR_NULL,
                                                            "p99": _NUMBER_OR_NULL, "mean": _NUMBER_OR_NULL}},
            "throughput_per_s": _NUMBER_OR_NULL,
            "inferences_total": {"type": ["integer", "null"]},
            "errors_total": {"type": ["integer", "null"]},
            "error_rate": {"type": ["number", "null"], "description": "errors / inferences of the last telemetry "
                                                                      "interval"},
            "cpu_percent": _NUMBER_OR_NULL, "memory_rss_bytes": {"type": ["integer", "null"]},
            "temperature_c": _NUMBER_OR_NULL, "telemetry_at": _NUMBER_OR_NULL,
            "capabilities": {"type": "object", "description": "only on GET /api/devices/{device_id}"},
            "report_cards": {"type": "array", "items": REPORT_CARD_SCHEMA,
                             "description": "only on GET /api/devices/{device_id}: per model, what the device "
                                            "measured at activation (docs/fleet-server.md, \"Report cards\")"},
            "pipelines": PIPELINES_PROPERTY,
        },
    },
    "DeviceList": {
        "type": "object",
        "properties": {
            "devices": {"type": "array", "items": {"$ref": "#/components/schemas/Device"}},
            "total": {"type": "integer", "description": "devices matching the filters (all pages)"},
            "limit": {"type": "integer"}, "offset": {"type": "integer"},
            "counts": {"type": "object", "properties": {
                "online": {"type": "integer"}, "offline": {"type": "integer"},
                "by_version": {"type": "object", "additionalProperties": {"type": "integer"}},
                "by_provider": {"type": "object", "additionalProperties": {"type": "integer"}}}},
        },
    },
    "Telemetry": {
        "type": "object",
        "properties": {
            "device": {"type": "string"}, "since": {"type": "number"}, "until": {"type": "number"},
            "step": {"type": "integer", "description": "seconds per point (raised to a multiple of the rollup step "
                                                       "when the range reaches past the raw window)"},
            "points": {"type": "array", "items": {"type": "object", "properties": {
                "ts": {"type": "integer", "description": "start of the point's bucket, unix seconds"},
                "samples": {"type": "integer"},
                "latency_p50_ms": {"type": ["number", "null"], "description": "mean of the samples' p50"},
                "latency_p99_ms": {"type": ["number", "null"], "description": "largest p99 of the samples"},
                "throughput_per_s": _NUMBER_OR_NULL, "inferences": {"type": "integer"},
                "errors": {"type": "integer"},
                "error_kinds": {"type": "object", "additionalProperties": {"type": "integer"},
                                "description": "the point's errors by the kind the device named (runtime, "
                                               "non_finite_output, ...), at most 32 kinds and other (the rest); errors "
                                               "stored before the server kept kinds have none"},
                "error_rate": _NUMBER_OR_NULL}}},
        },
    },
    "Artifact": {
        "type": "object",
        "properties": {
            "sha256": {"type": "string", "pattern": SHA256_PATTERN}, "name": {"type": "string"},
            "version": {"type": "string"}, "size": {"type": "integer"},
            "key_id": {"type": "string", "description": "the release key that signed it"},
            "targets": {"type": "array", "items": {"type": "string"}}, "created_at": {"type": "number"},
            "created_by": {"type": "string"},
            "url": {"type": "string", "description": "where devices fetch it"},
            "bad": {"type": ["object", "null"], "description": "the fleet-wide bad mark: never sent while set",
                    "properties": {"at": {"type": "number"}, "actor": {"type": "string"},
                                   "reason": {"type": "string"}}},
        },
    },
    # The schema the API validates with, plus what its own validator cannot say: exactly one target.
    "RolloutRequest": {**ROLLOUT_REQUEST_SCHEMA, "oneOf": [{"required": ["group"]}, {"required": ["devices"]}]},
    "GroupsRequest": GROUPS_REQUEST_SCHEMA,
    "DeadLetter": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "received_at": {"type": "number"},
                       "device": {"type": "string"},
                       "kind": {"type": "string", "enum": ["state", "job", "telemetry", "cmd"]},
                       "topic": {"type": "string"},
                       "reason": {"type": "string", "description": "why it could not be stored (ASCII)"},
                       "size": {"type": "integer", "description": "payload bytes"},
                       "payload_head": {"type": "string", "contentEncoding": "base64",
                                        "description": "the first 1024 bytes of the payload"}},
    },
    "RolloutSummary": {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "state": {"type": "string", "enum": ["pending", "running", "paused", "succeeded", "failed", "aborted"]},
            "wave": {"type": "integer", "description": "the current wave, 0-based (kept for clients; prefer "
                                                      "wave_number)"},
            "wave_number": {"type": "integer", "description": "the current wave, 1-based (as the CLI, the "
                                                             "dashboard and the audit count)"},
            "wave_count": {"type": "integer"},
            "artifact": {"type": "object", "properties": {"sha256": {"type": "string"}, "name": {"type": "string"},
                                                          "version": {"type": "string"}}},
            "target": {"type": "object", "description": "{group} or {devices: [...] (null in lists)}"},
            "reason": {"type": "string"}, "created_at": {"type": "number"}, "created_by": {"type": "string"},
            "updated_at": {"type": "number"}, "started_at": _NUMBER_OR_NULL, "finished_at": _NUMBER_OR_NULL,
        },
    },
    "Rollout": {
        "allOf": [{"$ref": "#/components/schemas/RolloutSummary"}],
        "type": "object",
        "properties": {
            "waves": {"type": "array", "items": {"type": "object", "properties": {
                "index": {"type": "integer", "description": "0-based"}, "number": {"type": "integer",
                                                                                 "description": "1-based"},
                "percent": {"type": "number"}, "devices": {"type": "integer"},
                "active": {"type": "integer"}, "failed": {"type": "integer"}, "in_progress": {"type": "integer"},
                "not_sent": {"type": "integer"},
                "offline": {"type": "integer", "description": "devices without a final answer that are offline "
                                                              "now (the wave waits for them until its deadline)"},
                "deadline": {**_NUMBER_OR_NULL, "description": "the running wave: wave_started_at + "
                                                               "wave_timeout_s (unix seconds); null otherwise"},
                "state": {"type": "string", "enum": ["waiting", "running", "soaking", "passed", "failed", "aborted",
                                                     "paused", "pending"]}}}},
            "gates": {"type": "object"}, "options": {"type": "object"},
            "transitions": {"type": "array", "description": "every transition, oldest first (the newest 1000)",
                            "items": {"type": "object", "properties": {
                                "at": {"type": "number"},
                                "event": {"type": "string", "enum": ["create", "start", "soak", "advance", "succeed",
                                                                     "fail", "pause", "resume", "abort"]},
                                "from": {"type": "string", "description": "empty for create"},
                                "to": {"type": "string"}, "wave": {"type": "integer", "description": "1-based"},
                                "actor": {"type": "string", "description": "the token's name, or server:ID"},
                                "reason": {"type": "string"}}}},
            "wave_started_at": _NUMBER_OR_NULL, "soak_started_at": _NUMBER_OR_NULL, "paused_at": _NUMBER_OR_NULL,
            "offline": {"type": "integer", "description": "the rollout's devices without a final answer, offline now"},
            "wave_deadline": {**_NUMBER_OR_NULL, "description": "when the running wave times out"},
            "counts": {"type": "object", "properties": {k: {"type": "integer"} for k in
                                                        ("devices", "active", "failed", "in_progress", "not_sent")}},
            "devices": {"type": "array", "items": {"type": "object", "properties": {
                "device": {"type": "string"}, "wave": {"type": "integer", "description": "0-based"},
                "wave_number": {"type": "integer", "description": "1-based"}, "command_id": {"type": "string"},
                "state": {"type": "string", "description": "not_sent, sent, or the job's state (queued, "
                                                           "downloading, ..., active, failed, rejected, rolled_back)"},
                "final": {"type": "boolean"}, "reason": {"type": "string"},
                "sent_at": _NUMBER_OR_NULL, "updated_at": _NUMBER_OR_NULL,
                "undo": {"type": ["object", "null"], "description": "the rollback or cancel a failed wave sent",
                         "properties": {"kind": {"type": "string", "enum": ["rollback", "cancel"]},
                                        "command_id": {"type": "string"}, "state": _STRING_OR_NULL,
                                        "reason": _STRING_OR_NULL}}}}},
        },
    },
    # The schema the API validates with, plus what its own validator cannot say: model names and their count.
    "TargetRequest": {**TARGET_REQUEST_SCHEMA, "properties": {
        **TARGET_REQUEST_SCHEMA["properties"],
        "models": {**TARGET_REQUEST_SCHEMA["properties"]["models"], "maxProperties": MAX_MODELS,
                   "propertyNames": {"pattern": ID_PATTERN, "maxLength": 64}}}},
    "ScopeTarget": {
        "type": "object",
        "properties": {
            "scope": {"type": "string", "enum": ["fleet", "group", "device"]}, "name": _STRING_OR_NULL,
            "models": {"type": "object", "additionalProperties": {"type": "object", "properties": {
                "artifact": {"type": "string", "description": "sha256 or \"absent\""},
                "revision": {"type": "integer", "description": "times the operator set this entry"},
                "reason": {"type": "string"}, "set_by": {"type": "string"}, "set_at": {"type": "number"}}}},
            "hold": {"type": ["object", "null"], "description": "reason, set_by, set_at when held"},
            "staged": {"type": "array", "items": {"type": "object"},
                       "description": "changes made in waves whose rollout has not applied them yet"},
            "devices": {"type": "array", "description": "groups only: each member's state, reason and difference",
                        "items": {"type": "object"}},
        },
    },
    "DeviceTarget": {
        "type": "object",
        "properties": {
            "device": {"type": "string"}, "groups": {"type": "array", "items": {"type": "string"}},
            "effective": {"type": "object", "description": "models (artifact, source: fleet, group:NAME or device, "
                                                           "revision), hold, held_by, conflicts (groups that "
                                                           "disagree)"},
            "reported": {"type": "object", "description": "online, status_reason, models (version, sha256), rejected "
                                                          "(artifact sha256 -> stage, reason, heard_at)"},
            "difference": {"type": "object", "additionalProperties": {"type": "string"}},
            "state": {"type": "string", "enum": ["converged", "send", "wait"]},
            "reason": {"type": "string", "description": "why the difference persists"},
        },
    },
    "DeviceHistory": {
        "type": "object",
        "properties": {
            "device": {"type": "string"}, "limit": {"type": "integer"},
            "next_before": {**_NUMBER_OR_NULL, "description": "the before of the next page; null on the last"},
            "entries": {"type": "array", "items": {"type": "object", "properties": {
                "job": {"type": "string", "description": "the command id"},
                "kind": {"type": "string", "description": "deploy, rollback, cancel, ping, ..."},
                "sent_by_server": {"type": "boolean", "description": "false: a command the server did not send "
                                                                     "(edgepack deploy, MQTT)"},
                "rollout": {"type": ["object", "null"], "properties": {"id": {"type": "string"},
                                                                       "state": {"type": "string"}}},
                "target": {**_STRING_OR_NULL, "description": "a target's deploy: the scope it came from (fleet, "
                                                              "group:NAME, device)"},
                "artifact": {"type": ["object", "null"], "properties": {
                    "sha256": {"type": "string"}, "name": _STRING_OR_NULL, "version": _STRING_OR_NULL}},
                "from_version": {"type": ["object", "null"], "description": "what a rollback undoes"},
                "started_at": {"type": "number"}, "updated_at": {"type": "number"},
                "states": {"type": "array", "items": {"type": "object", "properties": {
                    "state": {"type": "string"}, "final": {"type": "boolean"}, "reason": {"type": "string"},
                    "ts": {"type": "number", "description": "the device's clock"},
                    "received_at": {"type": "number", "description": "the server's clock"}}}},
                "state": _STRING_OR_NULL,
                "outcome": {"type": "string", "enum": list(HISTORY_OUTCOMES)},
                "reason": {"type": "string", "description": "the final state's reason (else the newest's), whole"}}}},
        },
    },
    "AuditEntry": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "ts": {"type": "number"},
                       "actor": {"type": "string", "description": "the token's name"},
                       "action": {"type": "string", "description": "artifact.upload, rollout.create, rollout.pause, "
                                                                   "rollout.resume, rollout.abort, target.set, "
                                                                   "device.*, command.sent (a command the server "
                                                                   "published), command.external (a command seen "
                                                                   "on a cmd topic that the server did not send)"},
                       "target": {"type": "string"}, "outcome": {"type": "string", "enum": ["ok", "refused"]},
                       "detail": {"type": "object"}, "remote": {"type": "string"}},
    },
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


def _path(name: str, pattern: str, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string", "pattern": pattern},
            "description": description}


_DEVICE = _path("device_id", ID_PATTERN, "device id")
_ROLLOUT = _path("rollout_id", ID_PATTERN, "rollout id")
_REASON_BODY = {"type": "object", "additionalProperties": False,
                "properties": {"reason": {"type": "string", "maxLength": 500}}}
_ERRORS = {"default": _json("an error (one shape for every error)", _ref("Error"))}
_LIMIT = _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}, "page size")
_UNPROCESSABLE = "well-formed, but its values cannot be used together or with the fleet as it is (the message says why)"

OPERATIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("get", "/healthz", {"summary": "Liveness (no token needed)", "security": [],
                         "responses": {"200": _json("the server runs", {"type": "object"})}}),
    ("get", "/openapi.json", {"summary": "This description (no token needed)", "security": [],
                              "responses": {"200": _json("OpenAPI 3.1", {"type": "object"})}}),
    ("get", "/metrics", {"summary": "Prometheus metrics: devices online by version and provider, rollouts by "
                                    "state, ingest counters, rate and lag",
                         "responses": {"200": {"description": "text exposition format 0.0.4",
                                               "content": {"text/plain": {"schema": {"type": "string"}}}}}}),
    ("get", "/api/status", {"summary": "This server: id, whether it leads the rollouts, ingest and driver counters",
                            "responses": {"200": _json("status", {"type": "object"})}}),
    ("get", "/api/devices", {
        "summary": "The fleet, one row per device, with counts",
        "parameters": [_query("group", {"type": "string", "pattern": ID_PATTERN}, "only members of this group"),
                       _query("online", {"type": "boolean"}, "true or false"),
                       _query("version", {"type": "string", "maxLength": 128},
                              "only devices running this model version"),
                       _query("limit", {"type": "integer", "minimum": 1, "maximum": 10000, "default": 1000},
                              "page size"),
                       _query("offset", {"type": "integer", "minimum": 0, "maximum": 10**9, "default": 0},
                              "rows to skip")],
        "responses": {"200": _json("devices", _ref("DeviceList"))}}),
    ("get", "/api/devices/{device_id}", {"summary": "One device, with its capabilities", "parameters": [_DEVICE],
                                         "responses": {"200": _json("the device", _ref("Device"))}}),
    ("get", "/api/devices/{device_id}/telemetry", {
        "summary": "A device's telemetry over time (raw inside the raw window, rollups before)",
        "parameters": [_DEVICE,
                       _query("since", {"type": "number", "minimum": 0}, "unix seconds (default: one hour ago)"),
                       _query("until", {"type": "number", "minimum": 0}, "unix seconds (default: now)"),
                       _query("step", {"type": "integer", "minimum": 1, "maximum": 86400 * 30, "default": 60},
                              "seconds per point")],
        "responses": {"200": _json("points", _ref("Telemetry")),
                      "422": _json("until not after since, or more than 5,000 points (raise step)", _ref("Error"))}}),
    ("get", "/api/devices/{device_id}/history", {
        "summary": "A device's update history, newest first: every command the server sent it and every job it "
                   "reported, with its rollout, artifact, states with times, outcome and reason",
        "parameters": [_DEVICE,
                       _query("limit", {"type": "integer", "minimum": 1, "maximum": HISTORY_MAX_PAGE,
                                        "default": HISTORY_DEFAULT_PAGE}, "jobs per page"),
                       _query("before", {"type": "number", "minimum": 0},
                              "only jobs started before this time (unix seconds; the previous page's next_before)")],
        "responses": {"200": _json("the history", _ref("DeviceHistory")),
                      "404": _json("no such device", _ref("Error"))}}),
    *LOG_OPERATIONS,
    *REPORT_CARD_OPERATIONS,
    ("put", "/api/devices/{device_id}/groups", {
        "summary": "Enroll a device in exactly these groups (audited as device.groups); rollouts target enrolled "
                   "groups only, never what a device claims",
        "parameters": [_DEVICE],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("GroupsRequest")}}},
        "responses": {"200": _json("the device", _ref("Device"))}}),
    ("delete", "/api/devices/{device_id}", {
        "summary": "Decommission a device (audited as device.decommission with the reason): its records and groups "
                   "go, its retained state is cleared on the broker, its later messages are dropped (counted as "
                   "decommissioned) until it is enrolled again",
        "parameters": [_DEVICE],
        "requestBody": {"required": False, "content": {"application/json": {"schema": _REASON_BODY}}},
        "responses": {"200": _json("decommissioned", {"type": "object", "properties": {
            "device": {"type": "string"}, "decommissioned_at": {"type": "number"}, "reason": {"type": "string"}}}),
                      "404": _json("no such device", _ref("Error"))}}),
    ("post", "/api/devices/{device_id}/actions/{action}", {
        "summary": "A per-device action, audited as device.<action> with the reason: rollback (to the last good "
                   "model; a signed command; holds the device when its target names the model), ping (a signed "
                   "command), rerun (the device's target again, as a new revision the reconciler sends), hold, "
                   "release (the device target's hold flag)",
        "parameters": [_DEVICE, {"name": "action", "in": "path", "required": True,
                                 "schema": {"type": "string", "enum": list(ACTIONS)}, "description": "the action"}],
        "requestBody": {"required": False, "content": {"application/json": {"schema": ACTION_REQUEST_SCHEMA}}},
        "responses": {"200": _json("done: what was sent or set", {"type": "object", "properties": {
            "device": {"type": "string"}, "action": {"type": "string"}, "reason": {"type": "string"},
            "command": {**_STRING_OR_NULL, "description": "the id of the command sent (rollback, ping) or the "
                                                          "reconciler's next one (rerun)"},
            "held": {"type": "boolean", "description": "rollback: the device is held (its target would undo it)"},
            "held_by": {"type": "array", "items": {"type": "string"}, "description": "hold, release: every scope "
                                                                                     "that still holds the device"},
            "models": {"type": "object", "description": "rerun: model -> artifact sha256 set again"}}}),
                      "400": _json("an unknown action, or a bad reason or model (the message names it)",
                                   _ref("Error")),
                      "404": _json("no such device", _ref("Error")),
                      "409": _json("nothing to do: no model to roll back, or no target to run again",
                                   _ref("Error")),
                      "422": _json(f"{_UNPROCESSABLE}: a model named for another action than rollback",
                                   _ref("Error"))}}),
    ("post", "/api/devices/{device_id}/enroll", {
        "summary": "Take a decommissioned device back (audited as device.enroll): its next message enrols it",
        "parameters": [_DEVICE],
        "requestBody": {"required": False, "content": {"application/json": {"schema": _REASON_BODY}}},
        "responses": {"200": _json("may join again", {"type": "object", "properties": {
            "device": {"type": "string"}, "enrolled_at": {"type": "number"}, "reason": {"type": "string"}}}),
                      "404": _json("the device is not decommissioned", _ref("Error"))}}),
    ("get", "/api/decommissioned", {
        "summary": "Decommissioned devices, newest first",
        "responses": {"200": _json("devices", {"type": "object", "properties": {"devices": {"type": "array", "items": {
            "type": "object", "properties": {"device": {"type": "string"}, "at": {"type": "number"},
                                             "actor": {"type": "string"}, "reason": {"type": "string"}}}}}})}}),
    ("get", "/api/devices/{device_id}/target", {
        "summary": "A device's effective target, its reported state, the difference and why it persists",
        "parameters": [_DEVICE], "responses": {"200": _json("the device's target", _ref("DeviceTarget"))}}),
    ("get", "/api/targets", {
        "summary": "Every target (fleet, groups, devices) and each device's state (converged, send, wait)",
        "responses": {"200": _json("targets", {"type": "object"})}}),
    *[op for path, params, what in (("/api/targets/fleet", [], "the fleet"),
                                    ("/api/targets/groups/{group}", [_path("group", ID_PATTERN, "group")],
                                     "a group (with its members' states)"),
                                    ("/api/targets/devices/{device_id}", [_DEVICE], "one device"))
      for op in (("get", path, {"summary": f"The target of {what}", "parameters": params,
                                "responses": {"200": _json("the target", _ref("ScopeTarget"))}}),
                 ("put", path, {"summary": f"Set, clear or hold the target of {what} (audited as target.set with "
                                           "the reason); the server reconciles the devices to it",
                                "parameters": params,
                                "requestBody": {"required": True, "content": {"application/json": {
                                    "schema": _ref("TargetRequest")}}},
                                "responses": {"200": _json("the target", _ref("ScopeTarget")),
                                              "422": _json("an artifact not stored or of another model, a scope "
                                                           "over 16 models, nothing to change", _ref("Error"))}}))],
    ("get", "/api/dead-letters", {
        "summary": "Device messages that parsed but could not be stored, newest first (the newest 10,000 kept)",
        "parameters": [_query("limit", {"type": "integer", "minimum": 1, "maximum": MAX_DEAD_LETTER_PAGE,
                                        "default": 100}, "page size"),
                       _query("before", {"type": "integer", "minimum": 0, "maximum": MAX_ROW_ID},
                              "entries with a smaller id (paging)"),
                       _query("device", {"type": "string", "pattern": ID_PATTERN}, "only this device's")],
        "responses": {"200": _json("dead letters", {"type": "object", "properties": {
            "dead_letters": {"type": "array", "items": _ref("DeadLetter")}}})}}),
    ("get", "/api/artifacts", {"summary": "Uploaded artifacts, newest first",
                               "responses": {"200": _json("artifacts", {"type": "object", "properties": {
                                   "artifacts": {"type": "array", "items": _ref("Artifact")}}})}}),
    ("post", "/api/artifacts", {
        "summary": "Upload a .edgepkg (the body is the file); verified with the release trust store before it is "
                   "stored",
        "requestBody": {"required": True, "content": {"application/octet-stream": {"schema": {
            "type": "string", "format": "binary"}}}},
        "responses": {"201": _json("stored", _ref("Artifact")), "200": _json("already stored", _ref("Artifact")),
                      "413": _json("over --max-upload", _ref("Error")),
                      "422": _json("refused by verification (empty, signature, hashes, limits)", _ref("Error")),
                      "507": _json("no space left in the artifact store", _ref("Error"))}}),
    ("get", "/api/artifacts/{sha256}", {
        "summary": "One artifact", "parameters": [_path("sha256", SHA256_PATTERN, "the artifact's sha256")],
        "responses": {"200": _json("the artifact", _ref("Artifact"))}}),
    *[(method, "/api/artifacts/{sha256}/bad", {
        "summary": summary, "parameters": [_path("sha256", SHA256_PATTERN, "the artifact's sha256")],
        **({"requestBody": {"required": True, "content": {"application/json": {"schema": BAD_REQUEST_SCHEMA}}}}
           if method == "post" else {}),
        "responses": {"200": _json("the artifact and what names it", {"type": "object", "properties": {
            "artifact": _ref("Artifact"), "targets": {"type": "array", "items": {"type": "object"}},
            "rollouts": {"type": "array", "items": {"type": "object"}}}}),
                      "404": _json("no such artifact", _ref("Error"))}})
      for method, summary in (("post", "Mark a release bad fleet-wide (audited artifact.bad): never sent, new "
                                       "rollouts and targets naming it refused, running rollouts paused"),
                              ("delete", "Clear the bad mark (audited artifact.good)"))],
    ("get", "/api/rollouts", {
        "summary": "Rollouts, newest first",
        "parameters": [_query("state", {"type": "string", "enum": list(STATES)}, "only rollouts in this state"),
                       _LIMIT],
        "responses": {"200": _json("rollouts", {"type": "object", "properties": {
            "rollouts": {"type": "array", "items": _ref("RolloutSummary")}}})}}),
    ("post", "/api/rollouts", {
        "summary": "Create a rollout (pending; the server starts it)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref("RolloutRequest")}}},
        "responses": {"201": _json("created", _ref("Rollout")),
                      "404": _json("no such artifact (upload it first)", _ref("Error")),
                      "422": _json(f"{_UNPROCESSABLE}: waves that do not grow or do not end at 100, unknown devices, "
                                   "a group without an online device", _ref("Error"))}}),
    ("get", "/api/rollouts/{rollout_id}", {"summary": "A rollout with its waves and every device's job",
                                           "parameters": [_ROLLOUT],
                                           "responses": {"200": _json("the rollout", _ref("Rollout"))}}),
    *[("post", f"/api/rollouts/{{rollout_id}}/{action}", {
        "summary": f"{action.capitalize()} a rollout ({what})", "parameters": [_ROLLOUT],
        "requestBody": {"required": False, "content": {"application/json": {"schema": _REASON_BODY}}},
        "responses": {"200": _json("the rollout", _ref("Rollout")),
                      "409": _json("the rollout's state does not allow it", _ref("Error"))}})
      for action, what in (("pause", "no new commands; jobs already sent go on"),
                           ("resume", "the wave's clocks skip the paused time"),
                           ("abort", "final; no new commands"))],
    *alerts_http.OPERATIONS,
    ("get", "/artifacts/{file_name}", {
        "summary": "An artifact's bytes, with HTTP Range (no token: devices fetch it; they verify the signature)",
        "security": [],
        "parameters": [_path("file_name", f"{SHA256_PATTERN[:-1]}\\.edgepkg$", "<sha256>.edgepkg")],
        "responses": {"200": {"description": "the file"}, "206": {"description": "the requested range"},
                      "404": _json("no such artifact", _ref("Error")),
                      "410": _json("the stored file was damaged and is quarantined (upload it again)", _ref("Error")),
                      "416": {"description": "range past the end"}}}),
]


OPERATIONS += ENROLLMENT_OPERATIONS


def describe() -> dict[str, Any]:
    """The whole document. Its server is "/" (relative to where the document was fetched), never
    the request's Host header: a document that echoes it tells a client to send its token to
    whatever host the request named."""
    from sdk.fleet_server.users_api import OPERATIONS as USER_OPERATIONS  # it imports this module's helpers

    paths: dict[str, dict[str, Any]] = {}
    for method, path, operation in (*OPERATIONS, *USER_OPERATIONS, *settings_api.OPERATIONS):
        paths.setdefault(path, {})[method] = {**operation,
                                              "responses": {**operation["responses"], **_ERRORS}}
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "Edgepack fleet server", "version": API_VERSION,
                 "description": "Devices, telemetry, artifacts, rollouts and the audit log of a fleet. Every "
                                "route but /healthz, /openapi.json and /artifacts/ needs Authorization: Bearer "
                                "TOKEN. Errors are {\"error\": {\"status\", \"code\", \"message\"}}."},
        "components": {"schemas": SCHEMAS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "servers": [{"url": "/"}],
        "paths": paths,
    }
    return document
