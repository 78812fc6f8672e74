"""A closed loop's start-up wave (all C clients at once) is run but not measured by the capacity
search, and is reported apart from the steady state in a plain run."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from servelab.bench.capacity import find_capacity
from servelab.bench.client import OpenAIStreamClient, StreamResult
from servelab.bench.prompts import PromptBuilder
from servelab.bench.runner import InFlight
from servelab.bench.session import BenchSession, _saturation_rule
from servelab.metrics import SLO, RequestRecord, steady_state_summary
from servelab.workload import WorkloadSpec

MOCK = Path(__file__).with_name("mock_openai_server.py")


def _record(i: int, sent_s: float, ttft_s: float) -> RequestRecord:
    times = [sent_s + ttft_s + 0.01 * k for k in range(4)]
    return RequestRecord(str(i), sent_s, None, times[0], times, times[-1], 8, 4)


def test_steady_state_summary_leaves_out_the_first_requests_and_their_time():
    # A wave of 4 queued prompts (TTFT 1..4 s) at t = 0, then 8 spread-out requests at 0.1 s.
    records = [_record(i, 0.0, 1.0 + i) for i in range(4)] + [_record(4 + i, 5.0 + i, 0.1) for i in range(8)]
    steady = steady_state_summary(records, skip_first=4)
    assert steady.num_requests == 8 and steady.ttft_s.max == pytest.approx(0.1)
    # its rates over the steady stretch: from the first measured send (the wave is done by then)
    # to the last send; seven requests finished in it, of 4 tokens each
    assert steady.duration_s == pytest.approx(12.0 - 5.0)
    assert steady.request_throughput == pytest.approx(7 / 7.0) and steady.output_throughput == pytest.approx(4.0)
    assert steady_state_summary(records[:4], skip_first=4) is None
    # Preemptions: the stretch's own, not the wave's.
    assert steady_state_summary(records, skip_first=4, preemption_times_s=[0.5, 3.0, 5.0, 9.5, 12.5]).preemptions == 2


def test_the_steady_rates_follow_littles_law_in_a_closed_loop():
    """C clients with no think time each keep one request in flight: C / mean E2E requests a
    second. Over the measured requests' whole span the wave's tail and the drain pulled the rate
    30% under it at these mixed lengths."""
    from servelab.sim import simulate
    from servelab.sim.runner import engine_sim_config

    config = engine_sim_config("servelab", model="llama-3.1-8b", hardware="h100-sxm", tp=1, weight_dtype="bfloat16",
                               kv_cache_dtype="bfloat16")  # fmt: skip
    wl = WorkloadSpec(num_requests=320, concurrency=64, input_len="uniform:16,1024", output_len="uniform:16,1024")
    result = simulate(config, wl)
    steady = result.steady_or_whole
    little = 64 / steady.e2e_s.mean
    assert steady.request_throughput == pytest.approx(little, rel=0.08)
    measured = [r for r in result.records if int(r.request_id) >= 64]
    span_s = max(r.last_token_s for r in measured) - min(r.arrival_s for r in measured)
    assert len(measured) / span_s < 0.8 * little  # the whole span's rate


def test_steady_state_summary_by_time_leaves_out_what_arrived_before_it():
    records = [_record(i, 0.0, 1.0 + i) for i in range(4)] + [_record(4 + i, 5.0 + i, 0.1) for i in range(8)]
    by_time = steady_state_summary(records, skip_first=0, after_s=5.0)
    assert by_time == steady_state_summary(records, skip_first=4)  # the same 8 requests, the same window
    assert steady_state_summary(records, skip_first=0, after_s=7.0).num_requests == 6
    assert steady_state_summary(records, skip_first=0, after_s=100.0) is None


def _result(index: int, ttft_s: float) -> StreamResult:
    return StreamResult(index=index, planned_send_s=None, send_s=0.0, end_s=ttft_s + 0.1,
                        prompt_tokens_planned=8, output_tokens_planned=4, first_token_s=ttft_s,
                        token_times_s=[ttft_s + 0.01 * k for k in range(4)], usage_output_tokens=4, success=True)  # fmt: skip


def test_early_stop_ignores_the_unmeasured_wave():
    slo = SLO(ttft_s=0.5)
    # 10 measured requests at p90: 2 violators decide it. The wave's 4 slow ones must not count.
    rule = _saturation_rule(slo, 90, total=10, skip_below=4)
    wave = [_result(i, 2.0) for i in range(4)]
    assert rule(wave + [_result(4, 0.1)], [InFlight(send_s=0.0, index=3)], 5.0) == ""
    assert rule(wave + [_result(4, 2.0)], [InFlight(send_s=0.0, index=5)], 5.0) != ""  # 2 measured violators
    assert _saturation_rule(slo, 90, total=10)(wave, [], 5.0) != ""  # counted, the wave alone would stop it


@pytest.fixture(scope="module")
def queueing_server():
    # Serial 10 ms prefills, 50 ms per output token: a burst of C simultaneous prompts waits up to
    # C x 10 ms for a first token, while a closed loop's spread-out later requests wait ~10 ms
    # until C x 10 ms exceeds a request's 400 ms decode (C ~ 40).
    proc = subprocess.Popen([sys.executable, str(MOCK), "--ttft-ms", "0", "--tpot-ms", "50", "--prefill-ms", "10"],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        yield f"http://127.0.0.1:{int(proc.stdout.readline().split()[1])}"
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_capacity_search_is_not_decided_by_the_start_up_wave(queueing_server):
    # p90 TTFT <= 40 ms. Counted, the wave (1/8 of a level's 8 x C requests, TTFTs 10, 20, ...,
    # C x 10 ms) puts p90 TTFT near C x 2 ms: the search stopped at ~19. In the steady state the
    # capacity on an idle host is ~43 (C x 10 ms - 400 ms <= 40 ms).
    slo = SLO(ttft_s=0.040)
    loop = asyncio.new_event_loop()
    client = OpenAIStreamClient(queueing_server, model="mock-model", max_connections=64)
    session = BenchSession(client, PromptBuilder(None, seed=0), slo=slo)
    try:
        runs: list = []
        base = WorkloadSpec(num_requests=None, concurrency=1, input_len="8", output_len="9", seed=0)
        measure = session.measure_fn(loop, base, "concurrency", 90, warmup=0, runs=runs)
        result = find_capacity(measure, slo, percentile=90, start=12, max_load=64, tolerance=0.1)
    finally:
        loop.run_until_complete(client.aclose())
        loop.close()
    assert result.best is not None and result.best.load >= 16, result.describe()
    # Levels the steady state passes and the whole run (wave counted) fails: had the wave been
    # counted, the search would have stopped below them. Judged within each run, so a loaded host
    # (client jitter costs a few ms of TTFT, and moves the capacity itself) cannot flip it.
    decided_by_wave = [
        load for load, out in runs if out.steady is not None and out.steady.ttft_s.p90 <= 0.040 < out.summary.ttft_s.p90
    ]
    assert decided_by_wave and max(decided_by_wave) <= result.best.load, result.describe()
    assert result.first_failing is not None and result.first_failing.load <= 56, result.describe()
    at_best = next(out for load, out in runs if load == result.best.load)
    c = int(result.best.load)
    # The wave ran (c more requests than measured, its last prompt queued behind c - 1 others) ...
    assert at_best.startup_requests == c and at_best.summary.num_requests == 9 * c
    assert at_best.summary.ttft_s.max > 0.5 * c * 0.010
    # ... and the level was judged without it.
    assert result.best.summary.num_requests == 8 * c and result.best.summary.ttft_s.p90 <= 0.040


def test_early_stop_counts_each_target_on_its_own():
    # 10 measured at p90: 2 requests over one target decide it; one over TTFT and another over
    # TPOT decide neither percentile, and the level may still pass.
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    slow_decode = dataclasses.replace(_result(1, 0.1), token_times_s=[0.1, 1.0, 2.0], usage_output_tokens=3)
    rule = _saturation_rule(slo, 90, total=10)
    assert rule([_result(0, 2.0), slow_decode], [], 5.0) == ""
    assert "TTFT" in rule([_result(0, 2.0), _result(2, 2.0)], [], 5.0)
    assert "TPOT" in rule([slow_decode, dataclasses.replace(slow_decode, index=3)], [], 5.0)


def test_a_trace_replayed_by_concurrent_clients_has_its_start_up_wave(queueing_server, tmp_path):
    # With --concurrency a trace is a closed loop (its arrival times are dropped), so its first C
    # requests are the wave and the steady state is reported without them.
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": i * 0.01, "prompt_tokens": 8, "output_tokens": 3}) + "\n"
                             for i in range(12)))  # fmt: skip
    loop = asyncio.new_event_loop()
    client = OpenAIStreamClient(queueing_server, model="mock-model", max_connections=4)
    try:
        out = loop.run_until_complete(
            BenchSession(client, PromptBuilder(None, seed=0)).run(WorkloadSpec(trace=str(trace), concurrency=4))
        )
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()
    assert out.startup_requests == 4 and out.steady is not None and out.steady.num_requests == 8


def test_a_rate_level_plans_arrivals_for_its_whole_duration():
    # `--search rate --duration 120s`: each level's arrivals span the duration, not 30 s of it
    seen = []

    async def run(workload, **kw):
        seen.append((workload.rate, workload.num_requests, kw["duration_s"]))
        raise asyncio.CancelledError

    session = BenchSession(None, PromptBuilder(None, seed=0))
    session.run = run
    loop = asyncio.new_event_loop()
    try:
        base = WorkloadSpec(num_requests=None, rate=1.0, input_len="8", output_len="4", seed=0)
        for duration_s, want in ((None, 30 * 10), (120.0, 1.5 * 120 * 10)):
            measure = session.measure_fn(loop, base, "rate", 90, duration_s=duration_s)
            with pytest.raises(asyncio.CancelledError):
                measure(10.0)
            assert seen[-1] == (10.0, want, duration_s)
    finally:
        loop.close()
