"""The native decode-attention kernel against a plain per-sequence reference (over fp32, fp16 and
bf16 caches), the prefill-attention kernel against SDPA, the K/V store rounding as torch rounds,
the model with and without the kernels, every ISA level's build (tests/runtime/isa_levels.py), the
default level and SERVELAB_ISA, each level's flags giving its own ISA whatever the compiler's
default, the SIMDe-tested levels building with the real intrinsics too, and a failed build
falling back with its reason recorded."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from servelab.runtime import native
from servelab.runtime.loader import load_model
from servelab.runtime.ops import NativeOps, TorchOps, select_ops
from servelab.errors import InvalidArgument
from tests.runtime.isa_levels import SIMDE_LEVELS, kernels_at
from tests.tiny_models import prefill_logits


def _reference(q, kc, vc, tables, ctx_lens, block_size, scale):
    """Each sequence alone: gather its keys slot by slot, SDPA with the KV heads repeated."""
    B, H, D = q.shape
    KV = kc.shape[0]
    out = []
    for b in range(B):
        slots = torch.tensor([tables[b][p // block_size] * block_size + p % block_size for p in range(ctx_lens[b])])
        k = kc[:, slots].repeat_interleave(H // KV, dim=0)  # [H, ctx, D]
        v = vc[:, slots].repeat_interleave(H // KV, dim=0)
        out.append(F.scaled_dot_product_attention(q[b][:, None], k.float(), v.float(), scale=scale)[:, 0].reshape(-1))
    return torch.stack(out)


@pytest.mark.parametrize(
    "kv_heads,group,head_dim,block_size,ctx_lens",
    [
        (3, 3, 64, 16, [1, 15, 16, 17, 96, 160]),  # SmolLM2's shape; block edges
        (2, 4, 128, 16, [5, 33, 250]),  # Llama-3-like head_dim
        (1, 1, 24, 7, [1, 6, 7, 8, 50]),  # odd block size, head_dim not a multiple of 32 (scalar tails)
        (4, 2, 40, 32, [3, 64, 65, 1000]),  # head_dim 40: vector body plus a tail
    ],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_per_sequence_attention(kernel, kv_heads, group, head_dim, block_size, ctx_lens, kv_dtype):
    g = torch.Generator().manual_seed(0)
    B, H = len(ctx_lens), kv_heads * group
    max_blocks = -(-max(ctx_lens) // block_size)
    num_blocks = B * max_blocks + 5
    kc = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=g).to(kv_dtype)
    vc = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=g).to(kv_dtype)
    # Scrambled, disjoint block tables padded with 0, as the executor builds them.
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables = [perm[b * max_blocks : (b + 1) * max_blocks].tolist() for b in range(B)]
    table = torch.zeros(B, max_blocks, dtype=torch.int64)
    for b, n in enumerate(ctx_lens):
        table[b, : -(-n // block_size)] = torch.tensor(tables[b][: -(-n // block_size)])
    # q as a strided view, like the model's q slice of its fused QK tensor.
    q = torch.randn(B, H + kv_heads, head_dim, generator=g)[:, :H] * 3
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full((B, H * head_dim), float("nan"))
    native.decode_attention(kernel, q, kc, vc, table, torch.tensor(ctx_lens), max(ctx_lens), block_size, scale, out)
    ref = _reference(q, kc, vc, tables, ctx_lens, block_size, scale)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # Our thread pool splits the (sequence, KV head) pairs; each pair's arithmetic is unchanged.
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            again = torch.full_like(out, float("nan"))
            native.decode_attention(
                kernel, q, kc, vc, table, torch.tensor(ctx_lens), max(ctx_lens), block_size, scale, again
            )
            assert torch.equal(again, out), threads
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_model_gives_the_same_logits_with_and_without_the_kernels(kernel, tiny_llama, kv_dtype):
    """Every kernel in the model's forward (RoPE + K/V store, add + RMSNorm, SwiGLU, decode
    attention) against the PyTorch path, through whole prefills, chunks and decodes; with a
    16-bit cache both paths round K and V the same way and read them back the same way."""
    model = load_model(tiny_llama, dtype=torch.float32).model
    assert isinstance(model.ops, NativeOps)
    ids = [int(t) for t in torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(2))]
    chunkings = (None, 7, 1)  # one pass; chunks attending to the cache; every token a decode
    with_kernels = [prefill_logits(model, ids, chunk=c, kv_dtype=kv_dtype) for c in chunkings]
    model.use_ops(TorchOps())
    without = [prefill_logits(model, ids, chunk=c, kv_dtype=kv_dtype) for c in chunkings]
    if kv_dtype == torch.float32:
        for got, ref in zip(with_kernels, without):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        return
    # Rounding to 16 bits turns fp32 summation-order differences (~1e-7) into a different 16-bit
    # value now and then, so the paths and chunkings agree to well within what the 16-bit cache
    # itself changes against an fp32 one (which must stay small).
    exact = prefill_logits(model, ids, kv_dtype=torch.float32)
    cache_error = (with_kernels[0] - exact).abs().max()
    assert 0 < cache_error <= 0.02 * exact.abs().max()
    for got in with_kernels + without:
        assert (got - with_kernels[0]).abs().max() <= cache_error / 2


def _store_inputs() -> torch.Tensor:
    """fp32 values that exercise 16-bit rounding: ordinary, ties, fp16 subnormals and
    underflow, the fp16 overflow edge (65504 .. 65520 and past it), bf16 carries. (No infinities:
    RoPE multiplies each value's partner by sin = 0, and inf * 0 is NaN.)"""
    g = torch.Generator().manual_seed(5)
    ordinary = torch.randn(4000, generator=g) * torch.logspace(-9, 6, 4000)
    bits = torch.randint(-(2**31), 2**31, (4000,), generator=g, dtype=torch.int64).to(torch.int32)  # both signs
    raw = bits.view(torch.float32)
    raw = torch.where(raw.isfinite(), raw, torch.zeros_like(raw))
    special = torch.tensor(
        [
            0.0,
            -0.0,
            1.0,
            -1.0,
            1 + 2**-11,
            1 + 3 * 2**-11,
            1 + 2**-8,
            1 + 3 * 2**-8,  # fp16 / bf16 ties
            2**-24,
            2**-25,
            1.5 * 2**-25,
            3 * 2**-25,
            2**-14,
            2**-14 - 2**-25,
            6e-8,
            1e-10,
            65504.0,
            65519.0,
            65520.0,
            7e4,
            -7e4,
            3.4e38,
            3.3961e38,
        ]
    )
    values = torch.cat([special, -special, ordinary, raw])
    return values[: values.numel() // 16 * 16]  # whole K/V rows of 8 (the specials come first)


def _check_store(store, kv_dtype, D: int = 8):
    """store(qkv, D, cos, sin, positions, slots, k, v) writes K/V rows of head_dim D; with cos = 1
    and sin = 0 the rotation leaves the values as they are, and the cache must hold exactly
    torch's casts."""
    values = _store_inputs()
    KV, H = 1, 1
    T = values.numel() // (2 * D)
    kv_vals = values[: T * 2 * D].view(T, 2, D)
    qkv = torch.cat([torch.zeros(T, H * D), kv_vals.reshape(T, 2 * D)], dim=1).contiguous()
    cos, sin = torch.ones(1, D), torch.zeros(1, D)
    positions, slots = torch.zeros(T, dtype=torch.int64), torch.randperm(T)
    k = torch.empty(KV, T, D, dtype=kv_dtype)
    v = torch.empty(KV, T, D, dtype=kv_dtype)
    store(qkv, D, cos, sin, positions, slots, k, v)
    rotated = qkv[:, H * D :].view(T, 2, D)  # the K values after the kernel's RoPE, V untouched
    torch.testing.assert_close(rotated, kv_vals, rtol=0, atol=0)  # (up to the sign of a zero)
    assert torch.equal(k[0, slots].view(torch.int16), rotated[:, 0].to(kv_dtype).view(torch.int16))
    assert torch.equal(v[0, slots].view(torch.int16), rotated[:, 1].to(kv_dtype).view(torch.int16))


def _prefill_reference(q, k, v, start_pos, scale):
    """SDPA with an explicit causal mask by position: q [n, H, D], k/v [ctx, KV, D]."""
    n, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(start_pos, start_pos + n)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1).reshape(n, -1)


# (heads, kv_heads, head_dim): SmolLM2's; no grouping with head_dims that leave vector tails
# (40) and scalar ones (33)
PREFILL_SHAPES = [(9, 3, 64), (4, 4, 40), (8, 2, 128), (2, 1, 33)]
# (start_pos, n): one row, whole prompts across the 32-row / 64-key blocks, later chunks over a
# cached context that starts mid-block
PREFILL_CHUNKS = [(0, 1), (0, 33), (0, 200), (60, 40), (100, 130), (5, 3)]


def _prefill_cases():
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, dim in PREFILL_SHAPES:
        for start, n in PREFILL_CHUNKS:
            ctx = start + n
            qkv = torch.randn(n, heads + 2 * kv_heads, dim, generator=g)  # q strided inside a fused qkv
            q = qkv[:, :heads]
            k, v = torch.randn(ctx, kv_heads, dim, generator=g), torch.randn(ctx, kv_heads, dim, generator=g)
            if start:  # a later chunk reads the cache as [KV, ctx, D] transposed
                k, v = k.transpose(0, 1).contiguous().transpose(0, 1), v.transpose(0, 1).contiguous().transpose(0, 1)
            yield q, k, v, start


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefill_kernel_matches_sdpa(kernel, threads):
    torch.set_num_threads(threads)
    try:
        for q, k, v, start in _prefill_cases():
            want = _prefill_reference(q, k, v, start, 0.3)
            torch.testing.assert_close(
                native.prefill_attention(kernel, q, k, v, start, 0.3), want, rtol=2e-5, atol=2e-5
            )
    finally:
        torch.set_num_threads(1)


def _check_prefill_nan(kernels):
    """A NaN in one key makes exactly the rows that see it NaN (the sampler then reports them)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(40, 4, 16, generator=g),
        torch.randn(40, 2, 16, generator=g),
        torch.randn(40, 2, 16, generator=g),
    )
    k[17, 1, 3] = float("nan")  # KV head 1: query heads 2 and 3, positions 17 on
    out = native.prefill_attention(kernels, q, k, v, 0, 0.25).view(40, 4, 16)
    assert out[17:, 2:].isnan().all(dim=-1).all()
    assert out[:17].isfinite().all() and out[:, :2].isfinite().all()


def test_prefill_kernel_keeps_nan_where_it_belongs(kernel):
    _check_prefill_nan(kernel)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_prefill_chunks_in_one_call_keep_each_chunks_bits(isa_kernels, threads):
    """Several whole prompts of one step in one call (ragged: 1 row, under a 16-key panel, over a
    32-row block, two 64-key blocks; GQA; q strided inside a fused qkv, a decode row first) give
    each prompt's rows the bits of its own call and leave every other row of out alone."""
    name, kernels = isa_kernels
    g = torch.Generator().manual_seed(5)
    lengths, H, KV = [1, 7, 33, 130, 16, 64], 6, 2
    for D in (16, 24, 64):
        T = 1 + sum(lengths)
        qkv = torch.randn(T, (H + 2 * KV) * D, generator=g)
        q = qkv[:, : H * D].view(T, H, D)
        k, v = qkv[:, H * D : (H + KV) * D].view(T, KV, D), qkv[:, (H + KV) * D :].view(T, KV, D)
        chunks, offset = [], 1
        for n in lengths:
            chunks.append((offset, n))
            offset += n
        out = torch.full((T, H * D), 7.0)
        torch.set_num_threads(threads)
        try:
            native.prefill_attention_chunks(kernels, q, k, v, chunks, 0.3, out)
            for offset, n in chunks:
                rows = slice(offset, offset + n)
                want = native.prefill_attention(kernels, q[rows], k[rows], v[rows], 0, 0.3)
                assert torch.equal(out[rows], want), (name, threads, D, n)
        finally:
            torch.set_num_threads(1)
        assert torch.equal(out[0], torch.full((H * D,), 7.0))


def test_prefill_wrapper_rejects_inconsistent_shapes(kernel):
    q, k = torch.randn(8, 4, 16), torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match="prefill_attention"):
        native.prefill_attention(kernel, q, k[:5], k[:5], 0, 0.25)  # fewer keys than positions
    with pytest.raises(ValueError, match="multiple of KV"):
        native.prefill_attention(kernel, q[:, :3], k, k, 0, 0.25)  # 3 query heads over 2 KV heads


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16])
def test_kv_store_rounds_as_torch_does(kernel, kv_dtype):
    _check_store(lambda qkv, D, *a: native.rope_store_kv(kernel, qkv, 1, 1, D, *a), kv_dtype)


