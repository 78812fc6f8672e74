"""Prometheus metrics for `GET /metrics`, named in parallel with vLLM's.

`namespace` "servelab" (the default) names vLLM's families `servelab:<name>`; "vllm" exports them
under vLLM's own names, label names (`model_name`, `engine`) and buckets, so that vLLM's Grafana
dashboards read a servelab server unchanged. Families vLLM has no counterpart for stay
`servelab:` in both, so they can never collide with a real vLLM's.

Per-request latencies are observed from the engine's own timestamps (time.perf_counter() on the
engine thread), as each output reaches the event loop: TTFT and queue time with the first
token, inter-token latencies as tokens arrive, E2E and vLLM's per-request phases (prefill,
decode, inference time, TPOT, token counts) at the finish, and tokens per step after each step.
docs/metrics.md defines every series. Engine-wide state (running,
waiting, KV usage, preemptions, prefix-cache totals) is read at scrape time from the snapshot
the step loop refreshes, so a scrape never touches the engine itself. Each app gets its own
CollectorRegistry (process, platform and GC collectors included): several servers can live in
one process (tests do).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from servelab.engine.outputs import EngineOutput, EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NAMESPACES = ("servelab", "vllm")
OWN = "servelab:"  # the prefix of the families vLLM has no counterpart for, in either namespace

# The same buckets as vLLM, so dashboards built for one read the other.
TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]  # fmt: skip
ITL_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0]  # fmt: skip
REQUEST_BUCKETS_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                     240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]
PREEMPTION_BUCKETS = [1, 2, 3, 4, 5, 10, 20]
KV_TRANSFER_BYTE_BUCKETS = [2.0**k for k in range(14, 35, 2)]  # 16 KiB .. 16 GiB
HTTP_DURATION_BUCKETS_S = [0.1, 0.5, 1.0]  # the instrumentator's few buckets (cardinality stays low)
# Why admission refused a request: QueueFull, draining, a stopped engine, a request that can never fit.
REJECTION_REASONS = ("queue_full", "draining", "engine_stopped", "too_long")


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50 ... up to max_value: vLLM's buckets for token counts."""
    out: list[int] = []
    scale = 1
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

    def __init__(self, prefix: str, labels: dict[str, str], get_stats: Callable[[], EngineStats],
                 worker_stats: WorkerStats | None = None):  # fmt: skip
        self.prefix = prefix
        self.labels = labels
        self.get_stats = get_stats
        self.worker_stats = worker_stats

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self.prefix, list(self.labels), [(list(self.labels.values()), self.get_stats())])
        if self.worker_stats is None:
            return
        model_name = self.labels["model_name"]
        per_worker = self.worker_stats()
        up = GaugeMetricFamily(OWN + "worker_up", "1 while the data-parallel worker serves, 0 once it failed.",
                               labels=["model_name", "worker"])  # fmt: skip
        for worker, stats in per_worker.items():
            up.add_metric([model_name, worker], 0.0 if stats is None else 1.0)
        yield up
        live = [([model_name, worker], stats) for worker, stats in per_worker.items() if stats is not None]
        yield from self._families(OWN + "worker_", ["model_name", "worker"], live, with_reasons=False)

    @staticmethod
    def _families(prefix: str, labels: list[str], rows: list[tuple[list[str], EngineStats]],
                  with_reasons: bool = True) -> Iterator[Metric]:  # fmt: skip
        def gauge(
            name: str, doc: str, value: Callable[[EngineStats], float], family_prefix: str = prefix
        ) -> GaugeMetricFamily:
            family = GaugeMetricFamily(family_prefix + name, doc, labels=labels)
            for values, stats in rows:
                family.add_metric(values, value(stats))
            return family

        def counter(name: str, doc: str, value: Callable[[EngineStats], float]) -> CounterMetricFamily:
            family = CounterMetricFamily(prefix + name, doc, labels=labels)
            for values, stats in rows:
                family.add_metric(values, value(stats))
            return family

        # a request whose KV is on its way waits too: vLLM's waiting count is the sum of the reasons
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                    lambda s: s.num_waiting + s.num_waiting_deferred)  # fmt: skip
        yield gauge("num_requests_running", "Requests in the running batch.", lambda s: s.num_running)
        if with_reasons:
            by_reason = GaugeMetricFamily(prefix + "num_requests_waiting_by_reason",
                                          "Waiting requests by reason: capacity (in the queue for a share of a step) "
                                          "or deferred (blocks held, KV still arriving from a prefill worker).",
                                          labels=[*labels, "reason"])  # fmt: skip
            for values, stats in rows:
                by_reason.add_metric([*values, "capacity"], stats.num_waiting)
                by_reason.add_metric([*values, "deferred"], stats.num_waiting_deferred)
            yield by_reason
        yield gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", lambda s: s.kv_cache_usage)
        # no vLLM counterpart: always servelab's own prefix outside the per-worker families
        own = prefix if prefix.startswith(OWN) else OWN
        yield gauge("kv_cache_blocks_total", "KV-cache blocks in the pool.", lambda s: s.num_blocks_total, own)
        yield gauge("kv_cache_blocks_free", "KV-cache blocks free (cached prefixes count as free).",
                    lambda s: s.num_blocks_free, own)  # fmt: skip
        yield counter("num_preemptions", "Preemptions (by recompute) since start.", lambda s: s.num_preemptions)
        yield counter("prefix_cache_hits", "Prompt tokens served from the prefix cache.", lambda s: s.prefix_cache_hits)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      lambda s: s.prefix_cache_queries)  # fmt: skip
        # Speculative decoding (vLLM's spec_decode families): a draft is one verification entry.
        yield counter("spec_decode_num_drafts", "Verification entries (a decode with drafts) run.",
                      lambda s: s.spec_num_drafts)  # fmt: skip
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", lambda s: s.spec_num_draft_tokens)
        yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      lambda s: s.spec_num_accepted_tokens)  # fmt: skip
        per_pos = CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by their position in the draft.",
                                      labels=[*labels, "position"])  # fmt: skip
        for values, stats in rows:
            for position, count in enumerate(stats.spec_accepted_per_position):
                per_pos.add_metric([*values, str(position)], count)
        yield per_pos


