"""Sampler: each logits transform, greedy, seeds, logprobs, and that draws follow the distribution."""

from __future__ import annotations

import math

import pytest
import torch

from servelab.core.sequence import SamplingParams, Sequence
from servelab.errors import InvalidArgument
from servelab.engine.sampler import Sampler, _min_p_mask, _top_k_mask, _top_p_mask, _top_p_mask_sorted


def seq(outputs: tuple[int, ...] = (), eos: tuple[int, ...] = (), **params) -> Sequence:
    s = Sequence("r", [1, 2, 3], SamplingParams(**params), eos_token_ids=eos)
    s.token_ids.extend(outputs)
    return s


def probs_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


# ------------------------------------------------------------------------------ transforms


def test_top_k_mask_keeps_the_k_largest_per_row():
    x = torch.tensor([[0.1, 3.0, 2.0, -1.0, 5.0], [4.0, 3.0, 2.0, 1.0, 0.0]])
    out = _top_k_mask(x, [2, 4])
    assert torch.isinf(out[0]).tolist() == [True, False, True, True, False]
    assert torch.isinf(out[1]).tolist() == [False, False, False, False, True]
    assert torch.equal(out[~torch.isinf(out)], x[~torch.isinf(out)])


def test_top_p_mask_keeps_the_smallest_nucleus():
    x = probs_logits([0.15, 0.5, 0.05, 0.3]).repeat(3, 1)
    out = _top_p_mask(x, [0.7, 0.85, 0.4])
    kept = (~torch.isinf(out)).tolist()
    assert kept[0] == [False, True, False, True]  # 0.5 + 0.3 reaches 0.7
    assert kept[1] == [True, True, False, True]  # needs 0.15 as well to reach 0.85
    assert kept[2] == [False, True, False, False]  # the top token alone reaches 0.4
    assert torch.equal(out[0, 1], x[0, 1])


def test_top_p_candidate_shortcut_matches_the_full_sort():
    """Large vocabularies look for the nucleus among the top candidates first; rows whose nucleus
    is wider (a flat distribution) fall back to sorting. Both must give the same mask."""
    torch.manual_seed(0)
    peaked = torch.randn(3, 5000) * 6  # nucleus of a few tokens
    flat = torch.randn(2, 5000) * 0.1  # nucleus of thousands of tokens
    x = torch.cat([peaked, flat])
    ps = [0.9, 0.5, 0.99, 0.9, 0.3]
    out = _top_p_mask(x.clone(), ps)
    reference = _top_p_mask_sorted(x.clone(), torch.tensor(ps).unsqueeze(1))
    assert torch.equal(torch.isinf(out), torch.isinf(reference))
    kept = (~torch.isinf(out)).sum(dim=-1).tolist()
    assert max(kept[:3]) < 256 < min(kept[3:])  # both paths were exercised


@pytest.mark.parametrize("p", [1e-46, 5e-324, 1e-40])
def test_a_top_p_below_float32s_range_keeps_the_most_likely_token(p):
    """A valid top_p so small that it rounds to 0 in float32 still keeps the top token, on the
    candidates' path (a large vocabulary) and the full sort's, as top_p -> 0 does."""
    torch.manual_seed(0)
    for x in (torch.randn(2, 5000) * 6, torch.randn(2, 8)):
        out = _top_p_mask(x.clone(), [p, p])
        assert (~torch.isinf(out)).sum(dim=-1).tolist() == [1, 1]
        assert torch.equal(out.argmax(dim=-1), x.argmax(dim=-1))


def test_min_p_mask_is_relative_to_the_top_probability():
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1]])
    out = _min_p_mask(p, [0.2, 0.6])
    assert out.tolist()[0] == pytest.approx([0.5, 0.3, 0.15, 0.0])  # threshold 0.1
    assert out.tolist()[1] == pytest.approx([0.4, 0.3, 0.0, 0.0])  # threshold 0.24


