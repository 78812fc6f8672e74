"""Prompt logprobs (vLLM's prompt_logprobs, and what completions' echo + logprobs returns): every
prompt token after the first scored from the prefill's own logits, equal to the model's
log-softmax over a direct forward, whether the prompt runs in one chunk or many, and never
skipped through the prefix cache."""

from __future__ import annotations

import pytest
import torch

from servelab.core.sequence import SamplingParams
from tests.tiny_models import prefill_logits

PROMPT = [int(t) for t in torch.randint(5, 500, (53,), generator=torch.Generator().manual_seed(7))]


def _run(engine, rid: str, prompt: list[int], params: SamplingParams):
    seq = engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        engine.step()
    return seq


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """log-softmax of a direct forward of the whole prompt: row p scores token p + 1."""
    from servelab.runtime.loader import load_model

    model = load_model(str(tiny_llama), dtype=torch.float32).model
    return torch.log_softmax(prefill_logits(model, PROMPT).float(), dim=-1)


def _check(seq, reference: torch.Tensor, top: int) -> None:
    assert len(seq.prompt_logprobs) == len(PROMPT) - 1
    for p, lp in enumerate(seq.prompt_logprobs):
        row = reference[p]
        assert lp.token_id == PROMPT[p + 1]
        assert lp.logprob == pytest.approx(row[PROMPT[p + 1]].item(), abs=1e-4)
        assert lp.rank == int((row > row[PROMPT[p + 1]]).sum()) + 1
        values, ids = torch.topk(row, top)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [2048, 16, 7])  # one chunk; chunks of a block; chunks across blocks
def test_prompt_logprobs_equal_the_models_log_softmax(tiny_engine_factory, reference, budget):
    engine = tiny_engine_factory(max_num_batched_tokens=budget, num_blocks=64)
    seq = _run(engine, "r", PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
    _check(seq, reference, top=3)
    # a continuation's loglikelihood is the sum over its tokens
    cont = slice(40, 52)
    want = sum(reference[p, PROMPT[p + 1]].item() for p in range(cont.start, cont.stop))
    assert sum(lp.logprob for lp in seq.prompt_logprobs[cont]) == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("top", [0, 3])
def test_prompt_logprobs_scored_in_row_slices_are_the_same(tiny_engine_factory, reference, monkeypatch, top):
    from servelab.engine import model_executor

    monkeypatch.setattr(model_executor, "_SCORE_SLICE_ROWS", 5)  # 52 scored rows: 10 slices and a tail of 2
    engine = tiny_engine_factory(num_blocks=64)
    seq = _run(engine, "r", PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=top))
    _check(seq, reference, top=top)


def test_a_cached_prefix_is_not_skipped_for_prompt_logprobs(tiny_engine_factory, reference):
    engine = tiny_engine_factory(num_blocks=64)
    warm = _run(engine, "warm", PROMPT, SamplingParams(max_tokens=1, temperature=0))
    assert warm.num_cached_tokens == 0
    seq = _run(engine, "scored", PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert seq.num_cached_tokens == 0  # the cache held 48 of these tokens; they were recomputed
    _check(seq, reference, top=0)
    # requests that do not ask still reuse the cache
    again = _run(engine, "again", PROMPT, SamplingParams(max_tokens=1, temperature=0))
    assert again.num_cached_tokens == 48


def test_prompt_logprobs_are_not_duplicated_by_a_preemption(tiny_engine_factory, reference):
    # 6 blocks of 16 tokens: two 53-token prompts cannot both run to completion, so the newer is preempted.
    engine = tiny_engine_factory(num_blocks=7, max_num_batched_tokens=16, max_model_len=112)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=1)
    a = engine.add_request("a", PROMPT, params)
    b = engine.add_request(
        "b", PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=1)
    )
    while engine.has_unfinished():
        engine.step()
    assert a.num_preemptions + b.num_preemptions >= 1
    _check(a, reference, top=1)
    _check(b, reference, top=1)


def test_prompt_logprobs_limit_is_named():
    from servelab.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"prompt_logprobs must be in \[0, 20\], got 21"):
        SamplingParams(prompt_logprobs=21)
