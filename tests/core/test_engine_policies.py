"""The engines' step compositions and admissions, as configuration of the one Scheduler:
prefill-first-chunked (SGLang), decode-first-whole (TensorRT-LLM), no-evict (TensorRT-LLM's
GUARANTEED_NO_EVICT) and reserve-ratio (SGLang's new-token ratio)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.core.admission import (
    SGLANG_INIT_NEW_TOKEN_RATIO,
    SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR,
    SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS,
    KVReservation,
)
from servelab.core.config import ADMISSIONS, POLICIES, SchedulerConfig
from servelab.core.plan import StepResult
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import SamplingParams, Sequence
from servelab.errors import InvalidArgument, RequestTooLong
from tests.driver import run_to_completion
from tests.fake_executor import FakeExecutor
from tests.scheduler_checks import check_block_manager, check_invariants


def seq(rid: str, prompt_len: int, max_tokens: int, arrival_s: float = 0.0, base: int = 1000) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(rid, [base + i for i in range(prompt_len)], params, arrival_s=arrival_s)


def config(**kw) -> SchedulerConfig:
    kw.setdefault("num_blocks", 256)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 4096)
    return SchedulerConfig(**kw)


def is_decode(entry) -> bool:  # noqa: ANN001
    """A running sequence's next token after its first (an entry the plan made before update)."""
    s = entry.seq
    return entry.num_tokens == 1 and s.num_output_tokens > 0 and entry.start_pos == len(s.token_ids) - 1


def test_unknown_policy_or_admission_names_the_choices():
    with pytest.raises(InvalidArgument, match="prefill-first-chunked, decode-first-whole"):
        SchedulerConfig(policy="sglang")
    with pytest.raises(InvalidArgument, match="admission must be one of recompute, no-evict, reserve-ratio"):
        SchedulerConfig(admission="guaranteed")


# ---- step composition ----------------------------------------------------------------------------


def test_prefill_first_chunked_runs_chunks_in_steps_of_their_own_before_any_decode():
    s = Scheduler(config(policy="prefill-first-chunked", max_num_batched_tokens=16))
    s.add(seq("a", 4, 6))
    ex = FakeExecutor()
    plan = s.schedule(0.0)
    s.update(plan, ex.execute(plan), 0.01)
    s.add(seq("b", 40, 2, base=5000))  # 40 tokens: three chunks of at most 16
    shapes = []
    for _ in range(4):
        plan = s.schedule(0.0)
        shapes.append([(e.seq.request_id, e.num_tokens) for e in plan.scheduled])
        s.update(plan, ex.execute(plan), 0.01)
    # b's chunks run back to back, alone: a's decodes wait until b's prompt is done.
    assert shapes == [[("b", 16)], [("b", 16)], [("b", 8)], [("a", 1), ("b", 1)]]


def test_prefill_first_chunked_fills_a_step_with_the_next_prompts_after_the_part_way_one():
    s = Scheduler(config(policy="prefill-first-chunked", max_num_batched_tokens=16))
    s.add(seq("a", 20, 2))
    s.add(seq("b", 10, 2, base=3000))
    ex = FakeExecutor()
    plans = []
    for _ in range(2):
        plan = s.schedule(0.0)
        plans.append([(e.seq.request_id, e.num_tokens, e.samples) for e in plan.scheduled])
        s.update(plan, ex.execute(plan), 0.01)
    assert plans == [[("a", 16, False)], [("a", 4, True), ("b", 10, True)]]


