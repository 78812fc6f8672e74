"""The discrete-event loop: arrivals, step completions and KV transfers on a virtual clock.

Each replica runs the engine's own Scheduler (as ImplicitDecodeScheduler, which decides the same
but skips steady decodes, when the cost model prices a step from its sums); a step is planned at
time t, timed by the SimExecutor's cost model and completes at t + duration, when
`Scheduler.update` appends the tokens (so token times are step end times). Nothing sleeps: the
clock jumps from event to event. `ClusterRun` is one run: its state and one method per event.

Disaggregated mode: a request's decode replica is picked with its prefill replica (as the front
end does), and it first runs on the prefill replica with max_tokens=1 (its sampled token is
dropped, as a vLLM disaggregation proxy does). Its KV then crosses the prefill replica's link,
one transfer at a time (bytes / bandwidth, plus a latency that overlaps the next transfer): the
blocks past the decode replica's own prefix-cache hits, as a decode worker asks for. It then
joins the decode replica's scheduler, which must find it blocks. There every
prompt position but the last costs nothing (the KV is already there); the last prompt token is
recomputed and samples the first output token, so TTFT includes the transfer.
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from servelab.core.config import SchedulerConfig
from servelab.core.plan import StepPlan, StepResult
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import SamplingParams, Sequence
from servelab.errors import ServelabError
from servelab.metrics import RequestRecord
from servelab.sim.executor import SimExecutor, StepCostModel
from servelab.sim.implicit_decodes import ImplicitDecodeScheduler, SimSequence
from servelab.sim.speculative import RequestAcceptances, Speculation, SpeculativeSimExecutor, propose
from servelab.core.router import Router
from servelab.workload import RequestSpec, has_own_tokens, simulated_prompt

CHECK_EVERY_EVENTS = 1024  # a few milliseconds of simulation between a run's `check` calls


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

    @property
    def kv_usage(self) -> float:
        return self.scheduler.block_manager.usage

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

    def copy(self) -> StepTrace:
        columns = (self.replica, self.start_s, self.duration_s, self.num_seqs, self.num_decode, self.num_tokens,
                   self.kv_usage)  # fmt: skip
        return StepTrace(*(array(column.typecode, column) for column in columns))


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
    # Disaggregated: the decode replica its KV goes to, picked with its prefill replica (as the
    # front end does) and counting it as outstanding from then on.
    decode_replica: Replica | None = None


@dataclass(slots=True)
class LoopResult:
    records: list[RequestRecord]
    duration_s: float
    trace: StepTrace
    replicas: list[Replica]
    kv_transfer_s: list[float]
    kv_transfer_bytes: float
    preempted_s: list[float]  # when each preemption happened (the start of the step that made it)
    stopped_early: str = ""  # why `stop` ended the run before every request finished
    # A stopped run goes on to its end from where it stopped, as if it never had (its own
    # result: this one's records and trace stay as they were at the stop).
    resume: Callable[[], LoopResult] | None = None


class ClusterSim:
    def __init__(
        self,
        pools: Mapping[str, tuple[int, SchedulerConfig]],
        cost_model: StepCostModel,
        *,
        router: str = "round-robin",
        seed: int = 0,
        kv_bytes: Callable[[int], float] | None = None,
        link_bandwidth_bytes_per_s: float = float("inf"),
        link_latency_s: float = 0.0,
        speculation: Speculation | None = None,
    ) -> None:
        """`pools` maps a role ("mixed", or "prefill" and "decode") to (replica count, config).
        With `speculation`, every decoding sequence proposes its drafts before each step.
        `kv_bytes(n)`: the bytes a prefill of n prompt tokens sends to a decode replica (None: none)."""
        self.replicas: list[Replica] = []
        self.pools: dict[str, list[Replica]] = {}
        # Every simulated token is this id, so steady decodes can run implicitly; that needs a
        # cost model that prices a step from its sums (the roofline does). A speculative decode
        # advances by a drawn number of tokens a step, and a sliding-window group frees pages as
        # a decode moves on, neither of which implicit decodes express.
        token = 1
        windowed = any(w is not None for _, config in pools.values() for w in config.resolve().kv_group_windows)
        implicit = getattr(cost_model, "time_from_totals", None) is not None and speculation is None and not windowed
        self.drafts = [token] * speculation.k if speculation is not None else None
        # Each request's acceptance; with no per-request profile a step's coverage is one number.
        acceptances = None if speculation is None else RequestAcceptances(speculation.acceptance, f"{seed}:acceptance")
        self.acceptances = acceptances
        self.draft_coverage: float | RequestAcceptances = 1.0
        if speculation is not None and acceptances is not None:
            per_request = speculation.acceptance.per_request
            self.draft_coverage = acceptances if per_request else speculation.acceptance.coverage
        self.propose_rng = random.Random(f"{seed}:propose")  # which steps draft, at a coverage under 1
        for role, (count, config) in pools.items():
            pool = []
            for _ in range(count):
                scheduler = (
                    ImplicitDecodeScheduler(config, token, keep_finished=0)
                    if implicit
                    else Scheduler(config, keep_finished=0)
                )
                index = len(self.replicas)
                executor: SimExecutor = SimExecutor(cost_model, token)
                if speculation is not None and self.acceptances is not None:
                    executor = SpeculativeSimExecutor(
                        cost_model, speculation, self.acceptances, f"{seed}:{index}", token
                    )
                replica = Replica(index, role, scheduler, executor)
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
        self.kv_bytes = kv_bytes
        self.link_bandwidth_bytes_per_s = link_bandwidth_bytes_per_s
        self.link_latency_s = link_latency_s

    def run(
        self,
        requests: list[RequestSpec],
        concurrency: int | None = None,
        on_done: Callable[[int], None] | None = None,
        check: Callable[[], None] | None = None,
        stop: Callable[[RequestRecord], str] | None = None,
    ) -> LoopResult:
        """`concurrency` caps requests in flight; with no arrival times it is a closed loop, whose
        clients send their next request a finished request's `think_s` after it ended. `check`
        is called every CHECK_EVERY_EVENTS events: what it raises ends the run (a time budget,
        a shutdown). `stop` sees each request's record as it finishes; a reason it returns ends
        the run after that event, with the unfinished requests left out of the records, and
        `LoopResult.resume` runs it on to its end."""
        return ClusterRun(self, requests, concurrency, on_done, check, stop).run()


class ClusterRun:
    """One run of a ClusterSim: the event queue and the run's state as attributes, one method per
    event kind (`arrive`, `step_done`, `kv_arrive`, `think_done`). An event is (time, serial,
    handler, a, b); the serial breaks ties in the order events were pushed."""

    def __init__(
        self,
        sim: ClusterSim,
        requests: list[RequestSpec],
        concurrency: int | None,
        on_done: Callable[[int], None] | None,
        check: Callable[[], None] | None = None,
        stop: Callable[[RequestRecord], str] | None = None,
    ) -> None:
        self.sim = sim
        self.stop = stop
        self.stopped_early = ""
        self.steps_in_place = 0  # by run_quiet_steps since the last event
        self.preempted_s: list[float] = []
        self.concurrency = concurrency
        self.on_done = on_done
        self.check = check
        self.events: list[tuple] = []
        self.counter = 0
        self.now = 0.0
        self.trace = StepTrace()
        self.records: list[RequestRecord] = []
        self.live: dict[str, _Request] = {}
        self.transfers: list[float] = []
        self.transfer_bytes = 0.0
        self.in_flight = 0
        self.pending: deque[RequestSpec] = deque()
        self.closed = bool(requests) and requests[0].arrival_s is None
        if self.closed:
            self.pending.extend(requests)
            self.arrivals: list[RequestSpec] = []
        else:
            self.arrivals = sorted(requests, key=lambda r: (r.arrival_s, r.index))
        self.next_arrival = 0
        self._params: dict[int, SamplingParams] = {}

    def run(self) -> LoopResult:
        # Closed loop and capped open loop start with as many requests as the cap allows.
        pending = self.pending
        if self.closed:
            for _ in range(min(self.concurrency or len(pending), len(pending))):
                self.send(pending.popleft(), 0.0)
        if self.arrivals:
            self.push_next_arrival()
        return self._loop()

    def _loop(self) -> LoopResult:
        events, heappop, check = self.events, heapq.heappop, self.check
        until_check = CHECK_EVERY_EVENTS
        while events:
            self.now, _, handler, a, b = heappop(events)
            handler(a, b)
            if self.stopped_early:
                return LoopResult(list(self.records), self.now, self.trace.copy(), self.sim.replicas,
                                  list(self.transfers), self.transfer_bytes, list(self.preempted_s),
                                  self.stopped_early, self._resume)  # fmt: skip
            if check is not None:
                # Steps run in place (run_quiet_steps) count as the events they replace.
                until_check -= 1 + self.steps_in_place
                self.steps_in_place = 0
                if until_check <= 0:
                    check()
                    until_check = CHECK_EVERY_EVENTS
        # Anything still live never got a step (a scheduler that cannot make progress): count it.
        self.pending.clear()
        for req in list(self.live.values()):
            self.fail(req, self.now, "never completed: the simulation ran out of events")
        return LoopResult(self.records, self.now, self.trace, self.sim.replicas, self.transfers, self.transfer_bytes,
                          self.preempted_s)  # fmt: skip

    def _resume(self) -> LoopResult:
        self.stop = None
        self.stopped_early = ""
        return self._loop()

    def params(self, max_tokens: int) -> SamplingParams:
        """The sampling params of every request with this output length: one object, checked once
        (nothing in the scheduler writes to a sequence's params)."""
        params = self._params.get(max_tokens)
        if params is None:
            params = self._params[max_tokens] = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return params

    def push(self, t: float, handler: Callable[[Any, Any], None], a: Any, b: Any = None) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, handler, a, b))

    def push_next_arrival(self) -> None:
        spec = self.arrivals[self.next_arrival]
        assert spec.arrival_s is not None  # an open loop's requests all carry their arrival time
        self.push(spec.arrival_s, self.arrive, spec)
        self.next_arrival += 1

    # ---- events --------------------------------------------------------------------------------

    def arrive(self, spec: RequestSpec, _: None) -> None:
        """A request of an open loop arrives: queue the next arrival, then send or hold this one."""
        if self.next_arrival < len(self.arrivals):
            self.push_next_arrival()
        if self.concurrency is not None and self.in_flight >= self.concurrency:
            self.pending.append(spec)
        else:
            self.send(spec, self.now)

    def step_done(self, replica: Replica, step: tuple[StepPlan, StepResult]) -> None:
        """A replica's step ends: apply it, hand on what finished, start the next step."""
        now = self.now
        plan, result = step
        # Only finished requests matter here: nothing streams in a simulation.
        for out in replica.scheduler.update(plan, result, now, finished_only=True):
            if out.finished:
                seq = out.seq
                assert seq is not None  # a scheduler's own outputs carry their sequence
                self.request_finished(replica, seq, now)
        self.start_step(replica, now)

    def think_done(self, _: None, __: None) -> None:
        """A closed-loop client's think time is over: it sends the next request, if one is left."""
        if self.pending:
            self.send(self.pending.popleft(), self.now)

    def kv_arrive(self, req: _Request, seq: SimSequence) -> None:
        """A prefilled request's KV reaches the decode pool: `seq` joins its decode replica."""
        replica = req.decode_replica
        assert replica is not None  # send() picked it
        rid = seq.request_id
        replica.executor.preloaded[rid] = req.spec.prompt_tokens - 1
        if not self.add_to(replica, seq, req, self.now, routed=True):
            replica.executor.preloaded.pop(rid, None)

    # ---- actions -------------------------------------------------------------------------------

    def start_step(self, replica: Replica, t: float) -> None:
        sched = replica.scheduler
        if self.sim.drafts is None and isinstance(sched, ImplicitDecodeScheduler):
            t = self.run_quiet_steps(replica, sched, t)
        if self.sim.drafts is not None:
            propose(sched, self.sim.drafts, self.sim.propose_rng, self.sim.draft_coverage)
        plan = sched.schedule(t)
        if plan.preempted:
            self.preempted_s.extend(repeat(t, len(plan.preempted)))
        if plan.is_empty:
            replica.busy = False
            return
        result = replica.executor.execute(plan)
        dur = result.duration_s
        replica.busy = True
        replica.num_steps += 1
        replica.busy_s += dur
        trace = self.trace
        trace.replica.append(replica.index)
        trace.start_s.append(t)
        trace.duration_s.append(dur)
        trace.num_seqs.append(plan.num_seqs)
        trace.num_decode.append(replica.executor.last_num_decode)
        trace.num_tokens.append(plan.num_batched_tokens)
        trace.kv_usage.append(sched.block_manager.usage)
        self.push(t + dur, self.step_done, replica, (plan, result))

    def run_quiet_steps(self, replica: Replica, sched: ImplicitDecodeScheduler, t: float) -> float:
        """Run, in place, the steps from `t` that are implicit decodes only and end before any
        other event: what start_step, the step's end event and update() would do for each (the
        same trace row, times and clock), without the plan, the result or the event queue.
        Returns when the next step starts, to plan as usual."""
        quiet = sched.quiet_steps()
        if quiet is None:
            return t
        count, context_tokens, steps = quiet
        decode_time_s = replica.executor.decode_time_s
        # Nothing is queued while the steps run in place, so the first event stays first.
        next_event_s = self.events[0][0] if self.events else math.inf
        starts: list[float] = []
        durations: list[float] = []
        busy_s = replica.busy_s
        for _ in range(steps):
            dur = decode_time_s(count, context_tokens)
            if dur is None:
                break
            end = t + dur
            if next_event_s <= end:
                break  # an event comes first (a tie too: it was queued before this step's end)
            starts.append(t)
            durations.append(dur)
            busy_s += dur
            t = end
            context_tokens += count
        n = len(starts)
        if not n:
            return t
        replica.busy = True
        replica.num_steps += n
        replica.busy_s = busy_s
        trace = self.trace
        trace.replica.extend(repeat(replica.index, n))
        trace.start_s.extend(starts)
        trace.duration_s.extend(durations)
        for column in (trace.num_seqs, trace.num_decode, trace.num_tokens):
            column.extend(repeat(count, n))
        trace.kv_usage.extend(repeat(sched.block_manager.usage, n))  # no block is taken or freed in such steps
        ends = starts[1:]  # each step ends where the next starts
        ends.append(t)
        sched.tick_quiet(ends)
        self.now = t
        self.steps_in_place += n
        return t

    def send(self, spec: RequestSpec, t: float) -> None:
        sim = self.sim
        self.in_flight += 1
        ids, hashes = simulated_prompt(spec, sim.block_size, sim.seed)
        req = _Request(spec, t, ids, hashes)
        rid = str(spec.index)
        self.live[rid] = req
        max_tokens = 1 if sim.disagg else spec.output_tokens
        seq = SimSequence(rid, ids, self.params(max_tokens), arrival_s=t)
        seq.unique_chain = has_own_tokens(spec)
        seq.prefix.hashes = list(hashes)  # the prefix cache would compute the same identities
        replica = sim.entry_router.pick(sim.entry_pool, hashes)
        req.prefill_replica = replica
        if sim.disagg:
            req.decode_replica = sim.decode_router.pick(sim.pools["decode"], hashes)
            req.decode_replica.outstanding += 1
        self.add_to(replica, seq, req, t)

    def add_to(self, replica: Replica, seq: Sequence, req: _Request, t: float, *, routed: bool = False) -> bool:
        """Add `seq` to `replica`'s scheduler (a failure fails the request). `routed`: the replica
        counted the request as outstanding when it was picked (a disaggregated decode replica)."""
        try:
            replica.scheduler.add(seq, t)
        except ServelabError as exc:
            self.fail(req, t, exc.message)
            return False
        if not routed:
            replica.outstanding += 1
        if not replica.busy:
            self.start_step(replica, t)
        return True

    def request_finished(self, replica: Replica, seq: Sequence, t: float) -> None:
        """A request finished on a replica: its KV leaves a prefill replica, else it is done."""
        sim = self.sim
        replica.outstanding -= 1
        req = self.live[seq.request_id]
        if req.first_scheduled_s is None:
            req.first_scheduled_s = seq.first_scheduled_s
            req.num_cached_tokens = seq.num_cached_tokens
        if replica.role == "prefill":
            # The decode replica takes the prompt now and is sent only the blocks past what its
            # own prefix cache holds, as a decode worker reserves it before the transfer.
            decode = req.decode_replica
            assert decode is not None  # send() picked it
            decode_seq = SimSequence(
                seq.request_id, req.prompt_token_ids, self.params(req.spec.output_tokens), arrival_s=req.sent_s
            )
            decode_seq.prefix.hashes = list(req.prompt_block_hashes)
            decode_seq.unique_chain = has_own_tokens(req.spec)
            cached = len(decode.scheduler.block_manager.find_cached_prefix(decode_seq)) * sim.block_size
            nbytes = (
                0.0 if sim.kv_bytes is None else max(0.0, sim.kv_bytes(req.spec.prompt_tokens) - sim.kv_bytes(cached))
            )
            start = max(t, replica.link_free_s)
            wire_s = nbytes / sim.link_bandwidth_bytes_per_s
            replica.link_free_s = start + wire_s
            done = start + wire_s + sim.link_latency_s
            req.transfer_s = done - t
            self.transfers.append(done - t)
            self.transfer_bytes += nbytes
            self.push(done, self.kv_arrive, req, decode_seq)
            return
        times = array("d", seq.token_times_s)
        ok = seq.finish_reason is not None and seq.finish_reason.value == "length"
        self.records.append(
            RequestRecord(
                seq.request_id,
                req.sent_s,
                req.first_scheduled_s,
                seq.first_token_s,
                times,
                t,
                req.spec.prompt_tokens,
                seq.num_output_tokens,
                success=ok,
                error=None if ok else f"finished with {seq.finish_reason}",
                num_cached_tokens=req.num_cached_tokens,
            )
        )
        if sim.acceptances is not None:
            sim.acceptances.forget(seq.request_id)
        self.finish_client(req, t)

    def fail(self, req: _Request, t: float, error: str) -> None:
        decode = req.decode_replica
        if decode is not None:  # counted when picked, and never reached it or was refused there
            decode.outstanding -= 1
            req.decode_replica = None
        self.records.append(
            RequestRecord(
                str(req.spec.index),
                req.sent_s,
                req.first_scheduled_s,
                None,
                array("d"),
                t,
                req.spec.prompt_tokens,
                0,
                success=False,
                error=error,
            )
        )
        self.finish_client(req, t)

    def finish_client(self, req: _Request, t: float) -> None:
        del self.live[str(req.spec.index)]
        self.in_flight -= 1
        if self.on_done is not None:
            self.on_done(1)
        if self.stop is not None and not self.stopped_early:
            # The run stops after this event, whatever else it does (so it can resume as if it never stopped).
            self.stopped_early = self.stop(self.records[-1])
        if self.pending and (self.closed or self.in_flight < (self.concurrency or 0)):
            if self.closed and req.spec.think_s > 0:
                # An event, never inline: even a tiny think time lands after the step that
                # starts at this instant, as a live client's round trip does. The next request
                # is taken when the think ends, so a run ends with its last requests, not thinks.
                self.push(t + req.spec.think_s, self.think_done, None)
            else:
                self.send(self.pending.popleft(), t)
