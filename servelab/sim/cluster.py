"""The discrete-event loop: arrivals, step completions and KV transfers on a virtual clock.

Each replica runs the engine's own Scheduler; a step is planned at time t, timed by the
SimExecutor's cost model and completes at t + duration, when `Scheduler.update` appends the
tokens (so token times are step end times). Nothing sleeps: the clock jumps from event to event.

Disaggregated mode: a request first runs on a prefill replica with max_tokens=1 (its sampled
token is dropped, as a vLLM disaggregation proxy does). Its KV then crosses the prefill
replica's link, one transfer at a time (bytes / bandwidth, plus a latency that overlaps the next
transfer), and joins a decode replica's scheduler, which must find it blocks. There every
prompt position but the last costs nothing (the KV is already there); the last prompt token is
recomputed and samples the first output token, so TTFT includes the transfer.
"""

from __future__ import annotations

import heapq
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from servelab.core.config import SchedulerConfig
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import SamplingParams, Sequence
from servelab.errors import ServelabError
from servelab.metrics import RequestRecord
from servelab.sim.executor import SimExecutor, StepCostModel
from servelab.sim.implicit_decodes import ImplicitDecodeScheduler, SimSequence
from servelab.sim.router import Router
from servelab.workload import RequestSpec, simulated_prompt

_ARRIVE, _STEP_DONE, _KV_ARRIVE = 0, 1, 2


@dataclass(slots=True, eq=False)
class Replica:
    index: int
    role: str  # "mixed" | "prefill" | "decode"
    scheduler: Scheduler
    executor: SimExecutor
    busy: bool = False
    outstanding: int = 0  # requests routed here and not yet done here
    num_steps: int = 0
    busy_s: float = 0.0
    link_free_s: float = 0.0  # prefill replicas: when the outgoing KV link is free

    def stats(self) -> dict:
        s = self.scheduler.stats()
        return {
            "replica": self.index,
            "role": self.role,
            "num_blocks": self.scheduler.config.num_blocks,
            "steps": self.num_steps,
            "busy_s": self.busy_s,
            "preemptions": s.num_preemptions,
            "finished": s.num_finished,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        }


@dataclass(slots=True)
class StepTrace:
    """One row per executed step, as columns (compact for hundreds of thousands of steps)."""

    replica: array = field(default_factory=lambda: array("i"))
    start_s: array = field(default_factory=lambda: array("d"))
    duration_s: array = field(default_factory=lambda: array("d"))
    num_seqs: array = field(default_factory=lambda: array("i"))
    num_decode: array = field(default_factory=lambda: array("i"))
    num_tokens: array = field(default_factory=lambda: array("i"))
    kv_usage: array = field(default_factory=lambda: array("d"))  # at the step's start, after planning

    def __len__(self) -> int:
        return len(self.start_s)


@dataclass(slots=True, eq=False)
class _Request:
    spec: RequestSpec
    sent_s: float
    prompt_token_ids: list[int]
    prompt_block_hashes: list[int]
    first_scheduled_s: float | None = None
    num_cached_tokens: int = 0
    transfer_s: float = 0.0
    prefill_replica: Replica | None = None


@dataclass(slots=True)
class LoopResult:
    records: list[RequestRecord]
    duration_s: float
    trace: StepTrace
    replicas: list[Replica]
    kv_transfer_s: list[float]
    kv_transfer_bytes: float


