"""agent.yaml: schema, validation up front, typed view.

Every key is validated before the agent touches the store or the network; unknown keys are
rejected with their dotted path (a typo like ``telemetry_intreval`` must not silently fall
back to a default). Relative paths are resolved against the config file's directory.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from device_agent.errors import ConfigError
from device_agent.streams import DEFAULT_MAX_STREAMS, DEFAULT_STREAM_IDLE_S
from edgepack_core.schema import validate
from edgepack_core.targets import PROFILES
from edgepack_core.yamlfile import read_yaml_file

MAX_CONFIG_BYTES = 256 * 1024
_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"}
_PATH = {"type": "string", "minLength": 1}
_POSITIVE = {"type": "integer", "minimum": 1}
_ORIGIN = r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?$"

HEALTH_WINDOW_DEFAULTS = {"default": 30.0, "min": 5.0, "max": 3600.0}
DOWNLOAD_DEADLINE_S = 3600.0
MIN_RATE_BYTES_S = 1024.0

CONFIG_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "edgepack-agent configuration (agent.yaml)",
    "type": "object",
    "additionalProperties": False,
    "required": ["device_id", "store", "trust"],
    "properties": {
        "device_id": _NAME,
        "store": _PATH,
        "trust": {"type": "array", "minItems": 1, "items": _PATH},
        "operator_keys": {"type": "array", "minItems": 1, "items": _PATH},
        "profile": {"enum": sorted(PROFILES)},
        "threads": {"type": "integer", "minimum": 0, "maximum": 256},
        "artifact": _PATH,
        "log_level": {"enum": ["debug", "info", "warning", "error"]},
        "api": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "listen": {"type": "string", "pattern": r"^[^\s:]*:\d{1,5}$"},
                "max_body_bytes": _POSITIVE,
                "enabled": {"type": "boolean"},
                "max_streams": {"type": "integer", "minimum": 1, "maximum": 100_000,
                                "description": "stateful models: streams kept at once (least recently used dropped)"},
                "stream_idle_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 86_400,
                                  "description": "stateful models: a stream unused this long is forgotten"},
                "read_timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600,
                                   "description": "a request's head, and then its body, must arrive within this (408)"},
                "keep_alive_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 3600,
                                 "description": "an idle kept-alive connection is closed after this"},
                "max_connections": {"type": "integer", "minimum": 1, "maximum": 65_536,
                                    "description": "open connections at once; one more is answered 503 and closed"},
                "workers": {"type": "integer", "minimum": 1, "maximum": 256,
                            "description": "threads decoding bodies and running inference at once"},
                "max_queue": {"type": "integer", "minimum": 0, "maximum": 65_536,
                              "description": "inference requests waiting for a worker; one more is answered 503"},
                "max_buffered_bytes": _POSITIVE,
                "max_json_bytes": _POSITIVE,
                "max_decoded_bytes": _POSITIVE,
                "max_image_pixels": _POSITIVE,
                "max_image_decodes": {"type": "integer", "minimum": 1, "maximum": 256,
                                      "description": "image bodies decoded at once"},
                "max_batch_bytes": {**_POSITIVE, "description": "bytes of a tensor for an input with symbolic "
                                    "dims (a batch), at least one row; 413 beyond"},
                "max_json_output_bytes": {**_POSITIVE, "description": "bytes of raw output tensors answered as "
                                          "JSON; 413 beyond (ask for npz or v2 binary data)"},
            },
        },
        "limits": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "max_artifact_bytes": _POSITIVE,
                "max_member_bytes": _POSITIVE,
                "max_total_bytes": _POSITIVE,
            },
        },
        "mqtt": {
            "type": "object",
            "additionalProperties": False,
            "required": ["host"],
            "properties": {
                "host": {"type": "string", "minLength": 1},
                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                "keepalive": {"type": "integer", "minimum": 1, "maximum": 65535},
                "telemetry_interval": {"type": "number", "exclusiveMinimum": 0},
                "groups": {"type": "array", "items": _NAME},
                "protocol": {"enum": ["5", "3.1.1"]},
                "client_id": {"type": "string", "minLength": 1},
                "username": {"type": "string"},
                "password": {"type": "string"},
                "topic_root": {"type": "string", "minLength": 1},
                "tls": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"ca": _PATH, "cert": _PATH, "key": _PATH, "insecure": {"type": "boolean"}},
                },
                "queue": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"path": _PATH, "max_messages": _POSITIVE, "max_bytes": _POSITIVE},
                },
            },
        },
        "updates": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "enabled": {"type": "boolean"},
                "health_window_s": {"anyOf": [
                    {"type": "number", "minimum": 0},
                    {"type": "object", "additionalProperties": False,
                     "properties": {"default": {"type": "number", "minimum": 0},
                                    "min": {"type": "number", "minimum": 0},
                                    "max": {"type": "number", "minimum": 0}}},
                ]},
                "health_min_requests": {"type": "integer", "minimum": 0},
                "contract_error_min_clients": {"type": "integer", "minimum": 1, "maximum": 256},
                "min_free_bytes": {"type": "integer", "minimum": 0, "maximum": 2**50},
                "max_error_rate": {"type": "number", "minimum": 0, "maximum": 1},
                "max_latency_factor": {"type": "number", "exclusiveMinimum": 0},
                "download_dir": _PATH,
                "max_download_bytes": _POSITIVE,
                "allowed_names": {"type": "array", "minItems": 1, "items": _NAME},
                "allowed_origins": {"type": "array", "minItems": 1,
                                    "items": {"type": "string", "pattern": _ORIGIN}},
                "download_deadline_s": {"type": "number", "exclusiveMinimum": 0},
                "min_rate_bytes_s": {"type": "number", "minimum": 0},
            },
        },
    },
}

DEFAULT_LISTEN = "127.0.0.1:8750"
DEFAULT_MAX_BODY = 16 * 1024 * 1024


@dataclass(frozen=True)
class ApiSettings:
    """The HTTP API's bounds (agent.yaml ``api:``; docs/agent.md, "HTTP API"). Memory held by
    request bodies is at most ``max_buffered_bytes`` plus, per worker, ``max_decoded_bytes`` of
    tensors (``max_batch_bytes`` for an input with symbolic dims) or one image of
    ``max_image_pixels`` (``max_image_decodes`` of them at once), and ``max_json_output_bytes``
    of raw outputs encoded as JSON."""

    max_body_bytes: int = DEFAULT_MAX_BODY
    read_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 64
    workers: int = 4
    max_queue: int = 64
    max_buffered_bytes: int = 4 * DEFAULT_MAX_BODY
    max_json_bytes: int = 4 * 1024 * 1024
    max_decoded_bytes: int = 64 * 1024 * 1024
    max_image_pixels: int | None = None  # None: sized for this device's memory when the API starts
    max_image_decodes: int = 2
    max_batch_bytes: int = 4 * 1024 * 1024
    max_json_output_bytes: int = 1024 * 1024


def _api_settings(api: dict[str, Any], name: str) -> ApiSettings:
    """The ``api:`` bounds with defaults; a body limit larger than the buffer it must fit in is
    refused (no body could ever be taken whole)."""
    settings = ApiSettings(**{key: api[key] for key in ApiSettings.__dataclass_fields__ if key in api})
    for key in ("read_timeout_s", "keep_alive_s"):
        if not math.isfinite(getattr(settings, key)):
            raise ConfigError(f"api.{key}", f"{getattr(settings, key)} is not a finite number", config=name)
    if settings.max_buffered_bytes < settings.max_body_bytes:
        raise ConfigError("api.max_buffered_bytes", f"{settings.max_buffered_bytes} is under api.max_body_bytes "
                          f"({settings.max_body_bytes}): no body of the allowed size could be taken", config=name)
    return settings


@dataclass(frozen=True)
class AgentConfig:
    """A validated agent.yaml with absolute paths and defaults filled in."""

    path: Path | None
    device_id: str
    store: Path
    trust: list[Path]
    operator_keys: list[Path] = field(default_factory=list)
    profile: str = "x86"
    threads: int = 0
    artifact: Path | None = None
    log_level: str = "info"
    listen: str | None = DEFAULT_LISTEN
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_streams: int = DEFAULT_MAX_STREAMS
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S
    api: ApiSettings = field(default_factory=ApiSettings)
    limits: dict[str, int] = field(default_factory=dict)
    mqtt: dict[str, Any] | None = None
    updates: dict[str, Any] = field(default_factory=dict)

    @property
    def listen_host_port(self) -> tuple[str, int] | None:
        if self.listen is None:
            return None
        host, _, port = self.listen.rpartition(":")
        return host or "127.0.0.1", int(port)


def _resolve(base: Path, value: str) -> Path:
    return (base / value).resolve()


def _finite(updates: dict[str, Any], key: str, value: Any, name: str) -> None:
    """YAML's .nan and .inf pass every ``minimum`` check (NaN compares false): refuse them."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"updates.{key}", f"{value} is not a finite number", config=name)


