"""The simulator's Python API: `simulate(SimConfig(...), workload) -> SimResult`.

Used by `servelab sim`, the capacity planner and the lab. Imports no torch.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from servelab.core.admission import whole_prompt_too_long
from servelab.core.config import ResolvedSchedulerConfig, SchedulerConfig
from servelab.core.speculative import SpeculativeConfig
from servelab.cost.host_overhead import HostCost, HostOverheadCost
from servelab.cost.memory import MemoryPlan
from servelab.cost.speculative import Acceptance, DraftCost, draft_cost, draft_model_spec, kv_tokens_beside_draft
from servelab.cost.step_cost import StepCostModel
from servelab.errors import DoesNotFit, InvalidArgument, RequestTooLong
from servelab.metrics import SLO, RequestRecord, Summary, steady_state_summary, summarize
from servelab.metrics.summary import Dist
from servelab.sim.cluster import ClusterSim, LoopResult, StepTrace
from servelab.sim.engine_profiles import engine_profile
from servelab.sim.speculative import Speculation, realised
from servelab.core.router import ROUTERS
from servelab.spec.dtypes import DEFAULT_DTYPE, canonical_dtype, kv_dtype_alias
from servelab.spec.hardware import HardwareSpec, get_hardware
from servelab.spec.kv_groups import KVGroups
from servelab.spec.model import ModelSpec, get_model
from servelab.workload import RequestSpec, WorkloadSpec

# A 400 Gb/s NIC per GPU (InfiniBand NDR / RoCE), the usual fabric between serving nodes.
DEFAULT_LINK_BYTES_PER_S_PER_DEVICE = 50e9
DEFAULT_LINK_LATENCY_S = 0.5e-3
MAX_REPLICAS = 10_000  # each replica holds a scheduler and a block pool in memory


@kv_dtype_alias  # the old name of kv_cache_dtype
@dataclass(slots=True)
class SimConfig:
    model: str | ModelSpec = "llama-3.1-8b"
    hardware: str | HardwareSpec = "h100-sxm"
    tp: int = 1
    weight_dtype: str = DEFAULT_DTYPE  # spec/dtypes.py's names; old spellings ("bf16") are read as their new one
    kv_cache_dtype: str = DEFAULT_DTYPE
    replicas: int = 1
    disagg: tuple[int, int] | None = None  # (prefill replicas, decode replicas) instead of `replicas`
    router: str = "round-robin"
    # One replica's scheduler. num_blocks None: the KV pool from the memory plan; max_model_len
    # None: the model's context length.
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    memory_fraction: float = 0.9
    link_bandwidth_bytes_per_s: float | None = None  # prefill→decode link; None: 50 GB/s per device
    link_latency_s: float = DEFAULT_LINK_LATENCY_S
    efficiency: Any = None  # servelab.cost.roofline.Efficiency; None: its defaults
    cost_model: StepCostModel | None = None  # replaces the roofline (e.g. a calibrated profile)
    slo: SLO | None = None
    # The serving engine whose defaults these are (sim/engine_profiles.py's engine_sim_config sets
    # them); None: the scheduler and memory share as given. Reported, and checked to be a known name.
    engine_profile: str | None = None
    # The engine's host work per step, added after the roofline's time or hidden behind it.
    host_cost: HostCost | None = None
    # Speculative decoding (vLLM's --speculative-config, or its JSON) and how often drafts are
    # accepted; None: plain decoding.
    speculative: SpeculativeConfig | str | None = None
    spec_acceptance: Acceptance | None = None

    def __post_init__(self) -> None:
        self.weight_dtype, self.kv_cache_dtype = (
            canonical_dtype(self.weight_dtype),
            canonical_dtype(self.kv_cache_dtype),
        )
        self.speculative = SpeculativeConfig.parse(self.speculative)
        if self.speculative is None:
            if self.spec_acceptance is not None:
                raise InvalidArgument("an acceptance model needs a speculative config", param="spec_acceptance")
        else:
            if self.spec_acceptance is None:
                raise InvalidArgument(
                    "speculative decoding needs an acceptance model (a rate or a measured profile)",
                    param="spec_acceptance",
                )
            self.spec_acceptance = self.spec_acceptance.for_k(self.speculative.num_speculative_tokens)
            if self.disagg is not None:
                raise InvalidArgument(
                    "speculative decoding is simulated on colocated replicas, not with disaggregation",
                    param="speculative_config",
                )
        if self.disagg is not None:
            if len(self.disagg) != 2:
                raise InvalidArgument(f"disagg is (prefill replicas, decode replicas), got {self.disagg!r}")
            p, d = self.disagg
            if p < 1 or d < 1:
                raise InvalidArgument(f"disaggregation needs >= 1 prefill and >= 1 decode replica, got {p}:{d}")
        elif self.replicas < 1:
            raise InvalidArgument(f"replicas must be >= 1, got {self.replicas}", param="replicas")
        if self.num_replicas > MAX_REPLICAS:
            raise InvalidArgument(
                f"replicas: at most {MAX_REPLICAS:,} in one simulation, got {self.num_replicas:,}", param="replicas"
            )
        if self.router not in ROUTERS:
            raise InvalidArgument(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.link_bandwidth_bytes_per_s is not None and not self.link_bandwidth_bytes_per_s > 0:
            raise InvalidArgument(f"link bandwidth must be > 0 bytes/s, got {self.link_bandwidth_bytes_per_s}")
        if self.link_latency_s < 0:
            raise InvalidArgument(f"link latency must be >= 0 s, got {self.link_latency_s}")
        if self.engine_profile is not None:
            engine_profile(self.engine_profile)  # InvalidArgument naming the known ones

    @property
    def model_spec(self) -> ModelSpec:
        return self.model if isinstance(self.model, ModelSpec) else get_model(self.model)

    @property
    def hardware_spec(self) -> HardwareSpec:
        return self.hardware if isinstance(self.hardware, HardwareSpec) else get_hardware(self.hardware)

    @property
    def extrapolation(self) -> tuple[str, ...]:
        """Why the roofline's price for this deployment rests on no kernel measured for it (none
        under a calibrated profile, which is measured)."""
        if self.cost_model is not None:
            return ()
        from servelab.cost.roofline import extrapolation

        return extrapolation(self.model_spec, self.hardware_spec, self.weight_dtype, self.kv_cache_dtype, self.tp)

    @property
    def spec_config(self) -> SpeculativeConfig:
        assert isinstance(self.speculative, SpeculativeConfig)  # parsed in __post_init__
        return self.speculative

    def speculation(self) -> Speculation | None:
        """The draft and acceptance models of a speculative run, the draft priced on the same devices."""
        if self.speculative is None:
            return None
        assert self.spec_acceptance is not None  # __post_init__ requires it
        config = self.spec_config
        if self.cost_model is not None and config.method == "draft_model":
            draft = DraftCost(config, self._measured_draft(config))
        else:
            draft = draft_cost(
                config, self.hardware_spec, self.weight_dtype, self.kv_cache_dtype, self.tp, efficiency=self.efficiency
            )
        return Speculation(config, self.spec_acceptance, draft)

    def _measured_draft(self, config: SpeculativeConfig) -> StepCostModel:
        """A calibrated profile prices only the model it measured, on its own host: a draft that is
        that model runs its passes at the profile's step times, less the serving term (a draft pass
        streams nothing); any other draft has no measured price there and is refused."""
        draft = draft_model_spec(config)
        assert draft is not None  # method draft_model
        target = self.model_spec
        if _dims(draft) != _dims(target):
            raise InvalidArgument(
                f"speculative_config.model {config.model!r} ({draft.name}) is not the model the calibrated "
                f"profile measured ({target.name}): a step cost profile has no price for another model on its "
                "host; simulate the draft model on a catalog accelerator instead",
                param="speculative_config",
            )
        assert self.cost_model is not None  # only called under a profile
        without_serving = getattr(self.cost_model, "without_serving", None)
        return without_serving() if callable(without_serving) else self.cost_model

    @property
    def num_replicas(self) -> int:
        return sum(self.disagg) if self.disagg else self.replicas

    @property
    def num_devices(self) -> int:
        return self.num_replicas * self.tp

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_spec.name,
            "hardware": self.hardware_spec.name,
            "tp": self.tp,
            "weight_dtype": self.weight_dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "replicas": None if self.disagg else self.replicas,
            "disagg": None if self.disagg is None else f"{self.disagg[0]}:{self.disagg[1]}",
            "num_devices": self.num_devices,
            "router": self.router,
            "engine_profile": self.engine_profile,
            "scheduler": self.scheduler.policy,
            "admission": self.scheduler.admission,
            "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            "max_num_seqs": self.scheduler.max_num_seqs,
            "max_model_len": self.scheduler.max_model_len,
            "block_size": self.scheduler.block_size,
            "enable_prefix_caching": self.scheduler.enable_prefix_caching,
            "memory_fraction": self.memory_fraction,
            "num_blocks": self.scheduler.num_blocks,
            "link_bandwidth_bytes_per_s": self.link_bandwidth_bytes_per_s,
            "link_latency_s": self.link_latency_s,
            "cost_model": "roofline" if self.cost_model is None else _describe(self.cost_model),
            "extrapolation": list(self.extrapolation),
            "host_cost": None if self.host_cost is None or self.cost_model is not None else self.host_cost.describe(),
            "speculative_config": None if self.speculative is None else self.spec_config.to_json(),
            "spec_acceptance": None if self.spec_acceptance is None else self.spec_acceptance.to_dict(),
            "slo": None if self.slo is None else self.slo.to_dict(),
        }


def engine_sim_config(profile: str, *, scheduler: Mapping[str, Any] | None = None, **fields: Any) -> SimConfig:
    """A SimConfig for the deployment in `fields` (SimConfig's own: model, hardware, tp, dtypes,
    replicas, ...) run as `profile` runs it: its scheduler with the knobs in `scheduler` winning,
    its KV memory share (unless `memory_fraction` is among `fields`), its host cost and its roofline
    terms (unless `efficiency` is among `fields`)."""
    base = SimConfig(**fields)
    overrides = dict(scheduler or {})
    settings = engine_profile(profile).settings(
        base.model_spec,
        base.hardware_spec,
        tp=base.tp,
        weight_dtype=base.weight_dtype,
        kv_cache_dtype=base.kv_cache_dtype,
        num_blocks=overrides.get("num_blocks"),
        block_size=overrides.get("block_size", SchedulerConfig().block_size),
        max_model_len=overrides.get("max_model_len"),
        memory_fraction=fields.get("memory_fraction"),
    )
    return replace(
        base,
        engine_profile=settings.profile,
        scheduler=settings.scheduler_config(overrides),
        memory_fraction=settings.memory_fraction,
        host_cost=settings.host,
        efficiency=base.efficiency if "efficiency" in fields else settings.efficiency,
    )


@dataclass(slots=True)
class SimResult:
    records: list[RequestRecord]
    # The whole run's summary, or how to make it: made when first read (`summary`), since a
    # caller of the steady state alone (`plan`) never reads it.
    whole: Summary | Callable[[], Summary] = field(repr=False)
    trace: StepTrace
    replica_stats: list[dict[str, Any]]
    config: dict[str, Any]
    kv_transfer_s: Dist = field(default_factory=Dist)
    kv_transfer_bytes: float = 0.0
    wall_s: float = 0.0
    # The run without its warm-up (by default a closed loop's start-up wave: all clients at once),
    # as `servelab bench` and `servelab plan` report it; None when nothing is excluded or left.
    steady: Summary | None = None
    warmup_requests_excluded: int = 0
    warmup_s: float = 0.0
    # Speculative runs: what was modelled and what the run accepted (`realised`).
    speculation: dict[str, Any] | None = None
    stopped_early: str = ""  # why `simulate(stop=...)` ended the run before every request finished
    # A stopped run's way on: the whole run's result, as if it had never stopped.
    resume: Callable[[], SimResult] | None = field(default=None, repr=False)

    @property
    def summary(self) -> Summary:
        """The whole run's summary, warm-up included."""
        if not isinstance(self.whole, Summary):
            self.whole = self.whole()
        return self.whole

    @property
    def num_steps(self) -> int:
        return len(self.trace)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"summary": self.summary.to_dict(), "config": self.config}
        out["replicas"] = self.replica_stats
        if self.config.get("disagg"):
            out["kv_transfer"] = {"time_s": self.kv_transfer_s.to_dict(), "total_bytes": self.kv_transfer_bytes}
        if self.steady is not None:
            out["steady_state"] = {"startup_requests_excluded": self.warmup_requests_excluded,
                                   "warmup_s": self.warmup_s, "summary": self.steady.to_dict()}  # fmt: skip
        if self.speculation is not None:
            out["speculation"] = self.speculation
        out["sim"] = {"steps": self.num_steps, "wall_s": self.wall_s}
        if self.stopped_early:
            out["sim"]["stopped_early"] = self.stopped_early
        return out

    @property
    def steady_or_whole(self) -> Summary:
        return self.summary if self.steady is None else self.steady

    @property
    def peak_running(self) -> int:
        """Most sequences in one replica's step over the run."""
        return max(self.trace.num_seqs, default=0)

    @property
    def peak_kv_usage(self) -> float:
        """Highest fraction of a replica's KV pool in use at a step's start over the run."""
        return max(self.trace.kv_usage, default=0.0)


