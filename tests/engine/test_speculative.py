"""Speculative decoding in the real engine (tiny random Llama): proposers, verification in the
executor and sampler, and what must not change with it: greedy output (bit-exact under
--deterministic), logprobs, stop conditions, logit edits, seeds, chunking, prefix caching and
preemption; and that rejection sampling keeps the target distribution (chi-square)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from servelab.core.sequence import SamplingParams, Sequence
from servelab.core.speculative import SpeculativeConfig
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.engine.sampler import Sampler
from servelab.engine.speculative import NgramProposer, PredictionProposer, Proposers
from servelab.errors import InvalidArgument
from tests.scheduler_checks import check_invariants
from tests.tiny_models import prefill_logits, write_tiny_llama

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


def _engine(tiny_llama, spec: str | None, **kwargs) -> LLMEngine:
    kwargs.setdefault("dtype", "float32")
    return LLMEngine.from_args(
        EngineArgs.from_kwargs(model=str(tiny_llama), speculative_config=spec, block_size=4, **kwargs)
    )


def _repetitive_prompts(vocab: int, n: int = 6, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat a phrase, so that prompt lookup finds continuations to propose."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randint(3, 8))]
        prompts.append((phrase * rng.randint(2, 5))[: rng.randint(8, 40)])
    return prompts


def _generate(engine: LLMEngine, prompts: list, params: SamplingParams | list[SamplingParams], tag: str = "r"):
    """Per prompt: (output token ids, logprobs as (token, logprob, top) triples, text, finish reason)."""
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    seqs = [engine.add_request(f"{tag}{i}", p, pp) for i, (p, pp) in enumerate(zip(prompts, params_list))]
    logprobs: dict[str, list] = {s.request_id: [] for s in seqs}
    text: dict[str, str] = {s.request_id: "" for s in seqs}
    reasons: dict[str, object] = {}
    while engine.has_unfinished():
        for out in engine.step():
            logprobs[out.request_id] += [(lp.token_id, lp.logprob, lp.top) for lp in out.logprobs or []]
            text[out.request_id] += out.text_delta
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    check_invariants(engine.scheduler)
    assert engine.scheduler.block_manager.num_free_blocks == engine.scheduler_config.num_blocks
    return [(s.output_token_ids, logprobs[s.request_id], text[s.request_id], reasons[s.request_id]) for s in seqs]


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"max_num_batched_tokens": 7},  # chunked prefill, and drafts cut to the token budget
        {"num_blocks": 30, "enable_prefix_caching": False},  # preemption
        {"enable_prefix_caching": True},
    ],
    ids=["batched", "chunked", "preempted", "prefix-cached"],
)
def test_greedy_output_and_logprobs_are_bit_identical_in_deterministic_mode(tiny_llama, knobs):
    base = _engine(tiny_llama, None, deterministic=True, **knobs)
    prompts = _repetitive_prompts(base.vocab_size)
    if knobs.get("enable_prefix_caching"):
        prompts += [p[:] for p in prompts[:3]]  # the same prompts again: their blocks come from the cache
    expected = _generate(base, prompts, GREEDY)
    spec = _engine(tiny_llama, NGRAM, deterministic=True, **knobs)
    got = _generate(spec, prompts, GREEDY)
    assert got == expected
    counters = spec.scheduler.spec_counters
    assert counters.num_drafts > 0 and counters.num_accepted_tokens > 0


def test_preemption_happens_under_speculation_and_loses_nothing(tiny_llama):
    base = _engine(tiny_llama, None, deterministic=True, num_blocks=30, enable_prefix_caching=False)
    prompts = _repetitive_prompts(base.vocab_size, n=8, seed=3)
    expected = _generate(base, prompts, GREEDY, "p")
    spec = _engine(tiny_llama, NGRAM, deterministic=True, num_blocks=30, enable_prefix_caching=False)
    got = _generate(spec, prompts, GREEDY, "p")
    assert got == expected
    assert spec.stats().num_preemptions > 0


def test_greedy_tokens_are_identical_in_default_mode(tiny_llama):
    """Exact fp32 without --deterministic: verification rows take the prefill kernels, which may
    round differently from the decode kernel; on the tiny model the tokens agree."""
    prompts = _repetitive_prompts(_engine(tiny_llama, None).vocab_size, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    assert [o[0] for o in _generate(_engine(tiny_llama, NGRAM), prompts, params)] == [
        o[0] for o in _generate(_engine(tiny_llama, None), prompts, params)
    ]


def test_greedy_tokens_are_identical_on_the_pytorch_ops(tiny_llama):
    """The ops without block tables (gather + SDPA, as on CUDA): each verification row's mask
    stops at its own position."""
    from servelab.runtime.ops import TorchOps

    def make(spec):
        engine = _engine(tiny_llama, spec)
        engine.executor.model.use_ops(TorchOps())
        return engine

    prompts = _repetitive_prompts(make(None).vocab_size, seed=6)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    spec = make(NGRAM)
    assert [o[0] for o in _generate(spec, prompts, params)] == [o[0] for o in _generate(make(None), prompts, params)]
    assert spec.scheduler.spec_counters.num_accepted_tokens > 0


@pytest.mark.slow
def test_bundled_model_greedy_output_is_bit_identical_on_an_edit_workload():
    import json
    import struct
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import spec_decode

    def make(spec):
        return LLMEngine.from_args(
            EngineArgs.from_kwargs(deterministic=True, max_model_len=512, speculative_config=spec)
        )

    spec = make(json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    prompts = spec_decode.prompts(spec, 2)
    params = SamplingParams(max_tokens=48, temperature=0, logprobs=0)

    def bits(outputs):
        return [(o[0], [struct.pack("<f", lp[1]) for lp in o[1]]) for o in outputs]

    assert bits(_generate(spec, prompts, params)) == bits(_generate(make(None), prompts, params))
    assert spec.scheduler.spec_counters.acceptance_rate > 0.5


def test_stop_conditions_and_logit_edits_behave_as_without_speculation(tiny_llama):
    base = _engine(tiny_llama, None, deterministic=True)
    prompts = _repetitive_prompts(base.vocab_size, n=4, seed=2)
    first = _generate(base, prompts[:1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), "f")[0]
    stop_text = first[2][len(first[2]) // 2 : len(first[2]) // 2 + 3]
    params = [
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop_text]),  # a stop string mid-draft
        SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),  # max_tokens inside an accepted draft
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[first[0][6]]),
        SamplingParams(
            max_tokens=16,
            temperature=0,
            ignore_eos=True,
            logit_bias={first[0][3]: 5.0},
            repetition_penalty=1.3,
            presence_penalty=0.5,
            min_tokens=4,
        ),  # fmt: skip
    ]
    expected = _generate(base, [prompts[0]] * 3 + [prompts[3]], params)
    assert expected[0][3].value == "stop" and len(expected[1][0]) == 5
    got = _generate(_engine(tiny_llama, NGRAM, deterministic=True), [prompts[0]] * 3 + [prompts[3]], params)
    assert got == expected


def test_a_row_that_fails_in_a_verification_ends_only_its_request(tiny_llama, monkeypatch):
    base = _engine(tiny_llama, None, deterministic=True)
    prompts = _repetitive_prompts(base.vocab_size, n=4, seed=9)
    expected = _generate(base, prompts, GREEDY)
    real = Sampler.sample

    def sample(self, logits, seqs, argmax=None, drafts=None):
        tokens, logprobs = real(self, logits, seqs, argmax, drafts)
        for i, seq in enumerate(seqs):  # request r1's rows fail once it has 3 tokens, drafts counted
            if seq.request_id == "r1" and seq.num_output_tokens >= 3:
                tokens[i] = None
                self.row_errors[i] = "injected"
        return tokens, logprobs

    monkeypatch.setattr(Sampler, "sample", sample)
    engine = _engine(tiny_llama, NGRAM, deterministic=True)
    got = _generate(engine, prompts, GREEDY)  # also checks that every block came back
    assert got[1][3].value == "error" and len(got[1][0]) <= 3
    assert [got[i] for i in (0, 2, 3)] == [expected[i] for i in (0, 2, 3)]
    assert engine.scheduler.spec_counters.num_drafts > 0


def test_seeded_sampling_is_reproducible_with_speculation(tiny_llama):
    prompts = _repetitive_prompts(_engine(tiny_llama, None).vocab_size, n=3, seed=4)
    params = [SamplingParams(max_tokens=20, temperature=0.7, seed=11 + i, ignore_eos=True) for i in range(3)]
    runs = [_generate(_engine(tiny_llama, NGRAM, deterministic=True), prompts, params) for _ in range(2)]
    assert runs[0] == runs[1]


def test_structured_output_requests_do_not_speculate(tiny_llama):
    from servelab.core.structured_output import StructuredOutputSpec

    engine = _engine(tiny_llama, NGRAM)
    pytest.importorskip("xgrammar")
    params = SamplingParams(max_tokens=8, temperature=0, structured_output=StructuredOutputSpec("regex", "(ab)+"))
    out = _generate(engine, ["ab ab ab ab"], params)
    assert engine.scheduler.spec_counters.num_drafts == 0 and out[0][3] is not None


# ------------------------------------------------------------------------------- draft model


def _draft(path, k: int = 3) -> str:
    return json.dumps({"model": str(path), "num_speculative_tokens": k})


@pytest.fixture(scope="module")
def other_tiny_llama(tmp_path_factory):
    """Another random model with the same vocabulary size: a poor draft, but a valid one."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-draft"), seed=1, hidden=32, num_layers=1)


