"""The agent settings a fleet server may change remotely: the keys, their values' bounds, the
document and its digest. Pure; shared so that the server refuses a value when the operator sets
it by the same rule the device applies when the signed document arrives.

A document is flat: dotted agent.yaml keys to values, with a generation that rises with every
document the server makes for a device::

    {"generation": 7, "settings": {"mqtt.telemetry_interval": 5, "updates.allowed_origins":
     ["http://fleet:8760"], "trust": ["edgepack-key: release\\n-----BEGIN PUBLIC KEY-----..."]}}

``trust`` and ``operator_keys`` hold PEM public keys (not paths: the device has no file of a key
it never saw). What only the device's own agent.yaml may change (its identity, store, listen
address, broker) is :data:`LOCAL_ONLY`: named as such when a document carries it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from edgepack_core.ed25519 import PublicKey
from edgepack_core.errors import KeyFileError, SchemaError
from edgepack_core.pipeline_spec import PipelineSpec, parse_pipelines, pipelines_schema
from edgepack_core.schema import json_integers, validate
from edgepack_core.signing import OPERATOR, RELEASE, check_kind, public_key_from_pem

MAX_KEYS = 16
"""Keys of one kind in a document (a rotation needs two; a few more for several release lines)."""
MAX_PEM_CHARS = 1024
MAX_DOCUMENT_KEYS = 64
"""Keys in one document: each is answered in the state message, which has to stay small."""
MAX_GENERATION = 2**53 - 1
_NAME = {"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"}
_ORIGIN = {"type": "string", "pattern": r"^https?://[A-Za-z0-9.-]+(:[0-9]{1,5})?$", "maxLength": 300}
_PEMS = {
    "type": "array",
    "minItems": 1,
    "maxItems": MAX_KEYS,
    "items": {"type": "string", "minLength": 1, "maxLength": MAX_PEM_CHARS},
}
_POSITIVE = {"type": "integer", "minimum": 1, "maximum": 2**50}

SETTING_KEYS: dict[str, dict[str, Any]] = {
    "trust": _PEMS,
    "operator_keys": _PEMS,
    "log_level": {"enum": ["debug", "info", "warning", "error"]},
    "mqtt.groups": {"type": "array", "maxItems": 32, "items": _NAME},
    "mqtt.telemetry_interval": {"type": "number", "minimum": 0.1, "maximum": 86400},
    "updates.allowed_origins": {"type": "array", "minItems": 1, "maxItems": 32, "items": _ORIGIN},
    "updates.health_window_s": {"type": "number", "minimum": 0, "maximum": 86400},
    "updates.health_min_requests": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
    "updates.max_error_rate": {"type": "number", "minimum": 0, "maximum": 1},
    "updates.max_latency_factor": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
    "updates.min_latency_increase_ms": {"type": "number", "minimum": 0, "maximum": 3_600_000},
    "updates.contract_error_min_clients": {"type": "integer", "minimum": 1, "maximum": 256},
    "limits.max_artifact_bytes": _POSITIVE,
    "limits.max_member_bytes": _POSITIVE,
    "limits.max_total_bytes": _POSITIVE,
    "pipelines": pipelines_schema(),
}
"""Every key a settings document may carry, with the JSON Schema of its value; besides these, the
per-model artifact limits :data:`MODEL_LIMIT` matches."""

MODEL_LIMIT = re.compile(
    r"^models\.([A-Za-z0-9][A-Za-z0-9._-]{0,63})\.limits\.(max_artifact_bytes|max_member_bytes|max_total_bytes)$"
)
"""``models.NAME.limits.FIELD``: one model's artifact limits, over ``limits.FIELD`` for that model."""


def schema_of(key: str) -> dict[str, Any] | None:
    """The JSON Schema of ``key``'s value, None for a key that is not a remote setting."""
    return SETTING_KEYS.get(key) or (_POSITIVE if MODEL_LIMIT.match(key) else None)


def model_limits(values: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Model name -> its limit fields, from a document's ``models.NAME.limits.FIELD`` keys."""
    out: dict[str, dict[str, int]] = {}
    for key, value in values.items():
        found = MODEL_LIMIT.match(key)
        if found:
            out.setdefault(found.group(1), {})[found.group(2)] = value
    return out

LOCAL_ONLY = frozenset(
    {
        "device_id",
        "store",
        "profile",
        "threads",
        "artifact",
        "models",
        "api",
        "api.listen",
        "api.enabled",
        "mqtt",
        "mqtt.host",
        "mqtt.port",
        "mqtt.client_id",
        "mqtt.username",
        "mqtt.password",
        "mqtt.password_file",
        "mqtt.tls",
        "mqtt.topic_root",
        "mqtt.protocol",
        "mqtt.keepalive",
        "mqtt.queue",
        "updates.enabled",
        "updates.download_dir",
    }
)
"""agent.yaml keys only the device's own file may change: who it is, where it keeps its models,
where it listens, how it reaches the broker (a wrong value sent remotely would cut it off)."""

KEY_KINDS_OF = {"trust": RELEASE, "operator_keys": OPERATOR}


@dataclass(frozen=True)
class SettingsDocument:
    """A checked document: the generation, the values by key (sorted), and the parsed keys and
    pipelines (``pipelines``: None when the document does not carry the key), parsed once here
    so the device checks and runs these values, never a second parse of ``values``."""

    generation: int
    values: tuple[tuple[str, Any], ...]
    release_keys: tuple[PublicKey, ...] = ()
    operator_keys: tuple[PublicKey, ...] = ()
    pipelines: tuple[PipelineSpec, ...] | None = None

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.values).get(key, default)

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.values)

    def to_json(self) -> dict[str, Any]:
        return {"generation": self.generation, "settings": dict(self.values)}


