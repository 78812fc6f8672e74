"""Pooling requests (embeddings) against HF transformers' final hidden states computed in one
pass: LAST and MEAN pooling, prompts chunked over several steps, prefix caching with a repeated
prefix, batched with generation, preempted, and no KV block left behind."""

from __future__ import annotations

import pytest
import torch

from servelab.core.sequence import FinishReason, PoolingParams, SamplingParams
from servelab.engine.llm_engine import EngineArgs, LLMEngine

transformers = pytest.importorskip("transformers")

TOL = 1e-4


@pytest.fixture(scope="module")
def hf(tiny_llama):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()


def reference(hf, ids: list[int], pooling_type: str, normalize: bool = True) -> torch.Tensor:
    """The plain PyTorch reference: the whole input in one forward pass, then pooled."""
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling_type == "LAST" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def ids_of(n: int, seed: int) -> list[int]:
    return [int(t) for t in torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed))]


def engine(tiny_llama, **knobs) -> LLMEngine:
    knobs = {"num_blocks": 64, "block_size": 16, **knobs}
    return LLMEngine.from_args(EngineArgs.from_kwargs(model=str(tiny_llama), dtype="float32", **knobs))


def run(eng: LLMEngine) -> int:
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    return steps


def assert_no_leak(eng: LLMEngine) -> None:
    bm = eng.scheduler.block_manager
    assert bm.num_used_blocks == 0
    assert bm.num_free_blocks == eng.scheduler_config.num_blocks


def pooled(seq) -> torch.Tensor:
    assert seq.finish_reason is FinishReason.STOP, seq.error
    assert seq.num_output_tokens == 0  # nothing sampled
    return torch.tensor(seq.pooled)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
@pytest.mark.parametrize("normalize", [True, False])
def test_short_input_matches_one_pass_reference(tiny_llama, hf, pooling_type, normalize):
    eng = engine(tiny_llama)
    ids = ids_of(40, 1)
    seq = eng.add_request("e", ids, SamplingParams(max_tokens=1), pooling=PoolingParams(pooling_type, normalize))
    assert run(eng) == 1
    got = pooled(seq)
    ref = reference(hf, ids, pooling_type, normalize)
    assert (got - ref).abs().max() <= TOL * ref.abs().max()
    if normalize:
        assert got.norm() == pytest.approx(1.0, abs=1e-5)
    assert_no_leak(eng)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_input_longer_than_the_step_budget_pools_across_chunks(tiny_llama, hf, pooling_type):
    eng = engine(tiny_llama, max_num_batched_tokens=32)
    ids = ids_of(150, 2)  # 5 chunks: 32 x 4 + 22
    seq = eng.add_request("e", ids, SamplingParams(max_tokens=1), pooling=PoolingParams(pooling_type))
    assert run(eng) == 5
    ref = reference(hf, ids, pooling_type)
    assert (pooled(seq) - ref).abs().max() <= TOL
    assert seq.pooling_sum is None
    assert_no_leak(eng)


def test_one_token_input_and_a_one_token_last_chunk(tiny_llama, hf):
    """A 1-token chunk runs on the decode path; it pools like any other."""
    eng = engine(tiny_llama, max_num_batched_tokens=16)
    one = eng.add_request("one", [7], SamplingParams(max_tokens=1), pooling=PoolingParams("MEAN"))
    ids = ids_of(33, 3)  # chunks of 16, 16, 1
    tail = eng.add_request("tail", ids, SamplingParams(max_tokens=1), pooling=PoolingParams("MEAN"))
    run(eng)
    assert (pooled(one) - reference(hf, [7], "MEAN")).abs().max() <= TOL
    assert (pooled(tail) - reference(hf, ids, "MEAN")).abs().max() <= TOL
    assert_no_leak(eng)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN"])
def test_prefix_cache_with_a_repeated_prefix(tiny_llama, hf, pooling_type):
    eng = engine(tiny_llama, enable_prefix_caching=True)
    prefix = ids_of(64, 4)
    first = eng.add_request("gen", prefix + ids_of(8, 5), SamplingParams(max_tokens=2, temperature=0))
    run(eng)
    assert first.finish_reason is FinishReason.LENGTH
    ids = prefix + ids_of(20, 6)
    seq = eng.add_request("e", ids, SamplingParams(max_tokens=1), pooling=PoolingParams(pooling_type))
    run(eng)
    # MEAN needs every position's hidden state, so it takes no cached block; LAST may reuse them.
    assert seq.num_cached_tokens == (0 if pooling_type == "MEAN" else 64)
    assert (pooled(seq) - reference(hf, ids, pooling_type)).abs().max() <= TOL
    # Its own blocks went to the prefix cache: a generation request reuses them.
    again = eng.add_request("gen2", ids + [9], SamplingParams(max_tokens=1, temperature=0))
    run(eng)
    assert again.num_cached_tokens == 80
    assert_no_leak(eng)


