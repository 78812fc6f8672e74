"""The native decode-attention kernel against a plain per-sequence reference, the model with and
without it, and a failed build falling back with its reason recorded."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from servelab.engine import native
from servelab.engine.testing import prefill_logits
from servelab.engine.weights import load_model


def _reference(q, kc, vc, tables, ctx_lens, block_size, scale):
    """Each sequence alone: gather its keys slot by slot, SDPA with the KV heads repeated."""
    B, H, D = q.shape
    KV = kc.shape[0]
    out = []
    for b in range(B):
        slots = torch.tensor([tables[b][p // block_size] * block_size + p % block_size for p in range(ctx_lens[b])])
        k = kc[:, slots].repeat_interleave(H // KV, dim=0)  # [H, ctx, D]
        v = vc[:, slots].repeat_interleave(H // KV, dim=0)
        out.append(F.scaled_dot_product_attention(q[b][:, None], k, v, scale=scale)[:, 0].reshape(-1))
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
def test_kernel_matches_per_sequence_attention(kernel, kv_heads, group, head_dim, block_size, ctx_lens):
    g = torch.Generator().manual_seed(0)
    B, H = len(ctx_lens), kv_heads * group
    max_blocks = -(-max(ctx_lens) // block_size)
    num_blocks = B * max_blocks + 5
    kc = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=g)
    vc = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=g)
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
            native.decode_attention(kernel, q, kc, vc, table, torch.tensor(ctx_lens), max(ctx_lens), block_size, scale, again)
            assert torch.equal(again, out), threads
    finally:
        torch.set_num_threads(before)


def test_model_gives_the_same_logits_with_and_without_the_kernels(kernel, tiny_llama):
    """Every kernel in the model's forward (RoPE + K/V store, add + RMSNorm, SwiGLU, decode
    attention) against the PyTorch path, through whole prefills, chunks and decodes."""
    model = load_model(tiny_llama, dtype=torch.float32).model
    assert model.native is not None
    ids = [int(t) for t in torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(2))]
    chunkings = (None, 7, 1)  # one pass; chunks attending to the cache; every token a decode
    with_kernels = [prefill_logits(model, ids, chunk=c) for c in chunkings]
    model.native = None
    for c, got in zip(chunkings, with_kernels):
        torch.testing.assert_close(got, prefill_logits(model, ids, chunk=c), rtol=1e-5, atol=1e-5)


def test_a_failed_build_falls_back_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_kernel", None)
    monkeypatch.setattr(native, "load_error", None)
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    assert native.native_kernels() is None
    assert "false failed" in native.load_error
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setenv("SERVELAB_NATIVE", "0")
    assert native.native_kernels() is None
    assert "SERVELAB_NATIVE=0" in native.load_error


@pytest.mark.parametrize("rows,hidden", [(1, 576), (7, 37), (32, 64)])
def test_add_rms_norm_and_silu_mul_match_pytorch(kernel, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x, delta, w = torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g), torch.randn(hidden, generator=g)
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


def test_engine_generates_the_same_tokens_on_the_pytorch_path(kernel, tiny_engine_factory):
    """The executor's two metadata shapes (block tables for the kernel; flat slots and a mask for
    gather + SDPA) drive the same greedy tokens for a batch of mixed-length prompts."""
    from servelab.core.sequence import SamplingParams

    outputs = []
    for use_native in (True, False):
        engine = tiny_engine_factory(enable_prefix_caching=False)
        if not use_native:
            engine.executor.model.native = None
        seqs = [
            engine.add_request(f"r{i}", list(range(10 + i, 10 + i + n)), SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
            for i, n in enumerate((3, 17, 40, 9))
        ]
        while engine.has_unfinished():
            engine.step()
        outputs.append([s.output_token_ids for s in seqs])
    assert outputs[0] == outputs[1]