def test_presence_and_frequency_penalties_follow_openai_semantics():
    logits = torch.zeros(2, 6)
    seqs = [
        seq(outputs=(1, 1, 2), presence_penalty=0.5, frequency_penalty=0.25),
        seq(outputs=(1, 1, 2)),  # no penalties: untouched
    ]
    out = Sampler._apply_penalties(logits, seqs)
    assert out[0].tolist() == pytest.approx([0, -1.0, -0.75, 0, 0, 0])
    assert out[1].tolist() == [0.0] * 6
    assert logits.abs().sum() == 0  # the caller's logits are not modified


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[0.0, 2.0, 1.5, 0.0]])
    assert Sampler().sample(logits, [seq(outputs=(1,), temperature=0.0)])[0] == [1]
    assert Sampler().sample(logits, [seq(outputs=(1,), temperature=0.0, frequency_penalty=1.0)])[0] == [2]
    assert Sampler().sample(logits, [seq(outputs=(1,), temperature=0.0, presence_penalty=-1.0)])[0] == [1]


def test_repetition_penalty_follows_vllm_semantics():
    """Seen tokens (prompt 1, 2, 3 and output 5): positive logits divided, the others multiplied."""
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.0, 4.0, 3.0], [1.0, 2.0, -1.0, 0.0, 4.0, 3.0]])
    seqs = [seq(outputs=(5,), repetition_penalty=2.0), seq(outputs=(5,))]
    out = Sampler._apply_repetition_penalty(logits, seqs)
    assert out[0].tolist() == [1.0, 1.0, -2.0, 0.0, 4.0, 1.5]
    assert out[1].tolist() == logits[1].tolist()
    assert logits[0, 1] == 2.0  # the caller's logits are not modified
    rewarded = Sampler._apply_repetition_penalty(logits[:1], [seq(outputs=(5,), repetition_penalty=0.5)])
    assert rewarded[0].tolist() == [1.0, 4.0, -0.5, 0.0, 4.0, 6.0]


@pytest.fixture(params=["native", "torch"])
def argmax_path(request, monkeypatch):
    """The sampler's argmax on the native kernel (CPU fp32) or on torch's own."""
    from servelab.runtime import native

    if request.param == "native":
        if native.native_kernels() is None:
            pytest.skip(f"native kernels unavailable: {native.load_error}")
    else:
        monkeypatch.setattr(native, "native_kernels", lambda level=None: None)
    return request.param


def test_repetition_penalty_changes_the_greedy_choice(argmax_path):
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    logits[:, 2] = 10.0  # a prompt token (prompt: 1, 2, 3), the argmax unpenalised
    logits[:, 7] = 6.0  # the next best, never seen
    seqs = [seq(temperature=0.0, repetition_penalty=r) for r in (1.0, 1.5, 2.0, 1.0)]
    argmax = logits.argmax(dim=-1).tolist()
    tokens, _ = Sampler().sample(logits.clone(), seqs, argmax)
    assert tokens == [2, 2, 7, 2]  # 10 / 1.5 > 6 > 10 / 2
    tokens, _ = Sampler().sample(logits.clone(), [seq(temperature=0.0, repetition_penalty=2.0)] * 4, argmax)
    assert tokens == [7] * 4


def test_repetition_penalty_is_checked():
    for bad in (0.0, -1.0, float("nan"), float("inf"), 101.0):
        with pytest.raises(InvalidArgument) as e:
            SamplingParams(repetition_penalty=bad)
        assert e.value.param == "repetition_penalty"


def test_min_tokens_bans_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    params = dict(temperature=0.0, min_tokens=2, max_tokens=5, stop_token_ids=[2])
    assert Sampler().sample(logits, [seq(eos=(1,), **params)])[0] == [3]
    assert Sampler().sample(logits, [seq(outputs=(3, 3), eos=(1,), **params)])[0] == [1]
    assert Sampler().sample(logits, [seq(eos=(1,), ignore_eos=True, **params)])[0] == [1]


# ------------------------------------------------------------------------------ greedy, seeds


