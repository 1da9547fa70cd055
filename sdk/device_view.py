"""One device as the fleet server sees it (``edgepack device show``): the server's answers parsed
once into a typed, frozen :class:`DeviceView`. Pure: no I/O.

Why a parser on the client side: most of what the answers hold was sent by the device (its
status reason, job reasons, model names and versions, pipeline names and reasons), and the
server stores it as it came, bounded but not cleaned. Printed raw on an operator's terminal, a
hostile device's ``\\x1b]0;...\\x07`` or ``\\x1b[2J`` would retitle or wipe it, and a ``\\n`` would
forge lines. So every string is cleaned here (:func:`clean`: control, format and separator
characters shown as escapes, cut to :data:`MAX_TEXT`), every list is bounded, every figure is a
finite number or None, before anything is rendered (:mod:`sdk.device_view_text`) or dumped as
JSON. The renderer then cuts each line to the terminal's share.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgepack_core.protocol.bounds import count, number  # the one figure and counter rule of device messages
from sdk.text_safety import MAX_TEXT, clean  # noqa: F401  the one rule every command prints by (and its limit)

SCHEMA = "edgepack.device-show/1"
MAX_MODELS = 32
MAX_PIPELINES = 16  # the protocol's limit (edgepack_core/protocol/pipeline_figures.py)
MAX_HISTORY = 5
MAX_ROLLOUTS = 5
MAX_CERTIFICATES = 5  # what GET /api/devices/{id}/credentials lists
MAX_GROUPS = 64


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any, limit: int) -> list[Any]:
    return list(value[:limit]) if isinstance(value, list) else []


# --------------------------------------------------------------------------- the value


@dataclass(frozen=True)
class Certificate:
    """The device's newest certificate from the fleet CA, as the server recorded it."""

    serial: str
    not_after: float
    revoked_at: float | None


@dataclass(frozen=True)
class Identity:
    id: str
    enrolled: bool  # False: decommissioned (its records are gone; its messages are dropped)
    groups: tuple[str, ...] = ()
    unenrolled_groups: tuple[str, ...] = ()  # what it claims that the server did not enroll
    online: bool = False
    status: str = "unknown"  # what its last state said: online, offline, unknown
    status_reason: str = ""
    last_seen: float | None = None
    first_seen: float | None = None
    decommissioned_at: float | None = None
    decommissioned_by: str = ""
    decommission_reason: str = ""
    credentials_known: bool = False  # the server answered GET /api/devices/{id}/credentials
    certificate: Certificate | None = None
    password: bool = False


@dataclass(frozen=True)
class ModelState:
    """One model: what the device reports running, what its effective target names, what differs."""

    model: str
    runs: str  # the version, or "" for nothing
    runs_sha256: str
    target: str  # the artifact's sha256, "absent" (the model is to be removed), or "" (no target)
    source: str  # the scope that set the target: fleet, group:G, device
    difference: str


@dataclass(frozen=True)
class TargetState:
    state: str  # converged | send | wait
    reason: str
    hold: bool
    held_by: tuple[str, ...]


@dataclass(frozen=True)
class Health:
    """The latest telemetry figures the server holds (any may be None)."""

    telemetry_at: float | None
    provider: str
    profile: str
    update_status: str
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    throughput_per_s: float | None
    inferences_total: int | None
    errors_total: int | None
    error_rate: float | None
    memory_rss_bytes: int | None
    cpu_percent: float | None
    temperature_c: float | None


@dataclass(frozen=True)
class Pipeline:
    name: str
    state: str
    reason: str
    frames: int | None
    fps: float | None
    dropped: int | None
    stage_errors: int | None
    source_state: str


@dataclass(frozen=True)
class HistoryEntry:
    started_at: float | None
    job: str
    kind: str
    artifact: str  # "name version (sha12)" or ""
    rollout: str
    outcome: str
    reason: str


@dataclass(frozen=True)
class RolloutEntry:
    """An active rollout (pending, running, paused) that lists the device."""

    id: str
    state: str
    wave: int
    wave_count: int
    artifact: str
    reason: str
    device_wave: int
    device_state: str
    device_reason: str


@dataclass(frozen=True)
class BadRelease:
    """A model the device runs whose artifact (same name and version) is marked bad fleet-wide."""

    model: str
    sha256: str
    version: str
    at: float | None
    actor: str
    reason: str


@dataclass(frozen=True)
class DeviceView:
    identity: Identity
    models: tuple[ModelState, ...] = ()
    target: TargetState | None = None
    health: Health | None = None
    pipelines: tuple[Pipeline, ...] = ()
    history: tuple[HistoryEntry, ...] = ()
    rollouts: tuple[RolloutEntry, ...] = ()
    bad_releases: tuple[BadRelease, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **dataclasses.asdict(self)}


