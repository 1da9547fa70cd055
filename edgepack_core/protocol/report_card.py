"""A model's report card: what the device measured of it on its own hardware at activation.

One typed, frozen value for both sides: the agent builds it (``device_agent/report_card.py``)
and publishes it in ``/healthz`` and in each entry of the state message's ``models``; the fleet
server parses it with :func:`parse_report_card` (through :func:`..messages.parse_state`) and
stores it per device and model version. The parser is pure and total: a card whose figures are
of the wrong type, out of range or inconsistent (p99 below p50, more accelerated nodes than
nodes) is dropped whole (None), never half believed; an agent without report cards sends none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgepack_core.protocol.bounds import count, number, text

MAX_PROVIDER_CHARS = 64
MAX_RUNS = 1000  # the agent runs at most 20; a card claiming more is not one of ours
MAX_NODES = 1_000_000


@dataclass(frozen=True)
class ReportCard:
    """Figures of one model measured at activation. Latencies in milliseconds over the golden
    samples (None without golden samples); ``first_inference_ms`` from the load start to the
    first golden answer (session creation included); ``peak_rss_bytes`` the process's high-water
    mark after the load; ``accelerated_share`` the share of the session's executed nodes on a
    provider other than the CPU (0 on the CPU provider; None when nothing ran to count them)."""

    provider: str
    runs: int
    p50_ms: float | None
    p99_ms: float | None
    first_inference_ms: float | None
    peak_rss_bytes: int | None
    nodes: int | None
    accelerated_nodes: int | None
    accelerated_share: float | None
    measured_at: float
    budget_hit: bool = False  # the latency runs stopped at the time budget, before their count

    def to_json(self) -> dict[str, Any]:
        return {"provider": self.provider, "runs": self.runs, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms,
                "first_inference_ms": self.first_inference_ms, "peak_rss_bytes": self.peak_rss_bytes,
                "nodes": self.nodes, "accelerated_nodes": self.accelerated_nodes,
                "accelerated_share": self.accelerated_share, "measured_at": self.measured_at,
                "budget_hit": self.budget_hit}


def _figure(value: Any) -> float | bool | None:
    """A non-negative figure, None for null, or False for anything else (the card is refused)."""
    if value is None:
        return None
    figure = number(value)
    return figure if figure is not None and figure >= 0 else False


def _counter(value: Any, limit: int) -> int | bool | None:
    if value is None:
        return None
    kept = count(value)
    return kept if kept is not None and kept <= limit else False


def _consistent(card: ReportCard) -> bool:
    if card.p50_ms is not None and card.p99_ms is not None and card.p99_ms < card.p50_ms:
        return False
    if card.nodes is not None and card.accelerated_nodes is not None and card.accelerated_nodes > card.nodes:
        return False
    return card.accelerated_share is None or card.accelerated_share <= 1.0


def parse_report_card(value: Any) -> ReportCard | None:
    """The card in a state's model entry, or None when absent or not a valid card. Pure."""
    if not isinstance(value, dict):
        return None
    provider, runs, measured_at = text(value.get("provider"), MAX_PROVIDER_CHARS), value.get("runs"), \
        number(value.get("measured_at"))
    figures = {key: _figure(value.get(key)) for key in ("p50_ms", "p99_ms", "first_inference_ms",
                                                        "accelerated_share")}
    counters = {"peak_rss_bytes": _counter(value.get("peak_rss_bytes"), 2**62 - 1),
                "nodes": _counter(value.get("nodes"), MAX_NODES),
                "accelerated_nodes": _counter(value.get("accelerated_nodes"), MAX_NODES)}
    kept_runs = _counter(runs, MAX_RUNS)
    if not provider or measured_at is None or measured_at < 0 or not isinstance(kept_runs, int) \
            or isinstance(kept_runs, bool) or any(v is False for v in (*figures.values(), *counters.values())):
        return None
    card = ReportCard(provider=provider, runs=kept_runs, measured_at=measured_at,
                      budget_hit=value.get("budget_hit") is True, **figures, **counters)  # type: ignore[arg-type]
    return card if _consistent(card) else None
