"""Scheduler: budgets, chunked prefill vs prefill-first, preemption, prefix caching, admission
errors, abort, stop conditions, and property tests over random workloads."""

from __future__ import annotations

import itertools
import random
import zlib

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from servelab.core.config import ResolvedSchedulerConfig, SchedulerConfig
from servelab.core.plan import StepPlan, StepResult, TokenLogprobs
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import (
    FinishReason,
    SamplingParams,
    Sequence,
    SequenceStatus,
)
from servelab.errors import InvalidArgument, NotFound, QueueFull, RequestTooLong
from tests.driver import run_to_completion
from tests.fake_executor import FakeExecutor
from tests.scheduler_checks import check_block_manager, check_invariants, waiting_in_order


def make_seq(rid: str, prompt_len: int = 8, max_tokens: int = 4, *, base: int = 1000, **kw) -> Sequence:
    params_kw = {k: kw.pop(k) for k in ("stop_token_ids", "ignore_eos", "min_tokens") if k in kw}
    return Sequence(
        rid, [base + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens, **params_kw), **kw
    )


def config(**kw) -> SchedulerConfig:
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 8192)
    return SchedulerConfig(**kw)


class Stepper:
    """Drives a scheduler one step at a time on a virtual clock."""

    def __init__(self, scheduler: Scheduler, executor: FakeExecutor | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor or FakeExecutor()
        self.now = 0.0

    def step(self) -> tuple[StepPlan, list]:
        plan = self.scheduler.schedule(self.now)
        result = self.executor.execute(plan)
        self.now += result.duration_s
        outputs = self.scheduler.update(plan, result, self.now)
        check_invariants(self.scheduler)
        return plan, outputs

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")


# ---- configuration and admission -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"num_blocks": 0}, "num_blocks must be an integer >= 1, got 0"),
        ({"block_size": -1}, "block_size must be an integer >= 1"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be"),
        ({"max_num_seqs": 0}, "max_num_seqs must be"),
        ({"max_model_len": 0}, "max_model_len must be"),
        ({"max_waiting": 0}, "max_waiting must be an integer >= 1 or None"),
        (
            {"policy": "sarathi"},
            "policy must be one of chunked, prefill-first, prefill-first-chunked, decode-first-whole, got 'sarathi'",
        ),
        ({"order": "lifo"}, "order must be one of fcfs, priority, got 'lifo'"),
    ],
)
def test_config_errors_name_the_input_and_the_limit(kw, message):
    with pytest.raises(InvalidArgument, match=message):
        config(**kw)


def test_a_scheduler_runs_on_the_resolved_config_of_what_it_is_given():
    plain = SchedulerConfig(num_blocks=8, block_size=4, max_model_len=64)
    s = Scheduler(plain)
    assert type(s.config) is ResolvedSchedulerConfig and s.config.kv_capacity_tokens == 32
    assert s.config.resolve() is s.config and Scheduler(s.config).config is s.config
    resized = s.config.resolve(num_blocks=2)
    assert (resized.num_blocks, resized.max_model_len, s.config.num_blocks) == (2, 64, 8)
    with pytest.raises(InvalidArgument, match="num_blocks must be an integer >= 1, got 0"):
        SchedulerConfig().resolve(num_blocks=0, max_model_len=64)


def test_too_long_request_is_rejected_with_the_numbers_and_nothing_is_lost():
    s = Scheduler(config(max_model_len=64))
    s.add(make_seq("ok", 10, 4))
    with pytest.raises(RequestTooLong, match=r"prompt of 60 tokens \+ max_tokens 5 = 65 exceeds max_model_len 64"):
        s.add(make_seq("long", 60, 5))
    assert s.num_waiting == 1 and s.get("long") is None
    Stepper(s).run()
    assert s.get("ok").finish_reason is FinishReason.LENGTH


def test_a_prompt_that_can_never_fit_the_kv_pool_is_rejected_not_left_waiting():
    s = Scheduler(config(num_blocks=4, block_size=4, max_model_len=100))
    with pytest.raises(RequestTooLong, match=r"prompt of 17 tokens can never fit the KV cache pool of 16 tokens"):
        s.add(make_seq("big", 17, 1))
    assert not s.has_unfinished()