@dataclass(frozen=True)
class Answers:
    """The server's answers about one device, as they came (``None``: not answered, a 404)."""

    device_id: str
    device: Mapping[str, Any] | None = None  # GET /api/devices/{id}
    decommissioned: Mapping[str, Any] | None = None  # its entry of GET /api/decommissioned
    target: Mapping[str, Any] | None = None  # GET /api/devices/{id}/target
    credentials: Mapping[str, Any] | None = None  # GET /api/devices/{id}/credentials
    history: Mapping[str, Any] | None = None  # GET /api/devices/{id}/history?limit=5
    rollouts: Sequence[Mapping[str, Any]] = ()  # GET /api/rollouts/{id} of the active ones listing it
    artifacts: Sequence[Mapping[str, Any]] = ()  # GET /api/artifacts (those marked bad are used)


# --------------------------------------------------------------------------- parsing


def _texts(value: Any, limit: int) -> tuple[str, ...]:
    return tuple(clean(item, 64) for item in _list(value, limit))


def _certificate(credentials: Mapping[str, Any]) -> Certificate | None:
    for row in _list(credentials.get("certificates"), MAX_CERTIFICATES):  # newest first
        row = _map(row)
        not_after = number(row.get("not_after"))
        if not_after is not None:
            return Certificate(clean(row.get("serial"), 40), not_after, number(row.get("revoked_at")))
    return None


def _with_credentials(identity: Identity, credentials: Mapping[str, Any] | None) -> Identity:
    if credentials is None:
        return identity
    return dataclasses.replace(
        identity,
        credentials_known=True,
        certificate=_certificate(credentials),
        password=credentials.get("password") is True,
    )


def _identity(answers: Answers) -> Identity:
    if answers.device is None:
        gone = _map(answers.decommissioned)
        return Identity(
            id=clean(answers.device_id, 64),
            enrolled=False,
            status="decommissioned",
            decommissioned_at=number(gone.get("at")),
            decommissioned_by=clean(gone.get("actor"), 128),
            decommission_reason=clean(gone.get("reason")),
        )
    doc = answers.device
    return Identity(
        id=clean(doc.get("id"), 64) or clean(answers.device_id, 64),
        enrolled=True,
        groups=_texts(doc.get("groups"), MAX_GROUPS),
        unenrolled_groups=_texts(doc.get("unenrolled_groups"), MAX_GROUPS),
        online=doc.get("online") is True,
        status=clean(doc.get("status"), 16) or "unknown",
        status_reason=clean(doc.get("status_reason")),
        last_seen=number(doc.get("last_seen")),
        first_seen=number(doc.get("first_seen")),
    )


def _models_from_target(target: Mapping[str, Any]) -> tuple[ModelState, ...]:
    effective = _map(_map(target.get("effective")).get("models"))
    reported = _map(_map(target.get("reported")).get("models"))
    difference = _map(target.get("difference"))
    names = sorted({*effective, *reported, *difference})[:MAX_MODELS]
    return tuple(
        ModelState(
            model=clean(name, 64),
            runs=clean(_map(reported.get(name)).get("version"), 64),
            runs_sha256=clean(_map(reported.get(name)).get("sha256"), 64),
            target=clean(_map(effective.get(name)).get("artifact"), 64),
            source=clean(_map(effective.get(name)).get("source"), 80),
            difference=clean(difference.get(name)),
        )
        for name in names
    )


def _models_from_device(doc: Mapping[str, Any]) -> tuple[ModelState, ...]:
    model = _map(doc.get("model"))
    if not model:
        return ()
    return (
        ModelState(
            model=clean(model.get("name"), 64),
            runs=clean(model.get("version"), 64),
            runs_sha256=clean(model.get("sha256"), 64),
            target="",
            source="",
            difference="",
        ),
    )


def _target(target: Mapping[str, Any]) -> TargetState:
    effective = _map(target.get("effective"))
    return TargetState(
        state=clean(target.get("state"), 16),
        reason=clean(target.get("reason")),
        hold=effective.get("hold") is True,
        held_by=_texts(effective.get("held_by"), 16),
    )


