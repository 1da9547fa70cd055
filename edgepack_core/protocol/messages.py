"""Device messages (``edgepack.state/1``, ``edgepack.telemetry/1``, ``edgepack.job/1``): the one
parser of each, into frozen, bounded values.

Every host reader of these messages (``sdk/fleet.py``, the fleet server's ingest,
``sdk/deploy/messaging.py``) parses with these functions, so each rule exists once: the bounds of
:mod:`.bounds` (size, string count, no NUL or lone surrogate, finite figures, counters below
2^62, clamped sums), the schema id, and the device named inside a message being the device of
its topic (the broker's ACL ties a topic to its device; the payload is whatever the device
wrote). A parser is pure and total: bytes in, a value or a :data:`~.bounds.Refusal` out.

Why not the full JSON Schema validation of every telemetry message: at a thousand messages a
second it would cost the fleet server more than the rest of ingest, and readers need only a
few figures. So a state or job event is refused when a field readers act on is wrong, while a
telemetry figure of the wrong type or out of range just reads as None.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from edgepack_core.golden_stream import GoldenCounts, counts_in
from edgepack_core.protocol.bounds import (
    Refusal,
    count,
    counter_map,
    counter_sum,
    decode_document,
    first_named,
    number,
    text,
)
from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.protocol.payloads import JOB_SCHEMA_ID, STATE_SCHEMA_ID, TELEMETRY_SCHEMA_ID
from edgepack_core.protocol.pipeline_figures import PipelineFigures, parse_pipelines_section
from edgepack_core.protocol.rejected import MAX_REJECTED, REJECTION_STAGES, RejectedRef
from edgepack_core.protocol.report_card import ReportCard, parse_report_card

MAX_GROUPS = 64  # the state schema's maxItems
MAX_CAPABILITIES_BYTES = 8 * 1024
MAX_STATE_REASON = 300
MAX_JOB_REASON = 500
MAX_NAME_CHARS = 64  # provider, profile
MAX_VERSION_CHARS = 128
MAX_JOB_TYPE_CHARS = 32
MAX_ERROR_KINDS = 64  # the agent sends at most 32 kinds and "other"
JOB_STATE = re.compile(r"[a-z_]{1,32}")  # the job schema's pattern
MAX_MODELS = 16  # the state schema's maxItems for models
_SHA256 = re.compile(r"[0-9a-f]{64}")

Status = Literal["online", "offline"]


@dataclass(frozen=True)
class ModelRef:
    """The model a device says it serves: ``name`` only if it is a valid id, ``sha256`` only if
    it has 64 characters, ``version`` cut to :data:`MAX_VERSION_CHARS`."""

    name: str | None
    version: str | None
    sha256: str | None = None
    report_card: ReportCard | None = None  # an entry of ``models`` only; None from older agents

    def to_json(self) -> dict[str, Any]:
        card = {} if self.report_card is None else {"report_card": self.report_card.to_json()}
        return {"name": self.name, "version": self.version, "sha256": self.sha256, **card}


@dataclass(frozen=True)
class SessionMark:
    """Which MQTT connection of a device a state belongs to: ``epoch`` names the device's
    connection counter (made afresh when its file is lost, e.g. a re-flashed card) and ``n``
    counts connection attempts within it. A birth and the last will of one connection carry the
    same mark, so a host can order them without trusting clocks or arrival order
    (``sdk/fleet_server/liveness.py``)."""

    epoch: str
    n: int

    def to_json(self) -> dict[str, str | int]:
        return {"epoch": self.epoch, "n": self.n}


SESSION_EPOCH = re.compile(r"[0-9a-f]{8,32}")


@dataclass(frozen=True)
class SettingsReport:
    """What a device says about its settings from the fleet server: the generation it holds (0:
    none), each key's result (``applied`` or ``refused: reason``) and the ids of the release and
    operator keys it trusts."""

    generation: int
    results: tuple[tuple[str, str], ...]
    release_keys: tuple[str, ...]
    operator_keys: tuple[str, ...]


@dataclass(frozen=True)
class DeviceState:
    """A retained state: the birth ("online", with capabilities) or the last will ("offline")."""

    device: str
    status: Status
    ts: float
    reason: str = ""  # offline only
    groups: tuple[str, ...] | None = None  # None: the message did not say
    model: ModelRef | None = None
    provider: str | None = None
    profile: str | None = None
    capabilities: str | None = None  # compact JSON with sorted keys; None when absent or too large
    session: SessionMark | None = None  # None: an agent from before connection marks
    rejected: tuple[RejectedRef, ...] = ()  # newest first; () also for an agent that does not report them
    # Every model the device holds (several named models); () from an agent before them, whose
    # one model is ``model``.
    models: tuple[ModelRef, ...] = ()
    settings: SettingsReport | None = None  # None: an agent before remote settings, or a malformed report

    def capabilities_dict(self) -> dict[str, Any]:
        """The capabilities as a fresh dict (empty when the message had none)."""
        return json.loads(self.capabilities) if self.capabilities else {}


@dataclass(frozen=True)
class Decommissioned:
    """An empty retained state: the device was removed from the fleet."""

    device: str


@dataclass(frozen=True)
class QueueCounters:
    """The device's outbox counters."""

    depth: int | None
    dropped: int | None
    produced: int | None
    delivered: int | None


