"""Lessons answered by the simulator (the engine's own scheduler on the roofline): TTFT and TPOT
as SLOs (3), chunked prefill (4), disaggregated serving (5).

Each runs a small workload (a few hundred requests at most) so that it answers in about a
second, under the lab's Budget (servelab.lab.simulations: a deadline, memory per run, a cache
bounded in bytes); results are cached per parameter set, and the simulation is deterministic
(seed 0), so a cached answer is the answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, cast

import numpy as np

from servelab.errors import DoesNotFit, InvalidArgument, ServelabError
from servelab.lab.common import Setup, fmt, setup_from, stat
from servelab.lab.limits import LIMITS, LabBusy, bounds, longest_tokens
from servelab.lab.params import Params
from servelab.lab.simulations import Budget, Simulations, result_bytes
from servelab.metrics import SLO, RequestRecord, Summary, steady_state_summary
from servelab.sim import SimConfig, SimResult, simulate
from servelab.sim.runner import engine_sim_config
from servelab.workload import RequestSpec, WorkloadSpec

if TYPE_CHECKING:
    from servelab.lab.capacity_lesson import CapacityPlanner

# Every rate of the SLO lesson runs for a duration, not a request count, so high rates are measured
# as long as low ones: SLO_STEADY_S of arrivals after the warm-up (long enough for a queue to build
# above saturation), and at least SLO_MIN_REQUESTS requests for the percentiles at low rates.
SLO_STEADY_S = 20.0
SLO_MIN_REQUESTS = 300
# Swept rates at or below LIGHT_LOAD of the saturation estimate keep no queue: their latencies sit
# near the unloaded floor with a narrow spread, and the system is steady once the warm-up has
# lasted a request's lifetime. Their floor is SLO_LIGHT_MIN_REQUESTS, raised until the warm-up
# spans a lifetime. At low rates the floor is nearly all of a run's cost (small batches: a
# simulated step per few tokens); docs/lab.md has the figures.
LIGHT_LOAD = 0.6
SLO_LIGHT_MIN_REQUESTS = 100
WARMUP_FRACTION = 0.2  # the first fifth of the arrivals fill the system from empty: not measured
SWEEP_FRACTIONS = (0.3, 0.6, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5)  # of the saturation estimate
SATURATED_BELOW = 0.9  # achieved under this share of the offered rate: the system is not keeping up
DISAGG_NUM_REQUESTS = 100
CDF_POINTS = 201


def _sim_config(s: Setup, scheduler: dict[str, Any] | None = None, **kwargs: Any) -> SimConfig:
    """The setup's deployment as its engine profile runs it; `scheduler`: knobs the lesson sets."""
    return engine_sim_config(
        s.engine_profile,
        scheduler=scheduler,
        model=s.model,
        hardware=s.hardware,
        tp=s.tp,
        weight_dtype=s.weight_dtype,
        kv_cache_dtype=s.kv_dtype,
        **kwargs,
    )


def cdf(values: list[float] | np.ndarray, scale: float = 1e3) -> dict[str, Any]:
    """Empirical CDF in ms: every sample when there are few, else CDF_POINTS quantiles."""
    arr = np.sort(np.asarray(values, dtype=np.float64)) * scale
    if arr.size == 0:
        return {"x": [], "cdf": [], "count": 0}
    if arr.size <= CDF_POINTS:
        return {"x": arr.tolist(), "cdf": (np.arange(1, arr.size + 1) / arr.size).tolist(), "count": int(arr.size)}
    q = np.linspace(0.0, 1.0, CDF_POINTS)
    return {"x": np.quantile(arr, q).tolist(), "cdf": q.tolist(), "count": int(arr.size)}


def _percentiles_ms(dist: Any) -> dict[str, float]:
    return {k: getattr(dist, k) * 1e3 for k in ("p50", "p90", "p99") if getattr(dist, k) is not None}


def _itl_gaps_s(records: list[RequestRecord]) -> np.ndarray:
    gaps = [np.diff(np.asarray(r.token_times_s)) for r in records if r.success and len(r.token_times_s) > 1]
    return np.concatenate(gaps) if gaps else np.empty(0)


# ---- 3. TTFT and TPOT as SLOs, under sustained load ---------------------------------------------


