"""agent.yaml: schema, validation up front, one typed value.

Every key is validated before the agent touches the store or the network; unknown keys are
rejected with their dotted path (a typo like ``telemetry_intreval`` must not silently fall
back to a default). The document is then parsed once into frozen dataclasses, one per section
(:class:`ApiSettings`, :class:`LimitSettings`, :class:`BrokerSettings`, :class:`UpdateSettings`),
whose fields are the section's keys and whose defaults are the documented ones: the rest of the
agent reads typed fields, never the YAML mapping. Relative paths are resolved against the config
file's directory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from device_agent.errors import ConfigError
from device_agent.logring import LOGS_CONFIG_SCHEMA, LogSettings
from device_agent.memory import MEMORY_CONFIG_SCHEMA, MemorySettings
from device_agent.password_file import MAX_PASSWORD_FILE_BYTES, read_password_file  # noqa: F401  (re-exported)
from device_agent.streams import DEFAULT_MAX_STREAMS, DEFAULT_STREAM_IDLE_S
from device_agent.telemetry import DEFAULT_MAX_BYTES, DEFAULT_MAX_MESSAGES
from device_agent.updates.disk import DEFAULT_MIN_FREE_BYTES
from device_agent.updates.health import HealthPolicy
from edgepack_core.artifact import Limits
from edgepack_core.errors import InvalidNameError
from edgepack_core.protocol.topics import DEFAULT_ROOT, validate_root
from edgepack_core.schema import validate
from edgepack_core.targets import PROFILES
from edgepack_core.yamlfile import read_yaml_file

if TYPE_CHECKING:  # parsed only when agent.yaml has the section (an idle agent without one never loads them)
    from device_agent.pipelines.spec import PipelineSpec
    from edgepack_core.mqtt_settings import TlsSettings

MAX_CONFIG_BYTES = 256 * 1024
MAX_MODELS = 16
"""The most models one agent holds (``models:``; a deploy of a new name beyond it is refused):
each holds an inference session in memory and a store on disk."""
_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"}
_PATH = {"type": "string", "minLength": 1}
_POSITIVE = {"type": "integer", "minimum": 1}
_ORIGIN = r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?$"

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
        "pipelines": {
            "type": "array",
            "description": "streams: sources, stages, tracker, rules and sinks (docs/agent.md, Pipelines; each item "
                           "is checked against schemas/pipeline.schema.json)",
        },
        "models": {
            "type": "array",
            "minItems": 1,
            "maxItems": MAX_MODELS,
            "description": "several named models, each installed from its artifact when the store lacks it",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", "artifact"],
                "properties": {"name": _NAME, "artifact": _PATH},
            },
        },
        "log_level": {"enum": ["debug", "info", "warning", "error"]},
        "logs": LOGS_CONFIG_SCHEMA,
        "memory": MEMORY_CONFIG_SCHEMA,
        "api": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "listen": {"type": "string", "pattern": r"^[^\s:]*:\d{1,5}$"},
                "max_body_bytes": _POSITIVE,
                "enabled": {"type": "boolean"},
                "max_streams": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 100_000,
                    "description": "stateful models: streams kept at once (least recently used dropped)",
                },
                "stream_idle_s": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": 86_400,
                    "description": "stateful models: a stream unused this long is forgotten",
                },
                "read_timeout_s": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": 3600,
                    "description": "a request's head, and then its body, must arrive within this (408)",
                },
                "keep_alive_s": {
                    "type": "number",
                    "exclusiveMinimum": 0,
                    "maximum": 3600,
                    "description": "an idle kept-alive connection is closed after this",
                },
                "max_connections": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 65_536,
                    "description": "open connections at once; one more is answered 503 and closed",
                },
                "workers": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 256,
                    "description": "threads decoding bodies and running inference at once",
                },
                "max_queue": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": 65_536,
                    "description": "inference requests waiting for a worker; one more is answered 503",
                },
                "max_buffered_bytes": _POSITIVE,
                "max_json_bytes": _POSITIVE,
                "max_decoded_bytes": _POSITIVE,
                "max_image_pixels": _POSITIVE,
                "max_image_decodes": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": 256,
                    "description": "image bodies decoded at once",
                },
                "max_batch_bytes": {
                    **_POSITIVE,
                    "description": "bytes of a tensor for an input with symbolic "
                    "dims (a batch), at least one row; 413 beyond",
                },
                "max_json_output_bytes": {
                    **_POSITIVE,
                    "description": "bytes of raw output tensors answered as "
                    "JSON; 413 beyond (ask for npz or v2 binary data)",
                },
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
                "password_file": _PATH,
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
        "enrollment": {
            "type": "object",
            "additionalProperties": False,
            "required": ["server"],
            "description": "where edgepack-agent enroll got this device's certificate: renewals go there too",
            "properties": {
                "server": {"type": "string", "pattern": r"^https?://[^\s]+$", "maxLength": 2048},
                "ca": _PATH,
            },
        },
        "updates": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "enabled": {"type": "boolean"},
                "health_window_s": {
                    "anyOf": [
                        {"type": "number", "minimum": 0},
                        {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "default": {"type": "number", "minimum": 0},
                                "min": {"type": "number", "minimum": 0},
                                "max": {"type": "number", "minimum": 0},
                            },
                        },
                    ]
                },
                "health_min_requests": {"type": "integer", "minimum": 0},
                "contract_error_min_clients": {"type": "integer", "minimum": 1, "maximum": 256},
                "min_free_bytes": {"type": "integer", "minimum": 0, "maximum": 2**50},
                "max_error_rate": {"type": "number", "minimum": 0, "maximum": 1},
                "max_latency_factor": {"type": "number", "exclusiveMinimum": 0},
                "min_latency_increase_ms": {"type": "number", "minimum": 0, "maximum": 3600000},
                "download_dir": _PATH,
                "max_download_bytes": _POSITIVE,
                "allowed_names": {"type": "array", "minItems": 1, "items": _NAME},
                "allowed_origins": {"type": "array", "minItems": 1, "items": {"type": "string", "pattern": _ORIGIN}},
                "download_deadline_s": {"type": "number", "exclusiveMinimum": 0},
                "min_rate_bytes_s": {"type": "number", "minimum": 0},
                "ca": _PATH,
            },
        },
    },
}

DEFAULT_LISTEN = "127.0.0.1:8750"
DEFAULT_MAX_BODY = 16 * 1024 * 1024
_HEALTH = HealthPolicy()
_LIMITS = Limits()
_Section = TypeVar("_Section")


@dataclass(frozen=True)
class ApiSettings:
    """The HTTP API (agent.yaml ``api:``; docs/agent.md, "HTTP API"). Memory held by request
    bodies is at most ``max_buffered_bytes`` plus, per worker, ``max_decoded_bytes`` of tensors
    (``max_batch_bytes`` for an input with symbolic dims) or one image of ``max_image_pixels``
    (``max_image_decodes`` of them at once), and ``max_json_output_bytes`` of raw outputs
    encoded as JSON."""

    enabled: bool = True
    listen: str = DEFAULT_LISTEN
    max_streams: int = DEFAULT_MAX_STREAMS
    stream_idle_s: float = DEFAULT_STREAM_IDLE_S
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

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) to listen on, or None when the API is off."""
        if not self.enabled:
            return None
        host, _, port = self.listen.rpartition(":")
        return host or "127.0.0.1", int(port)