def test_greedy_is_argmax_in_a_mixed_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    seqs = [seq(temperature=0.0) if i % 2 == 0 else seq(temperature=1.0, top_k=50) for i in range(8)]
    tokens, logprobs = Sampler().sample(logits, seqs)
    assert logprobs is None
    assert [tokens[i] for i in range(0, 8, 2)] == logits[0::2].argmax(dim=-1).tolist()
    all_greedy, _ = Sampler().sample(logits, [seq(temperature=0.0) for _ in range(8)])
    assert all_greedy == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params, plain",
    [
        ({"temperature": 0.0}, True),
        ({"temperature": 0.0, "top_k": 5, "top_p": 0.5, "seed": 3}, True),  # no effect under greedy
        ({"temperature": 0.5}, False),
        ({"temperature": 0.0, "presence_penalty": 0.1}, False),
        ({"temperature": 0.0, "frequency_penalty": -0.1}, False),
        ({"temperature": 0.0, "min_tokens": 1}, False),
        ({"temperature": 0.0, "repetition_penalty": 1.2}, False),
        ({"temperature": 0.0, "repetition_penalty": 1.0}, True),
        ({"temperature": 0.0, "logprobs": 0}, False),
        ({"temperature": 0.0, "logit_bias": {3: 1.0}}, False),
        ({"temperature": 0.0, "allowed_token_ids": [3]}, False),
    ],
)
def test_an_argmax_read_with_the_logits_is_taken_only_for_plain_greedy_rows(params, plain):
    """The forward's own argmax (model.greedy_tokens) stands for the tokens only where no transform
    or report could change them; otherwise the sampler reads the logits itself."""
    logits = torch.zeros(2, 20)
    logits[:, 3] = 1.0  # the logits' argmax: token 3
    stale = [7, -1]  # an argmax that is not the logits': taken only for plain rows
    seqs = [seq(temperature=0.0), seq(**params)]
    assert Sampler.plain_greedy(seqs) is plain
    sampler = Sampler()
    tokens, _ = sampler.sample(logits, seqs, stale)
    if plain:
        assert tokens == [7, None] and set(sampler.row_errors) == {1}  # -1: the row was not finite
    else:
        assert tokens[0] == 3 and tokens[1] is not None and not sampler.row_errors
    assert Sampler().sample(logits, seqs, [7])[0][0] == 3  # not one entry a row: ignored


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_row_with_non_finite_logits_gets_no_token(bad):
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    logits[1, 7] = bad
    logits[3] = bad
    before = logits.clone()
    seqs = [
        seq(temperature=0.0),
        seq(temperature=1.0, logprobs=2),
        seq(temperature=0.7, top_p=0.9, logprobs=1),
        seq(temperature=1.0, seed=3),
    ]
    tokens, logprobs = Sampler().sample(logits, seqs)
    assert tokens[1] is None and tokens[3] is None and logprobs[1] is None  # the scheduler ends them: "error"
    assert tokens[0] == logits[0].argmax().item() and 0 <= tokens[2] < 300 and logprobs[2].token_id == tokens[2]
    assert torch.equal(logits.nan_to_num(), before.nan_to_num())  # the caller's logits are untouched


def test_bf16_logits_and_input_not_modified():
    logits = torch.randn(3, 50).to(torch.bfloat16)
    before = logits.clone()
    tokens, _ = Sampler().sample(logits, [seq(temperature=0.0), seq(temperature=0.8, top_p=0.9), seq(top_k=5, seed=1)])
    assert tokens[0] == logits.float()[0].argmax().item()
    assert torch.equal(logits, before)


def run_steps(
    sampler: Sampler, target: Sequence, others: list[Sequence], logits_rows: torch.Tensor, steps: int
) -> list[int]:
    """Sample `steps` tokens for `target` while sharing each batch with `others`."""
    out = []
    for step in range(steps):
        batch = [*others[: step % (len(others) + 1)], target, *others[step % (len(others) + 1) :]]
        logits = torch.stack([logits_rows[step]] * len(batch))
        logits[[i for i, s in enumerate(batch) if s is not target]] += torch.randn(len(batch) - 1, logits.shape[1])
        tokens, _ = sampler.sample(logits, batch)
        token = tokens[batch.index(target)]
        target.token_ids.append(token)
        for s, t in zip(batch, tokens):
            if s is not target:
                s.token_ids.append(t)
        out.append(token)
    return out


