"""Lesson 7: capacity and cost across accelerators, `servelab plan`'s own result.

For each accelerator the lesson builds the `servelab plan` command line it shows under the chart,
parses it with plan's own parser and runs the jobs `plan` would run (`commands.plan.plan_inputs`,
then `bench.planner.plan_one`), so a bar and the command beside it give the same numbers.
Capacity is the concurrent requests that meet both targets, the TTFT and the TPOT at the 90th
percentile, up to the most that run at once (the KV cache, or the lab's sequence cap): queued
clients are not users. The chart names the limit that bound each bar.

A plan is a capacity search on the simulator for every accelerator, which takes far longer than
one HTTP request should wait. So the first request for a parameter set starts the plan in the
background and answers 202 with its progress and a partial result: the accelerators simulated so
far, and for the others the roofline's upper bound (marked as such; the bars keep the catalog's
order, so nothing moves when a simulation lands); the page draws it and polls until the 200.
The form's accelerator is simulated first, the others longest first (`PlanKey.jobs`).

Every plan of one lab runs on its `CapacityPlanner`: one process pool (started on demand, kept
for POOL_IDLE_S after the last plan so that the next input skips the workers' start-up, then shut
down), at most MAX_RUNNING_PLANS plans at once (429 beyond), and an LRU cache of the
last MAX_CACHED_PLANS results (plans are deterministic). A lab reachable by anyone must not
start processes per distinct URL, nor remember every URL forever. The SLO lesson's rate sweep
runs on the same planner (`sim_lessons.SweepKey`): any key with `total` and `jobs()` does.
"""

from __future__ import annotations

import argparse
import dataclasses

import functools
import multiprocessing
import os
import shlex
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi.responses import JSONResponse

from servelab.errors import ServelabError
from servelab.lab.common import DEFAULT_HARDWARE, fmt, setup_from, stat
from servelab.lab.limits import RETRY_AFTER_S, LabBusy, bounds
from servelab.lab.params import Params
from servelab.lab.simulations import SimulationCancelled, max_plan_concurrency
from servelab.spec import HARDWARE

PLAN_PERCENTILE = 90
# The lab's sequence cap, in place of the engine profile's (256 for servelab): past it memory or
# the targets bind for all but the shortest requests, which the bar then says.
MAX_NUM_SEQS = 4096
MAX_RUNNING_PLANS = 2  # each keeps the whole pool busy for seconds; more would only queue
# A bar's search may take this long on a worker; past it the bar says so (the page's answers come in
# seconds; 8,000-token outputs at loose targets would keep the shared workers for minutes).
JOB_TIME_LIMIT_S = 60.0
MAX_CACHED_PLANS = 64  # a plan's result is a few kB
# An idle pool's workers wait this long for the next plan (a reader trying inputs one after
# another) before they exit: a fresh pool's start-up costs each worker ~0.5 CPU-s.
POOL_IDLE_S = 60.0


@dataclass(slots=True)
class _PlanState:
    total: int
    rows: dict[str, Any] = field(default_factory=dict)  # hardware name -> PlanRow
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)
    remaining: int = 0


@dataclass(frozen=True, slots=True)
class PlanKey:
    """One capacity plan's inputs: what the form sets."""

    model: str
    weight_dtype: str
    kv_dtype: str
    tp: int
    engine_profile: str
    tpot_ms: float
    ttft_ms: float
    prompt_len: int
    output_len: int

    @property
    def total(self) -> int:
        return len(HARDWARE)

    def setup(self) -> Any:
        """The lessons' Setup of this key (the form's accelerator as its hardware)."""
        from servelab.lab.common import Setup
        from servelab.spec.model import get_model

        return Setup(get_model(self.model), HARDWARE[DEFAULT_HARDWARE], self.weight_dtype, self.kv_dtype, self.tp,
                     self.engine_profile)  # fmt: skip

    def jobs(self) -> list[tuple[str, Callable[[Any], Any], Any]]:
        """(row name, picklable function, its argument): one `plan_one` per accelerator, the
        longest first (the most users the roofline allows: a search simulates a few times as many
        requests), so that the pool's workers finish together rather than one waiting on the last."""
        from servelab.bench.planner import plan_one

        s = self.setup()
        users = {name: upper_bound(s, hw, self)["users"] for name, hw in HARDWARE.items()}
        jobs = [(job.hardware, plan_one, job) for job in _jobs(self)]
        return sorted(jobs, key=lambda job: -users.get(job[0], 0))