def test_every_isa_level_rounds_and_attends_the_same(isa_kernels):
    """Each ISA level's build (portable: half.h's scalar 16-bit conversions; AVX2; AVX-512, native
    or on SIMDe where the CPU lacks it) stores K/V with torch's roundings, attends over a 16-bit
    cache and in prefill as the references do, and gives torch's argmax, RMSNorm and SwiGLU."""
    name, kernels = isa_kernels
    for x in _argmax_cases():
        assert native.argmax_rows(kernels, x) == x.argmax(dim=-1).tolist(), (name, x.shape)
    for q, k, v, start in _prefill_cases():
        torch.testing.assert_close(
            native.prefill_attention(kernels, q, k, v, start, 0.3),
            _prefill_reference(q, k, v, start, 0.3),
            rtol=2e-5,
            atol=2e-5,
        )
    _check_prefill_nan(kernels)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(7, 37, generator=g), torch.randn(37, generator=g)
    want = F.rms_norm(x, (37,), w, 1e-6)
    torch.testing.assert_close(native.add_rms_norm(kernels, x, None, w, 1e-6), want, rtol=1e-5, atol=1e-5)
    gate_up = torch.randn(7, 2 * 37, generator=g) * 4
    want = F.silu(gate_up[:, :37]) * gate_up[:, 37:]
    torch.testing.assert_close(native.silu_mul(kernels, gate_up), want, rtol=1e-5, atol=1e-5)
    for kv_dtype in (torch.float32, torch.float16, torch.bfloat16):
        if kv_dtype != torch.float32:
            for D in (8, 40):  # 40: AVX-512's 16-lane fp16 store twice, then AVX2's 8
                _check_store(lambda qkv, D, *a: native.rope_store_kv(kernels, qkv, 1, 1, D, *a), kv_dtype, D)
        for D in (24, 48, 64):  # AVX2 8-lane tiles + a tail (24); AVX-512 16-lane ones, P V 32 + 16 (48)
            kc = torch.randn(2, 40 * 8, D, generator=g).to(kv_dtype)
            vc = torch.randn(2, 40 * 8, D, generator=g).to(kv_dtype)
            tables = [list(range(30, 20, -1)), list(range(1, 11))]
            ctx_lens = [73, 9]
            q = torch.randn(2, 6, D, generator=g)
            out = torch.empty(2, 6 * D)
            native.decode_attention(kernels, q, kc, vc, torch.tensor(tables), torch.tensor(ctx_lens), 73, 8, 0.2, out)
            torch.testing.assert_close(out, _reference(q, kc, vc, tables, ctx_lens, 8, 0.2), rtol=1e-5, atol=1e-5)