@pytest.mark.parametrize(
    "knobs", [{}, {"num_blocks": 30, "enable_prefix_caching": False}], ids=["batched", "preempted"]
)
def test_a_model_drafting_for_itself_is_always_accepted_and_changes_nothing(tiny_llama, knobs):
    base = _engine(tiny_llama, None, deterministic=True, **knobs)
    prompts = _repetitive_prompts(base.vocab_size, seed=7)
    expected = _generate(base, prompts, GREEDY)
    engine = _engine(tiny_llama, _draft(tiny_llama), deterministic=True, **knobs)
    assert _generate(engine, prompts, GREEDY) == expected
    counters = engine.scheduler.spec_counters
    assert counters.num_drafts > 0 and counters.acceptance_rate == 1.0  # the same bits, so the same argmax
    if knobs:
        assert engine.stats().num_preemptions > 0
    assert len(engine.core.proposers.draft._free) == engine.scheduler_config.num_blocks  # every draft block back


def test_a_poor_draft_model_changes_no_output(tiny_llama, other_tiny_llama):
    base = _engine(tiny_llama, None, deterministic=True)
    prompts = _repetitive_prompts(base.vocab_size, seed=8)
    expected = _generate(base, prompts, GREEDY)
    engine = _engine(tiny_llama, _draft(other_tiny_llama, k=4), deterministic=True)
    assert _generate(engine, prompts, GREEDY) == expected
    assert engine.scheduler.spec_counters.num_draft_tokens > 0


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    draft = write_tiny_llama(tmp_path / "draft", vocab_size=300)
    with pytest.raises(InvalidArgument, match="vocabulary") as err:
        _engine(tiny_llama, _draft(draft))
    assert err.value.param == "speculative_config"


