"""The scheduler's side of speculative decoding: verification entries under the budgets, the
accepted drafts appended with the stop conditions applied to each, KV rolled back past the last
accepted position, and (property test) output identical to plain decoding whatever is proposed."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from servelab.core.config import SchedulerConfig
from servelab.core.plan import StepPlan, StepResult
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import FinishReason, SamplingParams, Sequence
from tests.driver import run_to_completion
from tests.fake_executor import FakeExecutor
from tests.scheduler_checks import check_block_manager, check_invariants


def make_seq(rid: str, prompt_len: int = 8, max_tokens: int = 16, **params) -> Sequence:
    return Sequence(rid, [1000 + i for i in range(prompt_len)], SamplingParams(max_tokens=max_tokens, **params))


def scheduler(**kw) -> Scheduler:
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 4096)
    return Scheduler(SchedulerConfig(**kw))


class VerifyingExecutor(FakeExecutor):
    """FakeExecutor whose model is `token_at`: a verification entry accepts its drafts while they
    equal the model's tokens and samples the model's token after them, as greedy verification does."""

    def execute(self, plan: StepPlan) -> StepResult:
        result = super().execute(plan)
        accepted = []
        for i, s in enumerate(plan.scheduled):
            if not s.num_draft:
                continue
            first = s.start_pos + 1  # the position of the first draft
            drafts = s.seq.draft_token_ids[: s.num_draft]
            n = 0
            while n < len(drafts) and drafts[n] == self.token_at(s.seq, first + n):
                n += 1
            accepted.append((i, drafts[:n], None))
            result.sampled_token_ids[i] = self.token_at(s.seq, first + n)
        result.accepted = accepted
        return result


def prefill(s: Scheduler, ex: FakeExecutor, seq: Sequence) -> None:
    s.add(seq, 0.0)
    while seq.num_computed_tokens < seq.num_prompt_tokens:
        plan = s.schedule(0.0)
        s.update(plan, ex.execute(plan), 0.0)


def test_a_decode_with_drafts_verifies_them_in_one_entry():
    s, ex = scheduler(), VerifyingExecutor()
    seq = make_seq("a")
    prefill(s, ex, seq)
    start = len(seq.token_ids) - 1
    right = [ex.token_at(seq, start + 1 + i) for i in range(3)]
    seq.draft_token_ids = [*right[:2], 7]  # two right, the third wrong
    plan = s.schedule(1.0)
    (entry,) = plan.scheduled
    assert (entry.num_tokens, entry.num_draft, entry.start_pos) == (4, 3, start)
    assert entry.token_ids() == [seq.token_ids[-1], *right[:2], 7]
    assert plan.num_batched_tokens == 4
    (out,) = s.update(plan, ex.execute(plan), 1.0)
    assert out.new_token_ids == [*right[:2], ex.token_at(seq, start + 3)]
    assert seq.num_computed_tokens == start + 3  # the last token and two accepted drafts
    assert seq.draft_token_ids == []
    assert len(seq.block_table) == -(-len(seq.token_ids) // 4)  # rejected slots given back
    assert s.spec_counters.num_drafts == 1
    assert (s.spec_counters.num_draft_tokens, s.spec_counters.num_accepted_tokens) == (3, 2)
    assert s.spec_counters.accepted_per_position == [1, 1, 0]
    check_invariants(s)


def test_drafts_are_cut_to_the_token_budget_and_the_length_limit():
    s, ex = scheduler(max_num_batched_tokens=3), VerifyingExecutor()
    seq = make_seq("a", prompt_len=2, max_tokens=10)
    prefill(s, ex, seq)
    seq.draft_token_ids = [1, 2, 3, 4, 5]
    (entry,) = s.schedule(1.0).scheduled
    assert entry.num_draft == 2  # a budget of 3 = the decode + 2 drafts
    s.abort("a")

    s, ex = scheduler(), VerifyingExecutor()
    seq = make_seq("b", prompt_len=2, max_tokens=3)
    prefill(s, ex, seq)  # one token out: two more allowed
    seq.draft_token_ids = [ex.token_at(seq, 3 + i) for i in range(5)]
    plan = s.schedule(1.0)
    assert plan.scheduled[0].num_draft == 1  # one draft + the token after it reach max_tokens
    (out,) = s.update(plan, ex.execute(plan), 1.0)
    assert out.finished and out.finish_reason is FinishReason.LENGTH
    assert len(seq.token_ids) - seq.num_prompt_tokens == 3
    check_block_manager(s.block_manager)


def test_a_stop_token_among_accepted_drafts_ends_the_output_there():
    ex = VerifyingExecutor()
    seq = make_seq("a", stop_token_ids=[])
    s = scheduler()
    prefill(s, ex, seq)
    start = len(seq.token_ids) - 1
    right = [ex.token_at(seq, start + 1 + i) for i in range(4)]
    seq.params.stop_token_ids = [right[1]]
    seq.draft_token_ids = right
    plan = s.schedule(1.0)
    (out,) = s.update(plan, ex.execute(plan), 1.0)
    assert out.finished and out.finish_reason is FinishReason.STOP
    assert out.new_token_ids == right[:2]
    assert seq.token_ids[-2:] == right[:2] and seq.stop_reason == right[1]
    assert seq.block_table == [] and s.block_manager.num_used_blocks == 0


def test_a_short_pool_drops_the_drafts_instead_of_preempting():
    s, ex = scheduler(num_blocks=4, enable_prefix_caching=False), VerifyingExecutor()
    a, b = make_seq("a", prompt_len=7), make_seq("b", prompt_len=7)
    s.add(a, 0.0)
    s.add(b, 0.0)
    plan = s.schedule(0.0)
    s.update(plan, ex.execute(plan), 0.0)  # both prefilled in one step, 2 blocks each: the pool is full
    assert s.block_manager.num_free_blocks == 0
    a.draft_token_ids = [ex.token_at(a, 8 + i) for i in range(4)]
    plan = s.schedule(1.0)
    assert [e.num_draft for e in plan.scheduled] == [0, 0] and not plan.preempted
    s.update(plan, ex.execute(plan), 1.0)
    check_invariants(s)


def test_a_failed_verification_ends_the_request_with_an_error():
    s, ex = scheduler(), VerifyingExecutor()
    seq = make_seq("a")
    prefill(s, ex, seq)
    seq.draft_token_ids = [5, 6]
    plan = s.schedule(1.0)
    (out,) = s.update(plan, StepResult([None], accepted=[]), 1.0)
    assert out.finished and out.finish_reason is FinishReason.ERROR and out.new_token_ids == []
    check_block_manager(s.block_manager)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(12, 80),
    budget=st.integers(2, 40),
    policy=st.sampled_from(["chunked", "prefill-first", "prefill-first-chunked", "decode-first-whole"]),
    caching=st.booleans(),
    k=st.integers(1, 6),
    hit_rate=st.floats(0.0, 1.0),
)
def test_speculation_changes_no_output(seed, num_blocks, budget, policy, caching, k, hit_rate):
    """Whatever is proposed (right, wrong, cut by budgets or the pool, across preemptions and
    prefix hits), every request ends with the tokens plain decoding gives, and no block leaks."""
    rng = random.Random(seed)
    workload = [
        (f"r{i}", rng.randint(1, 14), rng.randint(1, 24), rng.random() * 0.05, rng.randrange(3)) for i in range(8)
    ]

    def seqs() -> list[Sequence]:
        out = []
        for rid, plen, max_tokens, arrival, family in workload:
            seq = Sequence(
                rid, [500 + family] * 3 + [900 + i for i in range(plen)], SamplingParams(max_tokens=max_tokens)
            )
            seq.arrival_s = arrival
            out.append(seq)
        return out

    def run(propose: bool) -> dict[str, list[int]]:
        cfg = dict(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=budget, policy=policy)
        s = scheduler(enable_prefix_caching=caching, **cfg)
        ex = VerifyingExecutor()

        def on_step(plan, result, outputs):
            check_invariants(s)
            if not propose:
                return
            for seq in s.running:
                if seq.num_computed_tokens == len(seq.token_ids) - 1:  # decoding
                    nxt = len(seq.token_ids)
                    seq.draft_token_ids = [
                        ex.token_at(seq, nxt + i) if rng.random() < hit_rate else 1 + i for i in range(k)
                    ]

        rejected: list[str] = []  # prompts a policy refuses (whole prompts over the budget): the same both ways
        done = run_to_completion(
            s, ex, seqs(), on_step=on_step, on_reject=lambda q, e: rejected.append(q.request_id), max_steps=5000
        )
        assert s.block_manager.num_used_blocks == 0
        check_block_manager(s.block_manager)
        verified.append(s.spec_counters.num_accepted_tokens if propose else 0)
        return {q.request_id: (q.token_ids, q.finish_reason) for q in done} | {r: "rejected" for r in rejected}

    verified: list[int] = []
    assert run(propose=True) == run(propose=False)
    target(float(verified[0]))  # steer towards runs that accept many drafts