class BackgroundKey(Protocol):
    """What the planner runs: a hashable key whose `jobs()` fill `total` rows, each in the pool."""

    @property
    def total(self) -> int: ...

    def jobs(self) -> list[tuple[str, Callable[[Any], Any], Any]]: ...


def job_order(jobs: list[tuple[str, Any, Any]], first: str | None = None) -> list[tuple[str, Any, Any]]:
    """The order the planner hands jobs to its workers: the row named `first` (the page's own
    accelerator, drawn first) ahead of the others, which keep their order."""
    return sorted(jobs, key=lambda job: job[0] != first) if first is not None else list(jobs)


def plan_argv(key: PlanKey, hardware: str) -> list[str]:
    """The `servelab plan` arguments of one accelerator's bar."""
    return [
        "plan", "--model", key.model, "--hardware", hardware, "--tp", str(key.tp),
        "--dtype", key.weight_dtype, "--kv-cache-dtype", key.kv_dtype, "--engine-profile", key.engine_profile,
        "--max-num-seqs", str(MAX_NUM_SEQS),
        *memory_cap_argv(key.setup(), [hardware], key.prompt_len, key.output_len, MAX_NUM_SEQS),
        "--slo-ttft", f"{key.ttft_ms:g}ms", "--slo-tpot", f"{key.tpot_ms:g}ms",
        "--percentile", str(PLAN_PERCENTILE), "--input-len", str(key.prompt_len), "--output-len", str(key.output_len),
    ]  # fmt: skip


def plan_command(key: PlanKey, hardware: str) -> str:
    return "servelab " + shlex.join(plan_argv(key, hardware))


def _jobs(key: PlanKey) -> list[Any]:
    """The jobs `servelab plan` runs for each bar's command, built by plan's own parser and code."""
    from servelab.commands.plan import add_arguments, plan_inputs

    parser = argparse.ArgumentParser(prog="servelab plan")
    add_arguments(parser)
    return [
        dataclasses.replace(job, time_limit_s=JOB_TIME_LIMIT_S)
        for hw in HARDWARE
        for job in plan_inputs(parser.parse_args(plan_argv(key, hw)[1:])).jobs
    ]