def _spread_bounds(center: int) -> tuple[int, int]:
    # Requests vary in length (half to 1.5x the chosen length) so the distributions have a shape.
    return max(1, center // 2), max(1, center * 3 // 2)


def _spread(center: int, name: str) -> str:
    low, high = _spread_bounds(center)
    return f"{low}-{high}" if high > low else str(center)


def _slo_requests(rate: float, light_lifetime_s: float | None = None) -> int:
    """Enough requests for SLO_STEADY_S of arrivals after the warm-up, and never fewer than
    SLO_MIN_REQUESTS. A swept rate under light load passes its requests' lifetime: its floor is
    SLO_LIGHT_MIN_REQUESTS, or as many as make the warm-up last that lifetime. A run too big for
    the lab's memory budget is refused with its inputs named."""
    floor = SLO_MIN_REQUESTS
    if light_lifetime_s is not None:
        warm = math.ceil(rate * light_lifetime_s / WARMUP_FRACTION)
        floor = min(SLO_MIN_REQUESTS, max(SLO_LIGHT_MIN_REQUESTS, warm))
    return max(floor, math.ceil(rate * SLO_STEADY_S / (1.0 - WARMUP_FRACTION)))


def lifetime_s(s: Setup, prompt_len: int, output_len: int, rate: float) -> float:
    """A request's prefill and decode steps at the batch Little's law gives at `rate` (the
    concurrency its lifetime and the rate imply, estimated twice from batch 1)."""
    rl = s.roofline()
    context = prompt_len + output_len // 2
    batch, life_s = 1, 0.0
    for _ in range(2):
        life_s = rl.prefill(prompt_len).time_s + output_len * rl.decode(batch, context).time_s
        batch = max(1, math.ceil(rate * life_s))
    return life_s


def _open_loop_run(
    budget: Budget, s_key: tuple, rate: float, num_requests: int, prompt_len: int, output_len: int
) -> SimResult:
    """One Poisson run. No SLO here: the targets are applied afterwards (`_steady`), so changing a
    target re-uses the simulation."""
    budget.require_memory(prompt_tokens=num_requests * prompt_len, output_tokens=num_requests * output_len,
                          inputs="rate, prompt_len or output_len")  # fmt: skip

    def run() -> SimResult:
        s = _setup_from_key(s_key)
        workload = WorkloadSpec(
            num_requests=num_requests,
            rate=rate,
            input_len=_spread(prompt_len, "prompt"),
            output_len=_spread(output_len, "output"),
            seed=0,
        )
        return simulate(_sim_config(s), workload, check=budget.check)

    key = ("open-loop", s_key, rate, num_requests, prompt_len, output_len)
    return budget.cached(key, run, lambda r: result_bytes([r]))


def _warmup_s(rate: float, num_requests: int) -> float:
    return WARMUP_FRACTION * num_requests / rate


@dataclass(slots=True)
class Steady:
    """A run's steady state: its summary without the warm-up, and the offered and achieved rates
    over the measurement window (from the end of the warm-up to the last arrival). Completions per
    second inside that window are the achieved rate: the drain after the last arrival, which a
    sustained load never reaches, is left out."""

    summary: Summary
    offered_rps: float
    achieved_rps: float
    window_s: float

    @property
    def goodput_rps(self) -> float:
        return self.achieved_rps * (self.summary.slo_attainment or 0.0)


def _steady(result: SimResult, rate: float, slo: SLO) -> Steady:
    n = len(result.records)
    start_s = _warmup_s(rate, n)
    steady = steady_state_summary(
        result.records,
        skip_first=0,
        after_s=start_s,
        slo=slo,
        num_devices=int(result.config.get("num_devices", 1) or 1),
    )
    assert steady is not None  # the warm-up is a fraction of the arrivals: some always remain
    end_s = max(r.arrival_s for r in result.records)
    window_s = max(end_s - start_s, 1e-9)
    arrived = sum(1 for r in result.records if start_s <= r.arrival_s <= end_s)
    done = sum(1 for r in result.records if r.success and (t := r.last_token_s) is not None and start_s <= t <= end_s)
    return Steady(steady, arrived / window_s, done / window_s, window_s)


def saturation_estimate_rps(s: Setup, prompt_len: int, output_len: int) -> float:
    """A request's GPU time at the largest batch the scheduler and the KV cache allow: its
    prefill alone plus its share of every decode step. Its inverse is where the sweep is centred."""
    rl = s.roofline()
    context = prompt_len + output_len
    plan = rl.memory
    max_num_seqs = _sim_config(s).scheduler.max_num_seqs
    batch = max(1, min(max_num_seqs, plan.max_batch(context) if plan.weights_fit else 1))
    gpu_s = rl.prefill(prompt_len).time_s + output_len * rl.decode(batch, prompt_len + output_len // 2).time_s / batch
    return 1.0 / gpu_s


class RateSweep(TypedDict):
    """The SLO lesson's sweep of rates, as its JSON carries it: one entry a rate in each list.
    `offered_rps` is the nominal Poisson rate; `arrived_rps` what the run's arrivals actually
    came at over the measurement window, and `achieved_rps` what it completed there: the charts
    plot the measured rates."""

    offered_rps: list[float]
    arrived_rps: list[float]
    achieved_rps: list[float]
    goodput_rps: list[float]
    measured_s: list[float]  # seconds of steady state each rate was measured over
    ttft_ms: list[float | None]  # at the sweep's percentile; None where no request finished
    tpot_ms: list[float | None]
    tpot_pct_ms: dict[str, list[float | None]]  # per-request TPOT at p50 / p90 / p99
    itl_pct_ms: dict[str, list[float | None]]  # per-token gaps (ITL), pooled, at p50 / p90 / p99
    meets: list[bool]
    complete: bool  # every rate simulated; until then the sweep is the rates done so far
    saturation_rps: float | None  # None until complete
    knee_rps: float | None  # the first rate (arrived) whose percentile latencies break a target


def sweep_rates(s: Setup, prompt_len: int, output_len: int) -> list[tuple[float, int]]:
    """The swept rates around the saturation estimate, each with its run's number of requests."""
    center = saturation_estimate_rps(s, prompt_len, output_len)
    lo_rate, hi_rate = LIMITS["slo"]["rate"]
    rates = sorted({float(f"{min(hi_rate, max(lo_rate, f * center)):.3g}") for f in SWEEP_FRACTIONS})
    out = []
    for rate in rates:
        light = lifetime_s(s, prompt_len, output_len, rate) if rate <= LIGHT_LOAD * center else None
        out.append((rate, _slo_requests(rate, light)))
    return out


@dataclass(frozen=True, slots=True)
class SweepKey:
    """One SLO rate sweep, run in the background on the lab's planner (`capacity_lesson`): one
    job per rate, each a `sweep_point`. The targets are not part of it: they are applied to the
    points afterwards (`sweep_of`), so changing a target re-simulates nothing."""

    s_key: tuple
    prompt_len: int
    output_len: int
    rates: tuple[tuple[float, int], ...]

    @property
    def total(self) -> int:
        return len(self.rates)

    def jobs(self) -> list[tuple[str, Any, Any]]:
        return [(f"{rate:g}", sweep_point, (self, rate, n)) for rate, n in self.rates]


_WORKER_SIMULATIONS: Simulations | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What an SLO reads of a measured request (`SLO.met_by`), without its token times."""

    success: bool
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None


def sweep_point(args: tuple[SweepKey, float, int]) -> dict[str, Any]:
    """One rate of the sweep, in a worker process (under a lesson's default Budget): its
    steady-state figures at the sweep's percentile and each measured request's outcome, small
    enough to send back (a run's records are megabytes)."""
    global _WORKER_SIMULATIONS
    key, rate, num_requests = args
    if _WORKER_SIMULATIONS is None:
        _WORKER_SIMULATIONS = Simulations()
    budget = Budget(_WORKER_SIMULATIONS, "slo")
    run = _open_loop_run(budget, key.s_key, rate, num_requests, key.prompt_len, key.output_len)
    st = _steady(run, rate, SLO())
    sm = st.summary
    start_s = _warmup_s(rate, len(run.records))
    return {
        "offered_rps": rate,
        "arrived_rps": st.offered_rps,
        "achieved_rps": st.achieved_rps,
        "measured_s": st.window_s,
        "ttft_ms": _ms_or_none(sm.ttft_s.p90),
        "tpot_ms": _ms_or_none(sm.tpot_s.p90),
        "tpot_pct_ms": {k: _ms_or_none(getattr(sm.tpot_s, k)) for k in PERCENTILES},
        "itl_pct_ms": {k: _ms_or_none(getattr(sm.itl_s, k)) for k in PERCENTILES},
        "outcomes": _pack([r for r in run.records if r.arrival_s >= start_s]),
    }


def _pack(records: list[RequestRecord]) -> dict[str, np.ndarray]:
    """Outcomes as arrays (NaN: no value): 17 bytes a request where objects take ~150, since the
    planner keeps its last results."""
    nan = math.nan

    def col(attr: str) -> np.ndarray:
        return np.array([nan if (v := getattr(r, attr)) is None else v for r in records], dtype=np.float64)

    return {"success": np.array([r.success for r in records], dtype=bool), "ttft_s": col("ttft_s"),
            "tpot_s": col("tpot_s"), "e2e_s": col("e2e_s")}  # fmt: skip


def _unpack(packed: dict[str, np.ndarray]) -> list[Outcome]:
    def value(x: float) -> float | None:
        return None if math.isnan(x) else x

    return [
        Outcome(bool(ok), value(ttft), value(tpot), value(e2e))
        for ok, ttft, tpot, e2e in zip(
            packed["success"], packed["ttft_s"].tolist(), packed["tpot_s"].tolist(), packed["e2e_s"].tolist()
        )  # fmt: skip
    ]


def sweep_of(points: list[dict[str, Any]], complete: bool, slo: SLO) -> RateSweep:
    """The sweep's JSON from the rates simulated so far (in rate order), with `slo` applied.
    Saturation and the knee are only stated once every rate is in: a partial sweep cannot know them."""
    points = sorted(points, key=lambda pt: pt["offered_rps"])
    arrived = [pt["arrived_rps"] for pt in points]
    achieved = [pt["achieved_rps"] for pt in points]
    # Goodput as the steady summary counts it: the measured requests that meet every target.
    # SLO.met_by reads only what an Outcome holds of a record.
    outcomes = [cast("list[RequestRecord]", _unpack(pt["outcomes"])) for pt in points]
    attainment = [sum(map(slo.met_by, out)) / len(out) for out in outcomes]
    meets = [
        _meets(None if pt["ttft_ms"] is None else pt["ttft_ms"] / 1e3, None if pt["tpot_ms"] is None else pt["tpot_ms"] / 1e3, slo)
        for pt in points
    ]  # fmt: skip
    # Saturation: the most the system completed, whatever was offered. The knee: the first
    # rate, as it arrived, whose percentile latencies break a target.
    return {
        "offered_rps": [pt["offered_rps"] for pt in points],
        "arrived_rps": arrived,
        "achieved_rps": achieved,
        "goodput_rps": [a * att for a, att in zip(achieved, attainment)],
        "measured_s": [pt["measured_s"] for pt in points],
        "ttft_ms": [pt["ttft_ms"] for pt in points],
        "tpot_ms": [pt["tpot_ms"] for pt in points],
        "tpot_pct_ms": {k: [pt["tpot_pct_ms"][k] for pt in points] for k in PERCENTILES},
        "itl_pct_ms": {k: [pt["itl_pct_ms"][k] for pt in points] for k in PERCENTILES},
        "meets": meets,
        "complete": complete,
        "saturation_rps": max(achieved) if complete else None,
        "knee_rps": next((r for r, ok in zip(arrived, meets) if not ok), None) if complete else None,
    }


PERCENTILES = ("p50", "p90", "p99")


def _ms_or_none(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def _knee_text(knee: float | None, saturation: float) -> str:
    if knee is None:
        return "Every swept rate meets the targets: tighten them to find the knee."
    when = "before" if knee < saturation else "only once"
    return (
        f"The targets break from about {fmt(knee)} req/s arriving, {when} the system saturates "
        f"(it completes at most about {fmt(saturation)} req/s)."
    )


SWEEP_PENDING = "The rate sweep is still running: saturation and the knee follow once every rate is simulated."


def _background_sweep(planner: CapacityPlanner, key: SweepKey, slo: SLO) -> tuple[RateSweep, dict[str, Any]]:
    """The sweep as far as it has run, and its progress. A lab already running its most background
    jobs answers the chosen rate alone, and the next poll asks again."""
    try:
        state = planner.plan_for(key)
    except LabBusy:
        return sweep_of([], False, slo), {"status": "running", "done": 0, "total": key.total,
                                     "message": "the rate sweep waits for a free slot"}  # fmt: skip
    done, rows = planner.snapshot(state)
    if done and state.error:
        raise ServelabError(f"the rate sweep failed: {state.error}")
    progress = {"status": "done" if done else "running", "done": len(rows), "total": state.total}
    if not done:
        progress["message"] = f"sweeping the rate: {len(rows)} of {state.total} rates simulated"
    return sweep_of(list(rows.values()), done, slo), progress


STALL_RATIO = 1.2  # a p99 token gap this far above the p99 TPOT is steps a request's mean hides


def _itl_text(itl: dict[str, float], tpot: dict[str, float]) -> str:
    itl99, tpot99 = itl.get("p99"), tpot.get("p99")
    if itl99 is None or tpot99 is None:
        return ""
    text = f"Per token, the p99 gap is {fmt(itl99)} ms against a p99 TPOT of {fmt(tpot99)} ms"
    if itl99 > STALL_RATIO * tpot99:
        return text + ": the steps that carry a prefill stall tokens, and a request's average hides them."
    return text + "."


def _meets(ttft_s: float | None, tpot_s: float | None, slo: SLO) -> bool:
    return (ttft_s is None or slo.ttft_s is None or ttft_s <= slo.ttft_s) and (
        tpot_s is None or slo.tpot_s is None or tpot_s <= slo.tpot_s
    )


def _key(s: Setup) -> tuple:
    return (s.model.name, s.hardware.name, s.weight_dtype, s.kv_dtype, s.tp, s.engine_profile)


def _setup_from_key(key: tuple) -> Setup:
    model, hardware, w, k, tp, profile = key
    return setup_from(
        Params(
            {
                "model": model,
                "hardware": hardware,
                "weight_dtype": w,
                "kv_dtype": k,
                "tp": str(tp),
                "engine_profile": profile,
            }
        )
    )


def _check_len(s: Setup, lesson: str, prompt_len: int, output_len: int) -> None:
    longest = longest_tokens(lesson, {"prompt_len": prompt_len, "output_len": output_len})
    if longest > s.model.max_context:
        from servelab.errors import InvalidArgument

        raise InvalidArgument(
            f"prompt_len + output_len: the longest request ({longest:,} tokens with the spread) exceeds "
            f"{s.model.name}'s maximum context of {s.model.max_context:,} tokens",
            param="prompt_len",
        )


def require_whole_prompt_fits(sched: Any, longest_prompt: int, prompt_len: int) -> None:
    """An engine profile that runs each prompt whole in one step (TensorRT-LLM's) needs the
    longest prompt within its step's token budget: a 400 naming prompt_len, not the simulator's
    refusal with its command-line advice."""
    if sched.policy == "decode-first-whole" and longest_prompt > sched.max_num_batched_tokens:
        raise InvalidArgument(
            f"prompt_len: this engine profile runs a prompt whole in one step of at most "
            f"{sched.max_num_batched_tokens:,} tokens, and the longest prompt ({longest_prompt:,} tokens, from "
            f"prompt_len {prompt_len:,} with the spread) is longer: lower prompt_len or pick a chunked profile",
            param="prompt_len",
        )


def _require_request_fits(s: Setup, prompt_len: int, output_len: int) -> None:
    """The longest request of the spread must fit one replica's KV pool on its own: the simulator
    refuses a run that would cut outputs short, and the lesson says so as a no_fit."""
    from servelab.sim.runner import kv_slots_needed, scheduler_config

    plan = s.memory()
    plan.require_weights_fit()
    longest_prompt, longest_output = _spread_bounds(prompt_len)[1], _spread_bounds(output_len)[1]
    sched = scheduler_config(_sim_config(s))
    require_whole_prompt_fits(sched, longest_prompt, prompt_len)
    pool = sched.num_blocks * sched.block_size
    if kv_slots_needed(longest_prompt, longest_output) > pool:
        raise DoesNotFit(
            f"{plan.describe()}: the longest request (prompt {longest_prompt:,} + output {longest_output:,} tokens, "
            f"from prompt_len {prompt_len:,} and output_len {output_len:,} with the spread) cannot fit one replica's "
            f"KV cache of {pool:,} tokens; lower prompt_len or output_len, or use fp8 KV, a larger tp or a bigger "
            f"accelerator"
        )


def slo(p: Params, budget: Budget, planner: CapacityPlanner) -> dict[str, Any]:
    """The chosen rate's run, answered at once; the rate sweep runs on `planner` in the background
    and fills in as the page polls (`status` "running" with `done` of `total` rates, until "done")."""
    s = setup_from(p)
    rate = p.float("rate", 20.0, **bounds("slo", "rate"))
    ttft_slo_ms = p.float("ttft_slo_ms", 500.0, **bounds("slo", "ttft_slo_ms"))
    tpot_slo_ms = p.float("tpot_slo_ms", 20.0, **bounds("slo", "tpot_slo_ms"))
    prompt_len = p.int("prompt_len", 1024, **bounds("slo", "prompt_len"))
    output_len = p.int("output_len", 128, **bounds("slo", "output_len"))
    _check_len(s, "slo", prompt_len, output_len)
    _require_request_fits(s, prompt_len, output_len)
    ttft_slo_s, tpot_slo_s = ttft_slo_ms / 1e3, tpot_slo_ms / 1e3
    target = SLO(ttft_s=ttft_slo_s, tpot_s=tpot_slo_s)
    num_requests = _slo_requests(rate)
    rates = sweep_rates(s, prompt_len, output_len)
    for swept, n in rates:  # a sweep run past the memory budget is refused now, not in the background
        budget.require_memory(prompt_tokens=n * prompt_len, output_tokens=n * output_len,
                              inputs="rate, prompt_len or output_len")  # fmt: skip
    result = _open_loop_run(budget, _key(s), rate, num_requests, prompt_len, output_len)
    st = _steady(result, rate, target)
    sm = st.summary
    warmup_s = _warmup_s(rate, num_requests)
    measured = [r for r in result.records if r.arrival_s >= warmup_s]
    ok = [r for r in measured if r.success]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpots = [r.tpot_s for r in ok if r.tpot_s is not None]
    n = len(measured)
    ttft_ok = sum(1 for r in ok if r.ttft_s is not None and r.ttft_s <= ttft_slo_s)
    tpot_ok = sum(1 for r in ok if r.tpot_s is None or r.tpot_s <= tpot_slo_s)
    attainment = {"ttft": ttft_ok / n, "tpot": tpot_ok / n, "both": sm.slo_attainment}
    ttft_cdf = {**cdf(ttfts), "percentiles": _percentiles_ms(sm.ttft_s)}
    tpot_cdf = {**cdf(tpots), "percentiles": _percentiles_ms(sm.tpot_s)}
    # Per-token gaps show the prefill stalls that a request's mean (its TPOT) averages away.
    itl_cdf = {**cdf(_itl_gaps_s(ok)), "percentiles": _percentiles_ms(sm.itl_s)}
    p90_ttft, p90_tpot = ttft_cdf["percentiles"].get("p90"), tpot_cdf["percentiles"].get("p90")
    meets = _meets(None if p90_ttft is None else p90_ttft / 1e3, None if p90_tpot is None else p90_tpot / 1e3, target)
    sweep, progress = _background_sweep(planner, SweepKey(_key(s), prompt_len, output_len, tuple(rates)), target)
    saturated = st.achieved_rps < SATURATED_BELOW * st.offered_rps  # against what actually arrived
    offered = f"{fmt(rate)} req/s offered ({fmt(st.offered_rps)} arrived)"
    if saturated:
        load = (
            f"{offered} is more than it sustains: it completes {fmt(st.achieved_rps)} "
            f"req/s and the queue grows for as long as the load lasts"
        )
    else:
        load = f"at {offered} it keeps up ({fmt(st.achieved_rps)} req/s completed)"
    knee = sweep["knee_rps"]
    saturation = sweep["saturation_rps"]
    return {
        **progress,
        "config": {
            **s.to_dict(),
            "rate": rate,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "num_requests": num_requests,
            "warmup_s": warmup_s,
            "measured_requests": n,
        },
        "ttft_slo_ms": ttft_slo_ms,
        "tpot_slo_ms": tpot_slo_ms,
        "ttft_ms": ttft_cdf,
        "tpot_ms": tpot_cdf,
        "itl_ms": itl_cdf,
        "attainment": attainment,
        "offered_rps": rate,
        "arrived_rps": st.offered_rps,  # the Poisson sample's own rate over the window
        "achieved_rps": st.achieved_rps,
        "saturated": saturated,
        "goodput_rps": st.goodput_rps,
        "request_throughput_rps": sm.request_throughput,
        "output_tokens_per_s": sm.output_throughput,
        "summary": sm.to_dict(),
        "sweep": sweep,
        "stats": [
            stat("offered / achieved rate", f"{fmt(rate)} / {fmt(st.achieved_rps)} req/s"),
            stat("p50 / p90 / p99 TTFT", " / ".join(fmt(v, "") for v in ttft_cdf["percentiles"].values()) + " ms"),
            stat("p50 / p90 / p99 TPOT", " / ".join(fmt(v, "") for v in tpot_cdf["percentiles"].values()) + " ms"),
            stat("p50 / p90 / p99 ITL", " / ".join(fmt(v, "") for v in itl_cdf["percentiles"].values()) + " ms"),
            stat("SLO attainment (both)", fmt(100 * (sm.slo_attainment or 0.0), "%")),
            stat("goodput", fmt(st.goodput_rps, "req/s")),
            stat("saturates at about", fmt(saturation, "req/s"))
            if saturation is not None
            else stat("rate sweep", f"{progress['done']} of {progress['total']} rates simulated"),
            stat(
                "measured",
                f"{n:,} of {num_requests:,} requests over {fmt(st.window_s)} s (first {fmt(warmup_s)} s of arrivals "
                f"left out)",
            ),
        ],
        "notice": (
            f"{load}; the p90 TTFT is {fmt(p90_ttft or math.nan)} ms and p90 TPOT {fmt(p90_tpot or math.nan)} ms, "
            f"so the deployment {'meets' if meets else 'misses'} the p90 targets "
            f"({fmt(100 * (sm.slo_attainment or 0.0))}% of requests meet both, a goodput of {fmt(st.goodput_rps)} "
            f"req/s). "
            + _itl_text(itl_cdf["percentiles"], tpot_cdf["percentiles"])
            + " "
            + (_knee_text(knee, saturation) if saturation is not None else SWEEP_PENDING)
        ),
    }


# ---- 4. Chunked prefill ---------------------------------------------------------------------------

SHORT_PROMPT = 256  # the decoding users' prompts


def _chunk_requests(s: Setup, prompt_len: int, decode_batch: int, chunk_tokens: int) -> tuple[list[RequestSpec], float]:
    """`decode_batch` users start at t=0; the long prompt arrives once they are decoding, and
    they keep decoding well past its prefill (whichever policy runs it)."""
    rl = s.roofline()
    step_s = rl.decode(decode_batch, SHORT_PROMPT + 64).time_s
    warmup_s = 2 * rl.prefill(SHORT_PROMPT, decode_batch).time_s + 10 * step_s
    long_prefill_s = rl.prefill(prompt_len).time_s
    chunks = math.ceil(prompt_len / chunk_tokens)
    busy_s = warmup_s + 1.5 * long_prefill_s + chunks * step_s
    output = min(4000, math.ceil(busy_s / step_s) + 30)
    users = [RequestSpec(i, 0.0, SHORT_PROMPT, output) for i in range(decode_batch)]
    return [*users, RequestSpec(decode_batch, warmup_s, prompt_len, 8)], warmup_s


def _require_kv_fit(s: Setup, requests: list[RequestSpec], _arrival_s: float) -> None:
    """All requests are resident at once, each at its own final context (the users' short prompts
    plus their outputs, the long prompt plus its few tokens): their sum must fit the KV cache."""
    plan = s.memory()
    plan.require_weights_fit()
    need = sum(r.prompt_tokens + r.output_tokens for r in requests)
    if need > plan.kv_capacity_tokens:
        users = requests[:-1]
        per_user = users[0].prompt_tokens + users[0].output_tokens if users else 0
        raise DoesNotFit(
            f"{plan.describe()}: {len(users)} decoding users at {per_user:,} tokens each plus the "
            f"{requests[-1].prompt_tokens:,}-token prompt need {need:,} tokens of KV cache, but "
            f"{plan.kv_capacity_tokens:,} fit after the weights; lower prompt_len or decode_batch, "
            f"or use fp8 KV, a larger tp or a bigger accelerator"
        )


def _chunk_runs(
    budget: Budget, s_key: tuple, prompt_len: int, decode_batch: int, chunk_tokens: int
) -> tuple[SimResult, SimResult, float]:
    s = _setup_from_key(s_key)
    requests, arrival_s = _chunk_requests(s, prompt_len, decode_batch, chunk_tokens)
    budget.require_memory(prompt_tokens=sum(r.prompt_tokens for r in requests),
                          output_tokens=sum(r.output_tokens for r in requests),
                          inputs="prompt_len or decode_batch")  # fmt: skip

    def run() -> tuple[SimResult, SimResult]:
        runs = {}
        for policy in ("prefill-first", "chunked"):
            config = _sim_config(
                s,
                scheduler={
                    "policy": policy,
                    "max_num_batched_tokens": chunk_tokens,
                    "max_num_seqs": max(256, decode_batch + 1),
                    "enable_prefix_caching": False,
                },
            )
            runs[policy] = simulate(config, requests, concurrency=len(requests), check=budget.check)
        return runs["prefill-first"], runs["chunked"]

    first, chunked = budget.cached(("chunked", s_key, prompt_len, decode_batch, chunk_tokens), run, result_bytes)
    return first, chunked, arrival_s


def _timeline(result: SimResult, long_id: str, window: tuple[float, float], label: str) -> dict[str, Any]:
    lo, hi = window
    t = result.trace
    start = np.frombuffer(t.start_s, dtype=np.float64)
    dur = np.frombuffer(t.duration_s, dtype=np.float64)
    prefill = np.frombuffer(t.num_tokens, dtype=np.int32) - np.frombuffer(t.num_decode, dtype=np.int32)
    keep = (start + dur >= lo) & (start <= hi)
    users_t, users_seq, long_t, long_seq = [], [], [], []
    max_gap_s = 0.0
    long_record = None
    for r in result.records:
        times = np.asarray(r.token_times_s)
        if r.request_id == long_id:
            long_record = r
            sel = times[(times >= lo) & (times <= hi)]
            long_t.extend((sel * 1e3).tolist())
            long_seq.extend([int(r.request_id)] * sel.size)
            continue
        if times.size > 1:
            # Only gaps while the long prompt is in the system are the lesson's stall.
            gaps = np.diff(times)
            in_window = (times[1:] >= lo) & (times[:-1] <= hi)
            if in_window.any():
                max_gap_s = max(max_gap_s, float(gaps[in_window].max()))
        sel = times[(times >= lo) & (times <= hi)]
        users_t.extend((sel * 1e3).tolist())
        users_seq.extend([int(r.request_id)] * sel.size)
    return {
        "label": label,
        "steps": {
            "start_ms": (start[keep] * 1e3).tolist(),
            "duration_ms": (dur[keep] * 1e3).tolist(),
            "prefill_tokens": prefill[keep].tolist(),
        },
        "tokens": {"time_ms": users_t, "seq": users_seq},
        "long_tokens": {"time_ms": long_t, "seq": long_seq},
        "max_user_gap_ms": max_gap_s * 1e3,
        "long_ttft_ms": None if long_record is None or long_record.ttft_s is None else long_record.ttft_s * 1e3,
        "longest_step_ms": float(dur[keep].max() * 1e3) if keep.any() else 0.0,
    }


def chunked_prefill(p: Params, budget: Budget) -> dict[str, Any]:
    s = setup_from(p)
    prompt_len = p.int("prompt_len", 8192, **bounds("chunked-prefill", "prompt_len"))
    decode_batch = p.int("decode_batch", 16, **bounds("chunked-prefill", "decode_batch"))
    chunk_tokens = p.int("chunk_tokens", 512, **bounds("chunked-prefill", "chunk_tokens"))
    if longest_tokens("chunked-prefill", {"prompt_len": prompt_len}) > s.model.max_context:
        from servelab.errors import InvalidArgument

        raise InvalidArgument(
            f"prompt_len: {prompt_len:,} plus the 8 tokens the long request generates exceeds "
            f"{s.model.name}'s maximum context of {s.model.max_context:,} tokens",
            param="prompt_len",
        )
    _require_kv_fit(s, *_chunk_requests(s, prompt_len, decode_batch, chunk_tokens))
    first, chunked, arrival_s = _chunk_runs(budget, _key(s), prompt_len, decode_batch, chunk_tokens)
    long_id = str(decode_batch)
    ends = [max(r.token_times_s[0] for r in res.records if r.request_id == long_id) for res in (first, chunked)]
    step_s = s.roofline().decode(decode_batch, SHORT_PROMPT).time_s
    window = (max(0.0, arrival_s - 8 * step_s), max(ends) + 10 * step_s)
    a = _timeline(first, long_id, window, "prefill-first")
    b = _timeline(chunked, long_id, window, f"chunked ({chunk_tokens} tokens/step)")
    return {
        "config": {**s.to_dict(), "prompt_len": prompt_len, "decode_batch": decode_batch, "chunk_tokens": chunk_tokens},
        "long_arrival_ms": arrival_s * 1e3,
        "time_range_ms": [window[0] * 1e3, window[1] * 1e3],
        "prefill_first": a,
        "chunked": b,
        "stats": [
            stat("prefill-first: worst gap between a user's tokens", fmt(a["max_user_gap_ms"], "ms")),
            stat("chunked: worst gap between a user's tokens", fmt(b["max_user_gap_ms"], "ms")),
            stat(
                "long prompt TTFT, prefill-first / chunked", f"{fmt(a['long_ttft_ms'])} / {fmt(b['long_ttft_ms'])} ms"
            ),
        ],
        "notice": _chunked_notice(a, b, prompt_len, chunk_tokens, decode_batch),
    }


def chunking_changes_nothing(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The chunked run's worst gap and long TTFT are prefill-first's (within 0.5%)."""
    return all(abs(b[k] - a[k]) <= 0.005 * a[k] for k in ("max_user_gap_ms", "long_ttft_ms"))


def _chunked_notice(a: dict[str, Any], b: dict[str, Any], prompt_len: int, chunk_tokens: int,
                    decode_batch: int) -> str:  # fmt: skip
    """Lesson 4's note: the stall prefill-first causes, and what chunking does to it, as measured."""
    first_gap, chunked_gap = a["max_user_gap_ms"], b["max_user_gap_ms"]
    head = (
        f"prefill-first stalls the decoding users for up to {fmt(first_gap)} ms while the {prompt_len:,}-token "
        f"prompt runs in one step"
    )
    if chunking_changes_nothing(a, b):
        why = (
            f": a chunk budget of {chunk_tokens:,} tokens holds the whole prompt beside the {decode_batch} decodes"
            if chunk_tokens >= prompt_len + decode_batch
            else ""
        )
        effect = f"chunking changes nothing here (worst gap {fmt(chunked_gap)} ms){why}"
    elif chunked_gap < first_gap:
        effect = f"chunks of {chunk_tokens:,} tokens cap the worst gap at {fmt(chunked_gap)} ms"
    else:
        effect = f"chunks of {chunk_tokens:,} tokens do not shorten the worst gap ({fmt(chunked_gap)} ms)"
    return (
        f"{head}; {effect}. The long prompt's TTFT goes from {fmt(a['long_ttft_ms'])} to {fmt(b['long_ttft_ms'])} ms."
    )


# ---- 5. Disaggregated serving -------------------------------------------------------------------------


def _disagg_runs(
    budget: Budget,
    s_key: tuple,
    rate: float,
    prefill_gpus: int,
    decode_gpus: int,
    link_bytes_per_s: float,
    prompt_len: int,
    output_len: int,
) -> tuple[SimResult, SimResult]:
    budget.require_memory(prompt_tokens=DISAGG_NUM_REQUESTS * prompt_len, output_tokens=DISAGG_NUM_REQUESTS * output_len,
                          inputs="prompt_len or output_len")  # fmt: skip

    def run() -> tuple[SimResult, SimResult]:
        s = _setup_from_key(s_key)
        workload = WorkloadSpec(
            num_requests=DISAGG_NUM_REQUESTS,
            rate=rate,
            input_len=_spread(prompt_len, "prompt"),
            output_len=_spread(output_len, "output"),
            seed=0,
        )
        colocated = simulate(_sim_config(s, replicas=prefill_gpus + decode_gpus), workload, check=budget.check)
        split = simulate(
            _sim_config(s, disagg=(prefill_gpus, decode_gpus), link_bandwidth_bytes_per_s=link_bytes_per_s),
            workload,
            check=budget.check,
        )
        return colocated, split

    key = ("disaggregated", s_key, rate, prefill_gpus, decode_gpus, link_bytes_per_s, prompt_len, output_len)
    return budget.cached(key, run, result_bytes)


def _side(result: SimResult, label: str) -> dict[str, Any]:
    sm = result.summary
    ok = [r for r in result.records if r.success]
    return {
        "label": label,
        "ttft_ms": {**cdf([r.ttft_s for r in ok if r.ttft_s is not None]), "percentiles": _percentiles_ms(sm.ttft_s)},
        "itl_ms": {**cdf(_itl_gaps_s(result.records)), "percentiles": _percentiles_ms(sm.itl_s)},
        "tpot_ms": _percentiles_ms(sm.tpot_s),
        "output_tokens_per_s_per_gpu": sm.output_throughput_per_device,
        "kv_transfer_ms": None if result.kv_transfer_s.mean is None else _percentiles_ms(result.kv_transfer_s),
    }


def _compare(split: float | None, colocated: float | None) -> str:
    """ "better", "worse" or "the same" (within half a percent) for a latency, lower being better."""
    if split is None or colocated is None:
        return "not measured"
    if abs(split - colocated) <= 0.005 * colocated:
        return "the same"
    return "better" if split < colocated else "worse"


def _disagg_notice(a: dict[str, Any], b: dict[str, Any], kv: dict[str, float]) -> str:
    """The split's trade, read from both runs: its ITL tail and median against colocated, each
    called better or worse as the numbers say, and the TTFT it pays."""
    a_itl, b_itl = a["itl_ms"]["percentiles"], b["itl_ms"]["percentiles"]
    tail = _compare(b_itl.get("p99"), a_itl.get("p99"))
    median = _compare(b_itl.get("p50"), a_itl.get("p50"))
    figures = (
        f"the split's p99 inter-token latency is {fmt(b_itl.get('p99'))} ms against {fmt(a_itl.get('p99'))} ms "
        f"colocated ({tail}) and its median {fmt(b_itl.get('p50'))} against {fmt(a_itl.get('p50'))} ms ({median})"
    )
    if tail == "better" and median != "better":
        verdict = "only the tail improves: no prefill interrupts its decodes, but fewer GPUs decode bigger batches"
    elif tail == "better":
        verdict = "both improve: no prefill interrupts its decodes"
    elif median == "better":
        verdict = "only the median improves; the tail does not, so this split does not buy the tail at this load"
    else:
        verdict = "neither improves at this load and split"
    ttft_a, ttft_b = a["ttft_ms"]["percentiles"].get("p90"), b["ttft_ms"]["percentiles"].get("p90")
    return (
        f"{figures}: {verdict}. Its p90 TTFT is {fmt(ttft_b)} ms against {fmt(ttft_a)} ms colocated "
        f"({_compare(ttft_b, ttft_a)}), including a median {fmt(kv.get('p50', math.nan))} ms KV transfer."
    )


def disaggregated(p: Params, budget: Budget) -> dict[str, Any]:
    s = setup_from(p)
    rate = p.float("rate", 6.0, **bounds("disaggregated", "rate"))
    prefill_gpus = p.int("prefill_gpus", 1, **bounds("disaggregated", "prefill_gpus"))
    decode_gpus = p.int("decode_gpus", 1, **bounds("disaggregated", "decode_gpus"))
    link_gbps = p.float("link_gbps", 50.0, **bounds("disaggregated", "link_gbps"))
    prompt_len = p.int("prompt_len", 2048, **bounds("disaggregated", "prompt_len"))
    output_len = p.int("output_len", 128, **bounds("disaggregated", "output_len"))
    if prefill_gpus + decode_gpus > 8:
        from servelab.errors import InvalidArgument

        raise InvalidArgument(
            f"prefill_gpus + decode_gpus: at most 8 replicas, got {prefill_gpus + decode_gpus}", param="decode_gpus"
        )
    _check_len(s, "disaggregated", prompt_len, output_len)
    _require_request_fits(s, prompt_len, output_len)
    colocated, split = _disagg_runs(
        budget, _key(s), rate, prefill_gpus, decode_gpus, link_gbps * 1e9, prompt_len, output_len
    )
    n = prefill_gpus + decode_gpus
    a = _side(colocated, f"colocated ({n} replicas)")
    b = _side(split, f"disaggregated {prefill_gpus}P:{decode_gpus}D")
    kv = b["kv_transfer_ms"] or {}
    return {
        "config": {
            **s.to_dict(),
            "rate": rate,
            "prefill_gpus": prefill_gpus,
            "decode_gpus": decode_gpus,
            "link_gbps": link_gbps,
            "prompt_len": prompt_len,
            "output_len": output_len,
            "num_requests": DISAGG_NUM_REQUESTS,
        },
        "colocated": a,
        "disaggregated": b,
        "stats": [
            stat(
                "p90 TTFT colocated / split",
                f"{fmt(a['ttft_ms']['percentiles'].get('p90'))} / {fmt(b['ttft_ms']['percentiles'].get('p90'))} ms",
            ),
            stat(
                "p50 ITL colocated / split",
                f"{fmt(a['itl_ms']['percentiles'].get('p50'))} / {fmt(b['itl_ms']['percentiles'].get('p50'))} ms",
            ),
            stat(
                "p99 ITL colocated / split",
                f"{fmt(a['itl_ms']['percentiles'].get('p99'))} / {fmt(b['itl_ms']['percentiles'].get('p99'))} ms",
            ),
            stat("KV transfer p50 / p99", f"{fmt(kv.get('p50', math.nan))} / {fmt(kv.get('p99', math.nan))} ms"),
            stat(
                "output tok/s per GPU colocated / split",
                f"{fmt(a['output_tokens_per_s_per_gpu'])} / {fmt(b['output_tokens_per_s_per_gpu'])}",
            ),
        ],
        "notice": _disagg_notice(a, b, kv),
    }