def test_full_queue_rejects_new_requests_and_keeps_the_queued_ones():
    s = Scheduler(config(max_waiting=2))
    s.add(make_seq("a"))
    s.add(make_seq("b"))
    with pytest.raises(QueueFull, match=r"waiting queue is full \(max_waiting=2\)"):
        s.add(make_seq("c"))
    assert [q.request_id for q in waiting_in_order(s)] == ["a", "b"]
    Stepper(s).step()  # both admitted: the queue has room again
    s.add(make_seq("c"))
    Stepper(s).run()
    assert all(s.get(r).num_output_tokens == 4 for r in "abc")


def test_duplicate_or_empty_requests_are_clear_errors():
    s = Scheduler(config())
    s.add(make_seq("a"))
    with pytest.raises(InvalidArgument, match="request id 'a' is already in use"):
        s.add(make_seq("a"))
    with pytest.raises(InvalidArgument, match="at least 1 token"):
        s.add(make_seq("empty", 0))


def test_add_stamps_arrival_only_when_unset():
    s = Scheduler(config())
    a, b = make_seq("a"), make_seq("b", arrival_s=1.5)
    s.add(a, now=2.0)
    s.add(b, now=2.0)
    assert (a.arrival_s, b.arrival_s) == (2.0, 1.5)


# ---- the shape of a step ---------------------------------------------------------------------------


def test_decode_schedules_exactly_the_last_token_and_blocks_cover_it():
    s = Scheduler(config(block_size=4))
    a = make_seq("a", 6, 10)
    s.add(a)
    st_ = Stepper(s)
    plan, _ = st_.step()
    assert [(x.num_tokens, x.start_pos, x.samples) for x in plan.scheduled] == [(6, 0, True)]
    for _ in range(5):
        plan = s.schedule(st_.now)
        (x,) = plan.scheduled
        assert (x.num_tokens, x.start_pos, x.samples) == (1, a.num_computed_tokens, True)
        assert x.start_pos == a.num_tokens - 1  # the last sampled token
        assert len(a.block_table) * 4 >= x.context_len
        s.update(plan, st_.executor.execute(plan), st_.now)


def test_chunked_prefill_splits_a_long_prompt_and_samples_only_at_its_end():
    s = Scheduler(config(max_num_batched_tokens=16, max_model_len=128))
    a = make_seq("a", 40, 2)
    s.add(a)
    st_ = Stepper(s)
    chunks = []
    while a.num_output_tokens == 0:
        plan, _ = st_.step()
        (x,) = plan.scheduled
        chunks.append((x.start_pos, x.num_tokens, x.samples))
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert a.first_token_s == pytest.approx(st_.now)


def test_budgets_are_respected_with_many_waiting():
    s = Scheduler(config(max_num_batched_tokens=20, max_num_seqs=3))
    for i in range(10):
        s.add(make_seq(f"r{i}", 7, 3))
    st_ = Stepper(s)
    while s.has_unfinished():
        plan, _ = st_.step()
        assert plan.num_batched_tokens == sum(x.num_tokens for x in plan.scheduled) <= 20
        assert len(plan.scheduled) <= 3 and s.num_running <= 3


def test_prefill_first_runs_whole_prompts_in_prefill_only_steps():
    s = Scheduler(config(policy="prefill-first", max_num_batched_tokens=16, max_model_len=128))
    s.add(make_seq("a", 4, 5))
    st_ = Stepper(s)
    st_.step()
    s.add(make_seq("b", 40, 2, base=5000))  # longer than the budget: still one step, no chunks
    plan, _ = st_.step()
    assert [(x.seq.request_id, x.num_tokens, x.samples) for x in plan.scheduled] == [("b", 40, True)]
    assert plan.num_batched_tokens == 40
    plan, _ = st_.step()  # now the decodes
    assert sorted(x.seq.request_id for x in plan.scheduled) == ["a", "b"]


# ---- chunked prefill vs prefill-first: the decode stall ------------------------------------------