@dataclass(frozen=True)
class ModelTelemetry:
    """One model's figures in a telemetry sample (several named models): inferences, errors by
    kind (the first :data:`MAX_ERROR_KINDS`; sums clamped to 2^62) and latency, like the device's."""

    name: str
    version: str | None = None
    inferences_total: int | None = None
    inferences_interval: int | None = None
    errors_total: int | None = None
    errors_interval: int | None = None
    error_kinds: tuple[tuple[str, int], ...] = ()
    error_kinds_interval: tuple[tuple[str, int], ...] = ()
    latency_p50: float | None = None
    latency_p90: float | None = None
    latency_p99: float | None = None
    latency_max: float | None = None
    latency_mean: float | None = None
    throughput_per_s: float | None = None

    @classmethod
    def from_sample(cls, name: str, version: str | None, sample: Telemetry) -> ModelTelemetry:
        """The figures of ``sample`` (one model's aggregator's) under the model's name."""
        return cls(name, version, **{f.name: getattr(sample, f.name) for f in dataclasses.fields(cls)
                                     if f.name not in ("name", "version")})

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, **_figures_json(self)}


def _figures_json(figures: ModelTelemetry | Telemetry) -> dict[str, Any]:
    """Inferences, errors, latency and throughput as a telemetry document carries them (the
    device's and each model's alike)."""
    return {"inferences": {"interval": figures.inferences_interval, "total": figures.inferences_total},
            "errors": dict(figures.error_kinds), "errors_interval": dict(figures.error_kinds_interval),
            "latency_ms": {"p50": figures.latency_p50, "p90": figures.latency_p90, "p99": figures.latency_p99,
                           "max": figures.latency_max, "mean": figures.latency_mean},
            "throughput_per_s": figures.throughput_per_s}


@dataclass(frozen=True)
class Telemetry:
    """One telemetry sample, as the agent builds it (:meth:`encode`) and a host parses it.
    ``error_kinds`` and ``error_kinds_interval`` are the per-kind error maps (the first
    :data:`MAX_ERROR_KINDS` kinds when parsed); ``errors_total`` and ``errors_interval`` are their
    sums, clamped to 2^62 (``clamped`` names those that were)."""

    device: str
    seq: int | None = None
    ts: float | None = None
    model: ModelRef | None = None
    provider: str | None = None
    interval_s: float | None = None
    latency_p50: float | None = None
    latency_p90: float | None = None
    latency_p99: float | None = None
    latency_max: float | None = None
    latency_mean: float | None = None
    throughput_per_s: float | None = None
    inferences_total: int | None = None
    inferences_interval: int | None = None
    errors_total: int | None = None
    errors_interval: int | None = None
    error_kinds: tuple[tuple[str, int], ...] = ()
    error_kinds_interval: tuple[tuple[str, int], ...] = ()
    cpu_percent: float | None = None
    memory_rss_bytes: int | None = None
    temperature_c: float | None = None
    uptime_s: float | None = None
    queue: QueueCounters | None = None
    clamped: tuple[str, ...] = ()
    models: tuple[ModelTelemetry, ...] = ()  # per model (several named models); () from older agents
    pipelines: tuple[PipelineFigures, ...] = ()  # per pipeline (pipeline_figures.py); () from older agents

    def latency_ms(self) -> dict[str, float | None]:
        return {"p50": self.latency_p50, "p90": self.latency_p90, "p99": self.latency_p99,
                "max": self.latency_max, "mean": self.latency_mean}

    def to_json(self) -> dict[str, Any]:
        """The sample's wire document, every key in the order the agent has always sent them."""
        queue = self.queue
        return {
            "schema": TELEMETRY_SCHEMA_ID, "device": self.device, "seq": self.seq, "ts": self.ts,
            "model": None if self.model is None else self.model.to_json(), "provider": self.provider,
            "interval_s": self.interval_s, **_figures_json(self),
            "cpu_percent": self.cpu_percent, "memory_rss_bytes": self.memory_rss_bytes,
            "temperature_c": self.temperature_c, "uptime_s": self.uptime_s,
            "queue": None if queue is None else {"depth": queue.depth, "dropped": queue.dropped,
                                                 "produced": queue.produced, "delivered": queue.delivered},
            **({"models": [model.to_json() for model in self.models]} if self.models else {}),
            **({"pipelines": [p.to_json() for p in self.pipelines]} if self.pipelines else {}),
        }

    def encode(self) -> bytes:
        """The wire bytes the agent publishes (the builder side of :func:`parse_telemetry`)."""
        return json.dumps(self.to_json()).encode()


