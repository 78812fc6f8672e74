"""/metrics under `--metrics-namespace vllm` reads as vLLM's: every query of vLLM's published
Grafana dashboard finds its metrics with the labels it filters and aggregates on, with vLLM's
types and buckets; and the families vLLM's server has beyond the engine's (HTTP, process,
admission) are there in both namespaces."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from servelab.engine.outputs import EngineStats
from servelab.errors import QueueFull
from servelab.server.app import create_app
from servelab.server.metrics import ServerMetrics, buckets_1_2_5
from servelab.server.state import ServerState
from tests.server.vllm_grafana_queries import QUERIES, VARIABLES

MODEL = "fake-model"
IDLE = EngineStats.idle(num_blocks=1)
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
                   "offset"}  # fmt: skip


def selectors(query: str) -> list[tuple[str, dict[str, str | None]]]:
    """Each metric a PromQL query reads, with the labels it needs: those its matchers filter on
    (label -> the value asked for, None for a regex or negation) and those `by (...)` keeps."""
    for variable in VARIABLES:
        query = query.replace(variable, "")  # a matcher's value, or a range: checked apart
    kept = {label.strip() for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", query)
            for label in group.split(",") if label.strip()}  # fmt: skip
    query = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", query)
    query = re.sub(r"\[[^\]]*\]", " ", query)  # range vectors
    found = []
    for m in re.finditer(r"([A-Za-z_:][\w:]*)\s*(\{[^}]*\})?", query):
        name, matchers = m.group(1), m.group(2) or ""
        if query[m.end() :].lstrip().startswith("(") or name in PROMQL_KEYWORDS:
            continue  # a function or an operator, not a metric
        needed: dict[str, str | None] = {label: None for label in kept}
        for label, op, value in re.findall(r'(\w+)\s*(=~|!=|!~|=)\s*"([^"]*)"', matchers):
            needed[label] = value if op == "=" else None
        found.append((name, needed))
    return found


def test_selectors_reads_names_matchers_and_by_labels():
    q = 'sum by(le, engine) (rate(vllm:x_bucket{model_name="m", job=~"a.*"}[5m])) / vllm:y'
    assert selectors(q) == [("vllm:x_bucket", {"le": None, "engine": None, "model_name": "m", "job": None}),
                            ("vllm:y", {"le": None, "engine": None})]  # fmt: skip


def _samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _types(text: str) -> dict[str, str]:
    return {family.name: family.type for family in text_string_to_metric_families(text)}


def _value(text: str, name: str, **labels: str) -> float:
    return sum(
        s.value for s in _samples(text) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture
def vllm_client(fake_engine):
    with TestClient(create_app(fake_engine(max_model_len=128), metrics_namespace="vllm")) as c:
        yield c


def _run_requests(client: TestClient) -> None:
    for max_tokens in (2, 5):
        assert client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": max_tokens,
                                                    "ignore_eos": True}).status_code == 200  # fmt: skip
    # one prompt, 3 choices of different lengths: vLLM's parent request
    body = {"prompt": "hello", "n": 3, "max_tokens": 4, "ignore_eos": True}
    assert client.post("/v1/completions", json=body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True, "ignore_eos": True}
    assert client.post("/v1/chat/completions", json=chat).status_code == 200


def test_every_grafana_query_finds_its_metrics_and_labels(vllm_client):
    _run_requests(vllm_client)
    samples = _samples(vllm_client.get("/metrics").text)
    missing = []
    for query in QUERIES:
        for name, needed in selectors(query):
            needed = {
                label: MODEL if label == "model_name" and value == "" else value for label, value in needed.items()
            }
            if not any(s.name == name and all(label in s.labels and value in (None, s.labels[label])
                                              for label, value in needed.items()) for s in samples):  # fmt: skip
                missing.append(f"{name} {needed}")
    assert not missing, missing
    assert len(QUERIES) == 27 and {n for q in QUERIES for n, _ in selectors(q)} >= {
        "vllm:request_max_num_generation_tokens_sum",
        "vllm:request_success_total",
        "vllm:kv_cache_usage_perc",
    }


def test_vllm_namespace_has_vllms_labels_types_and_buckets(vllm_client):
    _run_requests(vllm_client)
    text = vllm_client.get("/metrics").text
    for s in _samples(text):
        if s.name.startswith("vllm:"):
            assert s.labels["model_name"] == MODEL and s.labels["engine"] == "0", s
    assert not any(s.name.startswith("servelab:time_to_first") for s in _samples(text))
    types = _types(text)
    for name, kind in {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
                       "vllm:num_requests_waiting_by_reason": "gauge", "vllm:kv_cache_usage_perc": "gauge",
                       "vllm:num_preemptions": "counter", "vllm:prompt_tokens": "counter",
                       "vllm:prompt_tokens_cached": "counter", "vllm:generation_tokens": "counter",
                       "vllm:request_success": "counter", "vllm:prefix_cache_hits": "counter",
                       "vllm:prefix_cache_queries": "counter", "vllm:request_params_n": "histogram",
                       "vllm:request_num_preemptions": "histogram", "vllm:request_params_max_tokens": "histogram",
                       "vllm:request_max_num_generation_tokens": "histogram",
                       "vllm:iteration_tokens_total": "histogram", "vllm:cache_config_info": "gauge",
                       # no vLLM counterpart: servelab's own prefix, so they never collide with vLLM's
                       "servelab:kv_cache_blocks_total": "gauge", "servelab:request_rejected": "counter",
                       "servelab:scheduler_config_info": "gauge"}.items():  # fmt: skip
        assert types.get(name) == kind, (name, types.get(name))

    def buckets(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in _samples(text) if s.name == name + "_bucket"][:-1]  # less +Inf

    # vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py)
    assert buckets("vllm:request_params_n") == [1, 2, 5, 10, 20]
    assert buckets("vllm:time_to_first_token_seconds")[:3] == [0.001, 0.005, 0.01]
    assert buckets("vllm:time_to_first_token_seconds")[-1] == 2560.0
    assert buckets("vllm:e2e_request_latency_seconds")[-1] == 7680.0
    assert buckets("vllm:inter_token_latency_seconds")[-1] == 80.0
    assert buckets("vllm:request_prompt_tokens") == buckets_1_2_5(128) == [1, 2, 5, 10, 20, 50, 100]
    assert buckets("vllm:iteration_tokens_total") == [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def test_new_request_families_count_what_happened(vllm_client):
    _run_requests(vllm_client)
    text = vllm_client.get("/metrics").text
    # 3 requests of one prompt with n=1, one of n=3: four parents, their n observed once each
    assert _value(text, "vllm:request_params_n_count") == 4
    assert _value(text, "vllm:request_params_n_sum") == 1 + 1 + 3 + 1
    # the n=3 request's choices all ran to 4 tokens: its longest is 4, once
    assert _value(text, "vllm:request_max_num_generation_tokens_count") == 4
    assert _value(text, "vllm:request_max_num_generation_tokens_sum") == 2 + 5 + 4 + 3
    assert _value(text, "vllm:request_num_preemptions_count") == 6  # every finished request: 2 + 3 + 1
    assert _value(text, "vllm:request_num_preemptions_sum") == 0
    # the 3 choices share their prompt: the later ones find its full blocks cached (block 16, so
    # only prompts past 16 tokens cache; "hello" does not), so cached tokens never exceed prompt tokens
    assert 0 <= _value(text, "vllm:prompt_tokens_cached_total") <= _value(text, "vllm:prompt_tokens_total")
    waiting = {s.labels["reason"]: s.value for s in _samples(text) if s.name == "vllm:num_requests_waiting_by_reason"}
    assert waiting == {"capacity": 0.0, "deferred": 0.0}


def test_waiting_by_reason_sums_to_the_waiting_gauge():
    """As vLLM's: capacity (in the queue) + deferred (blocks held, KV on its way) = waiting."""
    stats = replace(IDLE, scheduler=replace(IDLE.scheduler, num_waiting=2), num_waiting_deferred=1)
    text = ServerMetrics(MODEL, lambda: stats, namespace="vllm").render().decode()
    assert _value(text, "vllm:num_requests_waiting_by_reason", reason="capacity") == 2
    assert _value(text, "vllm:num_requests_waiting_by_reason", reason="deferred") == 1
    assert _value(text, "vllm:num_requests_waiting") == 3


