"""Deterministic mode: greedy output bit-identical whatever else is in the
batch, however the prompt is chunked, and across preemption and recompute.

The kernels first: a batch-invariant linear gives each row the bits it gets alone, at every row
count and in every weight format; the paged attention kernel gives a decoded token exactly the
bits the prefill kernel gives the same token. Then the engine, on a tiny model and on the
bundled Q4_1 model.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from servelab.core.sequence import SamplingParams
from servelab.runtime import block_quant, native
from servelab.runtime.linear import DenseLinear
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from servelab.errors import InvalidArgument
from tests.scheduler_checks import check_invariants

from tests.runtime.test_block_quant import FORMATS, _packed

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 33, block_quant.MAX_ROWS + 1, 300)


@pytest.mark.parametrize("fmt", [*FORMATS, "F32"])
def test_an_invariant_linear_gives_each_row_its_bits_alone(kernel, fmt):
    in_features = 256 if fmt in ("Q4_K", "Q6_K") else 96
    if fmt == "F32":
        linear = DenseLinear(torch.randn(53, in_features))
    else:
        raw, dense = _packed(fmt, 53, in_features, seed=3)
        linear = block_quant.pack(dense, [(FORMATS[fmt], raw)], kernel)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(ROW_COUNTS), in_features, generator=g)
    bias = torch.randn(53, generator=g)
    weight = block_quant.batch_invariant(replace(linear, bias=bias), kernel)
    alone = torch.cat([weight(x[i : i + 1]) for i in range(x.shape[0])])
    for rows in ROW_COUNTS:  # the in-register kernel's, the panel kernel's and MKL's row counts
        assert torch.equal(weight(x[:rows]), alone[:rows]), rows
    ref = torch.nn.functional.linear(x.double(), weight.dequantize().double(), bias.double())
    assert (alone.double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # the fp32 product, in one order


def test_the_default_linear_is_not_invariant(kernel):
    """What deterministic mode fixes: rows 1-4, 5-128 and above sum in three different orders."""
    raw, dense = _packed("Q4_1", 64, 576, seed=4)
    weight = block_quant.pack(dense, [(3, raw)], kernel)
    x = torch.randn(200, 576)
    alone = torch.cat([weight(x[i : i + 1]) for i in range(8)])
    assert not all(torch.equal(weight(x[:rows])[:8], alone) for rows in (8, 200))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_paged_attention_matches_the_prefill_kernel_bit_for_bit(kernel, kv_dtype):
    H, KV, D, bs = 6, 2, 64, 16
    g = torch.Generator().manual_seed(1)
    ctx_lens = [1, 15, 64, 65, 130]
    num_blocks = sum(-(-c // bs) for c in ctx_lens) + 3
    kc = torch.randn(KV, num_blocks * bs, D, generator=g).to(kv_dtype)
    vc = torch.randn(KV, num_blocks * bs, D, generator=g).to(kv_dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()  # scattered blocks
    tables, used = [], 0
    for c in ctx_lens:
        n = -(-c // bs)
        tables.append(order[used : used + n])
        used += n
    table = torch.zeros(len(ctx_lens), max(len(t) for t in tables), dtype=torch.int64)
    for b, t in enumerate(tables):
        table[b, : len(t)] = torch.tensor(t)
    q = torch.randn(len(ctx_lens), H, D, generator=g)
    out = torch.empty(len(ctx_lens), H * D)
    native.paged_attention(kernel, q, kc, vc, table, torch.tensor(ctx_lens), max(ctx_lens), bs, 0.125, out)
    for b, c in enumerate(ctx_lens):
        slots = (torch.tensor(tables[b])[:, None] * bs + torch.arange(bs)).view(-1)[:c]
        k = kc.index_select(1, slots).float().transpose(0, 1)  # [ctx, KV, D]
        v = vc.index_select(1, slots).float().transpose(0, 1)
        for start in sorted({0, c - 1, c // 2}):  # the token as the last row of chunks of every size
            rows = torch.randn(c - start, H, D, generator=g)
            rows[-1] = q[b]
            want = native.prefill_attention(kernel, rows, k, v, start, 0.125)[-1]
            assert torch.equal(out[b], want), (c, start)


def test_deterministic_mode_refuses_what_it_cannot_guarantee(tiny_llama):
    with pytest.raises(InvalidArgument, match="deterministic mode computes in float32") as err:
        LLMEngine.from_args(EngineArgs(model=str(tiny_llama), dtype="bfloat16", deterministic=True))
    assert err.value.param == "dtype"
    with pytest.raises(InvalidArgument, match="deterministic mode runs on cpu only"):
        LLMEngine.from_args(EngineArgs(model=str(tiny_llama), device="cuda", deterministic=True))


# ------------------------------------------------------------------------------- the engine


def _prompts(n: int, length: tuple[int, int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*length))] for _ in range(n)]


def _generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> tuple[list, int]:
    """Per prompt its tokens and their logprobs (floats compared exactly: the bits), and the
    number of preemptions."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    seqs = [engine.add_request(f"{tag}{i}", ids, params) for i, ids in enumerate(prompts)]
    logprobs: dict[str, list[float]] = {s.request_id: [] for s in seqs}
    while engine.has_unfinished():
        for out in engine.step():
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs or []]
    check_invariants(engine.scheduler)
    return [(s.output_token_ids, logprobs[s.request_id]) for s in seqs], sum(s.num_preemptions for s in seqs)


