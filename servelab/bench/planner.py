"""Capacity planning on the simulator: for each (accelerator, TP) that fits, the capacity search of
`servelab.bench.capacity` run against `servelab.sim`, turned into tokens/s per device, devices for
a target request rate and dollars per million output tokens.

Each configuration is independent, so they run in parallel worker processes; a worker gets only
plain data (names, numbers, strings) and returns a plain dict.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict

from servelab.bench.binding import Binding, Ceiling, Observed, binding_limit, observe
from servelab.bench.capacity import (
    CapacityResult,
    CertainFailure,
    Level,
    LevelRun,
    find_capacity,
    slo_check,
    targets_text,
)
from servelab.bench.pareto import SweptLevel
from servelab.core.config import SchedulerConfig
from servelab.errors import DoesNotFit, InvalidArgument, RequestTooLong
from servelab.metrics import SLO
from servelab.spec.dtypes import DEFAULT_DTYPE, kv_dtype_alias
from servelab.units import parse_str_list
from servelab.workload import WorkloadSpec

if TYPE_CHECKING:
    from servelab.core.config import ResolvedSchedulerConfig
    from servelab.cost.profile import ProfileStepCost
    from servelab.cost.speculative import Acceptance
    from servelab.sim import SimResult
    from servelab.spec.hardware import HardwareSpec
    from servelab.spec.model import ModelSpec
    from servelab.workload.spec import RequestSpec

# Measured requests per client in a capacity level, and the fewest a level measures.
REQUESTS_PER_CLIENT = 4
MIN_LEVEL_REQUESTS = 100
# The capacity search's ceiling on concurrent requests: each level simulates that many in flight
# (and several times as many requests), so past it a plan only exhausts memory.
MAX_CONCURRENCY = 100_000
# Levels a frontier sweep adds past the search's first failing level: each doubles the load, so
# three reach 8x it; a ceiling (what runs at once) ends them sooner.
SWEEP_PAST_FAILURE = 3
# The TTFT target when none is given: MLPerf Inference's server-scenario limit for Llama 2 70B and
# Llama 3.1 8B. A 32k-token prefill of Llama 3.1 8B alone fits in it on an H100; a client that
# waits a whole request for a slot (10 s at 256 tokens x 40 ms) does not.
DEFAULT_SLO_TTFT_S = 2.0


@dataclass(slots=True)
class PlanRow:
    hardware: str
    tp: int
    fits: bool
    reason: str = ""  # why it does not fit, why no load meets the SLO, or that the search ran out of time
    timed_out: bool = False  # the search passed the job's time_limit_s: no answer
    capacity_concurrency: float | None = None
    tokens_per_s_per_device: float | None = None
    requests_per_s: float | None = None  # per replica (tp devices) at the capacity
    ttft_s: float | None = None  # percentile TTFT at the capacity
    tpot_s: float | None = None  # percentile TPOT at the capacity
    price_per_device_hour: float | None = None
    devices_needed: int | None = None  # for the target request rate
    cost_per_million_output_tokens: float | None = None
    capacity: dict[str, Any] | None = None  # the full CapacityResult.to_dict()
    binding: Binding | None = None  # which limit set the capacity (TTFT, TPOT, --max-num-seqs, KV cache, ...)
    max_running: int | None = None  # the most sequences that run at once: --max-num-seqs or the KV cache
    frontier: list[SweptLevel] = field(default_factory=list)  # every simulated concurrency, in load order
    extrapolation: list[str] = field(default_factory=list)  # why its price rests on no measured kernel
    cpu_s: float = 0.0  # CPU time plan_one took (a measurement of the planner, not of the plan: not in to_dict)

    @property
    def meets_slo(self) -> bool:
        return self.fits and self.tokens_per_s_per_device is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware,
            "tp": self.tp,
            "fits": self.fits,
            "reason": self.reason or None,
            "timed_out": self.timed_out,
            "capacity_concurrency": self.capacity_concurrency,
            "output_tokens_per_s_per_device": self.tokens_per_s_per_device,
            "requests_per_s_per_replica": self.requests_per_s,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "price_per_device_hour": self.price_per_device_hour,
            "devices_needed": self.devices_needed,
            "cost_per_million_output_tokens": self.cost_per_million_output_tokens,
            "binding_limit": None if self.binding is None else self.binding.to_dict(),
            "max_running": self.max_running,
            "capacity": self.capacity,
            "extrapolation": self.extrapolation,
        }


@kv_dtype_alias  # the old name of kv_cache_dtype
@dataclass(frozen=True, slots=True)
class PlanJob:
    """Everything one worker needs, as plain picklable data."""

    model: str  # what --model names (spec.model.resolve_model)
    hardware: str
    tp: int
    slo: SLO
    percentile: int
    workload: dict[str, Any]  # WorkloadSpec fields, without the load
    weight_dtype: str = DEFAULT_DTYPE
    kv_cache_dtype: str = DEFAULT_DTYPE
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # one replica's
    max_concurrency: int | None = None
    target_rate: float | None = None
    price_per_device_hour: float | None = None
    profile: str | None = None  # a `servelab calibrate` profile's path: it prices the steps
    # A serving engine's defaults (sim/engine_profiles.py) with `scheduler_overrides` winning, in
    # place of `scheduler`; None: `scheduler` as given.
    engine_profile: str | None = None
    scheduler_overrides: dict[str, Any] | None = None
    # Speculative decoding: vLLM's --speculative-config JSON and the acceptance model (cost/speculative.py).
    speculative: str | None = None
    spec_acceptance: Acceptance | None = None
    requests_per_client: int = REQUESTS_PER_CLIENT  # measured requests per level: this many per client
    tolerance: float | None = None  # the search's tolerance (default: find_capacity's)
    # Past the first failing level, double on to what runs at once (at most SWEEP_PAST_FAILURE
    # levels), so the frontier chart's curve reaches the high-throughput end.
    sweep_to_ceiling: bool = False
    # Stop a level as soon as it is certain to fail (`capacity.CertainFailure`); the answers are
    # the same either way. Off under `sweep_to_ceiling`: the frontier wants every level whole.
    early_stop: bool = True
    # Wall seconds the search may take (the lab's, for a server's shared workers); past them the
    # row answers nothing and says so. None: no limit (the CLI).
    time_limit_s: float | None = None


def level_requests(concurrency: int, requests_per_client: int = REQUESTS_PER_CLIENT, fixed: int | None = None) -> int:
    """The requests a capacity level at `concurrency` simulates: its measured ones (`fixed`, else
    `requests_per_client` per client and at least MIN_LEVEL_REQUESTS) after a first wave of one
    per client that is not measured."""
    return (fixed or max(MIN_LEVEL_REQUESTS, requests_per_client * concurrency)) + concurrency


def cost_per_million_tokens(price_per_device_hour: float, tokens_per_s_per_device: float) -> float:
    return price_per_device_hour / (tokens_per_s_per_device * 3600.0) * 1e6


class _Deployment(TypedDict):
    """What a plan row deploys: SimConfig's fields for the model on its hardware."""

    model: ModelSpec
    hardware: HardwareSpec
    tp: int
    weight_dtype: str
    kv_cache_dtype: str
    slo: SLO | None
    cost_model: ProfileStepCost | None
    speculative: str | None
    spec_acceptance: Acceptance | None


