"""The agent's metrics in the Prometheus text exposition format (version 0.0.4): inference
requests and errors, every HTTP answer by status class, answers with non-finite outputs, the
latency histogram, the active model and the API's load, and each pipeline's counters and
stage latency histograms."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from device_agent.request_stats import LATENCY_BUCKETS
from device_agent.runtime import InferenceService
from edgepack_core.protocol.pipeline_figures import PIPELINE_STATES, PipelineFigures

if TYPE_CHECKING:  # an agent without pipelines never loads them (tests/test_agent_lazy_imports.py)
    from device_agent.pipelines.latency import HistogramSnapshot, PipelineLatency


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


def prometheus_text(services: InferenceService | Mapping[str, InferenceService], http: HttpStats | None = None) -> str:
    """Metrics in the Prometheus text exposition format (version 0.0.4). One model: its series
    as they have always been; several (``services`` by model name): every per-model series
    carries a ``model="name"`` label."""
    if isinstance(services, InferenceService):
        services = {"": services}
    labelled = len(services) > 1
    lines = ["# HELP edgepack_requests_total Inference requests (/predict, v2 infer) by outcome.",
             "# TYPE edgepack_requests_total counter"]
    snaps = {name: (_model_label(name, labelled), service.stats.snapshot()) for name, service in services.items()}
    lines += _counters(snaps, "requests", "edgepack_requests_total", "status")
    lines += ["# HELP edgepack_errors_total Failed requests by kind.", "# TYPE edgepack_errors_total counter"]
    lines += _counters(snaps, "errors", "edgepack_errors_total", "kind")
    if http is not None:
        lines += ["# HELP edgepack_http_responses_total Every HTTP answer, by status class.",
                  "# TYPE edgepack_http_responses_total counter"]
        for status_class, count in http.snapshot().items():
            lines.append(f'edgepack_http_responses_total{{class="{status_class}"}} {count}')
    lines += ["# HELP edgepack_non_finite_outputs_total Answers whose outputs held NaN/inf (refused as "
              "kind non_finite_output, or served flagged where the recipe allows them).",
              "# TYPE edgepack_non_finite_outputs_total counter"]
    for label, snap in snaps.values():
        lines.append(f"edgepack_non_finite_outputs_total{{{label.rstrip(',')}}} {snap['non_finite']}" if label
                     else f"edgepack_non_finite_outputs_total {snap['non_finite']}")
    lines += ["# HELP edgepack_inference_latency_seconds Model run time per request.",
              "# TYPE edgepack_inference_latency_seconds histogram"]
    for label, snap in snaps.values():
        lines += _histogram(label, snap)
    lines += ["# HELP edgepack_model_info The active model and the provider it runs on.",
              "# TYPE edgepack_model_info gauge"]
    for service in services.values():
        model = service.model
        if model is not None:
            info = model.describe()
            lines.append(f'edgepack_model_info{{name="{_escape(info["name"])}",version="{_escape(info["version"])}",'
                         f'sha256="{info["sha256"]}",provider="{info["provider"]}"}} 1')
    return "\n".join(lines) + "\n"


def _counters(snaps: Mapping[str, tuple[str, dict[str, Any]]], key: str, metric: str, label_name: str) -> list[str]:
    """One counter family: each model's (``snaps``: label, snapshot) counts of ``key`` by value."""
    return [f'{metric}{{{label}{label_name}="{_escape(value)}"}} {count}'
            for label, snap in snaps.values() for value, count in sorted(snap[key].items())]


def _model_label(name: str, labelled: bool) -> str:
    """``model="name",`` ahead of a series' own labels when several models serve, else ""."""
    return f'model="{_escape(name)}",' if labelled else ""


def _histogram(label: str, snap: dict[str, Any]) -> list[str]:
    """One model's latency histogram series (``label``: its model label, or "")."""
    lines, cumulative = [], 0
    for bound, count in zip(LATENCY_BUCKETS, snap["buckets"], strict=False):
        cumulative += count
        lines.append(f'edgepack_inference_latency_seconds_bucket{{{label}le="{bound}"}} {cumulative}')
    cumulative += snap["buckets"][-1]
    lines.append(f'edgepack_inference_latency_seconds_bucket{{{label}le="+Inf"}} {cumulative}')
    plain = f"{{{label.rstrip(',')}}}" if label else ""
    lines.append(f"edgepack_inference_latency_seconds_sum{plain} {snap['latency_sum']:.9f}")
    lines.append(f"edgepack_inference_latency_seconds_count{plain} {cumulative}")
    return lines


def load_gauges(admitted: int, held_bytes: int) -> str:
    """The API's load now, in the Prometheus text format: requests holding a worker or queue
    slot, and request body bytes held in memory (counted as they arrive)."""
    return ("# HELP edgepack_http_requests_in_progress Inference requests admitted (reading, queued or running).\n"
            "# TYPE edgepack_http_requests_in_progress gauge\n"
            f"edgepack_http_requests_in_progress {admitted}\n"
            "# HELP edgepack_http_body_bytes_held Request body bytes held in memory (api.max_buffered_bytes).\n"
            "# TYPE edgepack_http_body_bytes_held gauge\n"
            f"edgepack_http_body_bytes_held {held_bytes}\n")


