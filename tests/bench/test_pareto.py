"""The frontier chart's curve: Pareto-optimal levels among those that serve, and capacity read at
the TPOT target, which is the capacity search's own answer."""

from __future__ import annotations

import pytest

from servelab.bench.pareto import SweptLevel, frontier_curves, pareto_mask
from servelab.bench.planner import PlanJob, PlanRow, plan_one
from servelab.metrics import SLO


def test_pareto_mask_keeps_only_undominated_points():
    points = [(10.0, 100.0), (20.0, 80.0), (15.0, 70.0), (20.0, 80.0), (5.0, 100.0), (30.0, 10.0)]
    # (15, 70) loses to (20, 80) on both; (5, 100) ties (10, 100) on y and loses on x; equal points stay.
    assert pareto_mask(points) == [True, True, False, True, False, True]
    assert pareto_mask([]) == []


def _level(c: int, tps: float, tpot_ms: float, passed: bool, serves: bool = True) -> SweptLevel:
    return SweptLevel(c, tps, tpot_ms / 1e3, 0.1, passed, serves)


def test_curve_leaves_out_levels_that_miss_ttft_and_reads_capacity_right_of_the_line():
    row = PlanRow(hardware="h100-sxm", tp=1, fits=True, price_per_device_hour=3.6)
    row.frontier = [
        _level(1, 100.0, 10.0, True),
        _level(8, 700.0, 20.0, True),
        _level(16, 650.0, 25.0, True),  # dominated by concurrency 8: slower and less
        _level(32, 1200.0, 40.0, False),  # past the TPOT target: on the curve, not the capacity
        _level(64, 2000.0, 60.0, False, serves=False),  # misses TTFT too: not a served level
    ]
    (curve,) = frontier_curves([row])
    assert [p.level.concurrency for p in curve.front] == [32, 8, 1]  # by tokens/s per user
    assert curve.capacity is not None and curve.capacity.level.concurrency == 8
    assert curve.capacity.usd_per_million_tokens == pytest.approx(3.6 / (700.0 * 3600) * 1e6)
    d = curve.to_dict()
    assert d["points"]["pareto"] == [False, True, False, True, True]  # 64, 32, 16, 8, 1
    assert d["points"]["tokens_per_s_per_user"][-1] == pytest.approx(100.0)


def test_tp_degrees_of_one_accelerator_share_a_curve():
    a = PlanRow(hardware="h200", tp=1, fits=True)
    b = PlanRow(hardware="h200", tp=2, fits=True)
    a.frontier = [_level(4, 400.0, 20.0, True)]
    b.frontier = [_level(4, 300.0, 10.0, True), _level(8, 350.0, 20.0, True)]  # (50, 350) loses to tp=1's (50, 400)
    (curve,) = frontier_curves([a, b])
    assert {(p.tp, p.level.concurrency) for p in curve.front} == {(1, 4), (2, 4)}
    assert curve.capacity is not None and curve.capacity.tp == 1 and curve.price_per_device_hour is None


def test_capacity_on_the_line_is_the_plans_and_the_sweep_runs_past_the_failure():
    job = PlanJob(
        model="llama-3.1-8b",
        hardware="a100-80gb",
        tp=1,
        slo=SLO(ttft_s=2.0, tpot_s=0.030),
        percentile=90,
        workload={"input_len": 512, "output_len": 32, "seed": 0},
        sweep_to_ceiling=True,
    )
    row = plan_one(job)
    (curve,) = frontier_curves([row])
    assert curve.capacity is not None
    assert curve.capacity.level.tokens_per_s_per_device == pytest.approx(row.tokens_per_s_per_device, rel=0.02)
    assert curve.capacity.level.concurrency == row.capacity_concurrency
    assert curve.capacity.tokens_per_s_per_user >= 1 / 0.030
    searched = {int(lv["load"]) for lv in row.capacity["levels"]}
    swept = {lv.concurrency for lv in row.frontier}
    assert swept > searched and max(swept) > max(searched)  # levels past the first failing one
    assert max(swept) <= row.max_running