@dataclass(frozen=True)
class CheckedValue:
    """One key's value as checked, with what checking it parsed: the pipelines of ``pipelines``
    and the public keys of ``trust`` or ``operator_keys`` (None for every other key), so that
    nothing downstream parses the raw value again."""

    value: Any
    pipelines: tuple[PipelineSpec, ...] | None = None
    keys: tuple[PublicKey, ...] | None = None


def check_value(key: str, value: Any) -> Any:
    """Refuse ``value`` for ``key`` unless its schema accepts it (:class:`SchemaError` naming
    the key); lists come back as lists, integers given for numbers stay numbers."""
    return checked(key, value).value


def checked(key: str, value: Any) -> CheckedValue:
    """:func:`check_value`, with what it parsed (:class:`CheckedValue`)."""
    if key in LOCAL_ONLY:
        raise SchemaError(key, 'can only be changed in agent.yaml on the device (docs/agent.md, "Remote settings")')
    schema = schema_of(key)
    if schema is None:
        raise SchemaError(key, f"is not a remote setting (known: {', '.join(sorted(SETTING_KEYS))}, "
                               "models.NAME.limits.max_artifact_bytes|max_member_bytes|max_total_bytes)")
    value = json_integers(value, schema)  # JSON's 5.0 is the integer 5 (JSON Schema says so too)
    try:
        validate(value, schema, document=key)
    except SchemaError as err:  # named by the key alone: the value's own path is the key's
        where = key if err.path in ("", "<root>") else f"{key}{err.path.removeprefix('<root>')}"
        raise SchemaError(where, err.problem) from err
    if isinstance(value, float) and value != value:  # NaN passes every bound
        raise SchemaError(key, "is not a finite number")
    keys = parse_keys(key, value) if key in KEY_KINDS_OF else None
    pipelines = parse_pipelines(value) if key == "pipelines" else None  # the device's own rule (docs/agent.md)
    return CheckedValue(value, pipelines, keys)


def parse_keys(key: str, pems: list[str]) -> tuple[PublicKey, ...]:
    """The public keys of ``trust`` or ``operator_keys``; a key labelled with the other kind, or
    one given twice, is refused."""
    parsed: list[PublicKey] = []
    seen: set[bytes] = set()
    for index, pem in enumerate(pems):
        where = f"{key}[{index}]"
        data = pem.encode("utf-8")
        try:
            check_kind(data, where, KEY_KINDS_OF[key])
            public = public_key_from_pem(data, where)
        except KeyFileError as err:
            raise SchemaError(where, err.problem) from err
        raw = public.public_bytes_raw()
        if raw in seen:
            raise SchemaError(where, "names the same key twice")
        seen.add(raw)
        parsed.append(public)
    return tuple(parsed)


def unknown_keys(settings: Mapping[str, Any]) -> str:
    """Why a document's keys are refused ("" when all are remote settings): every unknown and
    every local-only key, by name."""
    local = sorted(key for key in settings if key in LOCAL_ONLY)
    unknown = sorted(key for key in settings if key not in LOCAL_ONLY and schema_of(key) is None)
    problems = []
    if unknown:
        problems.append(f"unknown keys {', '.join(unknown)}")
    if local:
        problems.append(f"{', '.join(local)} can only be changed in agent.yaml on the device")
    return "; ".join(problems)


def parse_document(generation: Any, settings: Any) -> SettingsDocument:
    """The whole document checked up front (:class:`SchemaError` naming the first problem): a
    generation in range, no unknown or local-only key, every value in bounds, key lists that are
    not empty (a device must keep a trusted release key and an operator key)."""
    if isinstance(generation, bool) or not isinstance(generation, int) or not 1 <= generation <= MAX_GENERATION:
        raise SchemaError("generation", f"must be an integer from 1 to {MAX_GENERATION}")
    if not isinstance(settings, dict):
        raise SchemaError("settings", "must be an object of dotted agent.yaml keys")
    if len(settings) > MAX_DOCUMENT_KEYS:
        raise SchemaError("settings", f"holds {len(settings)} keys, at most {MAX_DOCUMENT_KEYS}")
    refused = unknown_keys(settings)
    if refused:
        raise SchemaError("settings", refused)
    for key in ("trust", "operator_keys"):
        if key in settings and settings[key] == []:
            raise SchemaError(key, "would leave the device without any key of this kind: refused whole")
    parsed = {key: checked(key, value) for key, value in settings.items()}
    return SettingsDocument(
        generation=generation,
        values=tuple(sorted(settings.items())),
        release_keys=parsed["trust"].keys or () if "trust" in parsed else (),
        operator_keys=parsed["operator_keys"].keys or () if "operator_keys" in parsed else (),
        pipelines=parsed["pipelines"].pipelines if "pipelines" in parsed else None,
    )


def digest(settings: Mapping[str, Any]) -> str:
    """sha256 of a document's settings in canonical JSON: the server sends a new generation
    only when this changes."""
    text = json.dumps(dict(settings), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()