@dataclass(frozen=True)
class LimitSettings:
    """What the artifact reader accepts (agent.yaml ``limits:``)."""

    max_artifact_bytes: int = _LIMITS.max_archive_bytes
    max_member_bytes: int = _LIMITS.max_member_bytes
    max_total_bytes: int = _LIMITS.max_total_bytes

    def reader_limits(self) -> Limits:
        return dataclasses.replace(
            _LIMITS,
            max_archive_bytes=self.max_artifact_bytes,
            max_member_bytes=self.max_member_bytes,
            max_total_bytes=self.max_total_bytes,
        )


@dataclass(frozen=True)
class OutboxSettings:
    """The telemetry outbox (agent.yaml ``mqtt.queue:``); ``path`` None: ``<store>/outbox.db``."""

    path: Path | None = None
    max_messages: int = DEFAULT_MAX_MESSAGES
    max_bytes: int = DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class BrokerSettings:
    """The broker connection and the agent's presence on it (agent.yaml ``mqtt:``)."""

    host: str
    port: int = 1883
    keepalive: int = 30
    telemetry_interval: float = 10.0
    groups: tuple[str, ...] = ()
    protocol: Literal["5", "3.1.1"] = "5"
    client_id: str | None = None  # None: the device id
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    password_file: Path | None = None  # where ``password`` was read from (None: inline, deprecated, or none)
    topic_root: str = DEFAULT_ROOT
    tls: TlsSettings | None = None
    queue: OutboxSettings = OutboxSettings()


