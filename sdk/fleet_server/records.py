"""What one state, telemetry or job message says, as bounded, typed values. Pure: bytes in,
a record or a drop reason out; never raises.

Every value a record holds can be stored by both backends and computed with: a message whose
strings (any of them, keys included) hold a NUL or a lone surrogate is dropped (``bad_text``;
sqlite3 and psycopg cannot encode a surrogate, PostgreSQL text refuses NUL, and the API could
not answer it as UTF-8); counters are below :data:`BIG` (2^62), and a sum of counters (the
per-reason error maps) is clamped to :data:`BIG` and the record says which field was clamped
(``clamped``), so no stored integer, nor the sum of two of them, passes a signed 64-bit column.

Why not the full JSON Schema validation of every telemetry message: at a thousand messages a
second it would cost the server more than the rest of ingest, and the server needs only a
few figures. Each figure is taken only when it has the right type and a finite value; a
message whose schema id, device or size is wrong is dropped and counted by reason. The
device named inside a message must be the device of its topic (the broker's ACL ties a
topic to its device; the payload is whatever the device wrote).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any

from edgepack_core.protocol.ids import is_valid_id
from edgepack_core.protocol.payloads import JOB_SCHEMA_ID, STATE_SCHEMA_ID, TELEMETRY_SCHEMA_ID

MAX_MESSAGE_BYTES = 64 * 1024
MAX_CAPABILITIES_BYTES = 8 * 1024
MAX_GROUPS = 64
MAX_TEXT = 300
MAX_REASON = 500
BIG = 2**62  # counters beyond this are nonsense (and would overflow a BIGINT)
MAX_STRINGS = 10_000  # strings looked at in one message (a 64 KiB payload holds fewer)
_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")
JOB_STATE = re.compile(r"[a-z_]{1,32}")  # the job schema's pattern


@dataclass(frozen=True)
class StateRecord:
    device: str
    status: str  # online | offline
    ts: float
    reason: str
    groups: tuple[str, ...] | None  # None: the message did not say
    model_name: str | None
    model_version: str | None
    model_sha256: str | None
    provider: str | None
    profile: str | None
    capabilities: str | None  # compact JSON


@dataclass(frozen=True)
class Decommissioned:
    """An empty retained state: the device was removed from the fleet."""

    device: str


@dataclass(frozen=True)
class TelemetryRecord:
    device: str
    seq: int | None
    model_name: str | None
    model_version: str | None
    model_sha256: str | None
    provider: str | None
    latency_p50: float | None
    latency_p90: float | None
    latency_p99: float | None
    latency_mean: float | None
    throughput_per_s: float | None
    inferences_total: int | None
    inferences_interval: int | None
    errors_total: int | None
    errors_interval: int | None
    cpu_percent: float | None
    memory_rss_bytes: int | None
    temperature_c: float | None
    clamped: tuple[str, ...] = ()  # fields whose sum passed BIG and were clamped to it


@dataclass(frozen=True)
class JobRecord:
    device: str
    job: str
    type: str
    state: str
    final: bool
    reason: str
    ts: float


Record = StateRecord | Decommissioned | TelemetryRecord | JobRecord


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) and abs(number) < 1e15 else None


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < BIG:
        return None
    return value


def _text(value: Any, limit: int = MAX_TEXT) -> str | None:
    return value[:limit] if isinstance(value, str) else None


def _model(doc: dict[str, Any]) -> tuple[str | None, str | None, str | None]:
    model = doc.get("model")
    if not isinstance(model, dict):
        return None, None, None
    name = model.get("name") if is_valid_id(model.get("name")) else None
    sha = model.get("sha256")
    sha = sha if isinstance(sha, str) and len(sha) == 64 else None
    return name, _text(model.get("version"), 128), sha


def _error_sum(value: Any) -> tuple[int | None, bool]:
    """The sum of a per-reason counter map, clamped to :data:`BIG`; and whether it was clamped."""
    if not isinstance(value, dict):
        return None, False
    total = sum(c for c in (_count(item) for item in value.values()) if c is not None)
    return min(total, BIG), total > BIG


def has_bad_text(doc: Any) -> bool:
    """Whether any string in the decoded JSON (keys too) holds a NUL or a lone surrogate, or the
    document holds more than :data:`MAX_STRINGS` strings. Iterative: no recursion on depth."""
    stack, seen = [doc], 0
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, str):
            seen += 1
            if seen > MAX_STRINGS or _BAD_TEXT.search(item) is not None:
                return True
    return False


def _decode(payload: bytes) -> dict[str, Any] | str:
    if len(payload) > MAX_MESSAGE_BYTES:
        return "too_large"
    try:
        doc = json.loads(payload)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return "not_json"
    if not isinstance(doc, dict):
        return "bad_schema"
    return "bad_text" if has_bad_text(doc) else doc


def parse_state(device: str, payload: bytes) -> StateRecord | Decommissioned | str:
    """A retained state message, or the reason it is dropped."""
    if payload == b"":
        return Decommissioned(device)
    doc = _decode(payload)
    if isinstance(doc, str):
        return doc
    status, ts = doc.get("status"), _number(doc.get("ts"))
    if doc.get("schema") != STATE_SCHEMA_ID or status not in ("online", "offline") or ts is None or ts < 0:
        return "bad_schema"
    if doc.get("device") != device:
        return "device_mismatch"
    groups = doc.get("groups")
    group_list = tuple(dict.fromkeys(g for g in groups[:MAX_GROUPS] if is_valid_id(g))) \
        if isinstance(groups, list) else None
    capabilities = doc.get("capabilities")
    caps_text = None
    if isinstance(capabilities, dict):
        caps_text = json.dumps(capabilities, separators=(",", ":"), sort_keys=True)
        caps_text = caps_text if len(caps_text) <= MAX_CAPABILITIES_BYTES else None
    profile = capabilities.get("profile") if isinstance(capabilities, dict) else None
    name, version, sha = _model(doc)
    return StateRecord(device=device, status=status, ts=ts,
                       reason=(_text(doc.get("reason")) or "") if status == "offline" else "",
                       groups=group_list, model_name=name, model_version=version, model_sha256=sha,
                       provider=_text(doc.get("provider"), 64), profile=_text(profile, 64), capabilities=caps_text)


def parse_telemetry(device: str, payload: bytes) -> TelemetryRecord | str:
    """A telemetry message, or the reason it is dropped."""
    doc = _decode(payload)
    if isinstance(doc, str):
        return doc
    if doc.get("schema") != TELEMETRY_SCHEMA_ID:
        return "bad_schema"
    if doc.get("device") != device:
        return "device_mismatch"
    latency = doc.get("latency_ms") if isinstance(doc.get("latency_ms"), dict) else {}
    inferences = doc.get("inferences") if isinstance(doc.get("inferences"), dict) else {}
    name, version, sha = _model(doc)
    errors_total, total_clamped = _error_sum(doc.get("errors"))
    errors_interval, interval_clamped = _error_sum(doc.get("errors_interval"))
    clamped = tuple(field for field, flag in (("errors_total", total_clamped), ("errors_interval", interval_clamped))
                    if flag)
    return TelemetryRecord(
        device=device, seq=_count(doc.get("seq")), model_name=name, model_version=version, model_sha256=sha,
        provider=_text(doc.get("provider"), 64),
        latency_p50=_number(latency.get("p50")), latency_p90=_number(latency.get("p90")),
        latency_p99=_number(latency.get("p99")), latency_mean=_number(latency.get("mean")),
        throughput_per_s=_number(doc.get("throughput_per_s")),
        inferences_total=_count(inferences.get("total")), inferences_interval=_count(inferences.get("interval")),
        errors_total=errors_total, errors_interval=errors_interval,
        cpu_percent=_number(doc.get("cpu_percent")), memory_rss_bytes=_count(doc.get("memory_rss_bytes")),
        temperature_c=_number(doc.get("temperature_c")), clamped=clamped,
    )


def parse_job(device: str, payload: bytes) -> JobRecord | str:
    """A job event, or the reason it is dropped."""
    doc = _decode(payload)
    if isinstance(doc, str):
        return doc
    state, job, final, ts = doc.get("state"), doc.get("job"), doc.get("final"), _number(doc.get("ts"))
    if doc.get("schema") != JOB_SCHEMA_ID or not is_valid_id(job) or not isinstance(final, bool) or ts is None \
            or not isinstance(state, str) or JOB_STATE.fullmatch(state) is None:
        return "bad_schema"
    if doc.get("device") != device:
        return "device_mismatch"
    return JobRecord(device=device, job=job, type=_text(doc.get("type"), 32) or "", state=state, final=final,
                     reason=_text(doc.get("reason"), MAX_REASON) or "", ts=ts)