def test_decode_first_whole_puts_decodes_first_and_never_chunks_a_prompt():
    s = Scheduler(config(policy="decode-first-whole", max_num_batched_tokens=16))
    s.add(seq("a", 4, 6))
    ex = FakeExecutor()
    plan = s.schedule(0.0)
    s.update(plan, ex.execute(plan), 0.01)
    s.add(seq("b", 16, 2, base=5000))  # fits the budget, not beside a's decode: waits, whole
    s.add(seq("c", 3, 2, base=7000))  # and nobody overtakes it
    plan = s.schedule(0.0)
    assert [(e.seq.request_id, e.num_tokens) for e in plan.scheduled] == [("a", 1)]
    s.update(plan, ex.execute(plan), 0.01)
    s.abort("a")
    plan = s.schedule(0.0)
    assert [(e.seq.request_id, e.num_tokens) for e in plan.scheduled] == [("b", 16)]
    s.update(plan, ex.execute(plan), 0.01)
    plan = s.schedule(0.0)
    assert [(e.seq.request_id, e.num_tokens) for e in plan.scheduled] == [("b", 1), ("c", 3)]
    with pytest.raises(RequestTooLong, match="exceeds max_num_batched_tokens 16, and policy decode-first-whole"):
        s.add(seq("d", 17, 2, base=9000))


def decode_first_and_prefill_first(policy: str) -> tuple[float, float]:
    """Mean TTFT and mean TPOT of a trace where long prompts keep arriving among decodes."""
    s = Scheduler(config(policy=policy, max_num_batched_tokens=64, num_blocks=2048))
    seqs = [seq(f"r{i}", 200, 40, arrival_s=0.02 * i, base=1000 * i) for i in range(40)]
    ex = FakeExecutor(step_s=0.004, per_token_s=5e-5)
    done = run_to_completion(s, ex, seqs)
    ttft = [q.first_token_s - q.arrival_s for q in done]
    tpot = [(q.finished_s - q.first_token_s) / (q.num_output_tokens - 1) for q in done]
    return sum(ttft) / len(ttft), sum(tpot) / len(tpot)


def test_prefill_first_gives_lower_ttft_and_higher_tpot_than_decode_first():
    ttft_decode_first, tpot_decode_first = decode_first_and_prefill_first("chunked")
    ttft_prefill_first, tpot_prefill_first = decode_first_and_prefill_first("prefill-first-chunked")
    # Prompts that do not wait behind decodes start sooner; decodes that wait behind prompts slow down.
    assert ttft_prefill_first < 0.9 * ttft_decode_first
    assert tpot_prefill_first > 1.2 * tpot_decode_first


# ---- admission -----------------------------------------------------------------------------------


def run_under_pressure(admission: str) -> tuple[Scheduler, int]:
    """A pool far smaller than the requests' total output; returns the scheduler and its peak batch."""
    s = Scheduler(config(admission=admission, num_blocks=60, block_size=4, max_num_batched_tokens=64))
    seqs = [seq(f"r{i}", 20, 60, arrival_s=0.001 * i, base=1000 * i) for i in range(24)]
    peak = 0

    def on_step(plan, result, outputs):  # noqa: ANN001, ANN202
        nonlocal peak
        peak = max(peak, s.num_running)
        check_invariants(s)

    done = run_to_completion(s, FakeExecutor(), seqs, on_step=on_step)
    assert len(done) == 24 and all(q.num_output_tokens == 60 for q in done)
    check_block_manager(s.block_manager)
    assert s.block_manager.num_used_blocks == 0
    return s, peak


def test_guaranteed_no_evict_never_preempts_and_admits_fewer():
    recompute, recompute_peak = run_under_pressure("recompute")
    no_evict, no_evict_peak = run_under_pressure("no-evict")
    assert recompute.num_preemptions > 0
    assert no_evict.num_preemptions == 0
    # Each request books 20 + 60 - 1 tokens = 20 blocks of 4: three fit the 60-block pool.
    assert no_evict_peak == 3 < recompute_peak


def test_reserve_ratio_preempts_less_than_recompute_and_admits_more_than_no_evict():
    recompute, recompute_peak = run_under_pressure("recompute")
    ratio, ratio_peak = run_under_pressure("reserve-ratio")
    _, no_evict_peak = run_under_pressure("no-evict")
    assert ratio.num_preemptions < recompute.num_preemptions
    assert no_evict_peak < ratio_peak <= recompute_peak