def _runs(make, prompts: list[list[int]], max_tokens: int, pressured_blocks: int) -> dict[str, list]:
    engine = make()
    runs = {"alone": [_generate(engine, [p], max_tokens, f"alone{i}-")[0][0] for i, p in enumerate(prompts)]}
    runs["batched"], _ = _generate(make(), prompts, max_tokens, "b")
    runs["chunked"], _ = _generate(make(max_num_batched_tokens=7), prompts, max_tokens, "c")
    runs["preempted"], num_preemptions = _generate(
        make(num_blocks=pressured_blocks, enable_prefix_caching=False), prompts, max_tokens, "p"
    )
    assert num_preemptions > 0
    return runs


def _tiny(tiny_llama, deterministic: bool, **variant):
    def make(**kwargs):
        return LLMEngine.from_args(
            EngineArgs.from_kwargs(
                model=str(tiny_llama), dtype="float32", deterministic=deterministic, block_size=4, **variant, **kwargs
            )
        )

    return make


VARIANTS = {
    "fp32": {},
    "fp16-kv": {"kv_cache_dtype": "float16"},
    "int8": {"quantization": "int8"},
    "bf16": {"quantization": "bf16"},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_model_is_bit_identical_alone_batched_chunked_and_preempted(tiny_llama, variant):
    if variant in ("int8", "bf16"):
        from servelab.runtime.quantization import check_supported

        try:
            check_supported(variant)
        except InvalidArgument as exc:
            pytest.skip(str(exc))
    make = _tiny(tiny_llama, deterministic=True, **VARIANTS[variant])
    runs = _runs(make, _prompts(12, (3, 40), vocab=make().vocab_size), max_tokens=20, pressured_blocks=40)
    for name in ("batched", "chunked", "preempted"):
        assert runs[name] == runs["alone"], name


def test_without_the_flag_the_bits_do_depend_on_the_batch(tiny_llama, kernel):
    """Why the mode exists (and that the test above can fail): the default kernels give a row
    other bits in another batch, chunking or after a recompute."""
    make = _tiny(tiny_llama, deterministic=False)
    runs = _runs(make, _prompts(12, (3, 40), vocab=make().vocab_size), max_tokens=20, pressured_blocks=40)
    assert any(runs[name] != runs["alone"] for name in ("batched", "chunked", "preempted"))


@pytest.mark.slow
def test_bundled_model_is_bit_identical_alone_batched_chunked_and_preempted():
    def make(**kwargs):
        return LLMEngine.from_args(EngineArgs.from_kwargs(deterministic=True, max_model_len=128, **kwargs))

    # 10 blocks of 16 tokens hold ~3 of the 6 sequences at full length: the rest get preempted
    runs = _runs(make, _prompts(6, (8, 40), vocab=40000), max_tokens=12, pressured_blocks=10)
    for name in ("batched", "chunked", "preempted"):
        assert runs[name] == runs["alone"], name