def decode_gaps_when_a_long_prompt_arrives(policy: str) -> tuple[float, float, int]:
    """8 sequences decode; a 4,000-token prompt arrives. Returns the largest gap between two
    tokens of a decoding sequence while the prompt is prefilled, the duration of one full-budget
    step, and the number of steps the prompt's prefill took."""
    budget = 512
    s = Scheduler(
        config(num_blocks=2048, block_size=16, max_num_batched_tokens=budget, max_model_len=8192, policy=policy)
    )
    ex = FakeExecutor(step_s=0.002, per_token_s=0.00005)
    decoders = [make_seq(f"d{i}", 32, 200, base=100 * i) for i in range(8)]
    for d in decoders:
        s.add(d)
    st_ = Stepper(s, ex)
    while any(d.num_output_tokens < 3 for d in decoders):
        st_.step()
    long = make_seq("long", 4000, 4, base=50_000)
    s.add(long, now=st_.now)
    marks = {d.request_id: len(d.token_times_s) for d in decoders}
    steps = 0
    while long.num_output_tokens == 0:
        st_.step()
        steps += 1
    st_.step()  # the decoders' token right after the prefill finished
    gaps = []
    for d in decoders:
        times = d.token_times_s[marks[d.request_id] - 1 :]
        gaps += [b - a for a, b in itertools.pairwise(times)]
    full_step_s = ex.step_s + ex.per_token_s * budget
    return max(gaps), full_step_s, steps