@dataclass(frozen=True)
class EnrollmentSettings:
    """``enrollment:``: the fleet server that issued the device's certificate (renewals redeem
    their token there) and the CA its HTTPS certificate is checked with (None: the system's)."""

    server: str
    ca: Path | None = None


@dataclass(frozen=True)
class HealthWindow:
    """``updates.health_window_s``: the window after a swap, and the range a command may ask for."""

    default: float = 30.0
    min: float = 5.0
    max: float = 3600.0


@dataclass(frozen=True)
class UpdateSettings:
    """Remote updates (agent.yaml ``updates:``; docs/updates.md)."""

    enabled: bool = True
    health_window_s: HealthWindow = HealthWindow()
    health_min_requests: int = _HEALTH.min_requests
    contract_error_min_clients: int = _HEALTH.contract_error_min_clients
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES
    max_error_rate: float = _HEALTH.max_error_rate
    max_latency_factor: float = _HEALTH.max_latency_factor
    min_latency_increase_ms: float = _HEALTH.min_latency_increase_s * 1000
    download_dir: Path | None = None  # None: <store>/downloads
    max_download_bytes: int = 1024**3
    allowed_names: tuple[str, ...] | None = None  # None: the name the device runs
    allowed_origins: tuple[str, ...] = ()  # (): any port on mqtt.host
    download_deadline_s: float = 3600.0
    min_rate_bytes_s: float = 1024.0
    ca: Path | None = None  # None: the system's CAs verify https:// downloads

    def health_policy(self) -> HealthPolicy:
        return HealthPolicy(
            max_error_rate=self.max_error_rate,
            max_latency_factor=self.max_latency_factor,
            min_latency_increase_s=self.min_latency_increase_ms / 1000,
            min_requests=self.health_min_requests,
            contract_error_min_clients=self.contract_error_min_clients,
        )


@dataclass(frozen=True)
class ModelEntry:
    """One item of ``models:``: a model name and the artifact installed for it when the store
    holds no model of that name (the artifact's manifest must carry that name)."""

    name: str
    artifact: Path