# ------------------------------------------------------------------------------- prediction


def test_a_prediction_speculates_without_a_config_and_reports_usage(tiny_llama):
    base = _engine(tiny_llama, None, deterministic=True)
    prompt = _repetitive_prompts(base.vocab_size, n=1, seed=5)[0]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    expected = _generate(base, [prompt], params)[0]
    engine = _engine(tiny_llama, None, deterministic=True)
    wrong = [t + 1 for t in expected[0][8:14]]
    prediction = expected[0][:8] + wrong + expected[0][8:]  # right, an edit, then right again
    predicted = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1, prediction=prediction)
    seq = engine.add_request("p", prompt, predicted)
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert seq.output_token_ids == expected[0]
    last = outputs[-1]
    accepted = engine.scheduler.spec_counters.num_accepted_tokens
    assert accepted >= 12  # the prediction's right parts, before and after the edit
    assert last.accepted_prediction_tokens == accepted
    assert last.rejected_prediction_tokens == len(prediction) - accepted
    # fewer steps than tokens: each verification kept several
    assert engine.scheduler.spec_counters.num_drafts < 20


def test_prediction_proposer_realigns_after_an_edit():
    proposer = PredictionProposer(k=3)
    proposer.add("r", [10, 11, 12, 13, 14, 15, 16, 17])
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=20))
    assert proposer.propose(seq) == [10, 11, 12]  # no output yet: the prediction's start
    seq.token_ids += [10, 11, 99, 98, 14]  # diverged at 12, rejoined at 14
    assert proposer.propose(seq) == [15, 16, 17]


def test_ngram_proposer_takes_the_latest_earlier_occurrence():
    proposer = NgramProposer(SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}'))
    seq = Sequence("r", [5, 6, 7, 1, 5, 6, 8, 2, 5, 6], SamplingParams())
    seq.num_computed_tokens = len(seq.token_ids) - 1
    assert proposer.propose(seq) == [8, 2, 5]  # "5 6" last seen before the suffix at 4
    seq.token_ids += [8, 2]
    assert proposer.propose(seq) == [5, 6, 8]  # the index grows with the sequence
    assert proposer.propose(Sequence("q", [1, 2, 3], SamplingParams())) == []


def _reference_lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition, by brute force: n from n_max down, the latest earlier occurrence."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for s in range(L - n - 1, -1, -1):
            if tokens[s : s + n] == tokens[L - n :]:
                return tokens[s + n : s + n + k]
    return []


