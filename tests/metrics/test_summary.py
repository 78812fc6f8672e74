import numpy as np
import pytest

from servelab.errors import InvalidArgument
from servelab.metrics import SLO, RequestRecord, format_summary_table, summarize


def rec(rid, arrival, tokens, scheduled=None, prompt=100, success=True):
    return RequestRecord(
        request_id=rid,
        arrival_s=arrival,
        first_scheduled_s=arrival if scheduled is None else scheduled,
        first_token_s=tokens[0] if tokens else None,
        token_times_s=list(tokens),
        end_s=tokens[-1] if tokens else None,
        prompt_tokens=prompt,
        output_tokens=len(tokens),
        success=success,
        error=None if success else "boom",
    )


def test_definitions_match_design():
    r = rec("a", 1.0, [1.5, 1.6, 1.8, 2.1], scheduled=1.2)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert r.queue_s == pytest.approx(0.2)
    assert rec("b", 0.0, [0.3]).tpot_s is None  # undefined for one-token outputs


def test_percentiles_pooled_itl_and_throughput():
    records = [rec("a", 0.0, [1.0, 1.1, 1.3]), rec("b", 0.5, [2.0, 2.4]), rec("c", 1.0, [1.5])]
    s = summarize(records, duration_s=4.0, num_devices=2, preemptions=3)
    # ITL is pooled over requests and never spans two of them.
    itls = [0.1, 0.2, 0.4]
    assert s.itl_s.mean == pytest.approx(np.mean(itls))
    assert s.itl_s.max == pytest.approx(0.4)
    assert s.itl_s.p90 == pytest.approx(np.percentile(itls, 90))
    ttfts = [1.0, 1.5, 0.5]
    assert s.ttft_s.p50 == pytest.approx(1.0) and s.ttft_s.p99 == pytest.approx(np.percentile(ttfts, 99))
    assert s.tpot_s.count == 2  # c has one token
    assert s.output_throughput == pytest.approx(6 / 4.0)
    assert s.output_throughput_per_device == pytest.approx(6 / 8.0)
    assert s.request_throughput == pytest.approx(3 / 4.0)
    assert s.input_throughput == pytest.approx(300 / 4.0)
    assert s.preemptions == 3 and s.goodput is None and s.slo_attainment is None


def test_failed_requests_are_counted_and_never_good():
    records = [rec("ok", 0.0, [0.1, 0.2]), rec("bad", 0.0, [], success=False)]
    s = summarize(records, 1.0, slo=SLO(ttft_s=1.0))
    assert (s.num_requests, s.completed, s.failed) == (2, 1, 1)
    assert s.slo_attainment == pytest.approx(0.5)
    assert s.goodput == pytest.approx(1.0)


def test_goodput_needs_every_target():
    fast = rec("fast", 0.0, [0.1, 0.12, 0.14])  # ttft 100 ms, tpot 20 ms
    slow_decode = rec("slow", 0.0, [0.1, 0.3, 0.5])  # ttft 100 ms, tpot 200 ms
    slow_start = rec("late", 0.0, [0.9, 0.91])  # ttft 900 ms
    one_token = rec("one", 0.0, [0.2])  # no TPOT to miss
    records = [fast, slow_decode, slow_start, one_token]
    s = summarize(records, 2.0, slo=SLO(ttft_s=0.5, tpot_s=0.05))
    assert s.slo_attainment == pytest.approx(2 / 4)
    assert s.goodput == pytest.approx(2 / 2.0)
    e2e = summarize(records, 2.0, slo=SLO(e2e_s=0.3))
    assert e2e.slo_attainment == pytest.approx(2 / 4)  # fast (140 ms) and one (200 ms)


def test_schema_and_table():
    s = summarize([rec("a", 0.0, [0.1, 0.2])], 1.0, slo=SLO(tpot_s=0.05))
    d = s.to_dict()
    for key in (
        "num_requests",
        "completed",
        "failed",
        "duration_s",
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "output_throughput_per_device",
        "preemptions",
        "goodput",
        "slo_attainment",
    ):
        assert key in d
    for metric in ("ttft_s", "tpot_s", "itl_s", "e2e_s", "queue_s"):
        assert set(d[metric]) == {"mean", "p50", "p90", "p95", "p99", "max"}
    table = format_summary_table(s)
    assert "TTFT" in table and "Goodput" in table and "100.00" in table
    empty = summarize([], 0.0)
    assert empty.to_dict()["ttft_s"]["p99"] is None and empty.output_throughput == 0


def test_bad_slo_and_devices():
    with pytest.raises(InvalidArgument):
        SLO(ttft_s=0)
    with pytest.raises(InvalidArgument):
        summarize([], 1.0, num_devices=0)