def test_prompt_tokens_cached_counts_prefix_cache_hits(fake_engine):
    with TestClient(create_app(fake_engine(max_model_len=256))) as c:
        prompt = "the quick brown fox jumps over the lazy dog " * 6  # several full 16-token blocks
        for _ in range(2):
            assert c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}).status_code == 200
        text = c.get("/metrics").text
    cached = _value(text, "servelab:prompt_tokens_cached_total")
    assert cached > 0 and cached == _value(text, "servelab:prefix_cache_hits_total")


def test_http_metrics_by_route_template_method_and_status_class(vllm_client):
    _run_requests(vllm_client)
    assert vllm_client.get("/v1/models").status_code == 200
    assert vllm_client.get("/no/such/path/42").status_code == 404
    assert vllm_client.post("/v1/completions", json={"prompt": "x", "max_tokens": -1}).status_code == 400
    text = vllm_client.get("/metrics").text
    requests = {(s.labels["handler"], s.labels["method"], s.labels["status"]): s.value
                for s in _samples(text) if s.name == "http_requests_total"}  # fmt: skip
    assert requests[("/v1/completions", "POST", "2xx")] == 3
    assert requests[("/v1/completions", "POST", "4xx")] == 1
    assert requests[("/v1/chat/completions", "POST", "2xx")] == 1
    assert requests[("/v1/models", "GET", "2xx")] == 1
    assert requests[("none", "GET", "4xx")] == 1  # the template, never the raw path
    assert vllm_client.get("/docs/static/swagger-ui.css").status_code == 200
    text = vllm_client.get("/metrics").text
    assert _value(text, "http_requests_total", handler="/docs/static", status="2xx") == 1  # a mount: its prefix
    assert not any(h in ("/metrics", "/health") for h, _, _ in requests)
    durations = [s for s in _samples(text) if s.name == "http_request_duration_seconds_count"]
    assert {s.labels["handler"] for s in durations} >= {"/v1/completions", "/v1/chat/completions"}
    assert {tuple(sorted(s.labels)) for s in durations} == {("handler", "method")}


