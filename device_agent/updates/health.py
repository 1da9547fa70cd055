"""The health window's verdict: did the new model hurt what users see? Pure.

Counted against the model (from the HTTP/runtime error kinds, see ``device_agent/runtime.py``):

- **model errors**: inference and postprocessing failures on well-formed input (kinds
  ``runtime``, ``postprocess``, ``internal``), and non-finite outputs (inputs with NaN/inf are
  refused as 400 before inference, so a non-finite output is the model's doing): those the
  recipe does not allow are refused (500, kind ``non_finite_output``), those it allows are
  served flagged; both count, once each (``non_finite`` in the stats counts both);
- **contract errors**: client errors that a contract break produces (wrong shape, dtype,
  input names, unsupported media type: ``shape``, ``dtype``, ``unknown_input``,
  ``missing_input``, ``unsupported_media``), but only when their rate in the window rises
  above the rate before the swap by more than the allowed error rate *and* come from at least
  ``contract_error_min_clients`` distinct peer addresses: a client that always sends bad shapes
  must not roll back every release, and one local client sending two wrong-shape requests into
  a quiet window must not roll back a healthy one (distinct addresses, so a process that can
  bind several loopback addresses still counts as several clients: docs/updates.md).

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
NON_FINITE_KIND = "non_finite_output"  # a refused answer; counted as a non-finite output, not twice
CONTRACT_ERROR_KINDS = frozenset({"shape", "dtype", "unknown_input", "missing_input", "unsupported_media"})
MIN_REQUESTS_FOR_LATENCY = 20
DEFAULT_CONTRACT_ERROR_MIN_CLIENTS = 3


@dataclass(frozen=True)
class HealthPolicy:
    max_error_rate: float = 0.05
    max_latency_factor: float = 3.0
    min_latency_increase_s: float = 0.002
    min_requests: int = 20
    contract_error_min_clients: int = DEFAULT_CONTRACT_ERROR_MIN_CLIENTS


@dataclass(frozen=True)
class Traffic:
    """Well-formed request outcomes over a span of time (a window, or everything before it)."""

    ok: int = 0
    model_errors: int = 0
    contract_errors: int = 0
    non_finite: int = 0  # answers with NaN/inf outputs: the refused ones and the flagged (ok) ones
    non_finite_refused: int = 0  # of ``non_finite``, those answered 500 (not in ``ok``)
    latency_sum: float = 0.0
    contract_clients: int = 0  # distinct peer addresses that sent contract errors (windows only)

    @property
    def total(self) -> int:
        return self.answered + self.contract_errors

    @property
    def answered(self) -> int:
        """Requests that reached the model: evidence about it (a contract error never runs it)."""
        return self.ok + self.model_errors + self.non_finite_refused

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
                   non_finite_refused=int(errors.get(NON_FINITE_KIND, 0)),
                   latency_sum=float(snapshot.get("latency_sum", 0.0)))


def clients_since(before: Mapping[str, Any], after: Mapping[str, Any]) -> int:
    """How many distinct peers sent a contract error between two snapshots: those whose latest
    contract error (``contract_peers``: peer -> its sequence number) is newer than the last one
    ``before`` saw (``contract_seq``). Exact up to the number of peers a snapshot keeps."""
    mark = int(before.get("contract_seq", 0))
    return sum(1 for seq in dict(after.get("contract_peers", {})).values() if int(seq) > mark)


def traffic_between(before: Mapping[str, Any], after: Mapping[str, Any]) -> Traffic:
    """What happened between two snapshots."""
    a, b = traffic_of(before), traffic_of(after)
    return Traffic(ok=b.ok - a.ok, model_errors=b.model_errors - a.model_errors,
                   contract_errors=b.contract_errors - a.contract_errors, non_finite=b.non_finite - a.non_finite,
                   non_finite_refused=b.non_finite_refused - a.non_finite_refused,
                   latency_sum=b.latency_sum - a.latency_sum, contract_clients=clients_since(before, after))


def needs_probes(window: Traffic, policy: HealthPolicy) -> bool:
    """Too little live traffic to judge on: replay the golden samples. Only requests that reached
    the model count, so wrong-shape requests cannot stand in for evidence that it works."""
    return window.answered < policy.min_requests


def judge(window: Traffic, before: Traffic, probes: Probes, policy: HealthPolicy) -> HealthVerdict:
    """The verdict on a health window. ``before`` is the traffic before the swap (the old model's
    rates and latency); ``probes`` the golden samples replayed in the window (possibly none)."""
    if window.answered < policy.min_requests and probes.sent == 0:
        return HealthVerdict(False, f"only {window.answered} live requests and no golden samples to probe: "
                                    "no evidence the model works")
    if probes.failed:
        return HealthVerdict(False, f"{probes.failed} of {probes.sent} golden-sample probes through the live "
                                    f"service failed: {probes.first_problem}")
    failures = window.model_errors + window.non_finite
    if window.total and failures / window.total > policy.max_error_rate:
        return HealthVerdict(False, f"{window.model_errors} model errors and {window.non_finite} non-finite outputs "
                                    f"in {window.total} requests (limit {policy.max_error_rate:.0%})")
    broke = contract_broke(window, before, policy)
    if broke:
        return HealthVerdict(False, broke)
    baseline = before.latency_sum / before.ok if before.ok else None
    if baseline and window.ok >= MIN_REQUESTS_FOR_LATENCY:
        mean = window.latency_sum / window.ok
        if latency_regressed(mean, baseline, policy):
            return HealthVerdict(False, f"mean latency {mean * 1000:.2f} ms is over {policy.max_latency_factor}x the "
                                        f"previous model's {baseline * 1000:.2f} ms")
    return HealthVerdict(True, f"{window.total} live requests and {probes.sent} probes, no problem found"
                               f"{_uncounted(window, policy)}")


def latency_regressed(mean: float, baseline: float, policy: HealthPolicy) -> bool:
    """Slower by the factor *and* by ``min_latency_increase_s``: a sub-millisecond model's mean
    moves by several times on a busy machine (a scheduler tick, a GC pause), which is noise and
    no reason to roll back a release; a real regression on such a model is also absolute. Pure."""
    return mean > baseline * policy.max_latency_factor and mean - baseline >= policy.min_latency_increase_s


def contract_broke(window: Traffic, before: Traffic, policy: HealthPolicy) -> str:
    """Why the window's contract errors break the I/O contract, or "" when they do not: their
    rate must rise above the pre-swap rate by more than ``max_error_rate`` and they must come
    from at least ``contract_error_min_clients`` distinct peers. Pure."""
    if not window.total or window.contract_rate <= before.contract_rate + policy.max_error_rate:
        return ""
    if window.contract_clients < policy.contract_error_min_clients:
        return ""
    return (f"client errors rose to {window.contract_errors} of {window.total} requests "
            f"({window.contract_rate:.0%}, {before.contract_rate:.0%} before the swap) from "
            f"{window.contract_clients} clients: the I/O contract broke")


def _uncounted(window: Traffic, policy: HealthPolicy) -> str:
    """The healthy verdict's note on contract errors too few clients sent to count."""
    if not window.contract_errors or window.contract_clients >= policy.contract_error_min_clients:
        return ""
    return (f" ({window.contract_errors} client errors from {window.contract_clients} client(s) not counted: "
            f"{policy.contract_error_min_clients} distinct clients needed)")


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
