"""The capacity search: its logic on a synthetic server, and against a brute-force sweep of the
simulator."""

from __future__ import annotations

import math

import numpy as np
import pytest

from servelab.bench.capacity import LevelRun, certainly_fails, find_capacity, slo_check
from servelab.errors import InvalidArgument
from servelab.metrics import SLO, RequestRecord, summarize
from servelab.sim import SimConfig, simulate
from servelab.workload import WorkloadSpec


def _summary(tpot_s: float, n: int = 20, failed: int = 0):
    records = []
    for i in range(n):
        ok = i >= failed
        times = [0.1 + k * tpot_s for k in range(5)] if ok else []
        records.append(
            RequestRecord(str(i), 0.0, None, times[0] if ok else None, times, 1.0, 10, 5, ok, None if ok else "boom")
        )
    return summarize(records, 1.0)


def test_doubles_then_bisects_to_the_exact_boundary():
    # A synthetic server whose TPOT is 10.5 ms + 1 ms per concurrent user: 50 ms is met up to 39.
    calls = []

    def measure(c):
        calls.append(c)
        return _summary(0.0105 + 0.001 * c)

    result = find_capacity(measure, SLO(tpot_s=0.050), percentile=90)
    assert calls[:7] == [1, 2, 4, 8, 16, 32, 64]
    assert result.best.load == 39 and result.first_failing.load == 40
    assert all(isinstance(c, int) for c in calls)
    assert len(calls) <= 7 + 5  # bisection from 32..64 takes log2(32) levels


def test_rate_search_stops_within_relative_tolerance():
    result = find_capacity(lambda r: _summary(0.0005 + 0.001 * r), SLO(tpot_s=0.050), mode="rate", start=1.0)
    # 49.5 itself is the boundary (TPOT exactly 50 ms): rounding decides which side it falls on.
    assert result.best.load <= 49.5 <= result.first_failing.load
    assert (result.first_failing.load - result.best.load) <= 0.05 * result.first_failing.load


def test_infeasible_slo_reports_no_capacity():
    result = find_capacity(lambda c: _summary(0.2), SLO(tpot_s=0.050))
    assert result.best is None and result.capacity_load is None
    assert "no load meets" in result.describe()


def test_failed_requests_fail_a_level_and_an_early_stop_is_a_failure():
    assert not slo_check(_summary(0.01, n=20, failed=3), SLO(tpot_s=0.05), 90)[0]  # 15% failed > 10%
    assert slo_check(_summary(0.01, n=20, failed=2), SLO(tpot_s=0.05), 90)[0]
    result = find_capacity(
        lambda c: LevelRun(_summary(0.01), "stopped early: saturated") if c > 4 else _summary(0.01), SLO(tpot_s=0.05)
    )
    assert result.best.load == 4 and result.first_failing.stopped_early


def test_max_load_caps_the_doubling():
    result = find_capacity(lambda c: _summary(0.01), SLO(tpot_s=0.05), max_load=24)
    assert result.reached_max_load and result.best.load == 24


def test_a_fractional_cap_on_concurrency_reports_only_what_it_ran():
    calls = []
    result = find_capacity(lambda c: calls.append(c) or _summary(0.01), SLO(tpot_s=0.05), max_load=2.5)
    assert calls == [1, 2] and result.best.load == 2 and result.reached_max_load
    with pytest.raises(InvalidArgument, match="maximum load 0 is below its start 1"):
        find_capacity(lambda c: _summary(0.01), SLO(tpot_s=0.05), max_load=0.5)


def test_a_start_near_the_boundary_steps_by_its_first_step_and_answers_as_from_one():
    def search(boundary, **kw):
        calls = []

        def measure(c):
            calls.append(c)
            return _summary(0.050 * math.sqrt(c / (boundary + 0.5)))  # p90 TPOT; the target is 50 ms

        return find_capacity(measure, SLO(tpot_s=0.050), **kw), calls

    # Just below: up 10%, then 21%, and the bracket narrows from there.
    result, calls = search(105, start=100, first_step=1.1)
    assert calls[:2] == [100, 110] and result.best.load == 105
    # Just above: down 10%, then 21%.
    result, calls = search(80, start=100, first_step=1.1)
    assert calls[:3] == [100, 90, 74] and result.best.load == 80
    # Far from it (the margins beyond 20%): doubling or halving at once.
    assert search(1000, start=100, first_step=1.1)[1][:3] == [100, 200, 400]
    assert search(10, start=100, first_step=1.1)[1][:3] == [100, 50, 25]
    for boundary in (3, 10, 37, 80, 105, 1000):
        plain = search(boundary)[0]
        near = search(boundary, start=boundary * 0.95, first_step=1.1)[0]
        tolerance = max(1.0, 0.01 * plain.first_failing.load)
        for r in (plain, near):
            assert boundary - tolerance <= r.best.load <= boundary < r.first_failing.load


def test_certainly_fails_agrees_with_numpy_percentiles():
    rng = np.random.default_rng(0)
    for _ in range(300):
        total = int(rng.integers(1, 60))
        p = int(rng.choice([50, 90, 95, 99]))
        violators = int(rng.integers(0, total + 1))
        if certainly_fails(violators, 0, total, p):
            # Whatever values the rest take (all well under the target), the percentile misses it.
            values = np.concatenate([np.full(violators, 2.0), np.zeros(total - violators)])
            assert np.percentile(values, p) > 1.0
            # ... and it also misses with fewer requests in the percentile (some failed).
            for dropped in range(0, total - violators):
                kept = np.concatenate([np.full(violators, 2.0), np.zeros(total - violators - dropped)])
                assert np.percentile(kept, p) > 1.0