def _dims(spec: ModelSpec) -> tuple[int, ...]:
    """What makes two specs the same network for pricing (names differ: catalog vs file)."""
    return (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.ffn_size,
            spec.vocab_size, spec.num_experts, spec.num_active_experts)  # fmt: skip


def _describe(cost_model: StepCostModel) -> str:
    """A cost model's own one-line description (a profile's form and serving term), else its type."""
    describe = getattr(cost_model, "describe", None)
    return describe() if callable(describe) else type(cost_model).__name__


def build_cost_model(config: SimConfig) -> StepCostModel:
    if config.cost_model is not None:
        return config.cost_model
    from servelab.cost.roofline import Efficiency, Roofline

    roofline = Roofline(
        config.model_spec,
        config.hardware_spec,
        weight_dtype=config.weight_dtype,
        kv_dtype=config.kv_cache_dtype,
        tp=config.tp,
        efficiency=config.efficiency if config.efficiency is not None else Efficiency(),
    )
    if config.host_cost is None:
        return roofline
    # A calibrated profile (above) measured its own engine's host work: the host cost prices the roofline only.
    return HostOverheadCost(roofline, config.host_cost, config.model_spec.num_layers)


def transfer_bytes(config: SimConfig) -> Callable[[int], float]:
    """The KV bytes a disaggregated prefill of n prompt tokens sends: what each of its TP ranks
    holds (a sliding-window layer only its window; a KV head shared by ranks, once a rank), summed
    over the ranks, as the decode replica's ranks each receive their own."""
    plan = MemoryPlan(
        config.model_spec, config.hardware_spec, config.weight_dtype, config.kv_cache_dtype, config.tp,
        config.memory_fraction,
    )  # fmt: skip
    return lambda n: plan.kv_bytes_per_sequence(n) * config.tp


