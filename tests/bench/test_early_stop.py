"""A capacity level stopped as soon as it is certain to fail decides exactly as its whole run.

Three levels: the rule (`CertainFailure`) against `slo_check` on drawn latencies, a simulated
level stopped and resumed against the same level run whole, and `plan_one` with the early stop
against the same plan without it.
"""

from __future__ import annotations

import dataclasses
import math
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.bench.capacity import CertainFailure, slo_check
from servelab.bench.planner import PlanJob, plan_one
from servelab.metrics import SLO, RequestRecord, summarize
from servelab.sim import SimConfig, simulate
from servelab.workload import WorkloadSpec


def _record(index: int, ttft_s: float, tpot_s: float, output_tokens: int, success: bool) -> RequestRecord:
    first = ttft_s
    times = array("d", [first + i * tpot_s for i in range(output_tokens)]) if success else array("d")
    return RequestRecord(str(index), 0.0, 0.0, first if success else None, times, times[-1] if success else 1.0,
                         16, output_tokens if success else 0, success=success)  # fmt: skip


latency = st.floats(0.001, 0.2, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(
    requests=st.lists(
        st.tuples(latency, latency, st.integers(1, 4), st.integers(0, 9).map(bool)), min_size=1, max_size=60
    ),
    skip=st.integers(0, 10),
    percentile=st.sampled_from([50, 90, 95, 99]),
    ttft_target=st.sampled_from([None, 0.05, 0.1]),
    tpot_target=st.sampled_from([None, 0.05, 0.1]),
    order=st.randoms(use_true_random=False),
)
def test_the_rule_stops_only_levels_whose_whole_summary_fails(
    requests, skip, percentile, ttft_target, tpot_target, order
):
    slo = SLO(ttft_s=ttft_target, tpot_s=tpot_target, e2e_s=None if ttft_target else 0.3)
    records = [_record(i, ttft, tpot, n, ok) for i, (ttft, tpot, n, ok) in enumerate(requests)]  # 1 in 10 fails
    measured = [r for r in records if int(r.request_id) >= skip]
    if not measured:
        return
    rule = CertainFailure(slo, percentile, len(measured), skip_below=skip)
    finish_order = list(records)
    order.shuffle(finish_order)
    reasons = [rule(r) for r in finish_order]
    passed, _ = slo_check(summarize(measured, 1.0, slo=slo), slo, percentile)
    if any(reasons):
        assert not passed, reasons
    # Once every measured request is in, the rule is certain of any failure that the value at
    # floor(p (n - 1)) decides (when every request counts: failures and one-token outputs, which
    # have no TPOT, shrink a percentile's sample, and the rule waits for the larger one).
    if all(r.success and r.output_tokens > 1 for r in measured):
        assert any(reasons) or passed or _decided_only_by_interpolation(measured, slo, percentile)


def _decided_only_by_interpolation(measured, slo, percentile) -> bool:
    """A level can fail with fewer violators than the rule waits for: the percentile interpolates
    between the value at floor(p (n - 1)), within the target, and the next one, over it."""
    for target, attr in ((slo.ttft_s, "ttft_s"), (slo.tpot_s, "tpot_s"), (slo.e2e_s, "e2e_s")):
        if target is None:
            continue
        values = sorted(v for r in measured if (v := getattr(r, attr)) is not None)
        if values:
            k = math.floor(percentile / 100 * (len(values) - 1))
            if values[k] <= target < values[-1]:
                return True
    return False


LEVELS = [
    # (config, workload): closed loops at concurrencies over what the targets allow
    (SimConfig(), dict(input_len="1024", output_len="128", concurrency=256, seed=1)),
    (SimConfig(hardware="a100-80gb"), dict(input_len="64-2048", output_len="16-300", concurrency=96, seed=2)),
    (SimConfig(model="llama-3.1-70b", tp=4), dict(input_len="2048", output_len="64", concurrency=160, seed=3)),
]


@pytest.mark.parametrize("config,load", LEVELS)
def test_a_stopped_simulation_resumes_into_the_whole_run(config, load):
    n, c = 4 * load["concurrency"], load["concurrency"]
    workload = WorkloadSpec(num_requests=n + c, **load)
    slo = SLO(ttft_s=0.5, tpot_s=0.030)
    whole = simulate(config, workload)
    stopped = simulate(config, workload, stop=CertainFailure(slo, 90, n, skip_below=c))
    assert stopped.stopped_early and stopped.resume is not None
    assert len(stopped.records) < len(whole.records)
    assert not slo_check(whole.steady, slo, 90)[0]  # stopped as failing: the whole run fails
    resumed = stopped.resume()
    assert not resumed.stopped_early and resumed.resume is None
    assert [r.to_dict() for r in resumed.records] == [r.to_dict() for r in whole.records]
    assert resumed.summary == whole.summary and resumed.steady == whole.steady
    for column in ("start_s", "duration_s", "num_seqs", "kv_usage"):
        assert getattr(resumed.trace, column) == getattr(whole.trace, column)
    assert resumed.replica_stats == whole.replica_stats
    # The stopped result keeps what it saw at the stop.
    assert len(stopped.trace) < len(whole.trace) and len(stopped.records) < len(resumed.records)


PLANS = [
    dict(hardware="l40s", slo=SLO(ttft_s=2.0, tpot_s=0.050), workload={"input_len": "1024", "output_len": "128"}),
    dict(hardware="h100-sxm", slo=SLO(ttft_s=1.0, tpot_s=0.040), workload={"input_len": "512", "output_len": "64"}),
    dict(
        hardware="a100-80gb",
        slo=SLO(ttft_s=0.5, tpot_s=0.030),
        workload={"input_len": "128-4096", "output_len": "16-512", "seed": 7},
    ),
    dict(hardware="h100-sxm", slo=SLO(tpot_s=0.020), workload={"input_len": "1024", "output_len": "48"}),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"{p['hardware']}-{p['slo'].tpot_s}")
def test_a_plan_with_early_stops_answers_as_one_without(plan):
    job = PlanJob(model="llama-3.1-8b", tp=1, percentile=90, price_per_device_hour=2.0, engine_profile="servelab",
                  scheduler_overrides={"max_num_seqs": 4096}, **plan)  # fmt: skip
    fast, slow = plan_one(job), plan_one(dataclasses.replace(job, early_stop=False))
    stopped = [lv for lv in fast.capacity["levels"] if lv["stopped_early"]]
    assert stopped, "the plan exercises the early stop"
    # A stopped level's margin is its part's, so the probes after it may differ; where both searches
    # ran a load, they agree on it.
    slow_passed = {lv["load"]: lv["passed"] for lv in slow.capacity["levels"]}
    common = [lv for lv in fast.capacity["levels"] if lv["load"] in slow_passed]
    assert len(common) >= 2 and all(lv["passed"] == slow_passed[lv["load"]] for lv in common)
    for name in ("capacity_concurrency", "tokens_per_s_per_device", "requests_per_s", "ttft_s", "tpot_s",
                 "cost_per_million_output_tokens", "binding", "max_running", "reason"):  # fmt: skip
        assert getattr(fast, name) == getattr(slow, name), name
    for key in ("best", "first_failing", "capacity_load"):
        assert fast.capacity[key] == slow.capacity[key], key
    # The frontier draws the levels run whole only, each as the search without stops drew it.
    loads = {lv["load"] for lv in stopped}
    assert not loads & {p.concurrency for p in fast.frontier}
    slow_points = {p.concurrency: p for p in slow.frontier}
    assert all(slow_points[p.concurrency] == p for p in fast.frontier if p.concurrency in slow_points)
    assert len(fast.frontier) == len(fast.capacity["levels"]) - len(loads)
