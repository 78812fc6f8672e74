"""Lesson 7: capacity and cost across accelerators, the capacity planner's own result
(`servelab.bench.planner`, the same code as `servelab plan`).

The search is uncapped: for each accelerator it runs until the TPOT target or the memory limit
binds (the KV cache: the search's maximum lies past the number of users whose requests fill it),
and the chart names which one did.

A plan is a capacity search on the simulator for every accelerator, which takes far longer than
one HTTP request should wait. So the first request for a parameter set starts the plan in the
background and answers 202 with its progress and a partial result: the accelerators simulated so
far, and for the others the roofline's instant estimate (marked as such); the page draws it and
polls until the 200 with the whole result.

Every plan of one lab runs on its `CapacityPlanner`: one process pool (started on demand, shut
down when idle), at most MAX_RUNNING_PLANS plans at once (429 beyond), and an LRU cache of the
last MAX_CACHED_PLANS results (plans are deterministic). A lab reachable by anyone must not
start processes per distinct URL, nor remember every URL forever.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from servelab.errors import ServelabError
from servelab.lab.common import fmt, setup_from, stat
from servelab.lab.limits import RETRY_AFTER_S, LabBusy, bounds
from servelab.lab.params import Params
from servelab.lab.simulations import SimulationCancelled
from servelab.metrics import SLO
from servelab.spec import HARDWARE

# Each accelerator's search runs ~10 simulations; these keep a whole plan near ten CPU-seconds.
REQUESTS_PER_USER = 2  # measured requests per simulated user at each level (plus the first wave)
PAST_MEMORY_WALL = 1.25  # the search's maximum, as a multiple of the users whose requests fill the KV cache
TOLERANCE_FRACTION = 0.03  # the bisection stops within this share of the memory wall
MAX_NUM_SEQS = 1 << 16  # the scheduler's sequence cap, out of the way: memory or the SLO binds first
# Short requests put the memory wall at tens of thousands of users, whose simulation would take
# minutes: the search stops here, and the bar says so. It is the largest batch the lab's forms take.
SEARCH_CEILING_USERS = 4096
PLAN_PERCENTILE = 90
MAX_RUNNING_PLANS = 2  # each keeps the whole pool busy for seconds; more would only queue
MAX_CACHED_PLANS = 64  # a plan's result is a few kB


@dataclass(slots=True)
class _PlanState:
    total: int
    rows: dict[str, Any] = field(default_factory=dict)  # hardware name -> PlanRow
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    remaining: int = 0


def memory_wall(model: str, hardware: str, w: str, k: str, tp: int, request_tokens: int) -> int:
    """Users whose requests, each at its full length, fill the KV cache (0: nothing fits)."""
    from servelab.cost import MemoryPlan
    from servelab.spec import get_hardware, get_model

    try:
        plan = MemoryPlan(get_model(model), get_hardware(hardware), w, k, tp)
    except ServelabError:
        return 0
    return plan.max_batch(request_tokens) if plan.weights_fit else 0


def _jobs(key: tuple) -> list[Any]:
    from servelab.bench.planner import PlanJob

    model, w, k, tp, engine_profile, tpot_ms, prompt_len, output_len = key
    workload = {"input_len": str(prompt_len), "output_len": str(output_len), "seed": 0}
    jobs = []
    for hw in HARDWARE.values():
        wall = max(1, memory_wall(model, hw.name, w, k, tp, prompt_len + output_len))
        jobs.append(
            PlanJob(
                model=model,
                hardware=hw.name,
                tp=tp,
                slo=SLO(tpot_s=tpot_ms / 1e3),
                percentile=PLAN_PERCENTILE,
                workload=workload,
                weight_dtype=w,
                kv_cache_dtype=k,
                engine_profile=engine_profile,
                scheduler_overrides={"max_num_seqs": MAX_NUM_SEQS},
                max_concurrency=min(int(wall * PAST_MEMORY_WALL) + 1, SEARCH_CEILING_USERS),
                price_per_device_hour=hw.price_per_hour_usd,
                requests_per_client=REQUESTS_PER_USER,
                tolerance=max(1.0, TOLERANCE_FRACTION * wall),
            )
        )
    return jobs


class CapacityPlanner:
    """The capacity plans of one lab: a bounded pool, a bounded queue, a bounded cache."""

    def __init__(self, *, max_workers: int | None = None, max_running: int = MAX_RUNNING_PLANS,
                 max_cached: int = MAX_CACHED_PLANS):  # fmt: skip
        self.max_workers = max_workers or max(1, min(len(HARDWARE), os.cpu_count() or 1))
        self.max_running = max_running
        self.max_cached = max(max_cached, max_running)
        self._plans: OrderedDict[tuple, _PlanState] = OrderedDict()
        self._pool: ProcessPoolExecutor | None = None
        self._retiring: threading.Thread | None = None  # shuts an idle pool down
        self._closed = False
        # Re-entrant: a future that is already done runs its callback in the submitting thread.
        self._lock = threading.RLock()

    @property
    def num_running(self) -> int:
        with self._lock:
            return sum(1 for state in self._plans.values() if not state.done.is_set())

    @property
    def num_processes(self) -> int:
        with self._lock:
            return 0 if self._pool is None else len(self._pool._processes or {})  # noqa: SLF001

    def plan_for(self, key: tuple, wait: bool = False) -> _PlanState:
        with self._lock:
            state = self._plans.get(key)
            if state is not None and not (state.done.is_set() and state.error):
                self._plans.move_to_end(key)
            else:
                state = self._start(key)
        if wait:
            state.done.wait()
        return state

    def snapshot(self, state: _PlanState) -> tuple[bool, dict[str, Any]]:
        """Whether the plan is done, and the rows finished so far, read together."""
        with self._lock:
            return state.done.is_set(), dict(state.rows)

    def _start(self, key: tuple) -> _PlanState:
        if self._closed:
            raise SimulationCancelled("the server is shutting down; it starts no new capacity plan")
        if self.num_running >= self.max_running:
            raise LabBusy(
                f"the lab is already running {self.max_running} capacity plans (the most it runs at once); "
                f"retry in {RETRY_AFTER_S} s"
            )
        state = _PlanState(total=len(HARDWARE))
        self._plans[key] = state
        self._plans.move_to_end(key)
        self._evict()
        try:
            jobs = _jobs(key)
        except Exception as exc:  # reported to the page; the next request retries
            state.error = f"{type(exc).__name__}: {exc}"
            state.done.set()
            return state
        from servelab.bench.planner import plan_one

        if self._pool is None:
            if self._retiring is not None:  # never two pools' processes at once
                self._retiring.join()
                self._retiring = None
            # spawn, not fork: this runs beside the web server's threads.
            self._pool = ProcessPoolExecutor(max_workers=self.max_workers,
                                             mp_context=multiprocessing.get_context("spawn"))  # fmt: skip
        state.remaining = len(jobs)
        for job in jobs:
            future = self._pool.submit(plan_one, job)
            future.add_done_callback(functools.partial(self._job_done, state, job.hardware))
        return state

    def _job_done(self, state: _PlanState, hardware: str, future: Future) -> None:
        with self._lock:
            try:
                state.rows[hardware] = future.result()
            except Exception as exc:
                state.error = state.error or f"{type(exc).__name__}: {exc}"
            state.remaining -= 1
            if state.remaining > 0:
                return
            state.done.set()
            if self.num_running == 0 and self._pool is not None:
                # Idle: give the worker processes back; the next plan starts a new pool. Not
                # here, though: this callback runs on the pool's own management thread.
                self._retiring = threading.Thread(target=self._pool.shutdown, name="lab-plan-pool-shutdown")
                self._retiring.start()
                self._pool = None

    def _evict(self) -> None:
        while len(self._plans) > self.max_cached:
            oldest = next((k for k, s in self._plans.items() if s.done.is_set()), None)
            if oldest is None:
                return
            del self._plans[oldest]

    def __len__(self) -> int:
        with self._lock:
            return len(self._plans)

    def close(self) -> None:
        """Ends the running plans (their processes are killed: a plan can run for seconds, and a
        stopping server must not wait for it) and refuses new ones."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            for process in list((pool._processes or {}).values()):  # noqa: SLF001
                process.terminate()
            pool.shutdown(wait=False, cancel_futures=True)