class HttpMetrics:
    """Per route (its template), as prometheus-fastapi-instrumentator names them; observed by
    server/http_metrics.py's middleware. The same names in both namespaces."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("http_requests", "HTTP requests by route template, method and status class.",
                                ["handler", "method", "status"], registry=registry)  # fmt: skip
        self.duration = Histogram("http_request_duration_seconds",
                                  "HTTP request to the end of its response (a stream: its last event).",
                                  ["handler", "method"], buckets=HTTP_DURATION_BUCKETS_S, registry=registry)  # fmt: skip

    def observe(self, handler: str, method: str, status_code: int, duration_s: float) -> None:
        self.requests.labels(handler=handler, method=method, status=f"{status_code // 100}xx").inc()
        self.duration.labels(handler=handler, method=method).observe(duration_s)


@dataclass(slots=True)
class _ChoiceGroup:
    """The n choices of one prompt: vLLM's parent request, whose longest choice is observed once."""

    n: int
    remaining: int
    max_generation_tokens: int = 0


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        get_stats: Callable[[], EngineStats],
        cache_info: dict[str, str] | None = None,
        max_model_len: int = 8192,
        scheduler_info: dict[str, str] | None = None,
        worker_stats: WorkerStats | None = None,
        namespace: str = "servelab",
    ):
        if namespace not in NAMESPACES:
            raise ValueError(f"metrics namespace must be one of {', '.join(NAMESPACES)}, got {namespace!r}")
        self.namespace = namespace
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        # vLLM labels every series with the engine core that made it; one engine here (data-parallel
        # workers are summed into it, and each appears again in servelab:worker_*).
        self._labels = {"model_name": model_name, **({"engine": "0"} if namespace == "vllm" else {})}
        labels = list(self._labels)
        ns = namespace + ":"
        r = self.registry
        self.ttft = Histogram(ns + "time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              labels, buckets=TTFT_BUCKETS_S, registry=r)  # fmt: skip
        self.itl = Histogram(ns + "inter_token_latency_seconds", "Gaps between consecutive output tokens.",
                             labels, buckets=ITL_BUCKETS_S, registry=r)  # fmt: skip
        self.e2e = Histogram(ns + "e2e_request_latency_seconds", "Arrival to last token.",
                             labels, buckets=REQUEST_BUCKETS_S, registry=r)  # fmt: skip
        self.queue_time = Histogram(ns + "request_queue_time_seconds", "Arrival to first scheduled.",
                                    labels, buckets=REQUEST_BUCKETS_S, registry=r)  # fmt: skip
        # vLLM's per-request phases, observed when a request finishes (see docs/metrics.md).
        self.request_tpot = Histogram(ns + "request_time_per_output_token_seconds",
                                      "Per request: decode time / (output tokens - 1); 0 for one token.",
                                      labels, buckets=ITL_BUCKETS_S, registry=r)  # fmt: skip
        self.prefill_time = Histogram(ns + "request_prefill_time_seconds", "First scheduled to first token.",
                                      labels, buckets=REQUEST_BUCKETS_S, registry=r)  # fmt: skip
        self.decode_time = Histogram(ns + "request_decode_time_seconds", "First token to last token.",
                                     labels, buckets=REQUEST_BUCKETS_S, registry=r)  # fmt: skip
        self.inference_time = Histogram(ns + "request_inference_time_seconds", "First scheduled to last token.",
                                        labels, buckets=REQUEST_BUCKETS_S, registry=r)  # fmt: skip
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = Histogram(ns + "request_prompt_tokens", "Prompt tokens per finished request.",
                                               labels, buckets=token_buckets, registry=r)  # fmt: skip
        self.request_generation_tokens = Histogram(ns + "request_generation_tokens",
                                                   "Generated tokens per finished request.",
                                                   labels, buckets=token_buckets, registry=r)  # fmt: skip
        self.request_max_tokens = Histogram(ns + "request_params_max_tokens",
                                            "The max_tokens the engine ran each finished request with.",
                                            labels, buckets=token_buckets, registry=r)  # fmt: skip
        self.request_params_n = Histogram(ns + "request_params_n", "The n (choices) of each prompt of a request.",
                                          labels, buckets=PARAMS_N_BUCKETS, registry=r)  # fmt: skip
        self.request_max_generation_tokens = Histogram(ns + "request_max_num_generation_tokens",
                                                       "Per prompt: the generated tokens of its longest choice.",
                                                       labels, buckets=token_buckets, registry=r)  # fmt: skip
        self.request_preemptions = Histogram(ns + "request_num_preemptions", "Preemptions per finished request.",
                                             labels, buckets=PREEMPTION_BUCKETS, registry=r)  # fmt: skip
        self.iteration_tokens = Histogram(ns + "iteration_tokens_total",
                                          "Tokens per engine step (prefill chunk tokens + decode tokens).",
                                          labels, buckets=ITERATION_TOKEN_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter(ns + "prompt_tokens", "Prompt tokens of requests that started generating.",
                                     labels, registry=r)  # fmt: skip
        self.prompt_tokens_cached = Counter(ns + "prompt_tokens_cached",
                                            "Of those, tokens served from the prefix cache (their prefill skipped).",
                                            labels, registry=r)  # fmt: skip
        self.generation_tokens = Counter(ns + "generation_tokens", "Generated tokens.", labels, registry=r)
        self.request_success = Counter(ns + "request_success", "Requests finished, by finish reason.",
                                       [*labels, "finished_reason"], registry=r)  # fmt: skip
        self.request_rejected = Counter(OWN + "request_rejected", "Requests refused at admission, by reason.",
                                        ["model_name", "reason"], registry=r)  # fmt: skip
        # disaggregated prefill/decode (docs/disaggregation.md): per request whose KV crossed
        own_labels = ["model_name"]
        self.kv_transfer_bytes = Histogram(OWN + "kv_transfer_bytes", "KV bytes sent from prefill to decode worker.",
                                           own_labels, buckets=KV_TRANSFER_BYTE_BUCKETS, registry=r)  # fmt: skip
        self.kv_transfer_time = Histogram(OWN + "kv_transfer_seconds",
                                          "Decode worker's receives posted to the last KV piece written.",
                                          own_labels, buckets=TTFT_BUCKETS_S, registry=r)  # fmt: skip
        self.kv_decode_queue = Histogram(OWN + "kv_transfer_decode_queue_seconds",
                                         "A prefilled request's wait for decode-side blocks (prefill queueing is "
                                         "request_queue_time).", own_labels, buckets=TTFT_BUCKETS_S,
                                         registry=r)  # fmt: skip
        r.register(_EngineStatsCollector(ns, self._labels, get_stats, worker_stats))
        if cache_info:  # like vLLM's cache_config_info: what the KV gauges above are counting
            info = Gauge(ns + "cache_config_info", "KV cache configuration, as labels (the value is 1).",
                         [*labels, *sorted(cache_info)], registry=r)  # fmt: skip
            info.labels(**self._labels, **cache_info).set(1)
        if scheduler_info:  # the scheduler's budgets: what `servelab validate` replays the run under
            sched = Gauge(OWN + "scheduler_config_info", "Scheduler configuration, as labels (the value is 1).",
                          ["model_name", *sorted(scheduler_info)], registry=r)  # fmt: skip
            sched.labels(model_name=model_name, **scheduler_info).set(1)
        # The process's CPU, memory and file descriptors, Python's version and GC, as every
        # Prometheus client exports them (vLLM's /metrics included).
        self.http = HttpMetrics(r)
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self._groups: dict[str, _ChoiceGroup] = {}  # request id -> its prompt's choices (engine thread)
        # Export zeros from the start: a series that appears only after the first request
        # makes rate() and "count went up by N" comparisons wrong.
        for metric in (self.ttft, self.itl, self.e2e, self.queue_time, self.prompt_tokens, self.prompt_tokens_cached,
                       self.generation_tokens, self.request_tpot, self.prefill_time, self.decode_time,
                       self.inference_time, self.request_prompt_tokens, self.request_generation_tokens,
                       self.request_max_tokens, self.request_params_n, self.request_max_generation_tokens,
                       self.request_preemptions, self.iteration_tokens):  # fmt: skip
            metric.labels(**self._labels)
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(**self._labels, finished_reason=reason)
        for reason in REJECTION_REASONS:
            self.request_rejected.labels(model_name=model_name, reason=reason)

    def expect_choices(self, request_ids: list[str], n: int) -> None:
        """A request about to be submitted as `request_ids`: its prompts' choices, `n` consecutive
        ids each. Before the submission, so that no choice can finish first; `forget_choices`
        if admission refuses it."""
        if n < 1 or len(request_ids) % n:
            raise ValueError(f"{len(request_ids)} request ids are not whole groups of n={n}")
        for start in range(0, len(request_ids), n):
            group = _ChoiceGroup(n=n, remaining=n)
            for rid in request_ids[start : start + n]:
                self._groups[rid] = group

    def forget_choices(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._groups.pop(rid, None)

    def observe_rejected(self, reason: str) -> None:
        self.request_rejected.labels(model_name=self.model_name, reason=reason).inc()

    def observe(self, out: EngineOutput) -> None:
        # A prompt-only request's one token is dropped before the client: it generated nothing.
        k = 0 if out.prompt_only else len(out.new_token_ids)
        labels = self._labels
        if k:
            self.generation_tokens.labels(**labels).inc(k)
            if out.num_output_tokens == k:  # these are the request's first tokens
                self.prompt_tokens.labels(**labels).inc(out.num_prompt_tokens)
                self.prompt_tokens_cached.labels(**labels).inc(out.num_cached_tokens)
                if out.first_token_offset_s is not None:
                    self.ttft.labels(**labels).observe(max(0.0, out.first_token_offset_s))
                if out.first_scheduled_offset_s is not None:
                    self.queue_time.labels(**labels).observe(max(0.0, out.first_scheduled_offset_s))
            # The gaps that end at this output's tokens (the first token has none).
            times = (
                out.token_offsets_s
                if out.prev_token_offset_s is None
                else [out.prev_token_offset_s, *out.token_offsets_s]
            )
            for before, after in zip(times, times[1:]):
                self.itl.labels(**labels).observe(max(0.0, after - before))
        if out.finished:
            reason = out.finish_reason.value if out.finish_reason is not None else "unknown"
            self.request_success.labels(**labels, finished_reason=reason).inc()
            if out.finished_offset_s is not None:
                self.e2e.labels(**labels).observe(max(0.0, out.finished_offset_s))
            self._observe_finished(out)
            self._observe_choice_finished(out.request_id, 0 if out.prompt_only else out.num_output_tokens)

    def _observe_choice_finished(self, request_id: str, n_out: int) -> None:
        """vLLM's per-parent histograms (n, the longest choice), once the prompt's last choice ends."""
        group = self._groups.pop(request_id, None) or _ChoiceGroup(remaining=1, n=1)  # submitted alone
        group.max_generation_tokens = max(group.max_generation_tokens, n_out)
        group.remaining -= 1
        if not group.remaining:
            self.request_params_n.labels(**self._labels).observe(group.n)
            self.request_max_generation_tokens.labels(**self._labels).observe(group.max_generation_tokens)

    def _observe_finished(self, out: EngineOutput) -> None:
        """vLLM's per-request phase histograms; a request aborted before its first token has no
        phases and is left out of them, as it is of TTFT."""
        labels = self._labels
        n_out = 0 if out.prompt_only else out.num_output_tokens
        self.request_prompt_tokens.labels(**labels).observe(out.num_prompt_tokens)
        self.request_generation_tokens.labels(**labels).observe(n_out)
        self.request_max_tokens.labels(**labels).observe(out.max_tokens)
        self.request_preemptions.labels(**labels).observe(out.num_preemptions)
        first_s, scheduled_s, last_s = out.first_token_offset_s, out.first_scheduled_offset_s, out.last_token_offset_s
        if first_s is None or scheduled_s is None or last_s is None:
            return
        decode_s = max(0.0, last_s - first_s)
        self.prefill_time.labels(**labels).observe(max(0.0, first_s - scheduled_s))
        self.decode_time.labels(**labels).observe(decode_s)
        self.inference_time.labels(**labels).observe(max(0.0, last_s - scheduled_s))
        self.request_tpot.labels(**labels).observe(decode_s / (n_out - 1) if n_out > 1 else 0.0)

    def observe_kv_transfer(self, num_bytes: int, transfer_s: float, decode_queue_s: float) -> None:
        labels = {"model_name": self.model_name}
        self.kv_transfer_bytes.labels(**labels).observe(num_bytes)
        self.kv_transfer_time.labels(**labels).observe(transfer_s)
        self.kv_decode_queue.labels(**labels).observe(decode_queue_s)

    def observe_step(self, num_tokens: int) -> None:
        """Called on the engine thread after each step with the tokens it ran."""
        self.iteration_tokens.labels(**self._labels).observe(num_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