def _health(doc: Mapping[str, Any]) -> Health:
    latency = _map(doc.get("latency_ms"))
    return Health(
        telemetry_at=number(doc.get("telemetry_at")),
        provider=clean(doc.get("provider"), 64),
        profile=clean(doc.get("profile"), 64),
        update_status=clean(doc.get("update_status"), 16),
        latency_p50_ms=number(latency.get("p50")),
        latency_p99_ms=number(latency.get("p99")),
        throughput_per_s=number(doc.get("throughput_per_s")),
        inferences_total=count(doc.get("inferences_total")),
        errors_total=count(doc.get("errors_total")),
        error_rate=number(doc.get("error_rate")),
        memory_rss_bytes=count(doc.get("memory_rss_bytes")),
        cpu_percent=number(doc.get("cpu_percent")),
        temperature_c=number(doc.get("temperature_c")),
    )


def _pipeline(doc: Any) -> Pipeline:
    doc = _map(doc)
    return Pipeline(
        name=clean(doc.get("name"), 64),
        state=clean(doc.get("state"), 16),
        reason=clean(doc.get("reason")),
        frames=count(doc.get("frames")),
        fps=number(doc.get("fps")),
        dropped=count(doc.get("dropped")),
        stage_errors=count(doc.get("stage_errors")),
        source_state=clean(_map(doc.get("source")).get("state"), 16),
    )


def _artifact_words(artifact: Any) -> str:
    artifact = _map(artifact)
    sha = clean(artifact.get("sha256"), 64)
    if not sha:
        return ""
    return f"{clean(artifact.get('name'), 64) or '?'} {clean(artifact.get('version'), 64) or '?'} ({sha[:12]})"


def _history(history: Mapping[str, Any]) -> tuple[HistoryEntry, ...]:
    entries = []
    for entry in _list(history.get("entries"), MAX_HISTORY):
        entry = _map(entry)
        entries.append(
            HistoryEntry(
                started_at=number(entry.get("started_at")),
                job=clean(entry.get("job"), 64),
                kind=clean(entry.get("kind"), 32),
                artifact=_artifact_words(entry.get("artifact")),
                rollout=clean(_map(entry.get("rollout")).get("id"), 64),
                outcome=clean(entry.get("outcome"), 32),
                reason=clean(entry.get("reason")),
            )
        )
    return tuple(entries)


def _rollout(doc: Mapping[str, Any], device: str) -> RolloutEntry | None:
    row = next((_map(d) for d in _list(doc.get("devices"), 100_000) if _map(d).get("device") == device), None)
    if row is None:
        return None
    wave = count(row.get("wave"))
    return RolloutEntry(
        id=clean(doc.get("id"), 64),
        state=clean(doc.get("state"), 16),
        wave=count(doc.get("wave_number")) or 0,
        wave_count=count(doc.get("wave_count")) or 0,
        artifact=_artifact_words(doc.get("artifact")),
        reason=clean(doc.get("reason")),
        device_wave=0 if wave is None else wave + 1,
        device_state=clean(row.get("state"), 32),
        device_reason=clean(row.get("reason")),
    )


def _bad_releases(models: Sequence[ModelState], artifacts: Sequence[Mapping[str, Any]]) -> tuple[BadRelease, ...]:
    """Each running model whose name and version are those of an artifact marked bad."""
    marked: dict[tuple[str, str], tuple[Mapping[str, Any], Mapping[str, Any]]] = {}
    for artifact in artifacts:
        bad = _map(_map(artifact).get("bad"))
        if bad:
            key = (clean(artifact.get("name"), 64), clean(artifact.get("version"), 64))
            marked.setdefault(key, (artifact, bad))
    found = []
    for model in models:
        hit = marked.get((model.model, model.runs)) if model.runs else None
        if hit is not None:
            artifact, bad = hit
            found.append(
                BadRelease(
                    model=model.model,
                    sha256=clean(artifact.get("sha256"), 64),
                    version=model.runs,
                    at=number(bad.get("at")),
                    actor=clean(bad.get("actor"), 128),
                    reason=clean(bad.get("reason")),
                )
            )
    return tuple(found)


def parse(answers: Answers) -> DeviceView:
    """The view of one device from the server's answers; bounded and cleaned (module docstring)."""
    identity = _with_credentials(_identity(answers), answers.credentials)
    if answers.device is None:
        return DeviceView(identity=identity)
    models = (_models_from_target(answers.target) if answers.target is not None else ()) or _models_from_device(
        answers.device
    )
    rollouts = (_rollout(doc, answers.device_id) for doc in answers.rollouts[:MAX_ROLLOUTS])
    return DeviceView(
        identity=identity,
        models=models,
        target=_target(answers.target) if answers.target is not None else None,
        health=_health(answers.device),
        pipelines=tuple(_pipeline(p) for p in _list(answers.device.get("pipelines"), MAX_PIPELINES)),
        history=_history(answers.history) if answers.history is not None else (),
        rollouts=tuple(r for r in rollouts if r is not None),
        bad_releases=_bad_releases(models, answers.artifacts),
    )