@dataclass(frozen=True)
class JobEvent:
    """One state change of a command's job. ``detail`` holds the state's facts as the device
    sent them (within the message bounds); it is the parser's own copy, not to be mutated.
    ``golden_stream``: its golden stream counts, typed once by :func:`parse_job_event` (the
    fleet server's rollouts read them; not sent: ``detail`` carries them on the wire)."""

    device: str
    job: str
    type: str
    state: str
    final: bool
    ts: float
    reason: str = ""
    version: str | None = None
    duplicate: bool = False
    detail: Mapping[str, Any] = field(default_factory=dict, hash=False)
    golden_stream: GoldenCounts | None = None

    def to_json(self) -> dict[str, Any]:
        """The event's wire document: what the agent publishes and ``edgepack device`` prints.
        Optional keys only when set, in the order the agent has always sent them."""
        doc: dict[str, Any] = {"schema": JOB_SCHEMA_ID, "device": self.device, "ts": self.ts, "job": self.job,
                               "type": self.type, "state": self.state, "reason": self.reason, "final": self.final}
        if self.version:
            doc["version"] = self.version
        if self.detail:
            doc["detail"] = dict(self.detail)
        if self.duplicate:
            doc["duplicate"] = True
        return doc

    def encode(self) -> bytes:
        """The wire bytes the agent publishes (the builder side of :func:`parse_job_event`)."""
        return json.dumps(self.to_json()).encode()


# --------------------------------------------------------------------------- shared pieces


def _document(payload: bytes, schema_id: str) -> dict[str, Any] | Refusal:
    """The decoded, bounded payload if it has ``schema_id``."""
    doc = decode_document(payload)
    if isinstance(doc, str):
        return doc
    if doc.get("schema") != schema_id:
        return "bad_schema"
    return doc


def _model(value: Any) -> ModelRef | None:
    if not isinstance(value, dict):
        return None
    name = value.get("name")
    sha = value.get("sha256")
    return ModelRef(name if is_valid_id(name) else None, text(value.get("version"), MAX_VERSION_CHARS),
                    sha if isinstance(sha, str) and len(sha) == 64 else None)


def _models(value: Any) -> tuple[ModelRef, ...]:
    """The models among the first :data:`MAX_MODELS` that have a valid name, each name once;
    () for a non-list or an absent key."""
    if not isinstance(value, list):
        return ()
    found: dict[str, ModelRef] = {}
    for item in value[:MAX_MODELS]:
        ref = _model(item)
        if ref is not None and ref.name is not None and ref.name not in found:
            found[ref.name] = dataclasses.replace(ref, report_card=parse_report_card(item.get("report_card")))
    return tuple(found.values())


def _groups(value: Any) -> tuple[str, ...] | None:
    """Valid group names, first :data:`MAX_GROUPS` looked at, each once; None for a non-list."""
    if not isinstance(value, list):
        return None
    return tuple(dict.fromkeys(g for g in value[:MAX_GROUPS] if is_valid_id(g)))


def _rejected_ref(value: Any) -> RejectedRef | None:
    if not isinstance(value, dict):
        return None
    name, sha, stage, ts = value.get("name"), value.get("sha256"), value.get("stage"), number(value.get("ts"))
    version = text(value.get("version"), MAX_VERSION_CHARS)
    if not (is_valid_id(name) and version and isinstance(sha, str) and _SHA256.fullmatch(sha)
            and stage in REJECTION_STAGES and ts is not None and ts >= 0):
        return None
    return RejectedRef(str(name), version, sha, str(stage), text(value.get("reason"), MAX_STATE_REASON) or "", ts)