@pytest.mark.parametrize("n_min, n_max", [(1, 4), (2, 3), (1, 12)])
def test_ngram_lookup_matches_its_definition_as_the_sequence_grows(n_min, n_max):
    rng = random.Random(n_max)
    config = SpeculativeConfig("ngram", 5, prompt_lookup_max=n_max, prompt_lookup_min=n_min)
    for trial in range(30):
        proposer = NgramProposer(config)
        seq = Sequence(f"r{trial}", [rng.randrange(6) for _ in range(rng.randint(1, 30))], SamplingParams())
        for _ in range(40):  # few distinct tokens: repeats at every length; the index grows a token a time
            assert proposer.propose(seq) == _reference_lookup(seq.token_ids, 5, n_min, n_max), seq.token_ids
            seq.token_ids += [rng.randrange(6) for _ in range(rng.randint(1, 3))]


def test_proposers_skip_sequences_that_are_not_decoding(tiny_llama):
    proposers = Proposers(SpeculativeConfig.parse(NGRAM), vocab_size=100)
    seq = Sequence("r", [1, 2, 1, 2, 1], SamplingParams())
    proposers.propose([seq])  # still prefilling
    assert seq.draft_token_ids == []
    seq.num_computed_tokens = 4
    proposers.propose([seq])
    assert seq.draft_token_ids == [2, 1]


def test_engine_args_refuse_what_speculation_does_not_support(tiny_llama):
    with pytest.raises(InvalidArgument, match="num_speculative_tokens") as err:
        EngineArgs(speculative_config='{"method": "ngram"}')
    assert err.value.param == "speculative_config"
    with pytest.raises(InvalidArgument, match="tensor_parallel_size 1"):
        EngineArgs(speculative_config=NGRAM, tensor_parallel_size=2)
    with pytest.raises(InvalidArgument, match="cpu only"):
        EngineArgs(speculative_config=NGRAM, device="cuda")
    with pytest.raises(InvalidArgument, match="not a token id"):
        SamplingParams(prediction=[1, -2])


# ------------------------------------------------------------------------------- distribution

# chi-square critical values at p = 0.001 (df = bins - 1): a fixed seed makes each test one draw
# of the statistic, which a correct sampler exceeds with probability 0.001
CHI2_CRITICAL_0_001 = {7: 24.32, 11: 31.26}


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token with probability 0 was sampled"
    expected = probs[keep] * counts.sum()
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("draft_rank", [0, 3, 11, -1], ids=["likely", "middle", "unlikely", "outside-top-k"])
def test_rejection_sampling_keeps_the_target_distribution(tiny_llama, draft_rank):
    """The first token sampled with a forced draft is distributed as the target's tempered,
    top-k'd distribution, whichever draft the proposer guessed."""
    engine = _engine(tiny_llama, None)
    logits = prefill_logits(engine.executor.model, [5, 17, 9, 33, 5, 17])[-1:].float()
    params = SamplingParams(temperature=0.8, top_k=12, max_tokens=4)
    probs = torch.softmax(logits[0] / 0.8, dim=-1)
    top = torch.topk(probs, 12)
    target = torch.zeros_like(probs)
    target[top.indices] = top.values / top.values.sum()
    ranked = torch.argsort(probs, descending=True).tolist()
    draft = ranked[draft_rank] if draft_rank >= 0 else ranked[40]
    n = 20000
    seq = Sequence("r", [1, 2, 3], params)
    sampler = Sampler(seed=1234)
    tokens, _ = sampler.sample(logits.expand(n, -1).contiguous(), [seq] * n, None, [draft] * n)
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.shape[0]).float()
    stat, df = _chi_square(counts, target)
    assert df == 11
    assert stat < CHI2_CRITICAL_0_001[df], (stat, draft_rank)
    if draft_rank >= 0:  # the draft is kept exactly as often as the target picks it
        assert abs(counts[draft] / n - target[draft]) < 4 * (target[draft] * (1 - target[draft]) / n) ** 0.5


def test_the_chi_square_check_can_fail():
    """The same statistic on a sampler that always keeps the draft is far past the critical value."""
    probs = torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05, 0.0, 0.0])
    counts = torch.zeros(8)
    counts[:6] = probs[:6] * 1000
    counts[1] += 200  # a biased sampler: the draft (1) too often
    counts[0] -= 200
    stat, df = _chi_square(counts, probs)
    assert stat > CHI2_CRITICAL_0_001[5 + 2]


def test_seeded_verification_rows_are_reproducible_and_drafts_change_no_distribution_support():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(temperature=1.0, seed=7, max_tokens=8)) for i in range(4)]
    a, _ = Sampler(0).sample(logits.clone(), seqs, None, [3, 4, -1, 9])
    b, _ = Sampler(99).sample(logits.clone(), seqs, None, [3, 4, -1, 9])
    assert a == b  # seeded rows: their own generator, whatever the engine seed
    c, _ = Sampler(0).sample(logits.clone(), seqs, None, None)
    assert c[2] == a[2]  # a row without a draft samples as before
