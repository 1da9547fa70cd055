"""The agent's metrics in the Prometheus text exposition format (version 0.0.4): inference
requests and errors, every HTTP answer by status class, answers with non-finite outputs, the
latency histogram, the active model and the API's load."""

from __future__ import annotations

import threading

from device_agent.request_stats import LATENCY_BUCKETS
from device_agent.runtime import InferenceService


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class HttpStats:
    """Every HTTP answer, counted by status class (``2xx`` ... ``5xx``), whichever layer gave it."""

    CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.answers = dict.fromkeys(self.CLASSES, 0)

    def count(self, status: int) -> None:
        key = f"{min(max(status // 100, 1), 5)}xx"
        with self._lock:
            self.answers[key] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.answers)


def prometheus_text(service: InferenceService, http: HttpStats | None = None) -> str:
    """Metrics in the Prometheus text exposition format (version 0.0.4)."""
    snap = service.stats.snapshot()
    lines = ["# HELP edgepack_requests_total Inference requests (/predict, v2 infer) by outcome.",
             "# TYPE edgepack_requests_total counter"]
    for status, count in sorted(snap["requests"].items()):
        lines.append(f'edgepack_requests_total{{status="{status}"}} {count}')
    lines += ["# HELP edgepack_errors_total Failed requests by kind.", "# TYPE edgepack_errors_total counter"]
    for kind, count in sorted(snap["errors"].items()):
        lines.append(f'edgepack_errors_total{{kind="{_escape(kind)}"}} {count}')
    if http is not None:
        lines += ["# HELP edgepack_http_responses_total Every HTTP answer, by status class.",
                  "# TYPE edgepack_http_responses_total counter"]
        for status_class, count in http.snapshot().items():
            lines.append(f'edgepack_http_responses_total{{class="{status_class}"}} {count}')
    lines += ["# HELP edgepack_non_finite_outputs_total Answers whose outputs held NaN/inf (refused as "
              "kind non_finite_output, or served flagged where the recipe allows them).",
              "# TYPE edgepack_non_finite_outputs_total counter",
              f"edgepack_non_finite_outputs_total {snap['non_finite']}"]
    lines += ["# HELP edgepack_inference_latency_seconds Model run time per request.",
              "# TYPE edgepack_inference_latency_seconds histogram"]
    cumulative = 0
    for bound, count in zip(LATENCY_BUCKETS, snap["buckets"], strict=False):
        cumulative += count
        lines.append(f'edgepack_inference_latency_seconds_bucket{{le="{bound}"}} {cumulative}')
    cumulative += snap["buckets"][-1]
    lines.append(f'edgepack_inference_latency_seconds_bucket{{le="+Inf"}} {cumulative}')
    lines.append(f"edgepack_inference_latency_seconds_sum {snap['latency_sum']:.9f}")
    lines.append(f"edgepack_inference_latency_seconds_count {cumulative}")
    lines += ["# HELP edgepack_model_info The active model and the provider it runs on.",
              "# TYPE edgepack_model_info gauge"]
    model = service.model
    if model is not None:
        info = model.describe()
        lines.append(f'edgepack_model_info{{name="{_escape(info["name"])}",version="{_escape(info["version"])}",'
                     f'sha256="{info["sha256"]}",provider="{info["provider"]}"}} 1')
    return "\n".join(lines) + "\n"


def load_gauges(admitted: int, held_bytes: int) -> str:
    """The API's load now, in the Prometheus text format: requests holding a worker or queue
    slot, and request body bytes held in memory (counted as they arrive)."""
    return ("# HELP edgepack_http_requests_in_progress Inference requests admitted (reading, queued or running).\n"
            "# TYPE edgepack_http_requests_in_progress gauge\n"
            f"edgepack_http_requests_in_progress {admitted}\n"
            "# HELP edgepack_http_body_bytes_held Request body bytes held in memory (api.max_buffered_bytes).\n"
            "# TYPE edgepack_http_body_bytes_held gauge\n"
            f"edgepack_http_body_bytes_held {held_bytes}\n")