def _profile_cost(path: str, tp: int) -> ProfileStepCost:
    from servelab.cost.profile import load_profile, profile_step_cost

    return profile_step_cost(load_profile(path), tp)  # no model check: `plan` made it once


def plan_one(job: PlanJob) -> PlanRow:
    """Memory check, then the capacity search on the simulator. Never raises for a configuration
    that cannot serve: the row says why."""
    start_cpu_s = time.process_time()
    row = _plan_one(job)
    row.cpu_s = time.process_time() - start_cpu_s
    return row


def _plan_one(job: PlanJob) -> PlanRow:
    from servelab.cost.memory import MemoryPlan
    from servelab.sim import SimConfig, simulate
    from servelab.sim.runner import build_cost_model, engine_sim_config, scheduler_config
    from servelab.spec.hardware import get_hardware
    from servelab.spec.model import resolve_model

    model, hardware = resolve_model(job.model), get_hardware(job.hardware)
    row = PlanRow(hardware=hardware.name, tp=job.tp, fits=False, price_per_device_hour=job.price_per_device_hour)
    deployment: _Deployment = {
        "model": model,
        "hardware": hardware,
        "tp": job.tp,
        "weight_dtype": job.weight_dtype,
        "kv_cache_dtype": job.kv_cache_dtype,
        "slo": job.slo,
        "cost_model": None if job.profile is None else _profile_cost(job.profile, job.tp),
        "speculative": job.speculative,
        "spec_acceptance": job.spec_acceptance,
    }
    if job.engine_profile is None:
        config = SimConfig(scheduler=job.scheduler, **deployment)
    else:
        config = engine_sim_config(job.engine_profile, scheduler=job.scheduler_overrides, **deployment)
    max_num_seqs = config.scheduler.max_num_seqs
    try:
        memory = MemoryPlan(model, hardware, job.weight_dtype, job.kv_cache_dtype, job.tp, config.memory_fraction)
        memory.require_weights_fit()
        base = WorkloadSpec(**job.workload)
        requests = base.generate()
        longest = max(s.prompt_tokens + s.output_tokens for s in requests)
        memory.require_fit(1, longest)
        sched = scheduler_config(config)
    except (DoesNotFit, InvalidArgument) as exc:
        row.reason = exc.message
        return row
    row.fits = True
    row.extrapolation = list(config.extrapolation)
    fixed_n = job.workload.get("num_requests")
    observed: dict[int, Observed] = {}
    # The lowest level stopped early, paused where it stopped: the search's first failing level
    # when it ends, whose whole run the row reports. A level stops only when it fails, and the
    # search only probes below its lowest failure, so one is kept at a time.
    paused: dict[int, Callable[[], SimResult]] = {}

    deadline = None if job.time_limit_s is None else time.monotonic() + job.time_limit_s

    def check() -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise _PastTimeLimit

    def measure(concurrency: float, early_stop: bool = False) -> LevelRun:
        c = int(concurrency)
        n = level_requests(c, job.requests_per_client, fixed_n) - c
        # All c clients send their first request at t = 0, so that wave's prompts queue behind one
        # another: a start-up burst no sustained load sees, yet with 4 requests per client (the default) a
        # quarter of the samples, enough to decide a p90 TTFT on its own. Like `servelab bench
        # --warmup`, the first wave runs (it fills the batch) but is not measured.
        # `simulate` leaves a closed loop's wave out of its steady-state summary by default.
        workload = WorkloadSpec(**{**job.workload, "num_requests": n + c, "concurrency": c, "rate": None})
        stop = CertainFailure(job.slo, job.percentile, n, skip_below=c) if early_stop else None
        result = simulate(config, workload, stop=stop, check=check)
        observed[c] = observe(result)
        if result.resume is not None:
            paused.clear()
            paused[c] = result.resume
        return LevelRun(result.steady_or_whole, result.stopped_early)

    def measure_whole(concurrency: float) -> LevelRun:
        """A level's whole run: the paused one resumed, else run afresh."""
        c = int(concurrency)
        resume = paused.pop(c, None)
        if resume is None:
            return measure(c)
        result = resume()
        observed[c] = observe(result)
        return LevelRun(result.steady_or_whole)

    # Clients beyond what runs at once only queue: they add TTFT, no throughput, and are not users.
    # So the search stops at the most sequences that can run, measured there exactly. Users who
    # think are in flight only E2E / (E2E + think) of the time (Little's law), so as many more of
    # them fit; E2E is at least one user's alone.
    walls = running_walls(sched, requests)
    ceiling = min(walls, key=walls.__getitem__)  # the first of equals
    row.max_running = walls[ceiling]
    try:
        max_load = row.max_running * _think_factor(config, job.workload)
    except (RequestTooLong, DoesNotFit) as exc:
        row.fits, row.reason = False, exc.message
        return row
    for cap in (job.max_concurrency, MAX_CONCURRENCY, fixed_n):  # fixed_n: more clients than requests changes nothing
        if cap is not None and cap < max_load:
            max_load, ceiling = cap, "search-maximum"
    early_stop = job.early_stop and not job.sweep_to_ceiling
    cost = build_cost_model(config)
    # --plot's frontier draws levels that miss the targets too.
    out_of_reach = None if job.sweep_to_ceiling else _out_of_reach(config, cost, requests, sched, job.slo)
    if out_of_reach is not None:
        row.reason = f"no load meets {targets_text(job.slo, job.percentile)}: {out_of_reach}"
        return row
    # --plot's frontier wants every doubling from 1.
    start = None if job.sweep_to_ceiling else _steady_estimate(
        cost, requests, int(max_load), sched.max_num_batched_tokens, job.slo)  # fmt: skip
    try:
        result = find_capacity(
            measure=functools.partial(measure, early_stop=early_stop),
            slo=job.slo,
            percentile=job.percentile,
            mode="concurrency",
            max_load=max_load,
            tolerance=job.tolerance,
            # From the estimate in steps of 10% while its margins are within 20% of the targets.
            start=start,
            first_step=2.0 if start is None else 1.1,
        )
        if result.first_failing is not None and result.first_failing.stopped_early:
            _measure_whole(result, measure_whole)
        paused.clear()
        past = _sweep_past_failure(result, max_load) if job.sweep_to_ceiling else []
        extra = []
        for c in past:
            summary = measure(c).summary
            extra.append(Level(c, summary, *slo_check(summary, job.slo, job.percentile)))
    except (RequestTooLong, DoesNotFit) as exc:
        row.fits = False
        row.reason = exc.message
        return row
    except _PastTimeLimit:
        row.timed_out = True
        row.reason = (
            f"the search ran past its time limit of {job.time_limit_s:g} s; shorter outputs or tighter targets "
            f"need fewer simulated requests"
        )
        return row
    fill_row(row, result, job, extra)
    row.binding = binding_limit(result, observed, max_num_seqs=max_num_seqs, request_tokens=longest, ceiling=ceiling,
                                budget_tokens=sched.max_num_batched_tokens,
                                budget_running=walls["max-num-batched-tokens"])  # fmt: skip
    return row