def _check_updates(updates: dict[str, Any], name: str) -> dict[str, Any]:
    """Normalise ``updates``: ``health_window_s`` becomes ``{default, min, max}`` (a plain number
    is the default), every number finite, and min <= default <= max."""
    given = updates.get("health_window_s", {})
    if isinstance(given, dict):
        window = {**HEALTH_WINDOW_DEFAULTS, **given}
    else:  # a plain number is the default, and widens the range to include itself
        window = {"default": given, "min": min(given, HEALTH_WINDOW_DEFAULTS["min"]),
                  "max": max(given, HEALTH_WINDOW_DEFAULTS["max"])}
    for key, value in window.items():
        _finite(updates, f"health_window_s.{key}", value, name)
    for key in ("max_error_rate", "max_latency_factor", "download_deadline_s", "min_rate_bytes_s"):
        if key in updates:
            _finite(updates, key, updates[key], name)
    if not window["min"] <= window["default"] <= window["max"]:
        raise ConfigError("updates.health_window_s", f"needs min <= default <= max, got {window['min']:g}, "
                          f"{window['default']:g}, {window['max']:g}", config=name)
    updates["health_window_s"] = {key: float(value) for key, value in window.items()}
    return updates


def check_config(document: Any, path: Path | None) -> AgentConfig:
    name = str(path) if path else "agent config"
    if not isinstance(document, dict):
        raise ConfigError("<root>", "must be a mapping of keys", config=name)
    validate(document, CONFIG_SCHEMA, document=name)
    base = path.parent if path else Path.cwd()
    api = document.get("api") or {}
    listen = api.get("listen", DEFAULT_LISTEN) if api.get("enabled", True) else None
    if listen is not None and not 0 < int(listen.rpartition(":")[2]) < 65536:
        raise ConfigError("api.listen", f"{listen!r} has no valid port", config=name)
    mqtt = dict(document["mqtt"]) if document.get("mqtt") else None
    if mqtt is not None:
        if "tls" in mqtt:
            mqtt["tls"] = {k: (str(_resolve(base, v)) if k in ("ca", "cert", "key") else v)
                           for k, v in mqtt["tls"].items()}
        if "queue" in mqtt and "path" in mqtt["queue"]:
            mqtt["queue"] = {**mqtt["queue"], "path": str(_resolve(base, mqtt["queue"]["path"]))}
        if "password" in mqtt and "username" not in mqtt:
            raise ConfigError("mqtt.password", "is set without mqtt.username", config=name)
    updates = _check_updates(dict(document.get("updates") or {}), name)
    if "download_dir" in updates:
        updates["download_dir"] = str(_resolve(base, updates["download_dir"]))
    return AgentConfig(
        path=path,
        device_id=document["device_id"],
        store=_resolve(base, document["store"]),
        trust=[_resolve(base, t) for t in document["trust"]],
        operator_keys=[_resolve(base, k) for k in document.get("operator_keys", [])],
        profile=document.get("profile", "x86"),
        threads=int(document.get("threads", 0)),
        artifact=_resolve(base, document["artifact"]) if document.get("artifact") else None,
        log_level=document.get("log_level", "info"),
        listen=listen,
        max_body_bytes=int(api.get("max_body_bytes", DEFAULT_MAX_BODY)),
        max_streams=int(api.get("max_streams", DEFAULT_MAX_STREAMS)),
        stream_idle_s=float(api.get("stream_idle_s", DEFAULT_STREAM_IDLE_S)),
        api=_api_settings(api, name),
        limits=dict(document.get("limits") or {}),
        mqtt=mqtt,
        updates=updates,
    )


