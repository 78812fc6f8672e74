"""`servelab bench` reports the server's prefix-cache hits over its run and warns when a run that
asked for no shared prefixes was served from the cache."""

from __future__ import annotations

from servelab.bench.prefix_cache import PrefixCacheCounters, PrefixCacheReport, parse_counters

SERVELAB = """# HELP servelab:prefix_cache_hits_total Prompt tokens served from the prefix cache.
# TYPE servelab:prefix_cache_hits_total counter
servelab:prefix_cache_hits_total{model_name="m"} 48.0
servelab:prefix_cache_queries_total{model_name="m"} 200.0
servelab:prefix_cache_queries_created{model_name="m"} 1.7e9
"""
VLLM = """vllm:prefix_cache_queries_total{engine="0",model_name="q"} 100.0
vllm:prefix_cache_hits_total{engine="0",model_name="q"} 10.0
vllm:prefix_cache_queries_total{engine="1",model_name="q"} 50.0
vllm:prefix_cache_hits_total{engine="1",model_name="q"} 5.0
"""


def test_counters_from_servelab_and_vllm_metrics():
    assert parse_counters(SERVELAB) == PrefixCacheCounters(48.0, 200.0)
    assert parse_counters(VLLM) == PrefixCacheCounters(15.0, 150.0)  # summed over engines
    assert parse_counters("some_other_metric 1.0\n") is None


def test_report_and_warning():
    before, after = PrefixCacheCounters(48, 200), PrefixCacheCounters(148, 600)
    report = PrefixCacheReport.between(before, after, shared_prefixes_asked=False, endpoint="completions")
    assert (report.hit_tokens, report.query_tokens, report.hit_rate) == (100, 400, 0.25)
    assert report.unexpected and "warning" in report.lines()[1] and "--seed" in report.lines()[1]
    asked = PrefixCacheReport.between(before, after, shared_prefixes_asked=True, endpoint="completions")
    chat = PrefixCacheReport.between(before, after, shared_prefixes_asked=False, endpoint="chat")
    assert not asked.unexpected and not chat.unexpected and len(asked.lines()) == 1
    fresh = PrefixCacheReport.between(before, PrefixCacheCounters(48, 600), shared_prefixes_asked=False,
                                      endpoint="completions")  # fmt: skip
    assert not fresh.unexpected and "0 of 400" in fresh.lines()[0]
    assert PrefixCacheReport.between(None, after, shared_prefixes_asked=False, endpoint="completions") is None
