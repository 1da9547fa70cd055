"""``edgepack device show`` as text: a :class:`~sdk.device_view.DeviceView` rendered for an
operator's terminal. Pure: the view and ``now`` in, lines out.

Bounded: every line is cut to :data:`WIDTH` characters, and no section prints more than
:data:`MAX_LINES` lines of what the device sent (models, pipelines); the rest is counted in one
line pointing at ``--json``. The view's strings are already cleaned of control characters
(:func:`sdk.device_view.clean`), so a line is one line.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from sdk.device_view import BadRelease, DeviceView, Health, Identity, ModelState, Pipeline, RolloutEntry, TargetState

WIDTH = 160
MAX_LINES = 8


def age(seconds: float) -> str:
    """A duration, coarse as an on-call operator reads it: ``59s``, ``1m``, ``59m``, ``1h 0m``,
    ``23h 59m``, ``1d 0h``; a negative one (clock skew) is ``0s``. Pure."""
    whole = max(0, int(seconds))
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60}m"
    return f"{whole // 86400}d {whole % 86400 // 3600}h"


def ago(ts: float | None, now: float) -> str:
    return "never" if ts is None else f"{age(now - ts)} ago"


def utc(ts: float | None) -> str:
    """A unix time as ``YYYY-MM-DD HH:MM:SS`` UTC (``-`` for None)."""
    if ts is None:
        return "-"
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def fit(line: str, width: int = WIDTH) -> str:
    """``line`` cut to ``width`` characters, the last one ``…`` when cut. Pure."""
    return line if len(line) <= width else line[: width - 1] + "…"


def _figure(value: float | int | None, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}{unit}" if isinstance(value, float) else f"{value}{unit}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 1048576:.1f} MiB"


def _certificate_words(identity: Identity, now: float) -> str:
    cert = identity.certificate
    if not identity.credentials_known:
        return "certificate: not known to this server"
    if cert is None:
        return "broker password (no certificate)" if identity.password else "no certificate from the fleet CA"
    if cert.revoked_at is not None:
        return f"certificate {cert.serial[:16]} revoked {ago(cert.revoked_at, now)}"
    if cert.not_after <= now:
        return f"certificate {cert.serial[:16]} expired {ago(cert.not_after, now)}"
    return f"certificate {cert.serial[:16]} expires in {age(cert.not_after - now)} ({utc(cert.not_after)} UTC)"


def identity_lines(identity: Identity, now: float) -> list[str]:
    if not identity.enrolled:
        by = f" by {identity.decommissioned_by}" if identity.decommissioned_by else ""
        why = f": {identity.decommission_reason}" if identity.decommission_reason else ""
        return [
            f"device {identity.id}: decommissioned {ago(identity.decommissioned_at, now)}{by}{why}",
            f"  its messages are dropped until it is enrolled again; {_certificate_words(identity, now)}",
        ]
    state = (
        "online"
        if identity.online
        else "offline"
        if identity.status == "offline"
        else f"silent (last state: {identity.status})"
    )
    why = f": {identity.status_reason}" if identity.status_reason and not identity.online else ""
    groups = ", ".join(identity.groups) or "none"
    claimed = f" (claims, not enrolled: {', '.join(identity.unenrolled_groups)})" if identity.unenrolled_groups else ""
    return [
        f"device {identity.id}: {state}{why}, last seen {ago(identity.last_seen, now)}",
        f"  groups: {groups}{claimed}",
        f"  enrolled (first seen {ago(identity.first_seen, now)}); {_certificate_words(identity, now)}",
    ]


def _capped(lines: Sequence[str], total: int, what: str) -> list[str]:
    shown = list(lines[:MAX_LINES])
    if total > len(shown):
        shown.append(f"  ... {total - len(shown)} more {what} (--json for all)")
    return shown


def _model_line(model: ModelState) -> str:
    runs = f"{model.runs} ({model.runs_sha256[:12]})" if model.runs_sha256 else (model.runs or "nothing")
    target = model.target if model.target in ("", "absent") else model.target[:12]
    wanted = f"target {target} from {model.source}" if target else "no target"
    return f"  {model.model}: runs {runs}; {wanted}" + (f"; {model.difference}" if model.difference else "")


def model_lines(models: Sequence[ModelState], target: TargetState | None) -> list[str]:
    if target is None:
        head = "target: none known (the server has no target document for it)"
    else:
        hold = f", held by {', '.join(target.held_by) or 'a hold'}" if target.hold else ""
        head = f"target: {target.state}{hold}" + (f": {target.reason}" if target.reason else "")
    body = [_model_line(m) for m in models] or ["  none reported"]
    return [head, *_capped(body, len(body), "models")]


def health_lines(health: Health, now: float) -> list[str]:
    rate = f" (rate {health.error_rate:.4f})" if health.error_rate is not None else ""
    return [
        f"health: telemetry {ago(health.telemetry_at, now)}, last update {health.update_status or 'none'}",
        f"  provider {health.provider or '-'}  profile {health.profile or '-'}  latency p50 "
        f"{_figure(health.latency_p50_ms, ' ms', 2)} p99 {_figure(health.latency_p99_ms, ' ms', 2)}  "
        f"throughput {_figure(health.throughput_per_s, '/s')}",
        f"  inferences {_figure(health.inferences_total)}  errors {_figure(health.errors_total)}{rate}  "
        f"memory {_mib(health.memory_rss_bytes)}  cpu {_figure(health.cpu_percent, '%')}  "
        f"temperature {_figure(health.temperature_c, ' C')}",
    ]


def _pipeline_line(p: Pipeline) -> str:
    source = f" source {p.source_state}" if p.source_state else ""
    why = f": {p.reason}" if p.reason else ""
    return (
        f"  {p.name}: {p.state or '-'}{why}, frames {_figure(p.frames)}, fps {_figure(p.fps)}, "
        f"dropped {_figure(p.dropped)}, stage errors {_figure(p.stage_errors)}{source}"
    )


def pipeline_lines(pipelines: Sequence[Pipeline]) -> list[str]:
    if not pipelines:
        return []
    return [
        f"pipelines ({len(pipelines)})",
        *_capped([_pipeline_line(p) for p in pipelines], len(pipelines), "pipelines"),
    ]


def history_lines(view: DeviceView) -> list[str]:
    """Each job on one line, its reason (when it has one) on the next."""
    if not view.identity.enrolled:
        return []
    lines = [f"history (last {len(view.history)}, newest first)" if view.history else "history: no job recorded"]
    for entry in view.history:
        what = f" {entry.artifact}" if entry.artifact else ""
        rollout = f" rollout {entry.rollout}" if entry.rollout else ""
        lines.append(f"  {utc(entry.started_at)}  {entry.kind}{what}{rollout}: {entry.outcome}  (job {entry.job})")
        if entry.reason:
            lines.append(f"    {entry.reason}")
    return lines


def rollout_lines(rollouts: Sequence[RolloutEntry]) -> list[str]:
    """Each active rollout on one line, then what it says about this device."""
    lines = ["in rollouts:"] if rollouts else []
    for r in rollouts:
        lines.append(
            f"  {r.id} {r.state}, wave {r.wave}/{r.wave_count}, {r.artifact or 'no artifact'}"
            + (f": {r.reason}" if r.reason else "")
        )
        lines.append(
            f"    this device: wave {r.device_wave}, {r.device_state}"
            + (f": {r.device_reason}" if r.device_reason else "")
        )
    return lines


def bad_lines(bad: Sequence[BadRelease], now: float) -> list[str]:
    return [
        f"BAD RELEASE: {b.model} {b.version} (artifact {b.sha256[:12]}) was marked bad {ago(b.at, now)}"
        + (f" by {b.actor}" if b.actor else "")
        + (f": {b.reason}" if b.reason else "")
        + "; see edgepack device rollback, edgepack target set"
        for b in bad
    ]


def render(view: DeviceView, now: float) -> str:
    """The whole view as text, bad releases first (what the operator must see), each line fit."""
    lines = [*bad_lines(view.bad_releases, now), *identity_lines(view.identity, now)]
    if view.identity.enrolled:
        lines += model_lines(view.models, view.target)
        if view.health is not None:
            lines += health_lines(view.health, now)
        lines += pipeline_lines(view.pipelines) + rollout_lines(view.rollouts)
    lines += history_lines(view)
    return "\n".join(fit(line) for line in lines)