# head_dim: the AVX-512 output tile's 64 dims (64, 128), its 48 / 32 / 16-dim tiles after them
# (48, 96, 16), AVX2's 8-dim step (24, 40) and the scalar tail (33); chunks as PREFILL_CHUNKS
_BITS_DIMS = [16, 24, 33, 40, 48, 64, 96, 128]


def _paged_case(kv_dtype, D: int, g: torch.Generator):
    """q [B, 6, D], a 2-KV-head cache of scattered 16-slot blocks, its tables and context lengths
    (one key, one under a 16-key panel, odd panel counts, two 64-key blocks)."""
    bs, ctx_lens = 16, [1, 9, 33, 64, 130]
    num_blocks = sum(-(-c // bs) for c in ctx_lens) + 2
    kc = torch.randn(2, num_blocks * bs, D, generator=g).to(kv_dtype)
    vc = torch.randn(2, num_blocks * bs, D, generator=g).to(kv_dtype)
    order, used = torch.randperm(num_blocks, generator=g), 0
    table = torch.zeros(len(ctx_lens), -(-max(ctx_lens) // bs), dtype=torch.int64)
    for b, c in enumerate(ctx_lens):
        n = -(-c // bs)
        table[b, :n] = order[used : used + n]
        used += n
    return torch.randn(len(ctx_lens), 6, D, generator=g), kc, vc, table, torch.tensor(ctx_lens)


@pytest.mark.parametrize("level", sorted(SIMDE_LEVELS))
def test_avx512_levels_give_avx2s_bits_in_attention_and_the_layer_ops(level):
    """The AVX-512 paths of prefill attention (16-lane score and output tiles), of the paged kernel
    that shares its rows (deterministic decode), of the softmax passes (exp16) and of RMSNorm,
    SwiGLU, RoPE and the K/V store sum and round each value in AVX2's order: the same bits as the avx2
    build, at every head_dim tail, row length and cache format, natively or on SIMDe. (The linears
    and decode attention sum in another order at 16 lanes: the tests above hold them to 1e-5.)
    The argmax passes are exact at any width: test_every_isa_level_... checks them against torch."""
    avx2, how = kernels_at("avx2")
    if avx2 is None:
        pytest.skip(f"avx2: {how}")
    kernels, how = kernels_at(level)
    if kernels is None:
        pytest.skip(f"{level}: {how}")
    g = torch.Generator().manual_seed(3)
    for D in _BITS_DIMS:
        for start, n in PREFILL_CHUNKS:
            q = torch.randn(n, 4, D, generator=g)
            k, v = torch.randn(start + n, 2, D, generator=g), torch.randn(start + n, 2, D, generator=g)
            got = native.prefill_attention(kernels, q, k, v, start, 0.3)
            assert torch.equal(got, native.prefill_attention(avx2, q, k, v, start, 0.3)), (level, D, start, n)
    for kv_dtype in (torch.float32, torch.bfloat16):
        for D in (24, 48, 64):
            q, kc, vc, table, ctx_lens = _paged_case(kv_dtype, D, g)
            out = {}
            for name, kn in ((level, kernels), ("avx2", avx2)):
                out[name] = torch.empty(q.shape[0], 6 * D)
                native.paged_attention(kn, q, kc, vc, table, ctx_lens, int(ctx_lens.max()), 16, 0.125, out[name])
            assert torch.equal(out[level], out["avx2"]), (level, kv_dtype, D)
    for kv_dtype in (torch.float16, torch.bfloat16):  # RoPE, then the store's rounding
        for D in (8, 24, 64):
            T, H, KV = 5, 3, 1
            qkv = torch.randn(T, (H + 2 * KV) * D, generator=g)
            cos, sin = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
            positions, slots = torch.randperm(T), torch.randperm(T)
            got = {}
            for name, kn in ((level, kernels), ("avx2", avx2)):
                rows, k, v = qkv.clone(), torch.empty(KV, T, D, dtype=kv_dtype), torch.empty(KV, T, D, dtype=kv_dtype)
                native.rope_store_kv(kn, rows, H, KV, D, cos, sin, positions, slots, k, v)
                got[name] = (rows, k.view(torch.int16), v.view(torch.int16))
            assert all(torch.equal(a, b) for a, b in zip(got[level], got["avx2"])), (level, kv_dtype, D)
    for hidden in (7, 8, 15, 16, 37, 576):  # under one vector, one of 8, one of 16, and tails
        x, delta, w = (
            torch.randn(3, hidden, generator=g),
            torch.randn(3, hidden, generator=g),
            torch.randn(hidden, generator=g),
        )
        x2 = x.clone()
        got, want = native.add_rms_norm(kernels, x, delta, w, 1e-6), native.add_rms_norm(avx2, x2, delta, w, 1e-6)
        assert torch.equal(x, x2) and torch.equal(got, want), (level, hidden)
        gate_up = torch.randn(3, 2 * hidden, generator=g) * 30  # past exp's clamps on both sides
        assert torch.equal(native.silu_mul(kernels, gate_up), native.silu_mul(avx2, gate_up)), (level, hidden)


def test_a_failed_build_falls_back_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_builds", {})
    monkeypatch.setattr(native, "load_error", None)
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert native.native_kernels() is None
    assert "false failed" in native.load_error
    assert type(select_ops(torch.device("cpu"), torch.float32)) is TorchOps  # the model runs on PyTorch
    monkeypatch.setattr(native, "_builds", {})
    monkeypatch.setenv("SERVELAB_NATIVE", "0")
    assert native.native_kernels() is None
    assert "SERVELAB_NATIVE=0" in native.load_error


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 37), (32, 64)])
def test_add_rms_norm_and_silu_mul_match_pytorch(kernel, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x, delta, w = (
        torch.randn(rows, hidden, generator=g),
        torch.randn(rows, hidden, generator=g),
        torch.randn(hidden, generator=g),
    )
    expected_x = x + delta
    expected = F.rms_norm(expected_x, (hidden,), w, 1e-6)
    got = native.add_rms_norm(kernel, x, delta, w, 1e-6)
    torch.testing.assert_close(x, expected_x, rtol=0, atol=0)  # the residual add happened in place
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(native.add_rms_norm(kernel, x, None, w, 1e-6), expected, rtol=1e-5, atol=1e-5)
    # SwiGLU over a fused gate/up output, with gate values far out on both sides of the exp range
    gate_up = torch.randn(rows, 2 * hidden, generator=g) * 4
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0
    expected_act = F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:]
    torch.testing.assert_close(native.silu_mul(kernel, gate_up), expected_act, rtol=1e-5, atol=1e-5)


def _argmax_cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    wide = torch.randn(33, 49152, generator=g)
    wide[3, 40000] = wide[3, 17] = 100.0  # a tie: the first index wins, as in torch
    wide[4] = float("-inf")  # every token masked
    wide[5, :] = 0.0
    wide[6, 49151] = 1e30  # the last element
    wide[7, 100:] = float("-inf")
    tails = torch.randn(4, 91, generator=g)  # AVX-512: 64 + 16, then 11 scalar; AVX2: 64, 16 + 11
    tails[0, 90] = tails[1, 70] = tails[2, 85] = tails[3, 63] = 9.0  # the largest in each part
    tails[2, 20] = 9.0  # and a tie with an earlier one
    return [
        wide,
        torch.randn(5, 7, generator=g),
        torch.randn(3, 37, generator=g),
        torch.randn(1, 1, generator=g),
        torch.randint(0, 3, (4, 1000), generator=g).float(),
        tails,
    ]  # many ties


def test_nonfinite_rows_are_exactly_the_rows_torch_finds(isa_kernels):
    """NaN, +inf or -inf at the start, mid-vector or in the scalar tail marks its row; the largest
    finite float, subnormals and -0.0 do not."""
    _, kernels = isa_kernels
    n = 91  # 64 + 16 + 8 + 3: every vector step and a tail
    x = torch.randn(12, n)
    x[1, 0], x[2, 47], x[3, 90], x[4, 5] = float("nan"), float("inf"), float("-inf"), float("nan")
    x[4, 80] = float("inf")
    x[5] = torch.finfo(torch.float32).max
    x[6, :10] = torch.finfo(torch.float32).tiny / 4  # subnormal
    x[7] = -0.0
    x[8, 63] = -torch.finfo(torch.float32).max
    x[11, 64] = float("nan")
    want = (~torch.isfinite(x).all(dim=-1)).nonzero().flatten().tolist()
    assert want == [1, 2, 3, 4, 11]
    assert native.nonfinite_rows(kernels, x) == want
    assert native.nonfinite_rows(kernels, x[5:8].contiguous()) == []


def test_argmax_rows_matches_torch(kernel):
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for x in _argmax_cases():
                assert native.argmax_rows(kernel, x) == x.argmax(dim=-1).tolist(), (threads, x.shape)
    finally:
        torch.set_num_threads(before)


def test_engine_generates_the_same_tokens_on_the_pytorch_path(kernel, tiny_engine_factory):
    """The executor's two metadata shapes (block tables for the kernel; flat slots and a mask for
    gather + SDPA) drive the same greedy tokens for a batch of mixed-length prompts."""
    from servelab.core.sequence import SamplingParams

    outputs = []
    for use_native in (True, False):
        engine = tiny_engine_factory(enable_prefix_caching=False)
        if not use_native:
            engine.executor.model.use_ops(TorchOps())
        seqs = [
            engine.add_request(
                f"r{i}", list(range(10 + i, 10 + i + n)), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
            )
            for i, n in enumerate((3, 17, 40, 9))
        ]
        while engine.has_unfinished():
            engine.step()
        outputs.append([s.output_token_ids for s in seqs])
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("preset, want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_importing_servelab_makes_idle_openmp_threads_wait_passively(preset, want):
    """servelab/__init__.py sets OMP_WAIT_POLICY (before torch loads libgomp) so that torch's idle
    OpenMP threads do not spin on the cores our kernels' pool needs; a user's own setting wins."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    code = "import os, servelab, torch; print(os.environ['OMP_WAIT_POLICY'])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == want


_AVX512_HOST = {  # torch.cpu.get_capabilities() of an AVX-512 host with VNNI but no BF16
    "avx2": True,
    "fma3": True,
    "f16c": True,
    "avx512_f": True,
    "avx512_bw": True,
    "avx512_vl": True,
    "avx512_dq": True,
    "avx512_vnni": True,
    "avx512_bf16": False,
}


def test_the_default_level_is_the_highest_the_cpu_has_and_the_env_only_lowers_it(monkeypatch, caplog):
    monkeypatch.delenv("SERVELAB_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: _AVX512_HOST)
    assert native.best_level() == "avx512_vnni"
    assert native.unavailable_reason("avx512_bf16") == "this CPU lacks avx512bf16"
    monkeypatch.setenv("SERVELAB_ISA", "AVX2")
    assert native.best_level() == "avx2"
    monkeypatch.setenv("SERVELAB_ISA", "avx512_bf16")  # past the CPU: its best instead, and the log says so
    assert native.best_level() == "avx512_vnni"
    assert "SERVELAB_ISA=avx512_bf16, but this CPU has only" in native.level_choice()
    monkeypatch.setenv("SERVELAB_ISA", "avx1024")
    with pytest.raises(
        InvalidArgument, match=r"SERVELAB_ISA='avx1024' is not an ISA level \(known, lowest first: port"
    ):
        native.best_level()
    monkeypatch.setenv("SERVELAB_ISA", "portable")
    monkeypatch.setattr(native, "_logged", set())
    with caplog.at_level("INFO", logger="servelab.runtime"):
        native.native_kernels()
        native.native_kernels()
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["native kernels: ISA level portable"]  # once


def test_cpu_features_fall_back_to_proc_cpuinfo(monkeypatch):
    torch_view = native.cpu_features()
    monkeypatch.delattr(torch.cpu, "get_capabilities")
    if not native._proc_cpuinfo_flags():
        pytest.skip("no /proc/cpuinfo flags here")
    assert native.cpu_features() == torch_view


def test_build_compiles_the_sources_given_with_the_extra_flags_and_leaves_the_loaded_kernels(monkeypatch, tmp_path):
    from importlib import resources

    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for src in resources.files("servelab.runtime").joinpath("csrc").iterdir():
        (csrc / src.name).write_bytes(src.read_bytes())
    (csrc / "parallel.c").write_text("/* another tree's pool */\n")
    cc = tmp_path / "cc"  # records its arguments and the sources it is given, then fails
    cc.write_text(
        '#!/bin/sh\necho "$@" > "$0.args"\nfor a; do case "$a" in *.c) cat "$a" >> "$0.args";; esac; done\nexit 1\n'
    )
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "cache"))
    builds = dict(native._builds)
    with pytest.raises(RuntimeError, match="failed"):
        native.build("avx2", ["-DSL_SPIN_NS=0"], csrc=csrc)
    recorded = (tmp_path / "cc.args").read_text()
    flags = " ".join(native.ISA_LEVELS[1].cflags)
    assert f"{flags} -DSL_SPIN_NS=0" in recorded and "/* another tree's pool */" in recorded
    assert native._builds == builds  # native_kernels() hands out what it did
    with pytest.raises(ValueError, match="unknown ISA level"):
        native.build("avx9")


@pytest.mark.parametrize("level", native.ISA_LEVELS, ids=lambda level: level.name)
def test_each_level_builds_with_its_own_isa_whatever_the_compiler_defaults_to(level, tmp_path):
    """A compiler that defaults to an AVX-512 CPU (-march=x86-64-v4: F/BW/VL/DQ) still builds the
    portable and avx2 levels without it: csrc/isa.h's SL_* macros are those of the CPU features
    each level needs, so SERVELAB_ISA=avx2 on such a host really is AVX2. (VNNI and BF16 are not
    turned off below their levels: gcc < 10 does not know -mno-avx512bf16.)"""
    import shutil
    import subprocess
    from importlib import resources

    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or not native._is_x86():
        pytest.skip("needs an x86 C compiler")
    want = {"SL_AVX2": "avx2", "SL_AVX512": "avx512f", "SL_AVX512_VNNI": "avx512vnni", "SL_AVX512_BF16": "avx512bf16"}
    src = tmp_path / "levels.c"
    checks = "".join(
        f"#if defined({macro}) != {int(feature in level.needs)}\n#error {macro} wrong\n#endif\n"
        for macro, feature in want.items()
    )
    src.write_text(f'#include "isa.h"\n{checks}')
    csrc = str(resources.files("servelab.runtime").joinpath("csrc"))
    probe = subprocess.run([cc, "-march=x86-64-v4", "-fsyntax-only", "-x", "c", "/dev/null"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"{cc} does not know -march=x86-64-v4")
    proc = subprocess.run(
        [cc, "-march=x86-64-v4", *level.cflags, f"-I{csrc}", "-fsyntax-only", str(src)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", sorted(SIMDE_LEVELS))
def test_levels_checked_on_simde_also_build_with_the_real_intrinsics(name, tmp_path):
    """A level this CPU lacks is tested on SIMDe, which accepts some code the compiler's own
    intrinsics do not (a name only SIMDe defines, a type it converts silently). On an AVX-512
    host that real build is the default, so here it must at least compile and link: every
    function declared and defined. -O0 for speed: the kernels write every immediate as a literal."""
    import shutil
    import subprocess
    from importlib import resources

    if native.unavailable_reason(name) is None:
        pytest.skip(f"this CPU has {name}: native_kernels builds it with the real intrinsics")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None or not native._is_x86():
        pytest.skip("needs an x86 C compiler")
    csrc = resources.files("servelab.runtime").joinpath("csrc")
    flags = [flag for flag in native._flags(native._LEVELS[name]) if flag != "-O3"]
    checks = ["-O0", "-Werror=implicit-function-declaration", "-Werror=incompatible-pointer-types", "-Wl,-z,defs"]
    sources = [str(csrc.joinpath(source)) for source in native._SOURCES]
    out = str(tmp_path / "real.so")
    proc = subprocess.run(
        [cc, *flags, *checks, *sources, "-o", out, "-lm", "-lpthread"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_pool_gives_every_job_all_its_parts_under_contention():
    """Jobs of 1-6 parts back to back, from three Python threads at once (one holds the pool, the
    others run inline), with gaps that let the workers fall asleep: every part of every job runs
    exactly once (the caller takes the parts no worker has claimed), whoever runs it."""
    import ctypes
    import threading
    import time

    kernels = native.native_kernels()
    if kernels is None:
        pytest.skip(f"no native kernels here: {native.kernels_unavailable(None)}")
    x = torch.randn(6, 1 << 16)  # argmax splits rows over threads: a part a row at most
    want = x.argmax(-1).tolist()
    failures: list[str] = []

    def hammer(seed: int) -> None:
        rng = torch.Generator().manual_seed(seed)
        for i in range(300):
            rows = int(torch.randint(1, 7, (), generator=rng))
            threads = int(torch.randint(1, 5, (), generator=rng))
            out = (ctypes.c_int64 * rows)()
            kernels.argmax_rows(x.data_ptr(), rows, x.shape[1], out, threads)
            if list(out) != want[:rows]:
                failures.append(f"thread {seed}, job {i}: {list(out)} != {want[:rows]}")
            if i % 50 == 0:
                time.sleep(0.001)  # past the workers' spin: they sleep, and the next job wakes them

    workers = [threading.Thread(target=hammer, args=(seed,)) for seed in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures, failures[:3]
