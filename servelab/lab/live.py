"""The live engine panel's data: the running server's own figures, read from its metrics.

The server passes `engine_metrics_source` to `create_lab_app`: a callable returning either

* a mapping already in the panel's shape (`EngineStats` below), or
* Prometheus exposition text (what the server's `/metrics` answers), from which the panel
  takes the gauges and histograms by their vLLM-style names: `*num_requests_running`,
  `*num_requests_waiting`, `*kv_cache_usage_perc` (or `*gpu_cache_usage_perc`),
  `*time_to_first_token_seconds` and `*inter_token_latency_seconds`
  (or `*time_per_output_token_seconds`).

Either way the panel draws only what the engine itself measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

from prometheus_client.parser import text_string_to_metric_families

from servelab.errors import ServelabError


class Histogram(TypedDict):
    le: list[float]  # bucket upper bounds in seconds; the last may be +inf (sent as null)
    counts: list[float]  # requests (or tokens) per bucket, not cumulative


class EngineStats(TypedDict, total=False):
    running: float
    waiting: float
    kv_usage: float  # fraction of the KV block pool in use, 0..1
    ttft_s: Histogram
    itl_s: Histogram


EngineMetricsSource = Callable[[], "Mapping[str, Any] | str"]

_GAUGES = {
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    "kv_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc", "kv_cache_usage"),
}
_HISTOGRAMS = {
    "ttft_s": ("time_to_first_token_seconds",),
    "itl_s": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
}


class EngineStatsUnavailable(ServelabError):
    http_status = 503
    error_type = "server_error"


def read_engine_stats(source: EngineMetricsSource) -> dict[str, Any]:
    try:
        raw = source()
    except Exception as exc:  # the engine may be starting or stopping; the panel says so
        raise EngineStatsUnavailable(f"engine metrics unavailable: {exc}") from exc
    stats = parse_prometheus_text(raw) if isinstance(raw, str) else dict(raw)
    return _json_safe(stats)


def parse_prometheus_text(text: str) -> dict[str, Any]:
    gauges: dict[str, float] = {}
    histograms: dict[str, Histogram] = {}
    for family in text_string_to_metric_families(text):
        name = family.name
        for key, suffixes in _GAUGES.items():
            if key not in gauges and name.endswith(suffixes):
                gauges[key] = sum(s.value for s in family.samples if s.name == name or s.name == name + "_total")
        for key, suffixes in _HISTOGRAMS.items():
            if key not in histograms and family.type == "histogram" and name.endswith(suffixes):
                histograms[key] = _histogram(family)
    stats: dict[str, Any] = dict(gauges)
    stats.update(histograms)
    return stats


def _histogram(family: Any) -> Histogram:
    # Buckets may come from several label sets (per model); sum them by upper bound.
    cumulative: dict[float, float] = {}
    for sample in family.samples:
        if sample.name.endswith("_bucket"):
            le = float(sample.labels["le"])
            cumulative[le] = cumulative.get(le, 0.0) + sample.value
    bounds = sorted(cumulative)
    counts, previous = [], 0.0
    for le in bounds:
        counts.append(cumulative[le] - previous)
        previous = cumulative[le]
    return {"le": bounds, "counts": counts}


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value