def _rejected(value: Any) -> tuple[RejectedRef, ...]:
    """The valid records among the first :data:`MAX_REJECTED`; () for a non-list or an absent key."""
    if not isinstance(value, list):
        return ()
    return tuple(ref for ref in map(_rejected_ref, value[:MAX_REJECTED]) if ref is not None)


MAX_SETTING_RESULTS = 64  # results kept from one report (a document holds at most a few dozen keys)
MAX_REPORTED_KEYS = 16  # keys of one kind a settings document may carry
_KEY_ID = re.compile(r"[0-9a-f]{16}")
_SETTING_KEY = re.compile(r"[a-z_][a-z0-9_.]{0,63}")


def _key_ids(value: Any) -> tuple[str, ...] | None:
    if not isinstance(value, list) or len(value) > MAX_REPORTED_KEYS:
        return None
    if not all(isinstance(kid, str) and _KEY_ID.fullmatch(kid) for kid in value):
        return None
    return tuple(dict.fromkeys(value))


def _settings(value: Any) -> SettingsReport | None:
    """The device's settings report, or None when absent or malformed (bounded: at most
    :data:`MAX_SETTING_RESULTS` results of :data:`MAX_STATE_REASON` characters each)."""
    if not isinstance(value, dict):
        return None
    generation, results, keys = count(value.get("generation")), value.get("results"), value.get("keys")
    if generation is None or not isinstance(results, dict) or len(results) > MAX_SETTING_RESULTS \
            or not isinstance(keys, dict):
        return None
    release, operator = _key_ids(keys.get("release")), _key_ids(keys.get("operator"))
    if release is None or operator is None:
        return None
    kept = tuple(sorted((key, text(result, MAX_STATE_REASON) or "") for key, result in results.items()
                        if isinstance(key, str) and _SETTING_KEY.fullmatch(key)))
    return SettingsReport(generation, kept, release, operator)


def _session(value: Any) -> SessionMark | None:
    """The connection mark, or None when absent or malformed (ordering then falls back to when
    the state was heard)."""
    if not isinstance(value, dict):
        return None
    epoch, n = value.get("epoch"), count(value.get("n"))
    if not isinstance(epoch, str) or not SESSION_EPOCH.fullmatch(epoch) or n is None:
        return None
    return SessionMark(epoch, n)