def test_refusals_by_the_guard_are_counted(fake_engine):
    with TestClient(create_app(fake_engine(), api_key="sk-test")) as c:
        assert c.post("/v1/completions", json={"prompt": "x"}).status_code == 401
        text = c.get("/metrics").text
    # refused before routing: no route took it
    assert _value(text, "http_requests_total", handler="none", method="POST", status="4xx") == 1


def test_process_and_python_families_are_exported(fake_engine):
    with TestClient(create_app(fake_engine())) as c:
        names = {s.name for s in _samples(c.get("/metrics").text)}
    assert {"process_resident_memory_bytes", "process_cpu_seconds_total", "python_info"} <= names
    assert any(n.startswith("python_gc_") for n in names)


def test_draining_refusals_are_counted(fake_engine):
    app = create_app(fake_engine())
    with TestClient(app) as c:
        app.state.servelab.begin_drain()
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 503
        text = c.get("/metrics").text
    assert _value(text, "servelab:request_rejected_total", reason="draining") == 1
    assert _value(text, "servelab:request_rejected_total", reason="queue_full") == 0


def test_a_full_queue_is_counted_and_its_choices_forgotten():
    class FullQueue:
        async def submit(self, requests):
            raise QueueFull("the waiting queue is full")

    state = ServerState(api_key=None)
    state._metrics = ServerMetrics(MODEL, lambda: IDLE)
    state._client = FullQueue()
    requests = [type("R", (), {"request_id": f"r-{i}", "priority": 0})() for i in range(4)]
    with pytest.raises(QueueFull):
        asyncio.run(state.submit(requests, n=2))
    text = state.metrics.render().decode()
    assert _value(text, "servelab:request_rejected_total", reason="queue_full") == 1
    assert state.metrics._groups == {}


def test_unknown_namespace_is_refused():
    with pytest.raises(ValueError, match="servelab, vllm"):
        ServerMetrics(MODEL, lambda: IDLE, namespace="sglang")


def test_data_parallel_front_end_exports_the_vllm_namespace(fake_engine):
    """Behind two workers: vLLM's families under vLLM's names (the workers summed as one engine),
    each worker under servelab:worker_*, and per-request preemptions carried from the workers."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.cluster.memory_cluster import end_all, memory_cluster

    # 8 blocks of 16 tokens per worker, two requests of ~100 tokens each on it: they preempt
    cluster, engines, _ = memory_cluster(fake_engine, 2, num_blocks=8, max_num_seqs=4, step_sleep_s=0.005)
    app = create_app(cluster, metrics_namespace="vllm")
    body = {"prompt": "hello world", "max_tokens": 100, "ignore_eos": True}
    try:
        with TestClient(app) as c, ThreadPoolExecutor(4) as pool:
            assert [f.result().status_code for f in [pool.submit(c.post, "/v1/completions", json=body)
                                                     for _ in range(4)]] == [200] * 4  # fmt: skip
            text = c.get("/metrics").text
    finally:
        end_all()
    samples = _samples(text)
    for query in QUERIES:
        for name, _ in selectors(query):
            assert any(s.name == name and s.labels.get("engine") == "0" for s in samples), name
    assert _value(text, "servelab:worker_up") == 2
    preemptions = sum(e.scheduler.num_preemptions for e in engines.values())
    assert preemptions > 0
    assert _value(text, "vllm:request_num_preemptions_sum") == preemptions == _value(text, "vllm:num_preemptions_total")
    assert _value(text, "vllm:request_params_n_count") == 4


@pytest.mark.slow
def test_serve_flag_exports_the_vllm_namespace(tiny_model_dir, tmp_path):
    import httpx

    from tests.server.conftest import launch_server

    server = launch_server(tiny_model_dir, tmp_path, "--metrics-namespace", "vllm", "--num-blocks", "64",
                           "--max-model-len", "256")  # fmt: skip
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        samples = _samples(httpx.get(server.url + "/metrics").text)
    finally:
        assert server.stop() == 0, server.log()
    model = tiny_model_dir.name
    for query in QUERIES:
        for name, _ in selectors(query):
            assert any(s.name == name and s.labels.get("model_name") == model and "engine" in s.labels
                       for s in samples), name  # fmt: skip
    assert not any(s.name.endswith("_created") for s in samples)  # serve drops them, as vLLM does