def test_bad_search_arguments():
    with pytest.raises(InvalidArgument, match="a fraction of the load"):
        find_capacity(lambda c: _summary(0.01), SLO(tpot_s=0.05), tolerance=1.0)
    with pytest.raises(InvalidArgument, match="percentile"):
        find_capacity(lambda c: _summary(0.01), SLO(tpot_s=0.05), percentile=80)
    with pytest.raises(InvalidArgument, match="target"):
        find_capacity(lambda c: _summary(0.01), SLO())


# A small, fast simulated deployment whose p90 TPOT and TTFT grow steadily with load.
SIM = SimConfig(model="llama-3.1-8b", hardware="a100-80gb")
SIM_SLO = SLO(ttft_s=2.0, tpot_s=0.040)


def _sim_concurrency(c: int):
    workload = WorkloadSpec(num_requests=40, concurrency=int(c), input_len="256-1024", output_len="16-48", seed=1)
    return simulate(SIM, workload).summary


def _sim_rate(rate: float):
    workload = WorkloadSpec(num_requests=40, rate=float(rate), input_len="256-1024", output_len="16-48", seed=1)
    return simulate(SIM, workload).summary


def test_search_on_the_simulator_matches_a_brute_force_sweep():
    sweep = {c: slo_check(_sim_concurrency(c), SIM_SLO, 90)[0] for c in range(1, 41)}
    boundary = max(c for c in sweep if all(sweep[k] for k in range(1, c + 1)))
    assert 2 < boundary < 40, "the sweep must cross the SLO inside its range for the test to mean anything"
    result = find_capacity(_sim_concurrency, SIM_SLO, percentile=90, max_load=40)
    assert abs(result.best.load - boundary) <= 1  # the concurrency tolerance
    assert result.best.load == boundary  # and with a monotone sweep, exactly
    assert result.tokens_per_s_per_device == pytest.approx(_sim_concurrency(boundary).output_throughput_per_device)


def test_rate_search_on_the_simulator_matches_a_brute_force_sweep():
    grid = [round(0.5 * k, 1) for k in range(1, 81)]
    sweep = {r: slo_check(_sim_rate(r), SIM_SLO, 90)[0] for r in grid}
    first_fail = next(r for r in grid if not sweep[r])
    boundary = max(r for r in grid if r < first_fail)
    result = find_capacity(_sim_rate, SIM_SLO, percentile=90, mode="rate", start=1.0)
    tolerance = 0.05 * result.first_failing.load
    assert boundary - tolerance - 0.5 <= result.best.load <= first_fail
    assert result.first_failing.load - result.best.load <= tolerance


def _summary_ttft(ttft_s: float, tpot_s: float, n: int = 20):
    records = [
        RequestRecord(str(i), 0.0, None, ttft_s, [ttft_s + k * tpot_s for k in range(5)], 1.0, 10, 5, True, None)
        for i in range(n)
    ]
    return summarize(records, 1.0)


def test_missed_targets_names_each_target_missed():
    from servelab.bench.capacity import missed_targets

    s = _summary_ttft(ttft_s=3.0, tpot_s=0.060)
    assert [m[0] for m in missed_targets(s, SLO(ttft_s=2.0, tpot_s=0.050), 90)] == ["TTFT", "TPOT"]
    assert [m[0] for m in missed_targets(s, SLO(ttft_s=4.0, tpot_s=0.050), 90)] == ["TPOT"]
    assert missed_targets(s, SLO(ttft_s=4.0, tpot_s=0.070), 90) == []
    assert slo_check(s, SLO(ttft_s=2.0, tpot_s=0.050), 90) == (False, "p90 TTFT 3000.0 ms > 2000 ms")


def test_binding_names_the_target_missed_by_more():
    from servelab.bench.binding import Observed, binding_limit

    def at(load: int) -> Observed:
        return Observed(peak_running=load, peak_kv_usage=0.1, preemptions=0, kv_capacity_tokens=100_000)

    def search(ttft_s: float, tpot_s: float):
        slo = SLO(ttft_s=2.0, tpot_s=0.050)
        return find_capacity(lambda c: _summary_ttft(0.1, 0.01) if c < 6 else _summary_ttft(ttft_s, tpot_s), slo)

    # TTFT 3 s is 1.5x its target, TPOT 60 ms 1.2x: the TTFT target bound.
    b = binding_limit(search(3.0, 0.060), {c: at(c) for c in range(1, 9)}, max_num_seqs=256, request_tokens=100)
    assert b.limit == "ttft" and b.at_concurrency == 6 and "the TTFT target" in b.detail
    b = binding_limit(search(2.1, 0.090), {c: at(c) for c in range(1, 9)}, max_num_seqs=256, request_tokens=100)
    assert b.limit == "tpot" and "the TPOT target" in b.detail
    # A search that passed at its ceiling is bound by what set it.
    passed = find_capacity(lambda c: _summary_ttft(0.1, 0.01), SLO(ttft_s=2.0), max_load=4)
    b = binding_limit(passed, {4: at(4)}, max_num_seqs=4, request_tokens=100, ceiling="max-num-seqs")
    assert b.limit == "max-num-seqs" and "more clients would only queue for a slot" in b.detail