def running_walls(sched: ResolvedSchedulerConfig, requests: Sequence[RequestSpec]) -> dict[Ceiling, int]:
    """The most sequences of these requests that run at once on one replica, by the limit that sets
    it: the scheduler's cap; the requests whose KV fits at once at full length (the mean request,
    with its pages at full length in every KV group, a sliding-window group's only its window's);
    and what the token budget keeps running (the mean request's prompt past its shared prefix)."""
    from servelab.core.kv_groups import pages_for
    from servelab.sim.runner import kv_slots_needed

    blocks_per_request = statistics.fmean(
        pages_for(sched.kv_group_windows, kv_slots_needed(r.prompt_tokens, r.output_tokens), sched.block_size)
        for r in requests
    )
    return {
        "max-num-seqs": sched.max_num_seqs,
        "kv-cache": max(1, int(sched.num_blocks // blocks_per_request)),
        "max-num-batched-tokens": sched.budget_running(
            statistics.fmean(r.prompt_tokens - min(r.prefix_tokens, r.prompt_tokens) for r in requests),
            statistics.fmean(r.output_tokens for r in requests),
        ),
    }


def alone_bounds(cost, requests: list, block_size: int) -> tuple[float, float | None]:  # noqa: ANN001
    """Lower bounds, from the cost model, on every request's (TTFT, TPOT) at any load: its prompt's
    uncached tokens in one step of their own (chunks or company only add to it: a step's time is
    subadditive in its tokens), and one decode step of it alone at its prompt's length (None when
    no request decodes)."""
    ttft_s = min(
        cost.step_time_s([(max(1, r.prompt_tokens - r.prefix_tokens // block_size * block_size), r.prompt_tokens)])
        for r in requests
    )
    decoding = [r.prompt_tokens for r in requests if r.output_tokens > 1]
    return ttft_s, min(cost.step_time_s([(1, p + 1)]) for p in decoding) if decoding else None


def _out_of_reach(config, cost, requests: list, sched: SchedulerConfig, slo: SLO) -> str | None:  # noqa: ANN001
    """Why no load can meet the targets where `alone_bounds` proves it (over a target: every
    level's percentile is too, and simulating one would only confirm it), else None. Only for
    requests of one length, whose bounds hold for every level's requests as for the sample's, on
    the roofline cost model (subadditive), without speculation (several tokens a step)."""
    one_length = len({(r.prompt_tokens, r.output_tokens, r.prefix_tokens) for r in requests}) == 1
    if not one_length or config.cost_model is not None or config.speculative is not None:
        return None
    ttft_s, tpot_s = alone_bounds(cost, requests, sched.block_size)
    if slo.ttft_s is not None and ttft_s > slo.ttft_s:
        return f"one request alone takes {ttft_s * 1e3:,.1f} ms to prefill its prompt, over the TTFT target"
    if slo.tpot_s is not None and tpot_s is not None and tpot_s > slo.tpot_s:
        return f"a decode step of one sequence alone takes {tpot_s * 1e3:,.2f} ms, over the TPOT target"
    return None


def _steady_estimate(cost, requests: list, max_load: int, budget: int, slo: SLO) -> int | None:  # noqa: ANN001
    """Where the capacity search starts: the most clients, up to `max_load`, whose steady step the
    cost model puts within the TPOT target: their decodes at the mean request's mid-decode context
    beside the prompt tokens they send a step (clients x prompt / output, up to the token budget).
    Where TPOT binds, the boundary is usually within 10% of it; where TTFT or a ceiling binds, it
    is an overestimate the search halves down from. None without a TPOT target (the search
    doubles from 1). Which levels run hangs on it, and the answer only within the search's
    tolerance while failures are monotone in load."""
    if slo.tpot_s is None:
        return None
    prompt = max(1, round(statistics.fmean(r.prompt_tokens for r in requests)))
    output = max(1, round(statistics.fmean(r.output_tokens for r in requests)))
    context = prompt + output // 2

    def within(clients: int) -> bool:
        chunk = min(max(0, budget - clients), round(clients * prompt / output))
        shape = [(1, context)] * clients + ([(chunk, prompt)] if chunk else [])
        return cost.step_time_s(shape) <= slo.tpot_s

    lo, hi = 1, max_load + 1  # within(lo) is not checked: one client is the least the search can start at
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    return lo


class _PastTimeLimit(Exception):
    """Raised inside a simulation when the search passes its job's time_limit_s."""


def _measure_whole(result: CapacityResult, measure: Callable[[float], LevelRun]) -> None:
    """Run the search's first failing level, stopped early, on to its end: the reason it failed,
    the limit that binds and the numbers beside them are the whole level's, as if it had never
    stopped. Its pass or fail is what the early stop decided (the rule is exact)."""
    first = result.first_failing
    assert first is not None
    whole = measure(first.load).summary
    passed, reason = slo_check(whole, result.slo, result.percentile)
    assert not passed, f"concurrency {first.load:g} stopped early as failing, yet passes when run whole"
    level = Level(first.load, whole, passed, reason)
    result.levels[result.levels.index(first)] = level
    result.first_failing = level


def _think_factor(config, workload: dict[str, Any]) -> int:  # noqa: ANN001
    """1 + think / E2E of one user alone (a few requests): how many users per request in flight."""
    from servelab.sim import simulate

    think_s = workload.get("think_time_s") or 0.0
    if not think_s:
        return 1
    alone = WorkloadSpec(**{**workload, "num_requests": 8, "concurrency": 1, "rate": None, "think_time_s": 0.0})
    e2e_s = simulate(config, alone, warmup_requests=0).summary.e2e_s.mean
    return 1 + math.ceil(think_s / e2e_s) if e2e_s else 1


def _sweep_past_failure(result: CapacityResult, max_load: float) -> list[int]:
    """The loads a frontier sweep adds: doubling from the first failing level, up to `max_load`."""
    if result.first_failing is None:
        return []
    measured = {int(lv.load) for lv in result.levels}
    loads: list[int] = []
    load = int(max(lv.load for lv in result.levels))
    while len(loads) < SWEEP_PAST_FAILURE and load < max_load:
        load = int(min(load * 2, max_load))
        if load not in measured:
            loads.append(load)
    return loads


def fill_row(row: PlanRow, result: CapacityResult, job: PlanJob, extra: list[Level] | None = None) -> None:
    """The row from the search's result; `extra` are levels swept past it for the frontier only."""
    row.capacity = result.to_dict()
    key = f"p{job.percentile}"
    without_tpot = dataclasses.replace(job.slo, tpot_s=None)
    for level in sorted([*result.levels, *(extra or [])], key=lambda lv: lv.load):
        if level.stopped_early:
            continue  # a part of a level: no steady-state point to draw
        s = level.summary
        serves = slo_check(s, without_tpot, job.percentile)[0]
        row.frontier.append(
            SweptLevel(
                concurrency=int(level.load),
                tokens_per_s_per_device=s.output_throughput_per_device,
                tpot_s=getattr(s.tpot_s, key),
                ttft_s=getattr(s.ttft_s, key),
                passed=level.passed,
                serves=serves,
            )
        )
    if result.best is None:
        row.reason = result.describe()
        return
    s = result.best.summary
    row.capacity_concurrency = result.best.load
    row.tokens_per_s_per_device = s.output_throughput_per_device
    row.requests_per_s = s.request_throughput
    row.ttft_s = getattr(s.ttft_s, key)
    row.tpot_s = getattr(s.tpot_s, key)
    if job.target_rate is not None and s.request_throughput > 0:
        row.devices_needed = math.ceil(job.target_rate / s.request_throughput) * job.tp
    if job.price_per_device_hour is not None and s.output_throughput_per_device > 0:
        row.cost_per_million_output_tokens = cost_per_million_tokens(
            job.price_per_device_hour, s.output_throughput_per_device
        )
    if result.reached_max_load:
        row.reason = f"still meets the targets at concurrency {result.best.load:g} (the search's maximum)"


def rank(rows: list[PlanRow]) -> list[PlanRow]:
    """Serving rows first (cheapest per token, else most tokens/s per device), then rows that
    fit but meet no SLO, then rows that do not fit."""

    def key(row: PlanRow) -> tuple:
        if row.meets_slo:
            cost = row.cost_per_million_output_tokens  # priced rows first: no price is not free
            return (0, cost is None, cost or 0.0, -(row.tokens_per_s_per_device or 0.0))
        return (1 if row.fits else 2, False, 0.0, 0.0)

    return sorted(rows, key=key)


def run_plan(jobs: list[PlanJob], workers: int | None = None) -> list[PlanRow]:
    """All jobs, in parallel processes when there is more than one."""
    if not jobs:
        return []
    if len(jobs) == 1 or workers == 1:
        return [plan_one(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(plan_one, jobs))


def parse_prices(text: str | None, hardware: list[str]) -> dict[str, float]:
    """'h100-sxm=2.5,h200=3.4' -> {...}; the catalog's price fills in any accelerator not named."""
    from servelab.spec.hardware import get_hardware

    prices: dict[str, float] = {}
    specs = [get_hardware(name) for name in hardware]
    for spec in specs:
        if spec.price_per_hour_usd is not None:
            prices[spec.name] = spec.price_per_hour_usd
    if text:
        for item in parse_str_list(text, name="--price"):
            name, sep, value = item.partition("=")
            if not sep:
                raise InvalidArgument(f"--price: expected NAME=DOLLARS_PER_DEVICE_HOUR, got {item!r}")
            try:
                price = float(value)
            except ValueError:
                raise InvalidArgument(f"--price: {value!r} is not a number (in {item!r})") from None
            if not price > 0:
                raise InvalidArgument(f"--price: must be > 0 $/device-hour, got {item!r}")
            # a hardware file's name (my-box) as well as its path or a catalog name
            name = name.strip()
            prices[name if name in {s.name for s in specs} else get_hardware(name).name] = price
    return prices


__all__ = [
    "PlanJob",
    "PlanRow",
    "cost_per_million_tokens",
    "level_requests",
    "parse_prices",
    "plan_one",
    "rank",
    "run_plan",
]
