"""`servelab plan` with a think time: the capacity is in users, each pausing between requests."""

from __future__ import annotations

import json

from servelab.bench.planner import PlanJob, plan_one
from servelab.cli import main as cli_main
from servelab.metrics import SLO

WORKLOAD = {"input_len": "256", "output_len": "64", "seed": 0}


def _row(**think):  # noqa: ANN003, ANN202
    return plan_one(
        PlanJob(
            model="llama-3.1-8b",
            hardware="h100-sxm",
            tp=1,
            slo=SLO(tpot_s=0.012),
            percentile=90,
            workload={**WORKLOAD, **think},
        )
    )


def test_users_who_read_between_requests_fit_in_greater_numbers():
    alone = _row()
    readers = _row(think_time_s=2.0, think_time_dist="exponential")
    # A user is in flight E2E / (E2E + think) of the time: ~4x as many users at about one request each.
    assert readers.capacity_concurrency > 3 * alone.capacity_concurrency
    best = readers.capacity["best"]["summary"]
    # Little's law on the judged level: requests/s = users / (E2E + think)
    e2e = best["e2e_s"]["mean"]
    assert abs(readers.requests_per_s / (readers.capacity_concurrency / (e2e + 2.0)) - 1) < 0.05
    levels = readers.capacity["levels"]
    assert all(lv["passed"] for lv in levels if lv["load"] <= readers.capacity_concurrency)
    assert not any(lv["passed"] for lv in levels if lv["load"] > readers.capacity_concurrency)
    assert _row(think_time_s=2.0, think_time_dist="exponential").to_dict() == readers.to_dict()  # seeded


def test_a_constant_think_time_keeps_users_in_lockstep():
    # All users start together and, pausing alike, come back nearly together (each after its own
    # E2E): about the bursts of no think time, so about as many users fit (exponential pauses
    # spread them: 3x and more), only fewer tokens per device.
    alone, lockstep = _row(), _row(think_time_s=2.0)
    assert lockstep.capacity_concurrency <= 1.05 * alone.capacity_concurrency
    assert lockstep.tokens_per_s_per_device < alone.tokens_per_s_per_device / 2


def test_plan_cli_says_the_think_time(capsys):
    argv = [
        "plan",
        "--hardware",
        "h100-sxm",
        "--slo-tpot",
        "12ms",
        "--input-len",
        "256",
        "--output-len",
        "64",
        "--num-requests",
        "40",
        "--workers",
        "1",
    ]
    assert cli_main([*argv, "--think-time", "exp:2s", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["think_time_s"] == 2.0 and data["workload"]["think_time_dist"] == "exponential"
    assert cli_main([*argv, "--think-time", "500ms"]) == 0
    out = capsys.readouterr().out
    assert "concurrency = users, think time 500 ms" in out and "lockstep" in out


def test_users_who_wait_for_the_token_budget_are_bound_by_it():
    """With think time the search offers more users than run at once; where the running batch
    reached what the token budget keeps running and the TTFT target broke, the budget binds: a
    budget twice as large serves about half as many users again."""
    from servelab.core.config import SchedulerConfig

    def row(budget: int):  # noqa: ANN202
        return plan_one(
            PlanJob(
                model="llama-3.1-8b",
                hardware="h100-sxm",
                tp=1,
                slo=SLO(tpot_s=0.030, ttft_s=0.300),
                percentile=90,
                workload={**WORKLOAD, "think_time_s": 2.0, "think_time_dist": "exponential"},
                scheduler=SchedulerConfig(max_num_batched_tokens=budget),
            )
        )

    small, large = row(512), row(1024)
    b = small.binding
    assert small.max_running == SchedulerConfig(max_num_batched_tokens=512).budget_running(256, 64) == 104
    assert b.limit == "max-num-batched-tokens" and b.at_concurrency > b.peak_running >= small.max_running
    assert "the token budget (--max-num-batched-tokens 512)" in b.detail and "waited for admission" in b.detail
    assert large.capacity_concurrency > 1.4 * small.capacity_concurrency