def test_the_sglang_ratio_decays_per_decode_step_and_resets_on_preemption():
    res = KVReservation("reserve-ratio", block_size=16)
    init = SGLANG_INIT_NEW_TOKEN_RATIO
    floor = init * SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR
    assert res.ratio == init
    res.after_step(preempted=False, idle=False)
    assert res.ratio == pytest.approx(init - (init - floor) / SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS)
    for _ in range(SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS):
        res.after_step(preempted=False, idle=False)
    assert res.ratio == pytest.approx(floor)
    res.after_step(preempted=True, idle=False)
    assert res.ratio == init


def test_a_booking_counts_the_whole_max_output_less_the_last_token():
    res = KVReservation("no-evict", block_size=4)
    q = seq("a", 10, 7)
    assert res.booking(q, length_limit=17) == 4  # 10 + 7 - 1 = 16 positions = 4 blocks
    sglang = KVReservation("reserve-ratio", block_size=4)
    assert sglang.booking(seq("b", 10, 10_000), length_limit=10_010) == -(-(10 + 4096 - 1) // 4)  # clipped


# ---- every policy x admission: nothing lost, budgets kept -----------------------------------------


request = st.tuples(st.integers(1, 60), st.integers(1, 40), st.sampled_from([0.0, 0.0, 0.002, 0.01]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=20),
    policy=st.sampled_from(POLICIES),
    admission=st.sampled_from(ADMISSIONS),
    num_blocks=st.integers(26, 80),
    budget=st.integers(8, 96),
    max_num_seqs=st.integers(1, 12),
)
def test_every_request_finishes_within_the_budgets_and_no_block_leaks(
    requests, policy, admission, num_blocks, budget, max_num_seqs
):
    cfg = config(
        policy=policy,
        admission=admission,
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=100,
    )
    s = Scheduler(cfg)
    seqs = [seq(f"r{i}", p, o, arrival_s=t, base=100 * i) for i, (p, o, t) in enumerate(requests)]
    rejected = []

    def on_step(plan, result: StepResult, outputs):  # noqa: ANN001, ANN202
        check_invariants(s)
        tokens = sum(e.num_tokens for e in plan.scheduled)
        assert plan.num_batched_tokens == tokens
        # Only the whole-prompt policies let one prompt pass the budget, alone in its step: under
        # decode-first-whole only a preempted one, whose recompute includes its output so far.
        assert tokens <= budget or (
            len(plan.scheduled) == 1
            and (
                policy == "prefill-first" or (policy == "decode-first-whole" and plan.scheduled[0].seq.num_preemptions)
            )
        )
        assert len(plan.scheduled) <= max_num_seqs and s.num_running <= max_num_seqs
        if admission == "no-evict":
            assert not plan.preempted
        if policy in ("prefill-first", "prefill-first-chunked") and any(not is_decode(e) for e in plan.scheduled):
            assert not any(is_decode(e) for e in plan.scheduled), "a decode ran in a prefill step"
        if policy == "prefill-first-chunked":
            part_way = [q for q in s.running if len(q.token_ids) - q.num_computed_tokens > 1]
            assert len(part_way) <= 1, "more than one prompt part-way through its chunks"

    done = run_to_completion(
        s,
        FakeExecutor(),
        seqs,
        on_step=on_step,
        on_reject=lambda q, err: rejected.append(q.request_id),
        max_steps=20_000,
    )
    assert len(done) + len(rejected) == len(seqs)
    assert all(q.num_output_tokens == q.params.max_tokens for q in done)
    assert s.block_manager.num_used_blocks == 0 and not s.running and not s.waiting
    # Only decode-first-whole refuses a request the others take: a prompt longer than the budget.
    assert all(
        policy == "decode-first-whole" and q.num_prompt_tokens > budget for q in seqs if q.request_id in rejected
    )
