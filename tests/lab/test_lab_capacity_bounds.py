"""The capacity lesson's plans run on one bounded pool with a bounded queue (429 beyond it) and an
LRU cache: distinct URLs can neither start processes without limit nor fill memory forever."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from fastapi.testclient import TestClient

from servelab.lab.app import create_lab_app
from servelab.lab.capacity_lesson import CapacityPlanner


def _params(output_len: int) -> dict:
    return {"tpot_ms": 50, "prompt_len": 16, "output_len": output_len}


def _wait_done(client: TestClient, params: dict, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = client.post("/api/lessons/capacity", json=params)
        if r.status_code == 200:
            return
        assert r.status_code == 202, r.text
        assert len(multiprocessing.active_children()) <= 1  # the one pool's one worker, never more
        time.sleep(0.2)
    raise AssertionError("the capacity plan did not finish")


def _wait_no_children(timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()


@pytest.mark.slow
def test_plans_share_one_bounded_pool_queue_and_cache(monkeypatch):
    import dataclasses

    from servelab.lab import capacity_lesson

    # The pool, queue and cache are what is tested here, not the search: keep each search short.
    jobs = capacity_lesson._jobs
    monkeypatch.setattr(
        capacity_lesson,
        "_jobs",
        lambda key: [dataclasses.replace(j, max_concurrency=4, tolerance=None) for j in jobs(key)],
    )
    _wait_no_children()  # other tests' pools
    monkeypatch.setattr(capacity_lesson, "POOL_IDLE_S", 2.0)
    app = create_lab_app()
    planner = app.state.capacity_planner = CapacityPlanner(max_workers=1, max_running=1, max_cached=2)
    client = TestClient(app)

    assert client.post("/api/lessons/capacity", json=_params(2)).status_code == 202
    busy = client.post("/api/lessons/capacity", json=_params(3))
    assert busy.status_code == 429, busy.text
    assert busy.headers["retry-after"] == "5" and "1 capacity plans" in busy.json()["error"]["message"]
    _wait_done(client, _params(2))
    warm = {p.pid for p in multiprocessing.active_children()}
    assert len(warm) == 1  # idle, the worker waits for the next plan ...
    _wait_done(client, _params(3))
    assert {p.pid for p in multiprocessing.active_children()} == warm  # ... and runs it

    _wait_no_children()  # idle for POOL_IDLE_S: the worker processes are given back

    _wait_done(client, _params(4))
    assert len(planner) == 2  # the oldest result (output_len 2) was dropped ...
    assert client.post("/api/lessons/capacity", json=_params(2)).status_code == 202  # ... so it plans again
    _wait_done(client, _params(2))
    planner.close()


class _Key:
    """A background key whose jobs finish at once (str of an int): only the order is tested."""

    total = 4

    def jobs(self) -> list:
        return [(name, str, i) for i, name in enumerate("abcd")]


def test_the_pages_own_accelerator_is_planned_first_and_the_rest_keep_their_order():
    planner = CapacityPlanner(max_workers=1)  # one worker: jobs end in the order handed out
    try:
        state = planner.plan_for(_Key(), wait=True, first="c")
    finally:
        planner.close()
    assert state.error is None and list(state.rows) == ["c", "a", "b", "d"]
    assert state.rows["c"] == "2"


def test_plan_jobs_come_longest_first_by_the_roofline_bound():
    from servelab.lab.capacity_lesson import PlanKey, job_order, upper_bound
    from servelab.lab.common import setup_from
    from servelab.lab.params import Params
    from servelab.spec import HARDWARE

    key = PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", 50.0, 2000.0, 1024, 256)
    names = [name for name, _, _ in key.jobs()]
    assert sorted(names) == sorted(HARDWARE)
    s = setup_from(Params({}))
    users = [upper_bound(s, HARDWARE[name], key)["users"] for name in names]
    assert users == sorted(users, reverse=True) and users[-1] == 0  # the L4 fits no user: last
    assert [name for name, _, _ in job_order(key.jobs(), "l4")] == ["l4", *names[:-1]]


class _Crash:
    """A key whose one job kills its worker process."""

    total = 1

    def jobs(self) -> list:
        import os

        return [("a", os._exit, 1)]


def test_a_warm_pool_whose_worker_died_is_replaced(monkeypatch):
    from servelab.lab import capacity_lesson

    monkeypatch.setattr(capacity_lesson, "POOL_IDLE_S", 30.0)  # the broken pool would otherwise stay warm
    planner = CapacityPlanner(max_workers=1)
    try:
        crashed = planner.plan_for(_Crash(), wait=True)
        assert crashed.error and "BrokenProcessPool" in crashed.error
        state = planner.plan_for(_Key(), wait=True)
        assert state.error is None and state.rows == {name: str(i) for i, name in enumerate("abcd")}
    finally:
        planner.close()


@pytest.mark.parametrize(
    ("targets", "lengths", "hardware"),
    [
        # A generous TTFT target lets clients queue for the token budget: the bar must not count them.
        ((50.2, 8690.0), (21, 136), "b200"),
        ((50.2, 8690.0), (21, 136), "mi300x"),
        ((50.0, 2000.0), (1024, 256), "b200"),
        ((50.0, 2000.0), (1024, 256), "a100-80gb"),
    ],
)
def test_the_roofline_bound_shown_first_is_above_the_plans_answer(targets, lengths, hardware):
    from servelab.bench.planner import plan_one
    from servelab.lab.capacity_lesson import PlanKey, _jobs, upper_bound
    from servelab.spec import HARDWARE

    key = PlanKey("llama-3.1-8b", "bfloat16", "bfloat16", 1, "servelab", *targets, *lengths)
    job = next(j for j in _jobs(key) if j.hardware == hardware)
    row, bound = plan_one(job), upper_bound(key.setup(), HARDWARE[hardware], key)
    assert row.capacity_concurrency is not None and row.capacity_concurrency <= bound["users"], (row, bound)
    assert row.tokens_per_s_per_device <= bound["tokens_per_s_per_gpu"], (row, bound)