class CapacityPlanner:
    """The background jobs of one lab (capacity plans, rate sweeps): a bounded pool, a bounded
    queue, a bounded cache."""

    def __init__(self, *, max_workers: int | None = None, max_running: int = MAX_RUNNING_PLANS,
                 max_cached: int = MAX_CACHED_PLANS):  # fmt: skip
        self.max_workers = max_workers or max(1, min(len(HARDWARE), os.cpu_count() or 1))
        self.max_running = max_running
        self.max_cached = max(max_cached, max_running)
        self.idle_s = POOL_IDLE_S
        self._plans: OrderedDict[BackgroundKey, _PlanState] = OrderedDict()
        self._pool: ProcessPoolExecutor | None = None
        self._retiring: threading.Thread | None = None  # shuts an idle pool down
        self._idle_timer: threading.Timer | None = None  # retires the pool once idle for idle_s
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

    def plan_for(self, key: BackgroundKey, wait: bool = False, first: str | None = None) -> _PlanState:
        """The plan of `key`, started if new (the job named `first` ahead of the others)."""
        with self._lock:
            state = self._plans.get(key)
            if state is not None and not (state.done.is_set() and state.error):
                self._plans.move_to_end(key)
            else:
                state = self._start(key, first)
        if wait:
            state.done.wait()
        return state

    def snapshot(self, state: _PlanState) -> tuple[bool, dict[str, Any]]:
        """Whether the plan is done, and the rows finished so far, read together."""
        with self._lock:
            return state.done.is_set(), dict(state.rows)

    def _start(self, key: BackgroundKey, first: str | None = None) -> _PlanState:
        if self._closed:
            raise SimulationCancelled("the server is shutting down; it starts no new capacity plan")
        if self.num_running >= self.max_running:
            raise LabBusy(
                f"the lab is already running {self.max_running} capacity plans (the most it runs at once); "
                f"retry in {RETRY_AFTER_S} s"
            )
        state = _PlanState(total=key.total)
        self._plans[key] = state
        self._plans.move_to_end(key)
        self._evict()
        try:
            jobs = job_order(key.jobs(), first)
        except Exception as exc:  # reported to the page; the next request retries
            state.error = f"{type(exc).__name__}: {exc}"
            state.done.set()
            return state
        if self._idle_timer is not None:  # the warm pool takes this plan
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._pool is not None and self._pool._broken:  # noqa: SLF001  a worker died: a new pool
            self._retire(self._pool)
        if self._pool is None:
            if self._retiring is not None:  # never two pools' processes at once
                self._retiring.join()
                self._retiring = None
            # spawn, not fork: this runs beside the web server's threads.
            self._pool = ProcessPoolExecutor(max_workers=self.max_workers,
                                             mp_context=multiprocessing.get_context("spawn"))  # fmt: skip
        state.remaining = len(jobs)
        for name, fn, arg in jobs:
            future = self._pool.submit(fn, arg)
            future.add_done_callback(functools.partial(self._job_done, state, name))
        return state

    def _job_done(self, state: _PlanState, name: str, future: Future) -> None:
        with self._lock:
            try:
                state.rows[name] = future.result()
            except Exception as exc:
                state.error = state.error or f"{type(exc).__name__}: {exc}"
            state.remaining -= 1
            if state.remaining > 0:
                return
            state.done.set()
            if self.num_running == 0 and self._pool is not None and not self._closed:
                if self.idle_s > 0:  # idle: the workers wait for the next plan a while
                    self._idle_timer = threading.Timer(self.idle_s, self._retire_if_idle, (self._pool,))
                    self._idle_timer.daemon = True
                    self._idle_timer.start()
                else:
                    self._retire(self._pool)

    def _retire_if_idle(self, pool: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool and self.num_running == 0:
                self._retire(pool)

    def _retire(self, pool: ProcessPoolExecutor) -> None:
        """Gives the worker processes back; the next plan starts a new pool. Never on the pool's
        own management thread, where `_job_done` runs: shutdown joins it. Under the lock."""
        self._retiring = threading.Thread(target=pool.shutdown, name="lab-plan-pool-shutdown")
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
            if self._idle_timer is not None:
                self._idle_timer.cancel()
                self._idle_timer = None
        if pool is not None:
            for process in list((pool._processes or {}).values()):  # noqa: SLF001
                process.terminate()
            pool.shutdown(wait=False, cancel_futures=True)


def capacity(p: Params, planner: CapacityPlanner) -> dict[str, Any] | JSONResponse:
    from servelab.bench.planner import DEFAULT_SLO_TTFT_S

    s = setup_from(p)
    tpot_ms = p.float("tpot_ms", 50.0, **bounds("capacity", "tpot_ms"))
    ttft_ms = p.float("ttft_ms", DEFAULT_SLO_TTFT_S * 1e3, **bounds("capacity", "ttft_ms"))
    prompt_len = p.int("prompt_len", 1024, **bounds("capacity", "prompt_len"))
    output_len = p.int("output_len", 256, **bounds("capacity", "output_len"))
    s.roofline()._check_context(prompt_len + output_len, "prompt_len + output_len")  # noqa: SLF001
    key = PlanKey(s.model.name, s.weight_dtype, s.kv_dtype, s.tp, s.engine_profile, tpot_ms, ttft_ms, prompt_len,
                  output_len)  # fmt: skip
    state = planner.plan_for(key, first=s.hardware.name)
    done, rows = planner.snapshot(state)
    if not done:
        partial = result(s, key, rows)
        partial.update(
            status="running",
            done=len(rows),
            total=state.total,
            message=f"planning: {len(rows)} of {state.total} accelerators simulated; the others show the "
            f"roofline's upper bound until their search ends",
        )
        return JSONResponse(partial, status_code=202)
    if state.error:
        raise ServelabError(f"the capacity plan failed: {state.error}")
    return result(s, key, rows)


def most_running(s: Any, hardware: Any, prompt_len: int, output_len: int, max_num_seqs: int | None = None) -> int:
    """What runs at once on `hardware`, as `servelab plan`'s ceiling counts it (`running_walls`):
    requests of these lengths whose KV pages fit at full length in the engine's pool, at most
    `max_num_seqs` (default: the engine profile's) and what its token budget keeps running; 0
    where the weights, or they and one such request, do not fit."""
    from servelab.bench.planner import running_walls
    from servelab.cost import MemoryPlan
    from servelab.sim.runner import engine_sim_config, scheduler_config
    from servelab.workload.spec import RequestSpec

    overrides = None if max_num_seqs is None else {"max_num_seqs": max_num_seqs}
    try:
        config = engine_sim_config(s.engine_profile, scheduler=overrides, model=s.model, hardware=hardware, tp=s.tp,
                                   weight_dtype=s.weight_dtype, kv_cache_dtype=s.kv_dtype)  # fmt: skip
        # As plan_one: one request at full length must fit beside the weights.
        MemoryPlan(s.model, hardware, s.weight_dtype, s.kv_dtype, s.tp, config.memory_fraction).require_fit(
            1, prompt_len + output_len
        )
        sched = scheduler_config(config)
    except ServelabError:
        return 0
    return min(running_walls(sched, [RequestSpec(0, None, prompt_len, output_len)]).values())


def memory_cap_argv(s: Any, hardware: list[str], prompt_len: int, output_len: int,
                    max_num_seqs: int | None = None) -> list[str]:  # fmt: skip
    """`--max-concurrency N` where the lab's memory budget per simulation caps a capacity level
    below what runs at once on one of `hardware` (long requests), else nothing."""
    cap = max_plan_concurrency(prompt_len, output_len)
    running = max(most_running(s, HARDWARE[hw], prompt_len, output_len, max_num_seqs) for hw in hardware)
    return ["--max-concurrency", str(cap)] if cap < running else []


def upper_bound(s: Any, hardware: Any, key: PlanKey) -> dict[str, Any]:
    """The roofline's instant upper bound for one accelerator, shown until its simulation ends.
    Users: no more than run at once (the requests whose KV fits at full length at the engine's
    memory share, the lab's sequence cap and memory budget) nor than whose decode step at the
    shortest context (the prompt alone) meets the TPOT target; none when one prefill alone misses
    the TTFT target. Tokens/s: those users' decode steps alone, as if no prefill ever took a step."""
    from servelab.lab.roofline_lessons import batch_at_tpot

    wall = min(
        most_running(s, hardware, key.prompt_len, key.output_len, MAX_NUM_SEQS),
        max_plan_concurrency(key.prompt_len, key.output_len),
    )
    if wall <= 0:
        return {"fits": False, "users": 0, "tokens_per_s_per_gpu": 0.0}
    try:
        rl = s.roofline(hardware=hardware)
    except ServelabError:
        return {"fits": False, "users": 0, "tokens_per_s_per_gpu": 0.0}
    users = 0
    if rl.prefill(key.prompt_len).time_s <= key.ttft_ms / 1e3:
        users = batch_at_tpot(rl, key.prompt_len, wall, key.tpot_ms / 1e3)
    tps = users / rl.decode(users, key.prompt_len).time_s / s.tp if users else 0.0
    return {"fits": wall > 0, "users": users, "tokens_per_s_per_gpu": tps}


# Which limit set a bar, in the lesson's words (binding.Limit's ids; the KV cache is "memory").
BIND_LABEL = {
    "memory": "memory (KV cache full)",
    "ttft": "the TTFT target",
    "tpot": "the TPOT target",
    "max-num-seqs": f"the lab's {MAX_NUM_SEQS:,}-sequence cap",
    "slo": "failed requests",
    "max-num-batched-tokens": "the engine's token budget per step (prompts share it with decodes)",
    "search-maximum": "the lab's memory budget per simulation (--max-concurrency)",
}


def _binds(row: Any) -> str | None:
    if row.binding is None:
        return None
    return "memory" if row.binding.limit == "kv-cache" else str(row.binding.limit)


def result(s: Any, key: PlanKey, rows_by_hw: dict[str, Any]) -> dict[str, Any]:
    from servelab.bench.planner import cost_per_million_tokens

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
            "ttft_ms",
            "tpot_ms",
            "price_per_gpu_hour",
            "binds",
            "binding",
            "config",
            "reason",
            "status",
            "command",
        )
    }
    # The catalog's order, simulated or not: a bar never moves when its simulation lands.
    for name, hw in HARDWARE.items():
        plan["hardware"].append(name)
        plan["tp"].append(s.tp)
        plan["price_per_gpu_hour"].append(hw.price_per_hour_usd)
        plan["command"].append(plan_command(key, name))
        r = rows_by_hw.get(name)
        if r is None:
            bound = upper_bound(s, hw, key)
            tps = bound["tokens_per_s_per_gpu"] or None
            plan["status"].append("estimate")
            plan["fits"].append(bound["fits"])
            plan["meets_slo"].append(None)  # not known until simulated
            plan["tokens_per_s_per_gpu"].append(tps or 0.0)
            plan["usd_per_million_tokens"].append(
                None
                if not tps or hw.price_per_hour_usd is None
                else cost_per_million_tokens(hw.price_per_hour_usd, tps)
            )
            plan["concurrency"].append(bound["users"] or None)
            plan["ttft_ms"].append(None)
            plan["tpot_ms"].append(None)
            plan["binds"].append(None)
            plan["binding"].append(None)
            plan["config"].append(
                f"≤ {bound['users']:,} users: upper bound from the roofline, simulating"
                if bound["fits"]
                else "does not fit"
            )
            plan["reason"].append("upper bound from the roofline; simulating")
            continue
        binds = _binds(r)
        plan["status"].append("simulated")
        plan["fits"].append(r.fits)
        plan["meets_slo"].append(r.meets_slo)
        plan["tokens_per_s_per_gpu"].append(r.tokens_per_s_per_device or 0.0)
        plan["usd_per_million_tokens"].append(r.cost_per_million_output_tokens)
        plan["concurrency"].append(r.capacity_concurrency)
        plan["ttft_ms"].append(None if r.ttft_s is None else r.ttft_s * 1e3)
        plan["tpot_ms"].append(None if r.tpot_s is None else r.tpot_s * 1e3)
        plan["binds"].append(binds)
        plan["binding"].append(None if r.binding is None else r.binding.detail)
        if r.meets_slo:
            plan["config"].append(f"{r.capacity_concurrency:,.0f} users · {BIND_LABEL.get(binds or '', binds)}")
        else:
            plan["config"].append(
                "does not fit" if not r.fits else "ran past the time limit" if r.timed_out else "misses the targets"
            )
        plan["reason"].append(r.reason or None)

    simulated = [rows_by_hw[name] for name in HARDWARE if name in rows_by_hw]
    pending = len(simulated) < len(HARDWARE)
    serving = [r for r in simulated if r.meets_slo]
    targets = f"p{PLAN_PERCENTILE} TTFT ≤ {fmt(key.ttft_ms)} ms and TPOT ≤ {fmt(key.tpot_ms)} ms"
    warning = None
    if simulated and not pending and not serving:
        reasons = "; ".join(f"{r.hardware}: {r.reason}" for r in simulated)
        warning = (
            f"no accelerator serves {s.model.name} within {targets}: {reasons}; loosen the targets, shorten the "
            f"requests, use smaller dtypes or raise TP"
        )
    if serving:
        cheapest = min(serving, key=lambda r: r.cost_per_million_output_tokens or float("inf"))
        fastest = max(serving, key=lambda r: r.tokens_per_s_per_device or 0.0)
        limits = ", ".join(f"{r.hardware} by {BIND_LABEL.get(_binds(r) or '', _binds(r))}" for r in serving)
        notice = (
            f"{fastest.hardware} serves the most tokens/s per GPU ({fmt(fastest.tokens_per_s_per_device)}), "
            f"but {cheapest.hardware} is cheapest at ${fmt(cheapest.cost_per_million_output_tokens or 0.0)} per "
            f"million output tokens; capacity is tokens/s per GPU at {targets}, not QPS. What bound each: {limits}."
        )
        if pending:
            notice += " The pale bars are the roofline's upper bound, until their simulation ends."
    elif pending:
        notice = "simulating; the pale bars are the roofline's upper bound until their simulation ends."
    else:
        notice = "nothing meets the targets: loosen them, shorten the requests, or raise TP."
    return {
        "status": "running" if pending else "done",
        "config": {
            **s.to_dict(),
            "tpot_ms": key.tpot_ms,
            "ttft_ms": key.ttft_ms,
            "prompt_len": key.prompt_len,
            "output_len": key.output_len,
            "percentile": PLAN_PERCENTILE,
            "max_num_seqs": MAX_NUM_SEQS,
        },
        "plan": plan,
        "warning": warning,
        "stats": [
            stat("targets", targets),
            stat(
                "accelerators that meet them",
                f"{len(serving)} of the {len(simulated)} simulated so far"
                if pending
                else f"{len(serving)} of {len(simulated)}",
            ),
            stat("users", "concurrent requests that meet both targets, up to what runs at once"),
        ],
        "notice": notice,
    }