def test_batched_with_generation_changes_neither(tiny_llama, hf):
    prompt = ids_of(50, 7)
    alone = engine(tiny_llama, max_num_batched_tokens=48)
    solo = alone.add_request("g", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    run(alone)

    eng = engine(tiny_llama, max_num_batched_tokens=48)
    gen = eng.add_request("g", prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    inputs = {f"e{i}": ids_of(30 + 25 * i, 10 + i) for i in range(4)}
    seqs = {rid: eng.add_request(rid, ids, SamplingParams(max_tokens=1), pooling=PoolingParams("MEAN" if i % 2 else "LAST"))
            for i, (rid, ids) in enumerate(inputs.items())}  # fmt: skip
    run(eng)
    assert gen.output_token_ids == solo.output_token_ids
    for i, (rid, seq) in enumerate(seqs.items()):
        ref = reference(hf, inputs[rid], "MEAN" if i % 2 else "LAST")
        assert (pooled(seq) - ref).abs().max() <= TOL, rid
    assert_no_leak(eng)


def test_preempted_mean_pooling_starts_its_sum_over(tiny_llama, hf):
    """A pool too small for everyone preempts the newest sequence, a pooling one among them;
    its running sum restarts with its recomputed prompt."""
    eng = engine(tiny_llama, num_blocks=10, max_num_batched_tokens=8)  # 160 tokens of KV
    gen = eng.add_request("g", ids_of(90, 20), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    ids = ids_of(120, 21)
    seq = eng.add_request("e", ids, SamplingParams(max_tokens=1), pooling=PoolingParams("MEAN"))
    run(eng)
    assert seq.num_preemptions >= 1 and gen.num_preemptions == 0
    assert gen.finish_reason is FinishReason.LENGTH
    assert (pooled(seq) - reference(hf, ids, "MEAN")).abs().max() <= TOL
    assert_no_leak(eng)


def test_abort_mid_prefill_frees_its_blocks(tiny_llama):
    eng = engine(tiny_llama, max_num_batched_tokens=32)
    eng.add_request("e", ids_of(150, 8), SamplingParams(max_tokens=1), pooling=PoolingParams("MEAN"))
    eng.step()
    assert eng.scheduler.block_manager.num_used_blocks > 0
    assert eng.abort("e")
    run(eng)
    assert_no_leak(eng)


def test_input_up_to_max_model_len_is_admitted_and_longer_refused(tiny_llama):
    from servelab.errors import RequestTooLong

    eng = engine(tiny_llama, max_model_len=64)
    seq = eng.add_request("fits", ids_of(64, 9), SamplingParams(max_tokens=1), pooling=PoolingParams())
    run(eng)
    assert seq.pooled is not None
    with pytest.raises(RequestTooLong, match="maximum context length is 64 tokens, but the input has 65"):
        eng.add_request("long", ids_of(65, 9), SamplingParams(max_tokens=1), pooling=PoolingParams())
    assert_no_leak(eng)


def test_pooling_params_are_checked():
    from servelab.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="pooling_type must be one of LAST, MEAN"):
        PoolingParams("CLS")


@pytest.mark.slow
def test_tensor_parallel_ranks_pool_the_same_vector(tiny_llama, hf):
    """Every rank runs the step's forward with the same pooled rows; rank 0's vector is the answer."""
    ids = ids_of(100, 30)
    for pooling_type in ("LAST", "MEAN"):
        eng = engine(tiny_llama, num_blocks=32, max_num_batched_tokens=32, tensor_parallel_size=2)
        try:
            seq = eng.add_request("e", ids, SamplingParams(max_tokens=1), pooling=PoolingParams(pooling_type))
            eng.add_request("g", ids[:20], SamplingParams(max_tokens=5, temperature=0))
            run(eng)
            assert (pooled(seq) - reference(hf, ids, pooling_type)).abs().max() <= TOL
        finally:
            eng.close()


def test_offline_llm_embed(tiny_llama, hf):
    from servelab.engine.llm import LLM

    llm = LLM(str(tiny_llama), dtype="float32", num_blocks=32, max_num_batched_tokens=32)
    inputs = [ids_of(50, 40), ids_of(7, 41)]
    outs = llm.embed(inputs, PoolingParams("MEAN"))
    assert [o.prompt_token_ids for o in outs] == inputs
    for out, ids in zip(outs, inputs):
        assert (torch.tensor(out.embedding) - reference(hf, ids, "MEAN")).abs().max() <= TOL
    text = llm.embed("the cache is warm")[0]
    assert len(text.embedding) == 64 and text.prompt_token_ids == llm.tokenizer.encode_prompt("the cache is warm")
    assert_no_leak(llm.engine)