class ClusterSim:
    def __init__(
        self,
        pools: dict[str, tuple[int, SchedulerConfig]],
        cost_model: StepCostModel,
        *,
        router: str = "round-robin",
        seed: int = 0,
        kv_bytes_per_token: float = 0.0,
        link_bandwidth_bytes_per_s: float = float("inf"),
        link_latency_s: float = 0.0,
    ) -> None:
        """`pools` maps a role ("mixed", or "prefill" and "decode") to (replica count, config)."""
        self.replicas: list[Replica] = []
        self.pools: dict[str, list[Replica]] = {}
        # Every simulated token is this id, so steady decodes can run implicitly; that needs a
        # cost model that prices a step from its sums (the roofline does).
        token = 1
        implicit = getattr(cost_model, "time_from_totals", None) is not None
        for role, (count, config) in pools.items():
            pool = []
            for _ in range(count):
                scheduler = (
                    ImplicitDecodeScheduler(config, token, keep_finished=0) if implicit
                    else Scheduler(config, keep_finished=0)
                )
                replica = Replica(len(self.replicas), role, scheduler, SimExecutor(cost_model, token))
                pool.append(replica)
                self.replicas.append(replica)
            self.pools[role] = pool
        self.disagg = "prefill" in self.pools
        self.entry_pool = self.pools["prefill" if self.disagg else "mixed"]
        self.entry_router = Router(router)
        self.decode_router = Router(router)
        # Simulated prompts carry their block hashes, so every pool must cut blocks alike.
        sizes = {config.block_size for _, config in pools.values()}
        if len(sizes) != 1:
            raise ValueError(f"all pools must share one block size, got {sorted(sizes)}")
        self.block_size = sizes.pop()
        self.seed = seed
        self.kv_bytes_per_token = kv_bytes_per_token
        self.link_bandwidth_bytes_per_s = link_bandwidth_bytes_per_s
        self.link_latency_s = link_latency_s

    def run(
        self,
        requests: list[RequestSpec],
        concurrency: int | None = None,
        on_done: Callable[[int], None] | None = None,
    ) -> LoopResult:
        """`concurrency` caps requests in flight; with no arrival times it is a closed loop."""
        events: list[tuple] = []
        counter = 0
        trace = StepTrace()
        records: list[RequestRecord] = []
        live: dict[str, _Request] = {}
        transfers: list[float] = []
        transfer_bytes = 0.0
        in_flight = 0
        pending: deque[RequestSpec] = deque()
        closed = bool(requests) and requests[0].arrival_s is None
        if closed:
            pending.extend(requests)
            arrivals: list[RequestSpec] = []
        else:
            arrivals = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        next_arrival = 0
        now = 0.0
        heappush, heappop = heapq.heappush, heapq.heappop

        def push(t: float, kind: int, a, b=None) -> None:
            nonlocal counter
            counter += 1
            heappush(events, (t, counter, kind, a, b))

        def start_step(replica: Replica, t: float) -> None:
            sched = replica.scheduler
            plan = sched.schedule(t)
            if plan.is_empty:
                replica.busy = False
                return
            result = replica.executor.execute(plan)
            dur = result.duration_s
            replica.busy = True
            replica.num_steps += 1
            replica.busy_s += dur
            trace.replica.append(replica.index)
            trace.start_s.append(t)
            trace.duration_s.append(dur)
            trace.num_seqs.append(plan.num_seqs)
            trace.num_decode.append(replica.executor.last_num_decode)
            trace.num_tokens.append(plan.num_batched_tokens)
            trace.kv_usage.append(sched.block_manager.usage)
            push(t + dur, _STEP_DONE, replica, (plan, result))

        def kick(replica: Replica, t: float) -> None:
            if not replica.busy:
                start_step(replica, t)

        def fail(req: _Request, t: float, error: str) -> None:
            records.append(
                RequestRecord(
                    str(req.spec.index), req.sent_s, req.first_scheduled_s, None, array("d"), t,
                    req.spec.prompt_tokens, 0, success=False, error=error,
                )
            )
            finish_client(req, t)

        def finish_client(req: _Request, t: float) -> None:
            nonlocal in_flight
            del live[str(req.spec.index)]
            in_flight -= 1
            if on_done is not None:
                on_done(1)
            if pending and (closed or in_flight < (concurrency or 0)):
                send(pending.popleft(), t)

        def add_to(replica: Replica, seq: Sequence, req: _Request, t: float) -> bool:
            try:
                replica.scheduler.add(seq, t)
            except ServelabError as exc:
                fail(req, t, exc.message)
                return False
            replica.outstanding += 1
            kick(replica, t)
            return True

        def send(spec: RequestSpec, t: float) -> None:
            nonlocal in_flight
            in_flight += 1
            ids, hashes = simulated_prompt(spec, self.block_size, self.seed)
            req = _Request(spec, t, ids, hashes)
            rid = str(spec.index)
            live[rid] = req
            max_tokens = 1 if self.disagg else spec.output_tokens
            seq = SimSequence(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=t)
            seq.block_hashes = list(hashes)  # the prefix cache would compute the same identities
            replica = self.entry_router.pick(self.entry_pool)
            req.prefill_replica = replica
            add_to(replica, seq, req, t)

        def on_finished(replica: Replica, seq: Sequence, t: float) -> None:
            nonlocal transfer_bytes
            replica.outstanding -= 1
            req = live[seq.request_id]
            if req.first_scheduled_s is None:
                req.first_scheduled_s = seq.first_scheduled_s
                req.num_cached_tokens = seq.num_cached_tokens
            if replica.role == "prefill":
                nbytes = self.kv_bytes_per_token * req.spec.prompt_tokens
                start = max(t, replica.link_free_s)
                wire_s = nbytes / self.link_bandwidth_bytes_per_s
                replica.link_free_s = start + wire_s
                done = start + wire_s + self.link_latency_s
                req.transfer_s = done - t
                transfers.append(done - t)
                transfer_bytes += nbytes
                push(done, _KV_ARRIVE, req)
                return
            times = array("d", seq.token_times_s)
            ok = seq.finish_reason is not None and seq.finish_reason.value == "length"
            records.append(
                RequestRecord(
                    seq.request_id, req.sent_s, req.first_scheduled_s, seq.first_token_s, times, t,
                    req.spec.prompt_tokens, seq.num_output_tokens, success=ok,
                    error=None if ok else f"finished with {seq.finish_reason}",
                    num_cached_tokens=req.num_cached_tokens,
                )
            )
            finish_client(req, t)

        # Closed loop and capped open loop start with as many requests as the cap allows.
        if closed:
            for _ in range(min(concurrency or len(pending), len(pending))):
                send(pending.popleft(), 0.0)
        if arrivals:
            push(arrivals[0].arrival_s, _ARRIVE, arrivals[0])
            next_arrival = 1

        while events:
            now, _, kind, a, b = heappop(events)
            if kind == _STEP_DONE:
                replica: Replica = a
                plan, result = b
                # Only finished requests matter here: nothing streams in a simulation.
                outputs = replica.scheduler.update(plan, result, now, finished_only=True)
                for out in outputs:
                    if out.finished:
                        on_finished(replica, out.seq, now)
                start_step(replica, now)
            elif kind == _ARRIVE:
                if next_arrival < len(arrivals):
                    nxt = arrivals[next_arrival]
                    push(nxt.arrival_s, _ARRIVE, nxt)
                    next_arrival += 1
                if concurrency is not None and in_flight >= concurrency:
                    pending.append(a)
                else:
                    send(a, now)
            else:  # _KV_ARRIVE on the decode side
                req: _Request = a
                rid = str(req.spec.index)
                replica = self.decode_router.pick(self.pools["decode"])
                seq = SimSequence(
                    rid, req.prompt_token_ids, SamplingParams(max_tokens=req.spec.output_tokens, ignore_eos=True),
                    arrival_s=req.sent_s,
                )
                seq.block_hashes = list(req.prompt_block_hashes)
                replica.executor.preloaded[rid] = req.spec.prompt_tokens - 1
                if not add_to(replica, seq, req, now):
                    replica.executor.preloaded.pop(rid, None)

        # Anything still live never got a step (a scheduler that cannot make progress): count it.
        pending.clear()
        for req in list(live.values()):
            fail(req, now, "never completed: the simulation ran out of events")
        return LoopResult(records, now, trace, self.replicas, transfers, transfer_bytes)
