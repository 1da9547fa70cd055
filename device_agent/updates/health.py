"""The health window's verdict: did the new model hurt what users see? Pure.

Counted against the model (from the HTTP/runtime error kinds, see ``device_agent/runtime.py``):

- **model errors**: inference and postprocessing failures on well-formed input (kinds
  ``runtime``, ``postprocess``, ``internal``), and non-finite outputs (inputs with NaN/inf are
  refused as 400 before inference, so a non-finite output is the model's doing);
- **contract errors**: client errors that a contract break produces (wrong shape, dtype,
  input names, unsupported media type: ``shape``, ``dtype``, ``unknown_input``,
  ``missing_input``, ``unsupported_media``), but only when their rate in the window rises
  above the rate before the swap by more than the allowed error rate: a client that always
  sends bad shapes must not roll back every release.

Never counted: malformed input (bad JSON, nested too deep, NaN inputs, corrupt images,
oversized bodies), so a local client cannot forge a rollback with garbage.

Never a pass on silence: with fewer than ``min_requests`` well-formed live requests the window
must be backed by golden-sample probes through the live service, or it fails; a probe that does
not reproduce its golden outputs fails the window outright (the smoke test demanded as much).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MODEL_ERROR_KINDS = frozenset({"runtime", "postprocess", "internal"})
CONTRACT_ERROR_KINDS = frozenset({"shape", "dtype", "unknown_input", "missing_input", "unsupported_media"})
MIN_REQUESTS_FOR_LATENCY = 20


@dataclass(frozen=True)
class HealthPolicy:
    max_error_rate: float = 0.05
    max_latency_factor: float = 3.0
    min_requests: int = 20


@dataclass(frozen=True)
class Traffic:
    """Well-formed request outcomes over a span of time (a window, or everything before it)."""

    ok: int = 0
    model_errors: int = 0
    contract_errors: int = 0
    non_finite: int = 0
    latency_sum: float = 0.0

    @property
    def total(self) -> int:
        return self.ok + self.model_errors + self.contract_errors

    @property
    def contract_rate(self) -> float:
        return self.contract_errors / self.total if self.total else 0.0


@dataclass(frozen=True)
class Probes:
    """Golden samples replayed through the live service."""

    sent: int = 0
    failed: int = 0
    first_problem: str = ""


@dataclass(frozen=True)
class HealthVerdict:
    healthy: bool
    reason: str


def _count(errors: Mapping[str, int], kinds: frozenset[str]) -> int:
    return sum(int(n) for kind, n in errors.items() if kind in kinds)


def traffic_of(snapshot: Mapping[str, Any]) -> Traffic:
    """The well-formed traffic in one RequestStats snapshot (cumulative since start)."""
    errors = snapshot.get("errors", {})
    return Traffic(ok=int(snapshot["requests"]["ok"]), model_errors=_count(errors, MODEL_ERROR_KINDS),
                   contract_errors=_count(errors, CONTRACT_ERROR_KINDS), non_finite=int(snapshot.get("non_finite", 0)),
                   latency_sum=float(snapshot.get("latency_sum", 0.0)))


def traffic_between(before: Mapping[str, Any], after: Mapping[str, Any]) -> Traffic:
    """What happened between two snapshots."""
    a, b = traffic_of(before), traffic_of(after)
    return Traffic(ok=b.ok - a.ok, model_errors=b.model_errors - a.model_errors,
                   contract_errors=b.contract_errors - a.contract_errors, non_finite=b.non_finite - a.non_finite,
                   latency_sum=b.latency_sum - a.latency_sum)


def needs_probes(window: Traffic, policy: HealthPolicy) -> bool:
    """Too little live traffic to judge on: replay the golden samples."""
    return window.total < policy.min_requests


def judge(window: Traffic, before: Traffic, probes: Probes, policy: HealthPolicy) -> HealthVerdict:
    """The verdict on a health window. ``before`` is the traffic before the swap (the old model's
    rates and latency); ``probes`` the golden samples replayed in the window (possibly none)."""
    if window.total < policy.min_requests and probes.sent == 0:
        return HealthVerdict(False, f"only {window.total} live requests and no golden samples to probe: "
                                    "no evidence the model works")
    if probes.failed:
        return HealthVerdict(False, f"{probes.failed} of {probes.sent} golden-sample probes through the live "
                                    f"service failed: {probes.first_problem}")
    failures = window.model_errors + window.non_finite
    if window.total and failures / window.total > policy.max_error_rate:
        return HealthVerdict(False, f"{window.model_errors} model errors and {window.non_finite} non-finite outputs "
                                    f"in {window.total} requests (limit {policy.max_error_rate:.0%})")
    if window.total and window.contract_rate > before.contract_rate + policy.max_error_rate:
        return HealthVerdict(False, f"client errors rose to {window.contract_errors} of {window.total} requests "
                                    f"({window.contract_rate:.0%}, {before.contract_rate:.0%} before the swap): "
                                    "the I/O contract broke")
    baseline = before.latency_sum / before.ok if before.ok else None
    if baseline and window.ok >= MIN_REQUESTS_FOR_LATENCY:
        mean = window.latency_sum / window.ok
        if mean > baseline * policy.max_latency_factor:
            return HealthVerdict(False, f"mean latency {mean * 1000:.2f} ms is over {policy.max_latency_factor}x the "
                                        f"previous model's {baseline * 1000:.2f} ms")
    return HealthVerdict(True, f"{window.total} live requests and {probes.sent} probes, no problem found")


def check_window(value: Any, *, low: float, high: float) -> float:
    """A requested health window in seconds, or ValueError naming why it is refused. Pure.

    Non-finite values are refused, not clamped: a NaN compares false with everything and
    would slip through ``<``/``>`` checks to mean "no window".
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"health_window_s {value!r} is not a finite number")
    if value < low or value > high:
        raise ValueError(f"health_window_s {value:g} is outside this device's range [{low:g}, {high:g}] s")
    return float(value)