def _capabilities(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    compact = json.dumps(value, separators=(",", ":"), sort_keys=True)
    return compact if len(compact) <= MAX_CAPABILITIES_BYTES else None


# --------------------------------------------------------------------------- parsers


def parse_state(device: str, payload: bytes) -> DeviceState | Decommissioned | Refusal:
    """A retained state heard on ``device``'s state topic, or why it is refused. An empty
    payload clears a decommissioned device."""
    if payload == b"":
        return Decommissioned(device)
    doc = _document(payload, STATE_SCHEMA_ID)
    if isinstance(doc, str):
        return doc
    status, ts = doc.get("status"), number(doc.get("ts"))
    if status not in ("online", "offline") or ts is None or ts < 0:
        return "bad_schema"
    if doc.get("device") != device:
        return "device_mismatch"
    capabilities = doc.get("capabilities")
    profile = capabilities.get("profile") if isinstance(capabilities, dict) else None
    reason = (text(doc.get("reason"), MAX_STATE_REASON) or "") if status == "offline" else ""
    return DeviceState(device=device, status="online" if status == "online" else "offline", ts=ts, reason=reason,
                       groups=_groups(doc.get("groups")), model=_model(doc.get("model")),
                       provider=text(doc.get("provider"), MAX_NAME_CHARS), profile=text(profile, MAX_NAME_CHARS),
                       capabilities=_capabilities(capabilities), session=_session(doc.get("session")),
                       rejected=_rejected(doc.get("rejected")), models=_models(doc.get("models")),
                       settings=_settings(doc.get("settings")) if status == "online" else None)


def _queue(value: Any) -> QueueCounters | None:
    if not isinstance(value, dict):
        return None
    return QueueCounters(count(value.get("depth")), count(value.get("dropped")), count(value.get("produced")),
                         count(value.get("delivered")))


def _section(doc: dict[str, Any], key: str) -> dict[str, Any]:
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def _error_figures(doc: dict[str, Any]) -> dict[str, Any]:
    """The error sums (clamped), which of them were clamped, and the kinds kept for display."""
    total, total_clamped = counter_sum(doc.get("errors"))
    interval, interval_clamped = counter_sum(doc.get("errors_interval"))
    flags = (("errors_total", total_clamped), ("errors_interval", interval_clamped))
    return {"errors_total": total, "errors_interval": interval,
            "clamped": tuple(name for name, flag in flags if flag),
            "error_kinds": counter_map(doc.get("errors"), MAX_ERROR_KINDS, MAX_NAME_CHARS),
            "error_kinds_interval": counter_map(doc.get("errors_interval"), MAX_ERROR_KINDS, MAX_NAME_CHARS)}


def _figures(doc: dict[str, Any]) -> dict[str, Any]:
    """Inferences, errors, latency and throughput of a telemetry document (the device's or one
    model's); a figure of the wrong type reads None."""
    latency, inferences = _section(doc, "latency_ms"), _section(doc, "inferences")
    return {"latency_p50": number(latency.get("p50")), "latency_p90": number(latency.get("p90")),
            "latency_p99": number(latency.get("p99")), "latency_max": number(latency.get("max")),
            "latency_mean": number(latency.get("mean")), "throughput_per_s": number(doc.get("throughput_per_s")),
            "inferences_total": count(inferences.get("total")),
            "inferences_interval": count(inferences.get("interval")), **_error_figures(doc)}


def _model_figures(value: Any) -> ModelTelemetry | None:
    """One model's figures, or None without a valid name."""
    if not isinstance(value, dict) or not is_valid_id(value.get("name")):
        return None
    figures = _figures(value)
    figures.pop("clamped")
    return ModelTelemetry(name=str(value["name"]), version=text(value.get("version"), MAX_VERSION_CHARS), **figures)


def _models_figures(value: Any) -> tuple[ModelTelemetry, ...]:
    """The valid models among the first :data:`MAX_MODELS`, each name once; () for a non-list."""
    return first_named(value, MAX_MODELS, _model_figures)


def parse_telemetry(device: str, payload: bytes) -> Telemetry | Refusal:
    """A telemetry sample heard on ``device``'s telemetry topic, or why it is refused."""
    doc = _document(payload, TELEMETRY_SCHEMA_ID)
    if isinstance(doc, str):
        return doc
    if doc.get("device") != device:
        return "device_mismatch"
    return Telemetry(
        device=device, seq=count(doc.get("seq")), ts=number(doc.get("ts")), model=_model(doc.get("model")),
        provider=text(doc.get("provider"), MAX_NAME_CHARS), interval_s=number(doc.get("interval_s")),
        cpu_percent=number(doc.get("cpu_percent")), memory_rss_bytes=count(doc.get("memory_rss_bytes")),
        temperature_c=number(doc.get("temperature_c")), uptime_s=number(doc.get("uptime_s")),
        queue=_queue(doc.get("queue")), models=_models_figures(doc.get("models")),
        pipelines=parse_pipelines_section(doc.get("pipelines")), **_figures(doc),
    )


def _job_fields_valid(doc: dict[str, Any]) -> bool:
    state = doc.get("state")
    return (is_valid_id(doc.get("job")) and isinstance(doc.get("final"), bool) and number(doc.get("ts")) is not None
            and isinstance(state, str) and JOB_STATE.fullmatch(state) is not None)


def parse_job_event(device: str, payload: bytes) -> JobEvent | Refusal:
    """A job event heard on ``device``'s job topic, or why it is refused: its job id, state
    (the schema's pattern), ``final`` and ``ts`` are required."""
    doc = _document(payload, JOB_SCHEMA_ID)
    if isinstance(doc, str):
        return doc
    if not _job_fields_valid(doc):
        return "bad_schema"
    if doc.get("device") != device:
        return "device_mismatch"
    detail, ts = doc.get("detail"), number(doc["ts"])
    detail = detail if isinstance(detail, dict) else {}
    return JobEvent(device=device, job=doc["job"], type=text(doc.get("type"), MAX_JOB_TYPE_CHARS) or "",
                    state=doc["state"], final=doc["final"], ts=ts if ts is not None else 0.0,
                    reason=text(doc.get("reason"), MAX_JOB_REASON) or "",
                    version=text(doc.get("version"), MAX_VERSION_CHARS), duplicate=doc.get("duplicate") is True,
                    detail=detail, golden_stream=counts_in(detail))


__all__ = [
    "MAX_REJECTED", "REJECTION_STAGES",
    "Decommissioned", "DeviceState", "JobEvent", "ModelRef", "ModelTelemetry", "QueueCounters", "Refusal",
    "RejectedRef", "Telemetry",
    "parse_job_event", "parse_state", "parse_telemetry",
]