def capacity(p: Params, planner: CapacityPlanner) -> dict[str, Any] | JSONResponse:
    s = setup_from(p)
    tpot_ms = p.float("tpot_ms", 50.0, **bounds("capacity", "tpot_ms"))
    prompt_len = p.int("prompt_len", 1024, **bounds("capacity", "prompt_len"))
    output_len = p.int("output_len", 256, **bounds("capacity", "output_len"))
    s.roofline()._check_context(prompt_len + output_len, "prompt_len + output_len")  # noqa: SLF001
    key = (s.model.name, s.weight_dtype, s.kv_dtype, s.tp, s.engine_profile, tpot_ms, prompt_len, output_len)
    state = planner.plan_for(key)
    done, rows = planner.snapshot(state)
    if not done:
        partial = result(s, rows, tpot_ms, prompt_len, output_len)
        partial.update(
            status="running",
            done=len(rows),
            total=state.total,
            message=f"planning: {len(rows)} of {state.total} accelerators simulated; "
            f"the others show the roofline's estimate until their search ends",
        )
        return JSONResponse(partial, status_code=202)
    if state.error:
        raise ServelabError(f"the capacity plan failed: {state.error}")
    return result(s, rows, tpot_ms, prompt_len, output_len)


def estimate(s: Any, hardware: Any, tpot_ms: float, prompt_len: int, output_len: int) -> dict[str, Any]:
    """The roofline's instant answer for one accelerator, shown until its simulation ends: the
    largest batch whose decode step at the mean context meets the TPOT target, capped by the KV
    cache; its throughput counts each user's prefill once per request (a batch's users produce
    batch × output_len tokens in output_len decode steps plus batch prefills)."""
    from servelab.cost import Roofline
    from servelab.lab.roofline_lessons import batch_at_tpot

    try:
        rl = Roofline(s.model, hardware, s.weight_dtype, s.kv_dtype, s.tp)
    except ServelabError:
        return {"fits": False, "batch": 0, "tokens_per_s_per_gpu": 0.0}
    wall = rl.memory.max_batch(prompt_len + output_len) if rl.memory.weights_fit else 0
    context = prompt_len + output_len // 2
    batch = batch_at_tpot(rl, context, wall, tpot_ms / 1e3)
    cycle_s = output_len * rl.decode(batch, context).time_s + batch * rl.prefill(prompt_len).time_s if batch else 0.0
    tps = batch * output_len / cycle_s / s.tp if batch else 0.0
    return {
        "fits": wall > 0,
        "batch": batch,
        "tokens_per_s_per_gpu": tps,
        "binds": "memory" if batch == wall else "slo",
    }