@dataclass(frozen=True)
class AgentConfig:
    """A validated agent.yaml with absolute paths and defaults filled in."""

    path: Path | None
    device_id: str
    store: Path
    trust: tuple[Path, ...]
    operator_keys: tuple[Path, ...] = ()
    profile: str = "x86"
    threads: int = 0
    artifact: Path | None = None
    models: tuple[ModelEntry, ...] = ()  # (): one unnamed model (``artifact:``, or what the store holds)
    pipelines: tuple[PipelineSpec, ...] = ()
    log_level: str = "info"
    api: ApiSettings = ApiSettings()
    limits: LimitSettings = LimitSettings()
    mqtt: BrokerSettings | None = None
    updates: UpdateSettings = UpdateSettings()
    logs: LogSettings = field(default_factory=LogSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    enrollment: EnrollmentSettings | None = None

    def client_certificate(self) -> tuple[str, str] | None:
        """The device's certificate and key (``mqtt.tls.cert``/``key``), also presented to an
        HTTPS artifact server that asks for one (mutual TLS, ``fleet serve --tls-client-ca``)."""
        tls = self.mqtt.tls if self.mqtt is not None else None
        return (tls.cert, tls.key) if tls is not None and tls.cert and tls.key else None


def _section(cls: type[_Section], values: Mapping[str, Any]) -> _Section:
    """A section's dataclass from its validated mapping (the schema refused unknown keys and
    wrong types): lists become tuples, integers given for float fields floats."""
    kinds = {f.name: f.type for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{key: _typed(kinds[key], value) for key, value in values.items()})


def _typed(kind: Any, value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    if kind in ("float", float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def _resolve(base: Path, value: str) -> Path:
    return (base / value).resolve()


def _api(api: Mapping[str, Any], name: str) -> ApiSettings:
    """The ``api:`` section; a listen address without a valid port, or a body limit larger than
    the buffer it must fit in (no body could ever be taken whole), is refused."""
    settings = _section(ApiSettings, api)
    if not 0 < int(settings.listen.rpartition(":")[2]) < 65536:
        raise ConfigError("api.listen", f"{settings.listen!r} has no valid port", config=name)
    if settings.max_buffered_bytes < settings.max_body_bytes:
        raise ConfigError(
            "api.max_buffered_bytes",
            f"{settings.max_buffered_bytes} is under api.max_body_bytes "
            f"({settings.max_body_bytes}): no body of the allowed size could be taken",
            config=name,
        )
    return settings


def _broker(mqtt: Mapping[str, Any], base: Path, name: str) -> BrokerSettings:
    """The ``mqtt:`` section, its TLS files and outbox path resolved against ``base``."""
    for key in ("password", "password_file"):
        if key in mqtt and "username" not in mqtt:
            raise ConfigError(f"mqtt.{key}", "is set without mqtt.username", config=name)
    if "password" in mqtt and "password_file" in mqtt:
        raise ConfigError("mqtt.password", "is set together with mqtt.password_file: keep the file alone", config=name)
    try:
        validate_root(mqtt.get("topic_root", DEFAULT_ROOT))
    except InvalidNameError as err:
        raise ConfigError("mqtt.topic_root", err.problem, config=name) from err
    values = dict(mqtt)
    if "password_file" in mqtt:
        values["password_file"] = _resolve(base, mqtt["password_file"])
        values["password"] = read_password_file(values["password_file"], name)
    if "tls" in mqtt:
        from edgepack_core.mqtt_settings import TlsSettings

        values["tls"] = _section(
            TlsSettings,
            {
                key: str(_resolve(base, value)) if key in ("ca", "cert", "key") else value
                for key, value in mqtt["tls"].items()
            },
        )
    if "queue" in mqtt:
        queue = dict(mqtt["queue"])
        if "path" in queue:
            queue["path"] = _resolve(base, queue["path"])
        values["queue"] = _section(OutboxSettings, queue)
    return _section(BrokerSettings, values)


def inline_password_warning(config: AgentConfig) -> str:
    """The warning ``edgepack-agent run`` prints once at start while agent.yaml holds the MQTT
    password inline, "" otherwise. Pure."""
    mqtt = config.mqtt
    if mqtt is None or mqtt.password is None or mqtt.password_file is not None:
        return ""
    return ("mqtt.password in agent.yaml is deprecated: put the password in a file only this user can read "
            "(chmod 600) and name it as mqtt.password_file (docs/agent.md)")


def _window(given: Any, name: str) -> HealthWindow:
    """``updates.health_window_s``: a mapping over the defaults, or a plain number that is the
    default and widens the range to include itself; min <= default <= max."""
    if isinstance(given, Mapping):
        window = dataclasses.replace(HealthWindow(), **{key: float(value) for key, value in given.items()})
    else:
        window = HealthWindow(float(given), min(float(given), HealthWindow.min), max(float(given), HealthWindow.max))
    if not window.min <= window.default <= window.max:
        raise ConfigError(
            "updates.health_window_s",
            f"needs min <= default <= max, got {window.min:g}, {window.default:g}, {window.max:g}",
            config=name,
        )
    return window


def _updates(updates: Mapping[str, Any], base: Path, name: str) -> UpdateSettings:
    values = dict(updates)
    if "health_window_s" in updates:
        values["health_window_s"] = _window(updates["health_window_s"], name)
    if "download_dir" in updates:
        values["download_dir"] = _resolve(base, updates["download_dir"])
    if "ca" in updates:
        values["ca"] = _resolve(base, updates["ca"])
        _check_ca(values["ca"], name)
    return _section(UpdateSettings, values)


def _check_ca(path: Path, name: str) -> None:
    """``updates.ca`` must load as CA certificates now, not at the first download."""
    from edgepack_core.tls import client_context  # ssl only for an agent that sets updates.ca

    try:
        client_context(str(path))
    except (OSError, ValueError) as err:  # ssl.SSLError is an OSError
        why = getattr(err, "reason", None) or getattr(err, "strerror", None) or err
        raise ConfigError("updates.ca", f"cannot load {path} as CA certificates (PEM): {why}", config=name) from err


def _models(document: Mapping[str, Any], base: Path, name: str) -> tuple[ModelEntry, ...]:
    """``models:``: unique names, and not together with ``artifact:`` (which model would it be?)."""
    if "artifact" in document:
        raise ConfigError("models", "is given together with artifact: use models: alone (one item per model) or "
                          "artifact: alone (one model)", config=name)
    entries = tuple(ModelEntry(item["name"], _resolve(base, item["artifact"])) for item in document["models"])
    seen: set[str] = set()
    for index, entry in enumerate(entries):
        if entry.name in seen:
            raise ConfigError(f"models[{index}].name", f"{entry.name!r} is named twice", config=name)
        seen.add(entry.name)
    return entries


def check_config(document: Any, path: Path | None) -> AgentConfig:
    """Validate an agent.yaml document and parse it into an :class:`AgentConfig`; errors name
    the offending key."""
    name = str(path) if path else "agent config"
    if not isinstance(document, dict):
        raise ConfigError("<root>", "must be a mapping of keys", config=name)
    validate(document, CONFIG_SCHEMA, document=name)
    base = path.parent if path else Path.cwd()
    values: dict[str, Any] = {key: document[key] for key in ("profile", "threads", "log_level") if key in document}
    if "operator_keys" in document:
        values["operator_keys"] = tuple(_resolve(base, k) for k in document["operator_keys"])
    if "artifact" in document:
        values["artifact"] = _resolve(base, document["artifact"])
    if "models" in document:
        values["models"] = _models(document, base, name)
    if "enrollment" in document:
        given = document["enrollment"]
        ca = _resolve(base, given["ca"]) if "ca" in given else None
        values["enrollment"] = EnrollmentSettings(given["server"], ca)
    if "pipelines" in document:
        from device_agent.pipelines.spec import parse_pipelines

        values["pipelines"] = parse_pipelines(document["pipelines"], where=f"{name}: pipelines")
    return AgentConfig(
        path=path,
        device_id=document["device_id"],
        store=_resolve(base, document["store"]),
        trust=tuple(_resolve(base, t) for t in document["trust"]),
        api=_api(document.get("api", {}), name),
        limits=_section(LimitSettings, document.get("limits", {})),
        mqtt=_broker(document["mqtt"], base, name) if "mqtt" in document else None,
        updates=_updates(document.get("updates", {}), base, name),
        logs=_section(LogSettings, document.get("logs", {})),
        memory=_section(MemorySettings, document.get("memory", {})),
        **values,
    )


def unauthenticated_commands_warning(config: AgentConfig) -> str:
    """The warning ``edgepack-agent run`` prints at every start while remote commands are
    unauthenticated (MQTT updates on, no ``operator_keys``), "" otherwise. Pure."""
    if config.operator_keys or config.mqtt is None or not config.updates.enabled:
        return ""
    return (
        "no operator_keys in agent.yaml: commands are not authenticated, so ANYONE WHO CAN PUBLISH TO THE "
        "BROKER CAN COMMAND THIS DEVICE: deploy or downgrade any artifact the trust store accepts, roll back, "
        'cancel updates, change telemetry (set operator_keys; see docs/updates.md, "Operator signatures")'
    )


def load_config(path: str | Path) -> AgentConfig:
    """Read and validate agent.yaml; errors name the offending key."""
    path = Path(path)
    document = read_yaml_file(
        path, MAX_CONFIG_BYTES, lambda problem: ConfigError("<file>", problem, config=str(path)), kind="config"
    )
    return check_config(document, path.resolve())
