"""Prometheus metrics for `GET /metrics`, named in parallel with vLLM's (`vllm:` -> `servelab:`).

Per-request latencies are observed from the engine's own timestamps (time.perf_counter() on the
engine thread), as each output reaches the event loop: TTFT and queue time with the first
token, inter-token latencies as tokens arrive, E2E and vLLM's per-request phases (prefill,
decode, inference time, TPOT, token counts) at the finish, and tokens per step after each step.
docs/metrics.md defines every series. Engine-wide state (running,
waiting, KV usage, preemptions, prefix-cache totals) is read at scrape time from the snapshot
the step loop refreshes, so a scrape never touches the engine itself. Each app gets its own
CollectorRegistry: several servers can live in one process (tests do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from servelab.core.sequence import Sequence
    from servelab.engine.llm_engine import EngineOutput, EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# The same buckets as vLLM, so dashboards built for one read the other.
TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]  # fmt: skip
REQUEST_BUCKETS_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
KV_TRANSFER_BYTE_BUCKETS = [2.0**k for k in range(14, 35, 2)]  # 16 KiB .. 16 GiB


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50 ... up to max_value: vLLM's buckets for token counts."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return out
            out.append(value)
        scale *= 10


WorkerStats = Callable[[], "dict[str, EngineStats | None]"]  # worker rank -> its stats (None: failed)


class _EngineStatsCollector(Collector):
    """Gauges and monotonic totals straight from the latest EngineStats snapshot. Behind
    data-parallel workers, these are the sums over the live workers, and each worker's own
    values are exported again under `servelab:worker_<name>` with a `worker` label (docs/metrics.md),
    so that sum() over a series never counts a worker twice."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats], worker_stats: WorkerStats | None = None):
        self.model_name = model_name
        self.get_stats = get_stats
        self.worker_stats = worker_stats

    def collect(self) -> Iterator[Metric]:
        yield from self._families("servelab:", ["model_name"], [([self.model_name], self.get_stats())])
        if self.worker_stats is None:
            return
        per_worker = self.worker_stats()
        up = GaugeMetricFamily("servelab:worker_up", "1 while the data-parallel worker serves, 0 once it failed.",
                               labels=["model_name", "worker"])  # fmt: skip
        for worker, stats in per_worker.items():
            up.add_metric([self.model_name, worker], 0.0 if stats is None else 1.0)
        yield up
        live = [([self.model_name, worker], stats) for worker, stats in per_worker.items() if stats is not None]
        yield from self._families("servelab:worker_", ["model_name", "worker"], live)

    @staticmethod
    def _families(prefix: str, labels: list[str], rows: list[tuple[list[str], EngineStats]]) -> Iterator[Metric]:
        def gauge(name: str, doc: str, value: Callable[[EngineStats], float]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(prefix + name.removeprefix("servelab:"), doc, labels=labels)
            for values, stats in rows:
                family.add_metric(values, value(stats))
            return family

        def counter(name: str, doc: str, value: Callable[[EngineStats], float]) -> CounterMetricFamily:
            family = CounterMetricFamily(prefix + name.removeprefix("servelab:"), doc, labels=labels)
            for values, stats in rows:
                family.add_metric(values, value(stats))
            return family

        yield gauge("servelab:num_requests_running", "Requests in the running batch.", lambda s: s.num_running)
        yield gauge("servelab:num_requests_waiting", "Requests waiting to be scheduled.", lambda s: s.num_waiting)
        yield gauge("servelab:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", lambda s: s.kv_cache_usage)
        yield gauge("servelab:kv_cache_blocks_total", "KV-cache blocks in the pool.", lambda s: s.num_blocks_total)
        yield gauge("servelab:kv_cache_blocks_free", "KV-cache blocks free (cached prefixes count as free).",
                    lambda s: s.num_blocks_free)  # fmt: skip
        yield counter("servelab:num_preemptions", "Preemptions (by recompute) since start.", lambda s: s.num_preemptions)
        yield counter("servelab:prefix_cache_hits", "Prompt tokens served from the prefix cache.",
                      lambda s: s.prefix_cache_hits)  # fmt: skip
        yield counter("servelab:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      lambda s: s.prefix_cache_queries)  # fmt: skip


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        get_stats: Callable[[], EngineStats],
        cache_info: dict[str, str] | None = None,
        max_model_len: int = 8192,
        scheduler_info: dict[str, str] | None = None,
        worker_stats: WorkerStats | None = None,
    ):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("servelab:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              labels, buckets=TTFT_BUCKETS_S, registry=r)  # fmt: skip
        self.itl = Histogram("servelab:inter_token_latency_seconds", "Gaps between consecutive output tokens.",
                             labels, buckets=ITL_BUCKETS_S, registry=r)  # fmt: skip
        self.e2e = Histogram("servelab:e2e_request_latency_seconds", "Arrival to last token.",
                             labels, buckets=REQUEST_BUCKETS_S, registry=r)  # fmt: skip
        self.queue_time = Histogram("servelab:request_queue_time_seconds", "Arrival to first scheduled.",
                                    labels, buckets=REQUEST_BUCKETS_S, registry=r)  # fmt: skip
        # vLLM's per-request phases, observed when a request finishes (see docs/metrics.md).
        self.request_tpot = Histogram("servelab:request_time_per_output_token_seconds",
                                      "Per request: decode time / (output tokens - 1); 0 for one token.",
                                      labels, buckets=ITL_BUCKETS_S, registry=r)  # fmt: skip
        self.prefill_time = Histogram("servelab:request_prefill_time_seconds", "First scheduled to first token.",
                                      labels, buckets=REQUEST_BUCKETS_S, registry=r)  # fmt: skip
        self.decode_time = Histogram("servelab:request_decode_time_seconds", "First token to last token.",
                                     labels, buckets=REQUEST_BUCKETS_S, registry=r)  # fmt: skip
        self.inference_time = Histogram("servelab:request_inference_time_seconds", "First scheduled to last token.",
                                        labels, buckets=REQUEST_BUCKETS_S, registry=r)  # fmt: skip
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = Histogram("servelab:request_prompt_tokens", "Prompt tokens per finished request.",
                                               labels, buckets=token_buckets, registry=r)  # fmt: skip
        self.request_generation_tokens = Histogram("servelab:request_generation_tokens",
                                                   "Generated tokens per finished request.",
                                                   labels, buckets=token_buckets, registry=r)  # fmt: skip
        self.request_max_tokens = Histogram("servelab:request_params_max_tokens",
                                            "The max_tokens the engine ran each finished request with.",
                                            labels, buckets=token_buckets, registry=r)  # fmt: skip
        self.iteration_tokens = Histogram("servelab:iteration_tokens_total",
                                          "Tokens per engine step (prefill chunk tokens + decode tokens).",
                                          labels, buckets=ITERATION_TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("servelab:prompt_tokens", "Prompt tokens of requests that started generating.",
                                     labels, registry=r)  # fmt: skip
        self.generation_tokens = Counter("servelab:generation_tokens", "Generated tokens.", labels, registry=r)
        self.request_success = Counter("servelab:request_success", "Requests finished, by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)  # fmt: skip
        # disaggregated prefill/decode (docs/disaggregation.md): per request whose KV crossed
        self.kv_transfer_bytes = Histogram("servelab:kv_transfer_bytes", "KV bytes sent from prefill to decode worker.",
                                           labels, buckets=KV_TRANSFER_BYTE_BUCKETS, registry=r)  # fmt: skip
        self.kv_transfer_time = Histogram("servelab:kv_transfer_seconds",
                                          "Decode worker's receives posted to the last KV piece written.",
                                          labels, buckets=TTFT_BUCKETS_S, registry=r)  # fmt: skip
        self.kv_decode_queue = Histogram("servelab:kv_transfer_decode_queue_seconds",
                                         "A prefilled request's wait for decode-side blocks (prefill queueing is "
                                         "request_queue_time).", labels, buckets=TTFT_BUCKETS_S, registry=r)  # fmt: skip
        r.register(_EngineStatsCollector(model_name, get_stats, worker_stats))
        if cache_info:  # like vLLM's cache_config_info: what the KV gauges above are counting
            info = Gauge("servelab:cache_config_info", "KV cache configuration, as labels (the value is 1).",
                         ["model_name", *sorted(cache_info)], registry=r)  # fmt: skip
            info.labels(model_name=model_name, **cache_info).set(1)
        if scheduler_info:  # the scheduler's budgets: what `servelab validate` replays the run under
            sched = Gauge("servelab:scheduler_config_info", "Scheduler configuration, as labels (the value is 1).",
                          ["model_name", *sorted(scheduler_info)], registry=r)  # fmt: skip
            sched.labels(model_name=model_name, **scheduler_info).set(1)
        self._labels = {"model_name": model_name}
        # Export zeros from the start: a series that appears only after the first request
        # makes rate() and "count went up by N" comparisons wrong.
        for metric in (self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_tokens, self.generation_tokens,
                       self.request_tpot, self.prefill_time, self.decode_time, self.inference_time,
                       self.request_prompt_tokens, self.request_generation_tokens, self.request_max_tokens,
                       self.iteration_tokens):  # fmt: skip
            metric.labels(**self._labels)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name=model_name, finished_reason=reason)

    def observe(self, out: EngineOutput) -> None:
        seq = out.seq
        # A prompt-only request's one token is dropped before the client: it generated nothing.
        k = 0 if seq.params.prompt_only else len(out.new_token_ids)
        labels = self._labels
        if k:
            self.generation_tokens.labels(**labels).inc(k)
            n_out = seq.num_output_tokens
            if n_out == k:  # these are the request's first tokens
                self.prompt_tokens.labels(**labels).inc(seq.num_prompt_tokens)
                if seq.first_token_s is not None:
                    self.ttft.labels(**labels).observe(max(0.0, seq.first_token_s - seq.arrival_s))
                if seq.first_scheduled_s is not None:
                    self.queue_time.labels(**labels).observe(max(0.0, seq.first_scheduled_s - seq.arrival_s))
            times = seq.token_times_s
            # The gaps that end at this output's tokens (the first token has none).
            first = max(1, len(times) - k)
            for i in range(first, len(times)):
                self.itl.labels(**labels).observe(max(0.0, times[i] - times[i - 1]))
        if out.finished:
            reason = out.finish_reason.value if out.finish_reason is not None else "unknown"
            self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()
            if seq.finished_s is not None:
                self.e2e.labels(**labels).observe(max(0.0, seq.finished_s - seq.arrival_s))
            self._observe_finished(seq)

    def _observe_finished(self, seq: Sequence) -> None:
        """vLLM's per-request phase histograms; a request aborted before its first token has no
        phases and is left out of them, as it is of TTFT."""
        labels = self._labels
        n_out = 0 if seq.params.prompt_only else seq.num_output_tokens
        self.request_prompt_tokens.labels(**labels).observe(seq.num_prompt_tokens)
        self.request_generation_tokens.labels(**labels).observe(n_out)
        self.request_max_tokens.labels(**labels).observe(seq.params.max_tokens)
        if seq.first_token_s is None or seq.first_scheduled_s is None or not seq.token_times_s:
            return
        last_s = seq.token_times_s[-1]
        decode_s = max(0.0, last_s - seq.first_token_s)
        self.prefill_time.labels(**labels).observe(max(0.0, seq.first_token_s - seq.first_scheduled_s))
        self.decode_time.labels(**labels).observe(decode_s)
        self.inference_time.labels(**labels).observe(max(0.0, last_s - seq.first_scheduled_s))
        self.request_tpot.labels(**labels).observe(decode_s / (n_out - 1) if n_out > 1 else 0.0)

    def observe_kv_transfer(self, num_bytes: int, transfer_s: float, decode_queue_s: float) -> None:
        labels = self._labels
        self.kv_transfer_bytes.labels(**labels).observe(num_bytes)
        self.kv_transfer_time.labels(**labels).observe(transfer_s)
        self.kv_decode_queue.labels(**labels).observe(decode_queue_s)

    def observe_step(self, num_tokens: int) -> None:
        """Called on the engine thread after each step with the tokens it ran."""
        self.iteration_tokens.labels(**self._labels).observe(num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