def scheduler_config(config: SimConfig) -> ResolvedSchedulerConfig:
    """One replica's scheduler: the KV pool is what the memory plan leaves after the weights."""
    model = config.model_spec
    groups = KVGroups.of_model(model)  # a windowed model's pages hold a group's layers (spec/kv_groups.py)
    num_blocks = config.scheduler.num_blocks
    if num_blocks is None:
        plan = MemoryPlan(
            model, config.hardware_spec, config.weight_dtype, config.kv_cache_dtype, config.tp, config.memory_fraction
        )
        plan.require_weights_fit()
        # A draft model's weights and KV share the devices with the target's.
        draft = None if config.speculative is None else draft_model_spec(config.spec_config)
        num_blocks = groups.pages_in(kv_tokens_beside_draft(plan, draft) // config.scheduler.block_size)
        if num_blocks < 1:
            raise DoesNotFit(f"{plan.describe()}: no room left for even one KV block after the weights")
    return config.scheduler.resolve(
        num_blocks=num_blocks,
        max_model_len=config.scheduler.max_model_len or model.max_context,
        kv_group_windows=groups.windows,
    )


def kv_slots_needed(prompt_tokens: int, output_tokens: int) -> int:
    """KV slots a request holds at its end: every token but the last sampled one (never fed back)."""
    return prompt_tokens + max(output_tokens - 1, 0)


def _check_lengths(requests: list[RequestSpec], sched: ResolvedSchedulerConfig) -> None:
    """Refuse up front, naming the request, rather than fail requests one by one mid-run, or
    (a request that outgrows the whole pool) silently stop its output short of what was asked."""
    limit = sched.max_model_len
    pool = sched.kv_capacity_tokens
    for r in requests:
        if r.prompt_tokens + r.output_tokens > limit:
            raise RequestTooLong(
                f"request {r.index}: prompt {r.prompt_tokens} + output {r.output_tokens} tokens exceeds "
                f"max_model_len {limit}; shorten --input-len/--output-len or raise --max-model-len"
            )
        if sched.policy == "decode-first-whole" and r.prompt_tokens > sched.max_num_batched_tokens:
            raise RequestTooLong(
                whole_prompt_too_long(f"request {r.index}", r.prompt_tokens, sched.max_num_batched_tokens)
            )
        if r.prompt_tokens > pool:
            raise RequestTooLong(
                f"request {r.index}: prompt of {r.prompt_tokens} tokens can never fit a replica's KV pool "
                f"of {pool} tokens"
            )
        if kv_slots_needed(r.prompt_tokens, r.output_tokens) > pool:
            raise RequestTooLong(
                f"request {r.index}: prompt {r.prompt_tokens} + output {r.output_tokens} tokens can never fit a "
                f"replica's KV pool of {pool} tokens (its output would be cut short); shorten --input-len/"
                f"--output-len, or make room with --kv-cache-dtype fp8, a larger --tp or a bigger accelerator"
            )


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection while the event loop runs: a run allocates millions of
    short-lived objects and keeps thousands of sequences and records alive, so the collector's
    passes over them took a tenth of a run, to free a few thousand objects (about one per
    request) that it frees when the run is over instead."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def simulate(
    config: SimConfig,
    workload: WorkloadSpec | list[RequestSpec],
    progress: bool = False,
    concurrency: int | None = None,
    warmup_requests: int | None = None,
    warmup_s: float = 0.0,
    check: Callable[[], None] | None = None,
    stop: Callable[[RequestRecord], str] | None = None,
) -> SimResult:
    """Run a workload through the simulated cluster. With a list of RequestSpec, `concurrency`
    caps requests in flight (a closed loop when they carry no arrival times; there each request's
    `think_s` is its client's pause after it ended, before the client takes the next).

    The steady-state summary leaves out the first `warmup_requests` requests (default: a closed
    loop's start-up wave, `concurrency` requests; none for an open loop) and those arriving
    before `warmup_s`. `check`, called every few thousand events, ends the run by raising (a
    caller's time budget or shutdown). `stop`, shown each request's record as it finishes, ends
    the run when it returns a reason (`SimResult.stopped_early`; the summaries then cover the
    requests that finished)."""
    if isinstance(workload, WorkloadSpec):
        requests = workload.generate()
        concurrency = workload.concurrency
        seed = workload.seed
    else:
        requests = list(workload)
        seed = 0
    if not requests:
        raise InvalidArgument("the workload has no requests")
    indices = [r.index for r in requests]
    if min(indices) < 0 or len(set(indices)) < len(indices):
        # A request's index names it (its records, its simulated prompt's own tokens and blocks).
        raise InvalidArgument("each request needs its own index >= 0: the list repeats one or holds a negative one")
    closed_loop = requests[0].arrival_s is None
    if closed_loop and concurrency is None:
        raise InvalidArgument("requests without arrival times need a concurrency (closed loop)")
    if concurrency is not None and concurrency < 1:  # 0 would queue every arrival and send none
        raise InvalidArgument(f"concurrency must be >= 1, got {concurrency}", param="concurrency")
    thinks = [r.think_s for r in requests]
    if not all(math.isfinite(t) and t >= 0 for t in thinks):
        raise InvalidArgument(f"think times must be finite durations >= 0 s, got {min(thinks)} .. {max(thinks)}")
    if any(thinks) and not closed_loop:
        raise InvalidArgument("a think time paces a closed loop; these requests carry their own arrival times")
    if warmup_requests is None:
        warmup_requests = (concurrency or 0) if closed_loop else 0  # a closed loop has a concurrency
    if warmup_requests < 0 or warmup_s < 0:
        raise InvalidArgument(f"the warm-up must be >= 0, got {warmup_requests} requests, {warmup_s:g} s")
    sched = scheduler_config(config)
    _check_lengths(requests, sched)
    cost_model = build_cost_model(config)
    if config.disagg:
        # On the decode side a transferred prompt costs nothing to "prefill", so give it a budget
        # that admits any prompt in one step rather than dribbling it in over several.
        decode_budget = max(sched.max_num_batched_tokens, sched.max_model_len + sched.max_num_seqs)
        decode = replace(sched, max_num_batched_tokens=decode_budget)
        pools = {"prefill": (config.disagg[0], sched), "decode": (config.disagg[1], decode)}
    else:
        pools = {"mixed": (config.replicas, sched)}
    link_bw = config.link_bandwidth_bytes_per_s or DEFAULT_LINK_BYTES_PER_S_PER_DEVICE * config.tp
    speculation = config.speculation()
    sim = ClusterSim(
        pools,
        cost_model,
        router=config.router,
        seed=seed,
        kv_bytes=transfer_bytes(config) if config.disagg else None,
        link_bandwidth_bytes_per_s=link_bw,
        link_latency_s=config.link_latency_s,
        speculation=speculation,
    )
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), unit="req", desc="simulating", file=sys.stderr, mininterval=0.5)
    start = time.perf_counter()
    try:
        with _gc_paused():
            out = sim.run(requests, concurrency, on_done=None if bar is None else bar.update, check=check, stop=stop)
    finally:
        if bar is not None:
            bar.close()
    wall_s = time.perf_counter() - start

    def result(out: LoopResult, wall_s: float) -> SimResult:
        preemptions = sum(r.scheduler.num_preemptions for r in out.replicas)
        whole = functools.partial(summarize, out.records, out.duration_s, config.num_devices, config.slo, preemptions)
        steady = None
        if warmup_requests or warmup_s:
            steady = steady_state_summary(
                out.records,
                skip_first=warmup_requests,
                after_s=warmup_s,
                num_devices=config.num_devices,
                slo=config.slo,
                preemption_times_s=out.preempted_s,
            )
        cfg = config.to_dict()
        cfg["max_model_len"] = sched.max_model_len
        cfg["num_blocks"] = sched.num_blocks
        cfg["kv_capacity_tokens"] = sched.kv_capacity_tokens
        if config.disagg:
            cfg["link_bandwidth_bytes_per_s"] = link_bw
        if isinstance(workload, WorkloadSpec):
            cfg["workload"] = workload.to_dict()
        else:
            cfg["workload"] = {
                "num_requests": len(requests),
                "concurrency": concurrency,
                "mean_think_time_s": sum(thinks) / len(thinks),
                "source": "request list",
            }
        return SimResult(
            records=out.records,
            whole=whole,
            trace=out.trace,
            replica_stats=[r.stats() for r in out.replicas],
            config=cfg,
            kv_transfer_s=Dist.of(out.kv_transfer_s),
            kv_transfer_bytes=out.kv_transfer_bytes,
            wall_s=wall_s,
            steady=steady,
            warmup_requests_excluded=0 if steady is None else len(out.records) - steady.num_requests,
            warmup_s=warmup_s,
            stopped_early=out.stopped_early,
            resume=None if out.resume is None else functools.partial(resumed, out.resume),
            speculation=None
            if speculation is None
            else {
                **speculation.describe(),
                "realised": realised([r.scheduler.spec_counters for r in out.replicas]),
                "draft_busy_s": sum(getattr(r.executor, "draft_s", 0.0) for r in out.replicas),
            },
        )

    def resumed(resume: Callable[[], LoopResult]) -> SimResult:
        start = time.perf_counter()
        with _gc_paused():
            out = resume()
        return result(out, wall_s + time.perf_counter() - start)

    return result(out, wall_s)


__all__ = ["SimConfig", "SimResult", "build_cost_model", "kv_slots_needed", "scheduler_config", "simulate"]
