"""The simulator's ImplicitDecodeScheduler decides exactly what the core Scheduler decides.

Both run the same random workload against an executor that samples one token for every entry
and whose step time depends on the plan's sums. Every step's sums and preemptions, every request's tokens, token times, finish
reason and timestamps, and the block tables and prefix-cache counters must match; a mid-run
`sync()` must give the explicit scheduler's exact state and change nothing after it.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.core.block_manager import BlockManager
from servelab.core.config import ADMISSIONS, POLICIES, SchedulerConfig
from servelab.core.plan import StepResult
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from servelab.errors import InvalidArgument, ServelabError
from servelab.sim import SimConfig, simulate
from servelab.sim.implicit_decodes import ImplicitDecodeScheduler, ImplicitStepPlan, SimSequence
from servelab.workload import WorkloadSpec
from tests.scheduler_checks import check_invariants

TOKEN = 7  # what the executor samples, every time


def build(workload: list[dict], cls: type[Sequence] = SimSequence) -> list[Sequence]:
    seqs = []
    for i, w in enumerate(workload):
        params = SamplingParams(
            max_tokens=w["max_tokens"],
            stop_token_ids=w["stop"],
            ignore_eos=w["ignore_eos"],
            min_tokens=min(w["min_tokens"], w["max_tokens"]),
        )
        # Identical prompts (same prefix, no own part) fill identical blocks in the same steps:
        # the prefix cache's first-published-wins rule then depends on the order of commits.
        own = [100 + (i * 13 + j) % 50 for j in range(w["prompt_len"])] if w["own"] else []
        prompt = (w["prefix"] + own) or [5]
        seq = cls(f"r{i}", prompt, params, arrival_s=w["arrival_s"], priority=w["priority"], eos_token_ids=w["eos"])
        if isinstance(seq, SimSequence):
            # Own tokens are unique per request here (13 i mod 50 differs for the 16 at most), so
            # its generated blocks are published late, as the simulator's requests' are.
            seq.unique_chain = bool(own)
        seqs.append(seq)
    return seqs


def num_implicit(plan) -> int:
    return plan.num_implicit_decodes if isinstance(plan, ImplicitStepPlan) else 0


def snapshot(s: Scheduler) -> list[tuple]:
    return [
        (
            q.request_id,
            list(q.token_ids),
            list(q.token_times_s),
            q.num_computed_tokens,
            list(q.block_table),
            q.prefix.num_committed,
        )
        for q in s.running
    ]


def drive(cfg: SchedulerConfig, workload: list[dict], *, implicit: bool, sync_every: int) -> dict:
    s = ImplicitDecodeScheduler(cfg, TOKEN) if implicit else Scheduler(cfg)
    seqs = build(workload, SimSequence if implicit else Sequence)
    pending = sorted(seqs, key=lambda q: q.arrival_s)
    added_at: dict[str, int] = {}
    abort_after = {f"r{i}": w["abort_after"] for i, w in enumerate(workload) if w["abort_after"] is not None}
    steps, snapshots, rejected = [], [], []
    coverage = {"implicit_steps": 0, "implicit_steps_at_full_budget": 0}
    now, step = 0.0, 0
    while True:
        while pending and pending[0].arrival_s <= now:
            q = pending.pop(0)
            try:
                s.add(q, now)
                added_at[q.request_id] = step
            except ServelabError:
                rejected.append(q.request_id)
        for rid, k in list(abort_after.items()):
            if rid in added_at and step - added_at[rid] >= k:
                del abort_after[rid]
                s.abort(rid, now)
        if not s.has_unfinished():
            if not pending:
                break
            now = pending[0].arrival_s
            continue
        plan = s.schedule(now)
        assert not plan.is_empty, "live requests but an empty step"
        num_sampling = sum(e.samples for e in plan.scheduled) + num_implicit(plan)
        totals = (*plan.shape_totals(), num_sampling, tuple(q.request_id for q in plan.preempted))
        duration = 1e-3 + 1e-5 * totals[0] + 1e-6 * totals[1] + 1e-7 * totals[2] + 1e-8 * totals[3]
        now += duration
        s.update(
            plan, StepResult([TOKEN if e.samples else None for e in plan.scheduled], duration), now, finished_only=True
        )
        steps.append(totals)
        if num_implicit(plan):
            coverage["implicit_steps"] += 1
            coverage["implicit_steps_at_full_budget"] += plan.num_batched_tokens == cfg.max_num_batched_tokens
        step += 1
        assert step < 20_000, "runaway"
        if step % sync_every == 0:
            if isinstance(s, ImplicitDecodeScheduler):
                s.sync()
            check_invariants(s)
            snapshots.append(snapshot(s))
    check_invariants(s)
    bm = s.block_manager
    assert bm.num_used_blocks == 0 and not s.running
    return {
        "steps": steps,
        "snapshots": snapshots,
        "rejected": rejected,
        "seqs": [
            (
                q.request_id,
                q.token_ids,
                q.token_times_s,
                q.finish_reason,
                q.status,
                q.num_preemptions,
                q.first_scheduled_s,
                q.first_token_s,
                q.finished_s,
                q.num_cached_tokens,
                q.stop_reason,
            )
            for q in seqs
        ],
        "counters": (
            s.num_preemptions,
            s.num_finished,
            bm.prefix_cache_hits,
            bm.prefix_cache_queries,
            bm.num_evictions,
            bm.num_cached_blocks,
        ),
        "coverage": coverage,
    }


COMPARED = ("steps", "snapshots", "rejected", "seqs", "counters")


request_strategy = st.fixed_dictionaries(
    {
        "arrival_s": st.sampled_from([0.0, 0.0, 0.004, 0.01, 0.03]),
        "prompt_len": st.integers(1, 40),
        "own": st.booleans(),
        "prefix": st.sampled_from([[], list(range(500, 516)), list(range(600, 637))]),
        "max_tokens": st.integers(1, 40),
        "min_tokens": st.integers(0, 3),
        # TOKEN as a stop or EOS id keeps those requests explicit and stops them early.
        "stop": st.sampled_from([[], [], [1], [TOKEN]]),
        "eos": st.sampled_from([(0,), (0,), (TOKEN,)]),
        "ignore_eos": st.booleans(),
        "priority": st.integers(0, 2),
        "abort_after": st.one_of(st.none(), st.none(), st.none(), st.integers(0, 30)),
    }
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=st.lists(request_strategy, min_size=1, max_size=16),
    num_blocks=st.integers(6, 60),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 80),
    max_num_seqs=st.integers(1, 10),
    policy=st.sampled_from(POLICIES),
    admission=st.sampled_from(ADMISSIONS),
    order=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    sync_every=st.sampled_from([3, 7, 1000]),
)
def test_implicit_decodes_match_the_explicit_loops(
    workload, num_blocks, block_size, budget, max_num_seqs, policy, admission, order, caching, sync_every
):
    cfg = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=min(num_blocks * block_size, 90),
        policy=policy,
        admission=admission,
        order=order,
        enable_prefix_caching=caching,
    )
    explicit = drive(cfg, workload, implicit=False, sync_every=sync_every)
    implicit = drive(cfg, workload, implicit=True, sync_every=sync_every)
    for key in COMPARED:
        assert implicit[key] == explicit[key], key


@pytest.mark.parametrize("caching", [True, False])
def test_a_decode_made_implicit_twice_for_one_tick_wakes_once(caching):
    """Hypothesis found it: a decode the token budget caught up, then made implicit again with
    the same next event, was filed twice under that tick and woken (finished) twice."""

    def request(max_tokens, prompt_len=1, own=False, prefix=()):
        return {
            "arrival_s": 0.0,
            "prompt_len": prompt_len,
            "own": own,
            "prefix": list(prefix),
            "max_tokens": max_tokens,
            "min_tokens": 0,
            "stop": [],
            "eos": (0,),
            "ignore_eos": False,
            "priority": 0,
            "abort_after": None,
        }

    workload = [request(n) for n in (1,) * 7 + (3, 3, 6, 6, 6)]
    workload += [request(6, prefix=range(500, 516)), request(6, 28, own=True), request(7, 30, own=True)]
    cfg = SchedulerConfig(
        num_blocks=15,
        block_size=8,
        max_num_batched_tokens=7,
        max_num_seqs=8,
        max_model_len=90,
        policy="prefill-first",
        order="fcfs",
        enable_prefix_caching=caching,
    )
    explicit = drive(cfg, workload, implicit=False, sync_every=7)
    implicit = drive(cfg, workload, implicit=True, sync_every=7)
    for key in COMPARED:
        assert implicit[key] == explicit[key], key


def test_seeded_random_workloads_match_and_reach_the_hard_cases(monkeypatch):
    # Hypothesis shrinks towards small cases; these 300 seeded ones are larger and are checked to
    # reach what is hard to get right: steps where the token budget binds with implicit decodes
    # in the batch (the cut must fall where the explicit loop puts it), preemption, reuse, and
    # decodes whose blocks filled together taking new ones in one go or, the pool short, one by one.
    rng = random.Random(20261129)
    totals = {"implicit_steps": 0, "implicit_steps_at_full_budget": 0, "preemptions": 0, "hits": 0}
    together = {True: 0, False: 0}
    append_block_each = BlockManager.append_block_each

    def counted(self, seqs):  # noqa: ANN001, ANN202
        ok = append_block_each(self, seqs)
        together[ok] += len(seqs) > 1
        return ok

    monkeypatch.setattr(BlockManager, "append_block_each", counted)
    for _ in range(300):
        workload = [
            {
                "arrival_s": rng.choice([0.0, 0.0, 0.004, 0.01, 0.03]),
                "prompt_len": rng.randint(1, 40),
                "own": rng.random() < 0.5,
                "prefix": rng.choice([[], list(range(500, 516)), list(range(600, 637))]),
                "max_tokens": rng.randint(1, 40),
                "min_tokens": rng.randint(0, 3),
                "stop": rng.choice([[], [], [1], [TOKEN]]),
                "eos": rng.choice([(0,), (0,), (TOKEN,)]),
                "ignore_eos": rng.random() < 0.5,
                "priority": rng.randint(0, 2),
                "abort_after": rng.choice([None, None, None, rng.randint(0, 30)]),
            }
            for _ in range(rng.randint(1, 16))
        ]
        num_blocks, block_size = rng.randint(6, 60), rng.choice([1, 2, 4, 8])
        cfg = SchedulerConfig(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_batched_tokens=rng.randint(1, 80),
            max_num_seqs=rng.randint(1, 10),
            max_model_len=min(num_blocks * block_size, 90),
            policy=rng.choice(POLICIES),
            order=rng.choice(["fcfs", "priority"]),
            enable_prefix_caching=rng.random() < 0.5,
            admission=rng.choice(ADMISSIONS),
        )
        sync_every = rng.choice([5, 1000])
        explicit = drive(cfg, workload, implicit=False, sync_every=sync_every)
        implicit = drive(cfg, workload, implicit=True, sync_every=sync_every)
        for key in COMPARED:
            assert implicit[key] == explicit[key], key
        for key in ("implicit_steps", "implicit_steps_at_full_budget"):
            totals[key] += implicit["coverage"][key]
        totals["preemptions"] += implicit["counters"][0]
        totals["hits"] += implicit["counters"][2]
    assert totals["implicit_steps"] > 1000 and totals["implicit_steps_at_full_budget"] > 20
    assert totals["preemptions"] > 50 and totals["hits"] > 0
    assert together[True] > 20 and together[False] > 5, together


def test_a_steady_batch_runs_implicitly_and_catches_up_exactly():
    # 8 requests of 200 tokens in one pool: after their prefill every step is 8 implicit decodes,
    # and each request wakes only when its block fills (every 16 steps) or it finishes.
    cfg = SchedulerConfig(num_blocks=400, block_size=16, max_num_batched_tokens=512, max_num_seqs=8, max_model_len=8192)
    workload = [
        dict(
            arrival_s=0.0,
            prompt_len=40,
            own=True,
            prefix=[],
            max_tokens=200,
            min_tokens=0,
            stop=[],
            eos=(0,),
            ignore_eos=True,
            priority=0,
            abort_after=None,
        )
        for _ in range(8)
    ]
    s = ImplicitDecodeScheduler(cfg, TOKEN)
    seqs = build(workload)
    for q in seqs:
        s.add(q, 0.0)
    now, implicit_counts, step_ends = 0.0, [], []
    while s.has_unfinished():
        plan = s.schedule(now)
        implicit_counts.append(plan.num_implicit_decodes)
        now += 0.01
        step_ends.append(now)
        s.update(plan, StepResult([TOKEN if e.samples else None for e in plan.scheduled], 0.01), now)
        check_invariants(s)
    assert len(implicit_counts) == 200  # one prefill step (which samples) and 199 decodes
    assert implicit_counts[0] == 0 and max(implicit_counts) == 8
    # Most steps carry every sequence implicitly; a few have one awake at its block boundary.
    assert sum(c == 8 for c in implicit_counts) > 150
    for q in seqs:
        assert q.status is SequenceStatus.FINISHED and q.finish_reason is FinishReason.LENGTH
        assert q.output_token_ids == [TOKEN] * 200
        assert q.token_times_s == step_ends and q.finished_s == step_ends[-1]
    assert s.block_manager.num_used_blocks == 0


class ShapeOnly:
    """The roofline without its `time_from_totals`: the simulator then runs the core Scheduler,
    and prices each step from its shape (the same time for the same sums)."""

    def __init__(self, roofline) -> None:
        self.roofline = roofline

    def step_time_s(self, shape):
        return self.roofline.step_time_s(shape)

    def step(self, shape):
        return self.roofline.step(shape)


def outcome(result) -> tuple:
    trace = result.trace
    return (
        sorted((r.to_dict() for r in result.records), key=lambda d: int(d["request_id"])),
        [
            list(getattr(trace, name))
            for name in ("replica", "start_s", "duration_s", "num_seqs", "num_decode", "num_tokens", "kv_usage")
        ],
        result.replica_stats,
    )


def _whole_shared(specs):
    """Every third request's prompt shared whole (no token of its own): at one prompt length those
    of a group are one prompt and generate the same blocks, which must be published as they fill
    (a preempted one recomputes from the others')."""
    return [replace(s, prefix_tokens=s.prompt_tokens) if s.index % 3 == 0 else s for s in specs]


@pytest.mark.parametrize("case", ["shared-prefix", "preempting", "disaggregated", "evicting", "whole-shared"])
def test_the_simulator_gives_the_core_schedulers_results(case, monkeypatch):
    # The same seeded workloads through ClusterSim twice: with ImplicitDecodeScheduler (the
    # roofline offers time_from_totals) and with the core Scheduler (ShapeOnly hides it). Every
    # record, token time and trace row must be the same, and so must every block manager's
    # prefix-cache counters at the end (ImplicitDecodeScheduler publishes the blocks a prompt of
    # its own generates when the sequence leaves implicit mode, the core Scheduler as each fills).
    from servelab.sim import SimConfig, simulate
    from servelab.sim.cluster import ClusterSim
    from servelab.sim.runner import build_cost_model, scheduler_config
    from servelab.workload import WorkloadSpec

    config, workload = {
        "shared-prefix": (
            SimConfig(scheduler=SchedulerConfig(block_size=16)),
            WorkloadSpec(
                120,
                rate=40.0,
                input_len="300-900",
                output_len="20-200",
                shared_prefix_fraction=0.5,
                num_prefix_groups=3,
                seed=11,
            ),
        ),
        "preempting": (
            SimConfig(scheduler=SchedulerConfig(num_blocks=300, max_num_batched_tokens=512)),
            WorkloadSpec(80, rate=None, concurrency=None, input_len="lognormal:400,0.5", output_len="16-300", seed=12),
        ),
        "disaggregated": (
            SimConfig(disagg=(1, 1)),
            WorkloadSpec(80, rate=30.0, input_len="512", output_len="1-150", shared_prefix_fraction=0.25, seed=13),
        ),
        # A pool that evicts published blocks and preempts, under prefixes shared by most of
        # each prompt.
        "evicting": (
            SimConfig(scheduler=SchedulerConfig(num_blocks=120, block_size=16, max_num_batched_tokens=256)),
            WorkloadSpec(
                90,
                rate=None,
                concurrency=12,
                input_len="17-160",
                output_len="40-260",
                shared_prefix_fraction=0.9,
                num_prefix_groups=2,
                seed=14,
            ),
        ),
        "whole-shared": (
            SimConfig(scheduler=SchedulerConfig(num_blocks=100, block_size=16, max_num_batched_tokens=256)),
            _whole_shared(
                WorkloadSpec(
                    90, rate=None, concurrency=12, input_len="64", output_len="40-200", num_prefix_groups=2, seed=15
                ).generate()
            ),
        ),
    }[case]
    roofline = build_cost_model(config)
    sched = scheduler_config(config)
    assert type(ClusterSim({"mixed": (1, sched)}, roofline).replicas[0].scheduler) is ImplicitDecodeScheduler
    assert type(ClusterSim({"mixed": (1, sched)}, ShapeOnly(roofline)).replicas[0].scheduler) is Scheduler
    managers: list[BlockManager] = []
    init = BlockManager.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        managers.append(self)

    monkeypatch.setattr(BlockManager, "__init__", recorded)

    def counters() -> list[tuple[int, ...]]:
        out = [
            (bm.prefix_cache_hits, bm.prefix_cache_queries, bm.num_evictions, bm.num_cached_blocks) for bm in managers
        ]
        managers.clear()
        return out

    concurrency = 12 if case == "whole-shared" else None
    fast = simulate(config, workload, concurrency=concurrency)
    fast_counters = counters()
    plain = simulate(replace(config, cost_model=ShapeOnly(roofline)), workload, concurrency=concurrency)
    assert fast.num_steps == plain.num_steps
    assert outcome(fast) == outcome(plain)
    assert fast_counters == counters()
    if case in ("preempting", "evicting", "whole-shared"):
        assert sum(r["preemptions"] for r in fast.replica_stats) > 0
    if case in ("evicting", "whole-shared"):
        hits, _, evictions, _ = fast_counters[0]
        assert hits > 0 and evictions > 0


def test_a_request_list_gives_each_request_its_own_index():
    # A request's simulated prompt is built from its index: two with one index would share the
    # blocks the simulator takes for a request's own.
    specs = WorkloadSpec(4, rate=None, concurrency=2, input_len="40", output_len="20").generate()
    for bad in (specs[:3] + [replace(specs[3], index=0)], specs[:3] + [replace(specs[3], index=-2)]):
        with pytest.raises(InvalidArgument, match="its own index"):
            simulate(SimConfig(), bad, concurrency=2)


def test_sliding_window_models_run_the_core_scheduler():
    # A sliding-window group frees pages as a decode moves on, which implicit decodes do not
    # express: such a model runs the core Scheduler even under a cost model priced from sums.
    from servelab.sim.cluster import ClusterSim
    from servelab.sim.runner import build_cost_model, scheduler_config

    windowed = scheduler_config(SimConfig(model="gemma-3-1b"))
    assert any(w is not None for w in windowed.kv_group_windows)
    priced_from_sums = build_cost_model(SimConfig())
    assert type(ClusterSim({"mixed": (1, windowed)}, priced_from_sums).replicas[0].scheduler) is Scheduler


def test_it_runs_only_sequences_that_carry_the_implicit_state():
    s = ImplicitDecodeScheduler(SchedulerConfig(num_blocks=8, block_size=4, max_model_len=64), TOKEN)
    with pytest.raises(TypeError, match="runs SimSequence, got Sequence"):
        s.add(Sequence("r0", [1, 2, 3], SamplingParams(max_tokens=2)), 0.0)
    assert not s.has_unfinished()


@pytest.mark.parametrize(
    "config,workload",
    [
        (SimConfig(), WorkloadSpec(num_requests=40, concurrency=2, input_len="64-900", output_len="1-300", seed=3)),
        (SimConfig(replicas=2), WorkloadSpec(num_requests=60, rate=3.0, input_len="512", output_len="200", seed=4)),
        (
            SimConfig(scheduler=SchedulerConfig(max_num_batched_tokens=64)),
            WorkloadSpec(num_requests=30, concurrency=80, input_len="16-200", output_len="50-150", seed=5),
        ),
    ],
)
def test_steps_run_in_place_between_events_change_nothing(monkeypatch, config, workload):
    # Steps of implicit decodes only that end before any other event skip the plan, the result
    # and the event queue (ClusterRun.run_quiet_steps): the records and trace are the same.
    quiet = simulate(config, workload)
    in_place = []
    tick_quiet = ImplicitDecodeScheduler.tick_quiet
    monkeypatch.setattr(
        ImplicitDecodeScheduler, "tick_quiet", lambda self, ends: in_place.extend(ends) or tick_quiet(self, ends)
    )
    counted = simulate(config, workload)
    monkeypatch.setattr(ImplicitDecodeScheduler, "quiet_steps", lambda self: None)
    evented = simulate(config, workload)
    # A lone replica's light load runs most steps in place; two replicas' steps interleave.
    assert len(in_place) > len(evented.trace) * (0.5 if config.replicas == 1 and workload.concurrency == 2 else 0.02)
    for run in (quiet, counted):
        assert [r.to_dict() for r in run.records] == [r.to_dict() for r in evented.records]
        for column in ("replica", "start_s", "duration_s", "num_seqs", "num_decode", "num_tokens", "kv_usage"):
            assert getattr(run.trace, column) == getattr(evented.trace, column), column
        assert run.replica_stats == evented.replica_stats