# (metric, help, type, the figure of a pipeline): the per-pipeline series of /metrics
_PIPELINE_SERIES: tuple[tuple[str, str, str, Callable[[PipelineFigures], int | None]], ...] = (
    ("edgepack_pipeline_frames_total", "Frames a pipeline's stages answered.", "counter", lambda p: p.frames),
    ("edgepack_pipeline_dropped_total", "Frames the latest policy dropped (the oldest, to keep the newest).",
     "counter", lambda p: p.dropped),
    ("edgepack_pipeline_stage_errors_total", "Frames skipped because a stage's model failed.", "counter",
     lambda p: p.stage_errors),
    ("edgepack_pipeline_source_frames_total", "Frames (or audio blocks) the source's reader decoded.", "counter",
     lambda p: None if p.source is None else p.source.frames),
    ("edgepack_pipeline_source_reconnects_total", "Times the source was reopened (after a failure or an end).",
     "counter", lambda p: None if p.source is None else p.source.reconnects),
    ("edgepack_pipeline_source_failures_total", "Source failures: cannot open, read error, watchdog.", "counter",
     lambda p: None if p.source is None else p.source.failures),
    ("edgepack_pipeline_source_up", "1 while the source gives frames, 0 while it is down or starting.", "gauge",
     lambda p: None if p.source is None else int(p.source.state == "up")),
)


def pipeline_metrics(figures: Sequence[PipelineFigures]) -> str:
    """The pipelines' counters in the Prometheus text format: one series per pipeline (label
    ``pipeline``), its state as a state set, and events by ``rule`` and ``kind``; "" without pipelines."""
    if not figures:
        return ""
    lines = ["# HELP edgepack_pipeline_state The pipeline's state (1: the one it is in).",
             "# TYPE edgepack_pipeline_state gauge"]
    lines += [f'edgepack_pipeline_state{{pipeline="{_escape(p.name)}",state="{state}"}} {int(p.state == state)}'
              for p in figures for state in PIPELINE_STATES]
    for metric, help_text, kind, value in _PIPELINE_SERIES:
        lines += [f"# HELP {metric} {help_text}", f"# TYPE {metric} {kind}"]
        lines += [f'{metric}{{pipeline="{_escape(p.name)}"}} {value(p)}' for p in figures if value(p) is not None]
    lines += ["# HELP edgepack_pipeline_events_total Events a pipeline's rules gave, by rule and kind.",
              "# TYPE edgepack_pipeline_events_total counter"]
    lines += [f'edgepack_pipeline_events_total{{pipeline="{_escape(p.name)}",rule="{_escape(rule)}",kind="{kind}"}} {n}'
              for p in figures for rule, kinds in p.events for kind, n in kinds]
    return "\n".join(lines) + "\n"


def pipeline_latency_metrics(latencies: Mapping[str, PipelineLatency]) -> str:
    """The pipelines' latency histograms (``latencies`` by pipeline name) in the Prometheus
    text format: each stage's work on a frame (labels ``pipeline``, ``stage``) and the frames'
    whole way from the reader to the sinks; "" without pipelines."""
    if not latencies:
        return ""
    lines = ["# HELP edgepack_pipeline_stage_seconds A stage's work on one frame (its model, pre- and "
             "postprocessing; not its wait for the frame).",
             "# TYPE edgepack_pipeline_stage_seconds histogram"]
    for pipeline, latency in latencies.items():
        for stage in latency.stages:
            labels = f'pipeline="{_escape(pipeline)}",stage="{_escape(stage.name)}"'
            lines += _bucket_series("edgepack_pipeline_stage_seconds", labels, stage.histogram)
    lines += ["# HELP edgepack_pipeline_end_to_end_seconds A frame's whole way, from the source's reader "
              "handing it on to the sinks done.",
              "# TYPE edgepack_pipeline_end_to_end_seconds histogram"]
    for pipeline, latency in latencies.items():
        lines += _bucket_series("edgepack_pipeline_end_to_end_seconds", f'pipeline="{_escape(pipeline)}"',
                                latency.end_to_end)
    return "\n".join(lines) + "\n"


def _bucket_series(metric: str, labels: str, histogram: HistogramSnapshot) -> list[str]:
    """One histogram's cumulative ``_bucket`` series up to ``le="+Inf"``, its ``_sum`` and ``_count``."""
    from device_agent.pipelines.latency import BUCKETS_S

    lines = [f'{metric}_bucket{{{labels},le="{bound}"}} {n}' for bound, n in zip(BUCKETS_S, histogram.cumulative,
                                                                                strict=False)]
    lines += [f'{metric}_bucket{{{labels},le="+Inf"}} {histogram.count}',
              f"{metric}_sum{{{labels}}} {histogram.sum_s:.9f}", f"{metric}_count{{{labels}}} {histogram.count}"]
    return lines