def _binds(row: Any) -> str | None:
    """Which limit set the row's capacity, in the lesson's words: "memory" (the KV cache: the
    planner saw it full, or the search passed its maximum, beyond the memory wall), "slo", or
    "ceiling" (still passing at SEARCH_CEILING_USERS, short of the memory wall)."""
    if row.binding is None:
        return None
    limit = row.binding.limit
    if limit == "search-maximum" and row.binding.at_concurrency >= SEARCH_CEILING_USERS:
        return "ceiling"
    return "memory" if limit in ("kv-cache", "search-maximum") else limit


BIND_LABEL = {
    "memory": "memory (KV cache full)",
    "slo": "the TPOT target",
    "max-num-seqs": "--max-num-seqs",
    "ceiling": f"the lab's {SEARCH_CEILING_USERS:,}-user ceiling, short of memory",
}


def result(s: Any, rows_by_hw: dict[str, Any], tpot_ms: float, prompt_len: int, output_len: int) -> dict[str, Any]:
    from servelab.bench.planner import PlanRow, cost_per_million_tokens, rank

    simulated = rank([rows_by_hw[name] for name in HARDWARE if name in rows_by_hw])
    pending = [name for name in HARDWARE if name not in rows_by_hw]
    plan: dict[str, list[Any]] = {
        k: []
        for k in (
            "hardware",
            "tp",
            "fits",
            "meets_slo",
            "tokens_per_s_per_gpu",
            "usd_per_million_tokens",
            "concurrency",
            "tpot_ms",
            "price_per_gpu_hour",
            "binds",
            "binding",
            "config",
            "reason",
            "status",
        )
    }

    def add(r: PlanRow, status: str, binds: str | None) -> None:
        plan["hardware"].append(r.hardware)
        plan["tp"].append(r.tp)
        plan["fits"].append(r.fits)
        plan["meets_slo"].append(r.meets_slo)
        plan["tokens_per_s_per_gpu"].append(r.tokens_per_s_per_device or 0.0)
        plan["usd_per_million_tokens"].append(r.cost_per_million_output_tokens)
        plan["concurrency"].append(r.capacity_concurrency)
        plan["tpot_ms"].append(None if r.tpot_s is None else r.tpot_s * 1e3)
        plan["price_per_gpu_hour"].append(r.price_per_device_hour)
        plan["binds"].append(binds)
        plan["binding"].append(None if r.binding is None else r.binding.detail)
        plan["status"].append(status)
        if r.meets_slo:
            prefix = "≈ " if status == "estimate" else "≥ " if binds == "ceiling" else ""
            plan["config"].append(f"{prefix}{r.capacity_concurrency:,.0f} users · {BIND_LABEL.get(binds or '', binds)}")
        else:
            plan["config"].append("does not fit" if not r.fits else "misses the target")
        plan["reason"].append(r.reason or None)

    for r in simulated:
        add(r, "simulated", _binds(r))
    for name in pending:
        hw = HARDWARE[name]
        e = estimate(s, hw, tpot_ms, prompt_len, output_len)
        tps = e["tokens_per_s_per_gpu"] or None
        row = PlanRow(
            hardware=name,
            tp=s.tp,
            fits=e["fits"],
            capacity_concurrency=e["batch"] or None,
            tokens_per_s_per_device=tps,
            price_per_device_hour=hw.price_per_hour_usd,
            reason="roofline estimate; simulating",
            cost_per_million_output_tokens=None
            if not tps or hw.price_per_hour_usd is None
            else cost_per_million_tokens(hw.price_per_hour_usd, tps),
        )
        add(row, "estimate", e.get("binds") if tps else None)
    serving = [r for r in simulated if r.meets_slo]
    warning = None
    if simulated and not pending and not serving:
        reasons = "; ".join(f"{r.hardware}: {r.reason}" for r in simulated)
        warning = (
            f"no accelerator serves {s.model.name} within {fmt(tpot_ms)} ms TPOT: {reasons}; loosen the TPOT "
            f"target, shorten the requests, use smaller dtypes or raise TP"
        )
    if serving:
        cheapest = serving[0]
        fastest = max(serving, key=lambda r: r.tokens_per_s_per_device or 0.0)
        bound = ", ".join(f"{r.hardware} by {BIND_LABEL.get(_binds(r) or '', _binds(r))}" for r in serving)
        notice = (
            f"{fastest.hardware} serves the most tokens/s per GPU ({fmt(fastest.tokens_per_s_per_device)}), "
            f"but {cheapest.hardware} is cheapest at ${fmt(cheapest.cost_per_million_output_tokens or 0.0)} per "
            f"million output tokens; capacity is tokens/s per GPU at the TPOT target, not QPS. "
            f"What bound each: {bound}."
        )
    elif pending:
        notice = "simulating; the bars that are not yet simulated are the roofline's estimate."
    else:
        notice = "nothing meets the target: loosen the TPOT target, shorten the requests, or raise TP."
    return {
        "status": "done" if not pending else "running",
        "config": {
            **s.to_dict(),
            "tpot_ms": tpot_ms,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "requests_per_user": REQUESTS_PER_USER,
            "percentile": PLAN_PERCENTILE,
        },
        "plan": plan,
        "warning": warning,
        "stats": [
            stat("target", f"p{PLAN_PERCENTILE} TPOT ≤ {fmt(tpot_ms)} ms"),
            stat(
                "accelerators that meet it",
                f"{len(serving)} of the {len(simulated)} simulated so far"
                if pending
                else f"{len(serving)} of {len(simulated)}",
            ),
            stat("search", "users until the TPOT target or the KV cache binds"),
        ],
        "notice": notice,
    }