def test_seeded_request_is_reproducible_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    rows = torch.randn(20, 500)
    params = dict(temperature=0.9, top_p=0.95, seed=1234, presence_penalty=0.3)
    alone = run_steps(Sampler(seed=1), seq(**params), [], rows, 20)
    crowded = run_steps(
        Sampler(seed=2),
        seq(**params),
        [seq(temperature=0.0), seq(temperature=1.2, seed=7), seq(temperature=0.7, top_k=10), seq(logprobs=3)],
        rows,
        20,
    )
    other_seed = run_steps(Sampler(seed=1), seq(**{**params, "seed": 4321}), [], rows, 20)
    assert alone == crowded
    assert alone != other_seed
    assert len(set(alone)) > 5  # genuinely random, not stuck on the argmax


# ------------------------------------------------------------------------------ logprobs


def test_logprobs_come_from_the_unmodified_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(3, 300)
    seqs = [
        seq(temperature=0.5, top_k=3, logprobs=5, frequency_penalty=1.0, outputs=(7, 7)),
        seq(temperature=0.0),
        seq(temperature=0.0, logprobs=0),
    ]
    tokens, logprobs = Sampler().sample(logits, seqs)
    reference = torch.log_softmax(logits, dim=-1)
    assert logprobs[1] is None
    first = logprobs[0]
    assert first.token_id == tokens[0]
    assert first.logprob == pytest.approx(reference[0, tokens[0]].item(), abs=1e-6)
    values, ids = torch.topk(reference[0], 5)
    assert [t for t, _ in first.top] == ids.tolist()
    assert [v for _, v in first.top] == pytest.approx(values.tolist(), abs=1e-6)
    assert tokens[0] in ids[:3].tolist()  # top_k=3 on the sampled side
    assert logprobs[2].top == [] and logprobs[2].logprob == pytest.approx(reference[2].max().item(), abs=1e-6)


# ------------------------------------------------------------------------------ distribution


def chi_square(counts: list[int], expected_probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected_probs) if p > 0)


# chi-square critical values at p = 0.001 (df = categories - 1)
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 5: 20.52}
N_DRAWS = 20000


def draw(params: dict, probs: list[float], seed: int = 0) -> list[int]:
    logits = probs_logits(probs).repeat(N_DRAWS, 1)
    # one Sequence object on every row: the rows are independent draws all the same
    tokens, _ = Sampler(seed=seed).sample(logits, [seq(**params)] * N_DRAWS)
    return [tokens.count(i) for i in range(len(probs))]


P = [0.35, 0.25, 0.2, 0.1, 0.07, 0.03]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"temperature": 1.0}, P),
        ({"temperature": 0.5}, [p**2 / sum(q**2 for q in P) for p in P]),
        ({"temperature": 1.0, "top_k": 3}, [p / 0.8 if i < 3 else 0 for i, p in enumerate(P)]),
        ({"temperature": 1.0, "top_p": 0.75}, [p / 0.8 if i < 3 else 0 for i, p in enumerate(P)]),
        ({"temperature": 1.0, "min_p": 0.6}, [p / 0.6 if i < 2 else 0 for i, p in enumerate(P)]),
    ],
)
def test_draws_follow_the_distribution(params, expected):
    counts = draw(params, P)
    assert all(c == 0 for c, p in zip(counts, expected) if p == 0)
    support = [p for p in expected if p > 0]
    stat = chi_square([c for c, p in zip(counts, expected) if p > 0], support)
    assert stat < CHI2_CRIT[len(support) - 1], (counts, stat)


def test_chi_square_check_can_fail():
    """The statistic must reject a wrong distribution, or the test above proves nothing."""
    counts = draw({"temperature": 1.0}, P)
    assert chi_square(counts, [1 / 6] * 6) > 100 * CHI2_CRIT[5]


def test_seeded_rows_follow_the_distribution_too():
    counts = [0] * len(P)
    logits = probs_logits(P).repeat(2000, 1)
    tokens, _ = Sampler().sample(logits, [seq(temperature=1.0, seed=i) for i in range(2000)])
    for t in tokens:
        counts[t] += 1
    assert chi_square(counts, P) < CHI2_CRIT[5], counts
    assert not math.isnan(sum(counts))


def test_empty_batch():
    assert Sampler().sample(torch.zeros(0, 10), []) == ([], None)


def test_mismatched_rows_are_rejected():
    with pytest.raises(ValueError, match="2 rows but 1 sequences"):
        Sampler().sample(torch.zeros(2, 4), [seq()])