def test_chunked_prefill_never_delays_decodes_by_more_than_one_step_budget():
    max_gap_s, full_step_s, steps = decode_gaps_when_a_long_prompt_arrives("chunked")
    assert max_gap_s <= full_step_s + 1e-12
    assert steps == -(-4000 // (512 - 8))  # the prompt was spread over several steps


def test_prefill_first_stalls_decodes_for_the_whole_prompt():
    max_gap_s, full_step_s, steps = decode_gaps_when_a_long_prompt_arrives("prefill-first")
    assert steps == 1
    # The 4,000-token step (plus the decode after it) sits between two tokens of every decoder.
    assert max_gap_s > 4000 / 512 * full_step_s * 0.9
    assert max_gap_s > 5 * full_step_s


# ---- preemption ----------------------------------------------------------------------------------


def test_preemption_takes_the_newest_first_and_recomputes_prompt_plus_output():
    # 6 blocks of 4: three sequences of 8-token prompts fill them once they decode.
    s = Scheduler(
        config(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=24, enable_prefix_caching=False)
    )
    seqs = [make_seq(f"r{i}", 7, 9, base=100 * i) for i in range(3)]
    for q in seqs:
        s.add(q)
    st_ = Stepper(s)
    st_.step()  # all three prefilled: 2 blocks each
    plan, _ = st_.step()  # each decodes position 7: still within 2 blocks
    assert s.num_preemptions == 0
    plan, _ = st_.step()  # position 8 needs a 3rd block each: the newest (r2) goes
    assert [q.request_id for q in plan.preempted] == ["r2"]
    assert seqs[2].status is SequenceStatus.WAITING and seqs[2].block_table == []
    assert seqs[2].num_preemptions == 1 and s.num_preemptions == 1
    generated = seqs[2].num_output_tokens
    assert generated == 2
    # When r2 comes back it is prefilled over prompt + its 2 tokens, sampling only at the end.
    while seqs[2].status is not SequenceStatus.RUNNING:
        plan, _ = st_.step()
    (x,) = [x for x in plan.scheduled if x.seq is seqs[2]]
    assert (x.start_pos, x.num_tokens, x.samples) == (0, 7 + generated, True)
    st_.run()
    # Recompute changed nothing in the output.
    for q in seqs:
        assert q.output_token_ids == [st_.executor.token_at(q, 7 + k) for k in range(9)]


def test_prefix_cache_makes_recompute_after_preemption_cheap():
    # 5 blocks of 4: two sequences prefill 7 tokens each (4 blocks); at position 8 both need a
    # third block, there is one, and r1 (the newest) preempts itself.
    s = Scheduler(config(num_blocks=5, block_size=4, max_num_batched_tokens=64, max_model_len=24))
    r0, r1 = make_seq("r0", 7, 9), make_seq("r1", 7, 9, base=200)
    s.add(r0)
    s.add(r1)
    st_ = Stepper(s)
    for _ in range(3):
        st_.step()
    assert r1.num_preemptions == 1 and r1.num_tokens == 9
    hits_before = s.block_manager.prefix_cache_hits
    while r1.status is not SequenceStatus.RUNNING:
        plan, _ = st_.step()
    # r0's growth evicted r1's second block (a chain is evicted tail first); the first survived.
    (x,) = [x for x in plan.scheduled if x.seq is r1]
    assert (x.start_pos, x.num_tokens, x.samples) == (4, 5, True)
    assert r1.num_cached_tokens == 4
    assert s.block_manager.prefix_cache_hits - hits_before == 4
    st_.run()
    assert r1.output_token_ids == [st_.executor.token_at(r1, 7 + k) for k in range(9)]


def test_a_sequence_that_outgrows_the_whole_pool_stops_with_length():
    # Prompt 6 + max_tokens 20 fits max_model_len but not the 16-token pool.
    s = Scheduler(config(num_blocks=4, block_size=4, max_model_len=64))
    a = make_seq("a", 6, 20)
    s.add(a)
    Stepper(s).run()
    assert a.finish_reason is FinishReason.LENGTH
    assert a.num_tokens == 17  # 16 tokens with KV + the last one sampled
    assert s.block_manager.num_free_blocks == 4


# ---- prefix caching through the scheduler -----------------------------------------------------------


def test_second_request_with_a_shared_1000_token_prefix_computes_only_its_suffix():
    s = Scheduler(config(num_blocks=1024, block_size=8, max_num_batched_tokens=4096, max_model_len=4096))
    prefix = [7000 + i for i in range(1000)]
    a = Sequence("a", prefix + [1, 2, 3], SamplingParams(max_tokens=2))
    b = Sequence("b", prefix + [4, 5, 6, 7, 8], SamplingParams(max_tokens=2))
    s.add(a)
    st_ = Stepper(s)
    st_.run()
    s.add(b)
    plan, _ = st_.step()
    (x,) = plan.scheduled
    assert (x.start_pos, x.num_tokens) == (1000, 5)
    assert b.num_cached_tokens == 1000
    stats = s.stats()
    assert stats.prefix_cache_hits == 1000 and stats.prefix_cache_queries == 1003 + 1005
    assert stats.prefix_cache_hit_rate == pytest.approx(1000 / 2008)
    st_.run()


# ---- ordering -----------------------------------------------------------------------------------


def test_priority_order_admits_by_priority_then_arrival():
    s = Scheduler(config(order="priority", max_num_seqs=1))
    s.add(make_seq("late-low", priority=5, arrival_s=1.0))
    s.add(make_seq("early-low", priority=5, arrival_s=0.5))
    s.add(make_seq("high", priority=-1, arrival_s=2.0))
    assert [q.request_id for q in waiting_in_order(s)] == ["high", "early-low", "late-low"]
    order = []
    st_ = Stepper(s)
    while s.has_unfinished():
        plan, _ = st_.step()
        for x in plan.scheduled:
            if x.seq.request_id not in order:
                order.append(x.seq.request_id)
    assert order == ["high", "early-low", "late-low"]


def test_priority_order_preempts_the_lowest_priority_first():
    s = Scheduler(config(order="priority", num_blocks=6, block_size=4, max_model_len=24, enable_prefix_caching=False))
    seqs = [
        make_seq("p0", 7, 9, priority=0),
        make_seq("p9", 7, 9, base=200, priority=9),
        make_seq("p1", 7, 9, base=300, priority=1),
    ]
    for q in seqs:
        s.add(q)
    st_ = Stepper(s)
    preempted = []
    while s.has_unfinished():
        plan, _ = st_.step()
        preempted += [q.request_id for q in plan.preempted]
    assert preempted[0] == "p9"


# ---- abort and finish ------------------------------------------------------------------------------


def test_abort_in_every_state_frees_blocks():
    s = Scheduler(config(max_num_seqs=1))
    a, b = make_seq("a", 8, 50), make_seq("b")
    s.add(a)
    s.add(b)
    st_ = Stepper(s)
    st_.step()
    assert a.block_table and b.status is SequenceStatus.WAITING
    assert s.abort("b", now=1.0)  # waiting
    assert s.abort("a", now=1.0)  # running
    assert (a.finish_reason, b.finish_reason) == (FinishReason.ABORT, FinishReason.ABORT)
    assert a.finished_s == 1.0 and a.block_table == []
    assert not s.has_unfinished() and s.num_waiting == 0 and s.num_running == 0
    assert s.block_manager.num_used_blocks == 0
    check_invariants(s)


def test_abort_of_a_finished_or_unknown_request_is_a_clear_error_and_loses_nothing():
    s = Scheduler(config())
    s.add(make_seq("done", 4, 1))
    s.add(make_seq("live", 4, 50))
    st_ = Stepper(s)
    st_.step()
    assert s.get("done").finish_reason is FinishReason.LENGTH
    with pytest.raises(NotFound, match=r"cannot abort request 'done': it already finished \(length\)"):
        s.abort("done", strict=True)
    with pytest.raises(NotFound, match="cannot abort request 'nope': no such request"):
        s.abort("nope", strict=True)
    assert s.abort("done") is False and s.abort("nope") is False  # the lenient form
    assert s.get("done").finish_reason is FinishReason.LENGTH  # unchanged
    assert s.get("live").status is SequenceStatus.RUNNING
    st_.run()
    assert s.get("live").num_output_tokens == 50


def test_abort_while_the_step_runs_drops_its_result():
    s = Scheduler(config())
    a, b = make_seq("a"), make_seq("b", base=50)
    s.add(a)
    s.add(b)
    ex = FakeExecutor()
    plan = s.schedule(0.0)
    result = ex.execute(plan)
    s.abort("a", now=0.1)
    outputs = s.update(plan, result, 0.2)
    assert [o.request_id for o in outputs] == ["b"]
    assert a.output_token_ids == [] and a.finish_reason is FinishReason.ABORT
    check_invariants(s)


def test_finish_from_the_engine_on_a_stop_string():
    s = Scheduler(config())
    a = make_seq("a", 4, 50)
    s.add(a)
    st_ = Stepper(s)
    st_.step()
    st_.step()
    assert s.finish("a", FinishReason.STOP, now=st_.now, stop_reason="\n\n")
    assert (a.finish_reason, a.stop_reason, a.finished_s) == (FinishReason.STOP, "\n\n", st_.now)
    assert a.block_table == [] and not s.has_unfinished()
    assert s.finish("a", FinishReason.STOP) is False  # already finished
    with pytest.raises(NotFound, match="cannot finish request 'x'"):
        s.finish("x", FinishReason.STOP)


# ---- stop conditions and events ------------------------------------------------------------------------


def scripted(tokens: dict[str, list[int]]) -> FakeExecutor:
    """An executor that samples the given outputs, in order, per request."""

    def token_fn(seq: Sequence, position: int) -> int:
        return tokens[seq.request_id][position - seq.num_prompt_tokens]

    return FakeExecutor(token_fn=token_fn)


def test_stop_conditions():
    s = Scheduler(config())
    seqs = {
        "eos": make_seq("eos", 4, 10, eos_token_ids=(2,)),
        "eos-ignored": make_seq("eos-ignored", 4, 4, eos_token_ids=(2,), ignore_eos=True),
        "min-tokens": make_seq("min-tokens", 4, 10, eos_token_ids=(2,), min_tokens=3),
        "stop-id": make_seq("stop-id", 4, 10, stop_token_ids=[7, 8]),
        "length": make_seq("length", 4, 3),
    }
    outputs = {
        "eos": [5, 2, 5, 5],
        "eos-ignored": [2, 2, 2, 2],
        "min-tokens": [2, 2, 2, 5],
        "stop-id": [5, 5, 8, 5],
        "length": [5, 5, 5, 5],
    }
    for q in seqs.values():
        s.add(q)
    Stepper(s, scripted(outputs)).run()
    got = {rid: (q.output_token_ids, q.finish_reason, q.stop_reason) for rid, q in seqs.items()}
    assert got == {
        "eos": ([5, 2], FinishReason.STOP, None),
        "eos-ignored": ([2, 2, 2, 2], FinishReason.LENGTH, None),
        "min-tokens": ([2, 2, 2], FinishReason.STOP, None),
        "stop-id": ([5, 5, 8], FinishReason.STOP, 8),
        "length": ([5, 5, 5], FinishReason.LENGTH, None),
    }


def test_update_returns_stream_events_and_timestamps():
    s = Scheduler(config(max_num_batched_tokens=8))
    a, b = make_seq("a", 4, 2), make_seq("b", 11, 1, base=50)
    s.add(a, now=0.0)
    s.add(b, now=0.0)
    plan = s.schedule(1.0)
    assert [(x.seq.request_id, x.num_tokens, x.samples) for x in plan.scheduled] == [("a", 4, True), ("b", 4, False)]
    lp = TokenLogprobs(token_id=11, logprob=-0.5)
    events = s.update(plan, StepResult([11, None], 0.1, [lp, None]), 2.0)
    assert [(e.request_id, e.new_token_ids, e.finished, e.logprobs) for e in events] == [("a", [11], False, [lp])]
    assert (a.first_scheduled_s, a.first_token_s, a.token_times_s) == (1.0, 2.0, [2.0])
    assert b.first_scheduled_s == 1.0 and b.first_token_s is None
    plan = s.schedule(3.0)
    events = s.update(plan, StepResult([12, 13], 0.1), 4.0)
    assert [(e.request_id, e.new_token_ids, e.finished, e.finish_reason) for e in events] == [
        ("a", [12], True, FinishReason.LENGTH),
        ("b", [13], True, FinishReason.LENGTH),
    ]
    assert a.finished_s == 4.0 and a.token_times_s == [2.0, 4.0]


def test_finished_only_update_changes_no_state_only_the_events():
    """The simulator's mode: the same sequences, tokens, times and frees; events only for ends."""

    def drive(finished_only: bool) -> tuple[list, list, list]:
        s = Scheduler(config(num_blocks=12, max_num_batched_tokens=16, max_num_seqs=4))
        seqs = [
            make_seq(f"r{i}", 5 + 3 * i, 3 + 2 * i, base=100 * i, stop_token_ids=[7], min_tokens=1) for i in range(6)
        ]
        for q in seqs:
            s.add(q, now=0.0)
        executor = FakeExecutor(token_fn=lambda q, pos: 7 if (q.request_id, pos) == ("r2", 15) else 3 + pos % 4)
        now, events = 0.0, []
        while s.has_unfinished():
            plan = s.schedule(now)
            result = executor.execute(plan)
            now += result.duration_s
            events += [
                (e.request_id, e.new_token_ids, e.finish_reason)
                for e in s.update(plan, result, now, finished_only=finished_only)
                if e.finished or not finished_only
            ]
            check_invariants(s)
        state = [(q.token_ids, q.token_times_s, q.finish_reason, q.stop_reason, q.num_preemptions) for q in seqs]
        streamed = [e for e in events if e[2] is None]
        return state, [e for e in events if e[2] is not None], streamed

    state, finished, streamed = drive(False)
    fast_state, fast_finished, fast_streamed = drive(True)
    assert fast_state == state and fast_finished == finished
    assert streamed and not fast_streamed
    assert ("r2", [7], FinishReason.STOP) in finished  # a stop token ends it before max_tokens
    assert any(n for *_, n in state), "the small pool should have preempted someone"


def test_the_length_limit_is_max_tokens_or_the_kv_pool():
    s = Scheduler(config(num_blocks=4, block_size=4, max_model_len=64))  # a 16-token pool
    assert s.length_limit(make_seq("a", 6, 20)) == 17  # its 17th token would need a 17th slot
    assert s.length_limit(make_seq("b", 6, 5)) == 11  # prompt + max_tokens


def test_a_missing_sample_ends_the_request_with_error():
    s = Scheduler(config())
    a = make_seq("a")
    s.add(a)
    plan = s.schedule(0.0)
    (event,) = s.update(plan, StepResult([None]), 0.1)
    assert (event.finished, event.finish_reason, a.finish_reason) == (True, FinishReason.ERROR, FinishReason.ERROR)
    assert s.block_manager.num_used_blocks == 0


def test_result_of_the_wrong_length_is_refused():
    s = Scheduler(config())
    s.add(make_seq("a"))
    plan = s.schedule(0.0)
    with pytest.raises(ValueError, match="1 sequences"):
        s.update(plan, StepResult([], 0.0), 0.0)


# ---- property tests ----------------------------------------------------------------------------------


class CheckingExecutor(FakeExecutor):
    """A FakeExecutor that checks every plan against the scheduler's state before running it."""

    def __init__(self, scheduler: Scheduler, full_check_every: int = 1, **kw) -> None:
        super().__init__(**kw)
        self.scheduler = scheduler
        self.full_check_every = full_check_every

    def execute(self, plan: StepPlan) -> StepResult:
        cfg = self.scheduler.config
        assert plan.scheduled, "empty step"
        assert plan.num_batched_tokens == sum(x.num_tokens for x in plan.scheduled)
        if cfg.policy == "chunked":
            assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
        else:  # prefill-first: only a lone whole prompt may exceed the budget
            assert plan.num_batched_tokens <= cfg.max_num_batched_tokens or len(plan.scheduled) == 1
        assert len(plan.scheduled) <= cfg.max_num_seqs
        assert len({id(x.seq) for x in plan.scheduled}) == len(plan.scheduled), "a sequence twice in a step"
        shape = plan.shape()
        assert plan.shape_totals() == (
            sum(q for q, _ in shape),
            len(shape),
            sum(c for _, c in shape),
            sum(q * c - q * (q - 1) // 2 for q, c in shape),
            sum(q == 1 for q, _ in shape),
        )
        for x in plan.scheduled:
            q = x.seq
            assert q.status is SequenceStatus.RUNNING and x.num_tokens >= 1
            assert x.start_pos == q.num_computed_tokens
            assert x.context_len <= q.num_tokens
            assert x.samples == (x.context_len == q.num_tokens)
            assert len(q.block_table) * cfg.block_size >= x.context_len, "KV slots not allocated"
            if q.num_computed_tokens == q.num_tokens - 1 and q.num_output_tokens:
                assert x.num_tokens == 1  # a decode
        if self.num_steps % self.full_check_every == 0:
            check_invariants(self.scheduler)  # no block both free and owned, no leak
        return super().execute(plan)


def small_token_fn(seq: Sequence, position: int) -> int:
    # Small vocabulary so that EOS (0) and stop ids (1, 2) do occur.
    return (zlib.crc32(seq.request_id.encode()) + position * 7) % 23


def run_workload(cfg: SchedulerConfig, workload: list[dict], *, full_check_every: int = 1) -> tuple:
    s = Scheduler(cfg)
    executor = CheckingExecutor(s, full_check_every, token_fn=small_token_fn)
    seqs, abort_at = [], {}
    for i, w in enumerate(workload):
        params = SamplingParams(
            max_tokens=w["max_tokens"],
            stop_token_ids=w["stop"],
            ignore_eos=w["ignore_eos"],
            min_tokens=min(w["min_tokens"], w["max_tokens"]),
        )
        prompt = w["prefix"] + [100 + (i * 13 + j) % 50 for j in range(w["prompt_len"])]
        q = Sequence(f"r{i}", prompt, params, arrival_s=w["arrival_s"], priority=w["priority"], eos_token_ids=(0,))
        seqs.append(q)
        if w["abort_after"] is not None:
            abort_at[q.request_id] = w["abort_after"]
    rejected = []
    steps = [0]
    aborted = set()

    def on_step(plan, result, outputs):
        # Abort `abort_after` steps after the request was added: waiting, running or finished.
        steps[0] += 1
        for rid, left in list(abort_at.items()):
            q = s.get(rid)
            if q is None:
                continue  # not arrived yet
            if left > 0:
                abort_at[rid] = left - 1
                continue
            del abort_at[rid]
            was_live = not q.is_finished
            assert s.abort(rid) is was_live
            if was_live:
                aborted.add(rid)
        if steps[0] % full_check_every == 0:
            check_invariants(s)

    finished = run_to_completion(
        s, executor, seqs, on_step=on_step, on_reject=lambda q, e: rejected.append((q, e)), max_steps=200_000
    )
    return s, seqs, finished, rejected, aborted


def check_outcome(s: Scheduler, seqs, finished, rejected, aborted) -> None:
    cfg = s.config
    rejected_ids = {q.request_id for q, _ in rejected}
    for q, err in rejected:
        assert isinstance(err, (RequestTooLong, QueueFull))
        assert q.status is SequenceStatus.WAITING and q.block_table == [] and q.num_output_tokens == 0
    assert {q.request_id for q in finished} == {q.request_id for q in seqs} - rejected_ids
    assert len(finished) == len({id(q) for q in finished}), "a request finished twice"
    for q in finished:
        assert q.status is SequenceStatus.FINISHED and q.block_table == []
        if q.request_id in aborted:
            assert q.finish_reason is FinishReason.ABORT
            continue
        out = q.output_token_ids
        assert out == [small_token_fn(q, q.num_prompt_tokens + k) for k in range(len(out))], "output changed"
        stops = set(q.params.stop_token_ids) | (set() if q.params.ignore_eos else set(q.eos_token_ids))
        early = [k for k, t in enumerate(out) if t in stops and k + 1 >= q.params.min_tokens]
        if early and early[0] + 1 <= q.params.max_tokens:
            assert q.finish_reason is FinishReason.STOP and len(out) == early[0] + 1
        else:
            assert q.finish_reason is FinishReason.LENGTH and len(out) == q.params.max_tokens
        assert q.arrival_s <= q.first_scheduled_s <= q.first_token_s <= q.finished_s
        assert len(q.token_times_s) == len(out)
    bm = s.block_manager
    assert bm.num_free_blocks == cfg.num_blocks and bm.num_used_blocks == 0 and not bm._owners
    check_block_manager(bm)
    assert not s.has_unfinished() and s.num_waiting == 0 and s.num_running == 0
    if cfg.order == "fcfs":  # no starvation: admission never overtakes
        admitted = [q for q in seqs if q.request_id not in rejected_ids and q.first_scheduled_s is not None]
        firsts = [q.first_scheduled_s for q in sorted(admitted, key=lambda q: (q.arrival_s, int(q.request_id[1:])))]
        assert firsts == sorted(firsts)


request_strategy = st.fixed_dictionaries(
    {
        "arrival_s": st.floats(0, 0.05),
        "prompt_len": st.integers(1, 40),
        "prefix": st.sampled_from([[], list(range(500, 516)), list(range(600, 630))]),
        "max_tokens": st.integers(1, 24),
        "min_tokens": st.integers(0, 2),
        "stop": st.sampled_from([[], [1], [1, 2]]),
        "ignore_eos": st.booleans(),
        "priority": st.integers(0, 3),
        "abort_after": st.one_of(st.none(), st.none(), st.integers(0, 12)),
    }
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=st.lists(request_strategy, min_size=1, max_size=25),
    num_blocks=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(1, 96),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["chunked", "prefill-first"]),
    order=st.sampled_from(["fcfs", "priority"]),
    caching=st.booleans(),
    max_waiting=st.one_of(st.none(), st.integers(1, 10)),
)
def test_random_workloads_keep_every_invariant(
    workload, num_blocks, block_size, budget, max_num_seqs, policy, order, caching, max_waiting
):
    capacity = num_blocks * block_size
    # Scale requests to the pool so that most are admitted and contend for it (and preempt).
    max_model_len = min(capacity, 80)
    for w in workload:
        if len(w["prefix"]) > max_model_len // 3:
            w["prefix"] = []
        w["prompt_len"] = max(1, w["prompt_len"] * max_model_len // 80)
        w["max_tokens"] = max(1, w["max_tokens"] * max_model_len // 80)
    cfg = SchedulerConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        # Within the pool, so only max_tokens or a stop token can end a request that is admitted.
        max_model_len=max_model_len,
        max_waiting=max_waiting,
        policy=policy,
        order=order,
        enable_prefix_caching=caching,
    )
    s, seqs, finished, rejected, aborted = run_workload(cfg, workload)
    check_outcome(s, seqs, finished, rejected, aborted)
    target(float(s.num_preemptions), label="preemptions")  # steer generation towards contention


def test_ten_thousand_random_requests_through_a_tiny_pool():
    rng = random.Random(1234)
    workload = []
    t = 0.0
    for _ in range(10_000):
        t += rng.expovariate(60.0)
        workload.append(
            {
                "arrival_s": t,
                "prompt_len": rng.randint(1, 120),
                "prefix": rng.choice([[], [], list(range(500, 532)), list(range(700, 764))]),
                "max_tokens": rng.randint(1, 40),
                "min_tokens": rng.randint(0, 1),
                "stop": rng.choice([[], [], [1]]),
                "ignore_eos": rng.random() < 0.5,
                "priority": 0,
                "abort_after": None,
            }
        )
    # Aborts a random number of steps after arrival: some while waiting, some mid-run, some late.
    for w in rng.sample(workload, 300):
        w["abort_after"] = rng.randint(0, 40)
    cfg = SchedulerConfig(
        num_blocks=96, block_size=8, max_num_batched_tokens=256, max_num_seqs=32, max_model_len=400, max_waiting=3000
    )
    s, seqs, finished, rejected, aborted = run_workload(cfg, workload, full_check_every=25)
    check_outcome(s, seqs, finished, rejected, aborted)
    assert len(finished) >= 9000 and s.num_preemptions > 100 and aborted
    assert s.block_manager.prefix_cache_hits > 0