def unauthenticated_commands_warning(config: AgentConfig) -> str:
    """The warning ``edgepack-agent run`` prints at every start while remote commands are
    unauthenticated (MQTT updates on, no ``operator_keys``), "" otherwise. Pure."""
    if config.operator_keys or config.mqtt is None or not config.updates.get("enabled", True):
        return ""
    return ("no operator_keys in agent.yaml: commands are not authenticated, so ANYONE WHO CAN PUBLISH TO THE "
            "BROKER CAN COMMAND THIS DEVICE: deploy or downgrade any artifact the trust store accepts, roll back, "
            "cancel updates, change telemetry (set operator_keys; see docs/updates.md, \"Operator signatures\")")


def load_config(path: str | Path) -> AgentConfig:
    """Read and validate agent.yaml; errors name the offending key."""
    path = Path(path)
    document = read_yaml_file(path, MAX_CONFIG_BYTES, lambda problem: ConfigError("<file>", problem, config=str(path)),
                              kind="config")
    return check_config(document, path.resolve())


def limits_from(config: AgentConfig) -> Mapping[str, int]:
    """The artifact reader limits of agent.yaml, as ``Limits`` keyword arguments."""
    mapping = {"max_artifact_bytes": "max_archive_bytes", "max_member_bytes": "max_member_bytes",
               "max_total_bytes": "max_total_bytes"}
    return {mapping[k]: v for k, v in config.limits.items()}
