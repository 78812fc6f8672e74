"""The live engine panel: it shows what the engine itself measured, read from the server's
metrics (the Prometheus text of `servelab serve`) or from a mapping."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from servelab.lab.app import create_lab_app
from servelab.lab.live import parse_prometheus_text


def _server_metrics(running: int = 3, waiting: int = 2, kv: float = 0.25):
    from servelab.core.scheduler_stats import SchedulerStats
    from servelab.engine.outputs import EngineStats
    from servelab.server.metrics import ServerMetrics

    # 100 blocks, 25 of them used
    stats = EngineStats(SchedulerStats(running, waiting, kv, 75, 25, 0, 0, 0, 0, 0), num_blocks_total=100)
    return ServerMetrics("m", lambda: stats)


def test_live_reads_the_servers_own_prometheus_metrics():
    metrics = _server_metrics()
    for ttft in (0.003, 0.03, 0.03, 0.3):
        metrics.ttft.labels(model_name="m").observe(ttft)
    for gap in (0.02, 0.02, 0.06):
        metrics.itl.labels(model_name="m").observe(gap)
    client = TestClient(create_lab_app(engine_metrics_source=lambda: metrics.render().decode()))
    assert client.get("/api/health").json()["live"] is True
    live = client.get("/api/live").json()
    assert (live["running"], live["waiting"], live["kv_usage"]) == (3, 2, 0.25)
    ttft = live["ttft_s"]
    assert sum(ttft["counts"]) == 4
    # Per-bucket (not cumulative) counts: 0.003 in (0.001, 0.005], two in (0.02, 0.04], 0.3 in (0.25, 0.5].
    by_le = dict(zip(ttft["le"], ttft["counts"]))
    assert (by_le[0.005], by_le[0.04], by_le[0.5], by_le[0.001]) == (1, 2, 1, 0)
    assert ttft["le"][-1] is None  # +Inf travels as null
    assert sum(live["itl_s"]["counts"]) == 3 and dict(zip(live["itl_s"]["le"], live["itl_s"]["counts"]))[0.025] == 2


def test_live_accepts_a_mapping_and_follows_the_engine():
    state = {"running": 1, "waiting": 0, "kv_usage": 0.1, "ttft_s": {"le": [0.1, float("inf")], "counts": [2, 0]}}
    client = TestClient(create_lab_app(engine_metrics_source=lambda: dict(state)))
    assert client.get("/api/live").json()["running"] == 1
    state["running"] = 7
    body = client.get("/api/live").json()
    assert body["running"] == 7 and body["ttft_s"]["le"] == [0.1, None]


def test_live_without_an_engine_or_with_a_failing_one():
    assert "servelab serve" in TestClient(create_lab_app()).get("/api/live").json()["error"]["message"]

    def broken():
        raise RuntimeError("engine is shutting down")

    response = TestClient(create_lab_app(engine_metrics_source=broken)).get("/api/live")
    assert response.status_code == 503 and "engine is shutting down" in response.json()["error"]["message"]


def test_parse_sums_histograms_over_label_sets():
    text = (
        "# TYPE x:time_to_first_token_seconds histogram\n"
        'x:time_to_first_token_seconds_bucket{model_name="a",le="0.1"} 1.0\n'
        'x:time_to_first_token_seconds_bucket{model_name="a",le="+Inf"} 2.0\n'
        'x:time_to_first_token_seconds_bucket{model_name="b",le="0.1"} 3.0\n'
        'x:time_to_first_token_seconds_bucket{model_name="b",le="+Inf"} 3.0\n'
        'x:time_to_first_token_seconds_count{model_name="a"} 2.0\n'
        'x:time_to_first_token_seconds_sum{model_name="a"} 0.5\n'
    )
    assert parse_prometheus_text(text)["ttft_s"] == {"le": [0.1, float("inf")], "counts": [4.0, 1.0]}


@pytest.mark.slow
def test_lab_mounted_in_the_real_server_shows_its_requests(tmp_path):
    """`servelab serve` mounts the lab at /lab; after a completion the live panel shows it."""
    from servelab.core.config import SchedulerConfig
    from tests.fake_executor import FakeExecutor
    from servelab.engine.llm_engine import LLMEngine
    from tests.tiny_models import write_tiny_llama
    from servelab.engine.tokenizer import Tokenizer
    from servelab.commands.serve import mount_lab
    from servelab.server.app import create_app

    model_dir = write_tiny_llama(tmp_path / "tiny")
    tokenizer = Tokenizer.from_hf_dir(model_dir)
    config = SchedulerConfig(
        num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128
    )
    engine = LLMEngine(FakeExecutor(vocab_size=tokenizer.vocab_size), tokenizer, config, "tiny")
    app = create_app(engine)
    with TestClient(app) as client:
        assert mount_lab(app) is True
        page = client.get("/lab/")
        assert page.status_code == 200 and "servelab lab" in page.text
        assert client.get("/lab/api/health").json()["live"] is True
        done = client.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "max_tokens": 5})
        assert done.status_code == 200, done.text
        live = client.get("/lab/api/live").json()
        assert sum(live["ttft_s"]["counts"]) == 1
        assert sum(live["itl_s"]["counts"]) == 4  # 5 tokens, 4 gaps
        assert live["running"] == 0 and live["waiting"] == 0
        # The lessons work under the mount too.
        assert client.post("/lab/api/lessons/batching", json={}).status_code == 200
