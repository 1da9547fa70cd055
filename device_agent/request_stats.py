"""The inference requests' counters for ``/metrics`` and the health window: outcomes, error
kinds, a fixed-bucket latency histogram, non-finite outputs and the peers of contract errors
(fixed memory)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

MAX_CONTRACT_PEERS = 256
"""Peers remembered for the contract-error rule: far above any ``contract_error_min_clients``."""
# Prometheus histogram bucket bounds (seconds) for inference latency.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class RequestStats:
    """Counters and a fixed-bucket latency histogram for /metrics (fixed memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[str, int] = {"ok": 0, "client_error": 0, "server_error": 0}
        self.errors: dict[str, int] = {}
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        # Answers whose outputs held NaN/inf: refused (also the error kind ``non_finite_output``)
        # or served flagged where the recipe allows them (device_agent/finiteness.py).
        self.non_finite = 0
        # Which peers sent contract errors (the health window counts distinct ones): peer address ->
        # the sequence number of its latest contract error, the least recently seen forgotten first.
        self.contract_seq = 0
        self.contract_peers: OrderedDict[str, int] = OrderedDict()

    def ok(self, seconds: float) -> None:
        index = 0
        while index < len(LATENCY_BUCKETS) and seconds > LATENCY_BUCKETS[index]:
            index += 1
        with self._lock:
            self.requests["ok"] += 1
            self.buckets[index] += 1
            self.latency_sum += seconds

    def error(self, kind: str, client: bool) -> None:
        with self._lock:
            self.requests["client_error" if client else "server_error"] += 1
            if kind in self.errors or len(self.errors) < 64:
                self.errors[kind] = self.errors.get(kind, 0) + 1

    def contract_error_from(self, peer: str) -> None:
        """Remember that ``peer`` sent a contract error (its kind is counted by :meth:`error`)."""
        with self._lock:
            self.contract_seq += 1
            self.contract_peers[peer] = self.contract_seq
            self.contract_peers.move_to_end(peer)
            if len(self.contract_peers) > MAX_CONTRACT_PEERS:
                self.contract_peers.popitem(last=False)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": dict(self.requests), "errors": dict(self.errors), "buckets": list(self.buckets),
                    "latency_sum": self.latency_sum, "non_finite": self.non_finite,
                    "contract_seq": self.contract_seq, "contract_peers": dict(self.contract_peers)}

    def count_non_finite(self) -> None:
        with self._lock:
            self.non_finite += 1
