"""The speculative-decoding cost model: expected tokens per verification, acceptance profiles,
verification and draft pricing, and the speedup's shape (falls to below 1 at the crossover batch)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.core.speculative import SpeculativeConfig
from servelab.cost.memory import MemoryPlan
from servelab.cost.roofline import Roofline
from servelab.cost.speculative import (
    NGRAM_PROPOSE_S_PER_SEQ,
    Acceptance,
    DraftCost,
    SpeculativeCost,
    draft_cost,
    expected_tokens_iid,
    kv_tokens_beside_draft,
)
from servelab.errors import InvalidArgument
from servelab.spec.hardware import get_hardware
from servelab.spec.model import get_model

NGRAM4 = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
H100 = get_hardware("h100-sxm")
TARGET = Roofline(get_model("llama-3.1-8b"), H100)


def ngram_cost(alpha: float, k: int = 4) -> SpeculativeCost:
    config = SpeculativeConfig("ngram", k)
    return SpeculativeCost(TARGET, DraftCost(config), Acceptance.rate(alpha, k))


@given(st.floats(0.0, 1.0), st.integers(1, 16))
def test_iid_expected_tokens_is_the_per_position_sum(alpha, k):
    assert Acceptance.rate(alpha, k).expected_tokens() == pytest.approx(expected_tokens_iid(alpha, k), rel=1e-9)


def test_expected_tokens_per_position():
    a = Acceptance((0.8, 0.5, 0.25), "test")
    assert a.expected_tokens() == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    assert a.expected_tokens(num_draft=1) == pytest.approx(1.8)
    assert a.draft_acceptance_rate == pytest.approx(1.3 / 3)
    assert expected_tokens_iid(0.0, 5) == 1.0 and expected_tokens_iid(1.0, 5) == 6.0


def test_counters_give_conditional_rates():
    # 10 verifications: 8 accepted draft 1, 4 of those draft 2, 1 draft 3
    a = Acceptance.from_counts(10, [8, 4, 1, 0], "p")
    assert a.per_position == pytest.approx((0.8, 0.5, 0.25, 0.0))
    assert a.for_k(2).per_position == pytest.approx((0.8, 0.5))
    with pytest.raises(InvalidArgument, match="covers 4 draft position"):
        a.for_k(5)


@pytest.mark.parametrize(
    ("num_drafts", "counts", "match"),
    [(10, [4, 8], "must not grow"), (0, [0], "num_drafts"), (10, [-1], "integers >= 0")],
)
def test_bad_counts_are_refused(num_drafts, counts, match):
    with pytest.raises(InvalidArgument, match=match):
        Acceptance.from_counts(num_drafts, counts, "profile p.json")


def test_sampled_acceptance_has_the_expected_mean():
    a = Acceptance((0.9, 0.6, 0.3), "test")
    rng = random.Random(7)
    n = 40_000
    mean = sum(a.sample(rng, 3) for _ in range(n)) / n
    assert mean == pytest.approx(a.expected_tokens() - 1, rel=0.02)
    assert all(a.sample(rng, 1) <= 1 for _ in range(100))


def test_verification_prices_k_plus_1_query_tokens_and_their_logits():
    b, c, k = 8, 1024, 4
    shape = [(k + 1, c + k)] * b
    tokens, seqs, context, pairs = Roofline.totals(shape)
    assert (tokens, seqs, context) == (b * (k + 1), b, b * (c + k))
    # query i of the chunk sees c + i keys (the cached ones and the chunk's own up to it)
    assert pairs == b * sum(c + i for i in range(k + 1))
    one_row = TARGET.cost_from_totals(tokens, seqs, context, pairs)
    all_rows = TARGET.cost_from_totals(tokens, seqs, context, pairs, logit_rows=b * (k + 1))
    lm_head_flops = 2.0 * TARGET.model.lm_head_params
    assert all_rows.flops - one_row.flops == pytest.approx(b * k * lm_head_flops)
    assert TARGET.time_from_totals(tokens, seqs, context, pairs, logit_rows=b * (k + 1)) == pytest.approx(
        all_rows.time_s
    )
    # memory-bound at batch 8: scoring 5 positions costs little more than 1
    plain = TARGET.decode(b, c).time_s
    assert plain < all_rows.time_s < 1.1 * plain


def test_measured_kernels_price_the_logit_rows_too():
    roofline = Roofline(get_model("llama-3.1-8b"), H100, measured_kernels=True)
    args = (640, 128, 128 * 1028, 128 * 1030)
    assert roofline.time_from_totals(*args, logit_rows=640) > roofline.time_from_totals(*args)


def test_ngram_draft_is_host_time_per_sequence():
    assert DraftCost(NGRAM4).time_s([(100, 100)], [(2, 50)] * 3) == pytest.approx(3 * NGRAM_PROPOSE_S_PER_SEQ)


def test_draft_model_runs_k_passes():
    config = SpeculativeConfig.parse('{"model": "llama-3.2-1b", "num_speculative_tokens": 3}')
    cost = draft_cost(config, H100, "bf16", "bf16")
    draft = cost.draft_model
    assert isinstance(draft, Roofline) and draft.model.name == "llama-3.2-1b"
    expected = (
        draft.step_time_s([(2, 102), (2, 202)])
        + draft.step_time_s([(1, 103), (1, 203)])
        + draft.step_time_s([(1, 104), (1, 204)])
    )
    assert cost.time_s([], [(2, 102), (2, 202)]) == pytest.approx(expected)
    # the prompt chunks the target ran are in the first pass only
    with_chunk = cost.time_s([(512, 512)], [(2, 102), (2, 202)])
    assert with_chunk - expected == pytest.approx(
        draft.step_time_s([(512, 512), (2, 102), (2, 202)]) - draft.step_time_s([(2, 102), (2, 202)])
    )


def test_unknown_draft_model_names_the_config():
    config = SpeculativeConfig.parse('{"model": "no-such-model", "num_speculative_tokens": 3}')
    with pytest.raises(InvalidArgument, match="speculative_config.model 'no-such-model'"):
        draft_cost(config, H100, "bf16", "bf16")


def test_draft_weights_and_kv_shrink_the_target_pool():
    plan = MemoryPlan(get_model("llama-3.1-8b"), H100)
    draft = get_model("llama-3.2-1b")
    tokens = kv_tokens_beside_draft(plan, draft)
    d = MemoryPlan(draft, H100)
    assert tokens == int(
        (plan.kv_capacity_bytes - d.weight_bytes_per_device)
        // (plan.kv_bytes_per_token_per_device + d.kv_bytes_per_token_per_device)
    )
    assert tokens < plan.kv_capacity_tokens
    assert kv_tokens_beside_draft(plan, None) == plan.kv_capacity_tokens


@settings(max_examples=60, deadline=None)
@given(k=st.integers(1, 8), batch=st.sampled_from([1, 4, 16, 64, 256]), context=st.sampled_from([128, 512, 2048]))
def test_at_zero_acceptance_speculation_only_costs(k, batch, context):
    row = ngram_cost(0.0, k).row(batch, context)
    assert row.tokens_per_step == 1.0
    assert row.speedup == pytest.approx(row.plain_step_s / (row.verify_step_s + row.draft_step_s))
    assert row.speedup <= 1.0


@settings(max_examples=60, deadline=None)
@given(
    a1=st.floats(0.0, 1.0),
    a2=st.floats(0.0, 1.0),
    k=st.integers(1, 8),
    batch=st.sampled_from([1, 8, 64, 512]),
)
def test_speedup_grows_with_acceptance(a1, a2, k, batch):
    lo, hi = sorted((a1, a2))
    assert ngram_cost(lo, k).row(batch, 512).speedup <= ngram_cost(hi, k).row(batch, 512).speedup * (1 + 1e-12)


@settings(max_examples=60, deadline=None)
@given(
    alpha=st.floats(0.0, 1.0),
    k=st.integers(1, 8),
    b1=st.integers(1, 4096),
    b2=st.integers(1, 4096),
    context=st.sampled_from([64, 512, 2048]),
)
def test_speedup_falls_with_batch(alpha, k, b1, b2, context):
    lo, hi = sorted((b1, b2))
    cost = ngram_cost(alpha, k)
    assert cost.row(hi, context).speedup <= cost.row(lo, context).speedup * (1 + 1e-9)


def test_crossover_is_where_speedup_drops_below_one_and_moves_out_with_acceptance():
    context = 512
    crossovers = [ngram_cost(a).crossover_batch(context) for a in (0.0, 0.3, 0.5, 0.7, 0.75)]
    assert crossovers[0] == 1  # nothing accepted: the verification is pure overhead
    assert all(c is not None for c in crossovers)
    assert crossovers == sorted(crossovers) and len(set(crossovers)) == 5
    assert ngram_cost(0.9).crossover_batch(context) is None  # 4.1 tokens a step outweigh the FLOPs
    cost = ngram_cost(0.7)
    c = cost.crossover_batch(context)
    assert cost.row(c, context).speedup < 1.0 <= cost.row(c - 1, context).speedup
    # compute-bound at the crossover: the verification's K + 1 tokens cost their FLOPs there
    assert TARGET.step([(5, context + 4)] * c).bound == "compute"


def test_speculation_pays_at_every_batch_when_kv_reads_dominate():
    # At long contexts each sequence's KV reads outweigh its verification FLOPs: no crossover.
    assert ngram_cost(0.7).crossover_batch(32_768, limit=1 << 14) is None


def test_a_slower_draft_costs_its_passes():
    config = SpeculativeConfig.parse('{"model": "llama-3.2-1b", "num_speculative_tokens": 4}')
    spec = SpeculativeCost(TARGET, draft_cost(config, H100, "bf16", "bf16"), Acceptance.rate(0.7, 4))
    row = spec.row(1, 1024)
    assert row.draft_step_s > 0.3 * row.plain_step_s  # four passes of a 16-layer model
    assert math.isclose(row.spec_tpot_s, (row.verify_step_s + row.draft_step_s) / row.tokens_per_step)
    assert spec.crossover_batch(1024) is not None


def test_a_coverage_under_one_mixes_verification_and_plain_steps():
    full = SpeculativeCost(TARGET, DraftCost(NGRAM4), Acceptance((0.8,) * 4, "p"))
    part = SpeculativeCost(TARGET, DraftCost(NGRAM4), Acceptance((0.8,) * 4, "p", coverage=0.6))
    f, p = full.row(1, 512), part.row(1, 512)
    tokens = Acceptance((0.8,) * 4, "p").expected_tokens()
    step = 0.6 * (f.verify_step_s + f.draft_step_s) + 0.4 * f.plain_step_s
    assert p.spec_tpot_s == pytest.approx(step / (0.6 * tokens + 0.4), rel=1e-12)
    assert 1.0 < p.speedup < f.speedup and p.plain_tpot_s == f.plain_tpot_s
    assert Acceptance.from_counts(10, [8, 4], "p", coverage=0.5).coverage == 0.5
    with pytest.raises(InvalidArgument, match=r"the draft coverage must be a number in \[0, 1\], got 1.5"):
        Acceptance.from_counts(10, [8, 4], "p", coverage=1.5)
    assert Acceptance.from_counts(10, [8, 4, 2], "p", coverage=0.5).for_k(2).coverage == 0.5
