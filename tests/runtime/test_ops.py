"""The kernel backend chosen once at load (runtime/ops.py) and the one linear interface
(runtime/linear.py): every ops implementation this host can run gives the reference ops' logits on
the tiny model (an AVX-512 level the CPU lacks runs on SIMDe, tests/runtime/isa_levels.py; without
SIMDe it is skipped and says why); every kind of linear is `y = lin(x)` with its bias inside."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.runtime import block_quant, native
from servelab.runtime.linear import DenseLinear, TransposedHead
from servelab.runtime.ops import OPS_NAMES, InvariantOps, NativeOps, OpsUnavailable, TorchOps, make_ops, select_ops
from servelab.runtime.quantization import Int8Linear
from servelab.runtime.loader import load_model
from servelab.runtime.model import AttentionMetadata
from servelab.errors import InvalidArgument
from tests.runtime.isa_levels import make_ops_at
from tests.tiny_models import max_rel_diff, prefill_logits

from .test_block_quant import FORMATS, _packed
from .test_weights import _write_gguf

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["hf", "gguf-q4_1"])
def tiny_model(request, tiny_llama, tmp_path_factory):
    """The tiny model as HF safetensors (dense linears), or as a Q4_1 GGUF (packed linears)."""
    if request.param == "hf":
        return tiny_llama
    return _write_gguf(tiny_llama, tmp_path_factory.mktemp("ops") / "tiny-q4_1.gguf", "Q4_1")


@pytest.fixture(scope="module")
def reference_logits(tiny_model):
    model = load_model(tiny_model, dtype=torch.float32).model
    model.use_ops(TorchOps())
    ids = [int(t) for t in torch.randint(0, 500, (45,), generator=torch.Generator().manual_seed(4))]
    return ids, {chunk: prefill_logits(model, ids, chunk=chunk) for chunk in (None, 7, 1)}


@pytest.mark.parametrize("name", OPS_NAMES)
def test_every_ops_implementation_gives_the_reference_logits(tiny_model, reference_logits, name, monkeypatch):
    """Whole prefill, chunks over the cache, and every token a decode: the same logits as the
    PyTorch reference up to fp32 summation order, and the same greedy tokens; the linears run
    the ops' own build of the kernels."""
    ops = make_ops_at(name, monkeypatch)
    model = load_model(tiny_model, dtype=torch.float32).model
    model.use_ops(ops)
    assert model.ops is ops and model.batch_invariant == name.startswith("invariant")
    if name != "torch":  # linears with C kernels of their own run the ops' build of them
        assert all(
            getattr(lin, "kernels", ops.kernels) is ops.kernels for lin in (*model.layers[0].linears(), model.lm_head)
        )
    ids, reference = reference_logits
    for chunk, want in reference.items():
        got = prefill_logits(model, ids, chunk=chunk)
        assert max_rel_diff(got, want) <= 1e-5, chunk
        assert torch.equal(got.argmax(-1), want.argmax(-1)), chunk


def test_an_isa_level_the_cpu_lacks_is_skipped_with_its_reason(monkeypatch):
    monkeypatch.setattr(native, "cpu_features", lambda: frozenset())  # a CPU with nothing past the baseline
    monkeypatch.setattr(native, "_builds", {})
    reason = native.unavailable_reason("avx2")
    assert reason is not None and "avx2" in reason and "fma" in reason
    assert native.native_kernels("avx2") is None and native.kernels_unavailable("avx2") == reason
    with pytest.raises(OpsUnavailable, match="avx2.*lacks"):
        make_ops("native-avx2", CPU, torch.float32)
    assert native.best_level() == "portable"  # what the model gets instead (when it builds)
    if native.kernels_unavailable("portable") is None:
        assert select_ops(CPU, torch.float32).name == "native-portable"


def test_select_ops_picks_by_device_dtype_and_mode(kernel):
    level = native.best_level()
    ops = select_ops(CPU, torch.float32)
    assert isinstance(ops, NativeOps) and ops.name == f"native-{level}" and ops.reads_block_tables
    assert type(select_ops(CPU, torch.bfloat16)) is TorchOps  # the C kernels are fp32 only
    assert isinstance(select_ops(CPU, torch.float32, deterministic=True), InvariantOps)
    with pytest.raises(InvalidArgument, match="float32 on the CPU") as err:
        select_ops(CPU, torch.bfloat16, deterministic=True)
    assert err.value.param == "deterministic"
    with pytest.raises(ValueError, match="unknown ops 'native-sse9'"):
        make_ops("native-sse9", CPU, torch.float32)


def test_the_lm_head_is_picked_once_at_load(tiny_llama):
    assert isinstance(load_model(tiny_llama, dtype=torch.float32).model.lm_head, TransposedHead)
    bf16 = load_model(tiny_llama, dtype=torch.bfloat16).model
    assert type(bf16.lm_head) is DenseLinear and type(bf16.ops) is TorchOps


def _linears(kernel, out_features: int, in_features: int, bias: torch.Tensor | None) -> dict:
    """One linear of each kind over (nearly) the same weight."""
    raw, dense = _packed("Q4_1", out_features, in_features, seed=out_features)
    packed = replace(block_quant.pack(dense, [(FORMATS["Q4_1"], raw)], kernel), bias=bias)
    return {
        "dense": DenseLinear(dense, bias),
        "transposed-head": TransposedHead(dense, bias),
        "gguf-blocks": packed,
        "gguf-blocks-invariant": block_quant.batch_invariant(packed, kernel),
        "dense-invariant": block_quant.batch_invariant(DenseLinear(dense, bias), kernel),
        "int8": Int8Linear.from_weight(dense, bias),
    }


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, block_quant.MAX_ROWS + 3), with_bias=st.booleans(), data=st.data())
def test_every_linear_is_x_times_its_weight_plus_its_bias(kernel, rows, with_bias, data):
    out_features = data.draw(st.sampled_from((16, 40)))
    in_features = data.draw(st.sampled_from((64, 96)))
    g = torch.Generator().manual_seed(rows)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    x = torch.randn(rows, in_features, generator=g)
    for kind, lin in _linears(kernel, out_features, in_features, bias).items():
        assert lin.shape == (out_features, in_features) and (lin.bias is None) == (bias is None), kind
        assert lin.numel() == out_features * in_features + (0 if bias is None else out_features), kind
        assert lin.nbytes > 0
        y = lin(x)
        assert y.shape == (rows, out_features) and y.dtype == torch.float32, kind
        want = F.linear(x.double(), lin.dequantize().double(), None if bias is None else bias.double())
        if rows:
            tol = 2e-2 if kind == "int8" else 1e-5  # int8 quantizes the activations too
            assert (y.double() - want).abs().max() <= tol * max(1.0, float(want.abs().max())), kind


def _windowed_reference(q, k, v, window, scale, softcap):
    """Attention of q [n, H, D] (positions 0..n-1) over k, v [n, KV, D], written out: keys in
    (p - window, p], scores soft-capped."""
    n, H, D = q.shape
    k, v = (t.repeat_interleave(H // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    qpos, kpos = torch.arange(n)[:, None], torch.arange(n)[None, :]
    scores = scores.masked_fill(~((kpos <= qpos) & (kpos > qpos - window)), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, H * D)


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("name", ["torch", *(n for n in OPS_NAMES if n.startswith("native"))])
def test_sliding_window_attention_in_prefill_chunks_and_decodes(name, softcap, monkeypatch):
    """Every query sees only the last `window` keys, whether it comes in a whole prompt, a later
    chunk over the cache, or a decode reading the block table (the native ops' metadata)."""
    ops = make_ops_at(name, monkeypatch)
    gen = torch.Generator().manual_seed(0)
    n, H, KV, D, window, bs = 23, 4, 2, 16, 5, 4
    q, k, v = (torch.randn(n, h, D, generator=gen) for h in (H, KV, KV))
    ref = _windowed_reference(q, k, v, window, 0.3, softcap)
    whole = ops.prefill_attention(q, k, v, 0, 0.3, window=window, softcap=softcap)
    assert max_rel_diff(whole, ref) < 1e-5
    later = ops.prefill_attention(q[9:], k, v, 9, 0.3, window=window, softcap=softcap)
    assert max_rel_diff(later, ref[9:]) < 1e-5
    # decodes at positions 22 and 3, their keys in scrambled blocks of a paged cache
    table = torch.tensor([[5, 0, 3, 1, 6, 2], [4, 7, 7, 7, 7, 7]])
    kc, vc = torch.zeros(KV, 8 * bs, D), torch.zeros(KV, 8 * bs, D)
    for row, length in ((0, n), (1, 4)):
        slots = table[row, torch.arange(length) // bs] * bs + torch.arange(length) % bs
        kc[:, slots], vc[:, slots] = k[:length].transpose(0, 1), v[:length].transpose(0, 1)
    ctx = torch.tensor([n, 4])
    meta = AttentionMetadata(
        positions=ctx - 1, slots=torch.zeros(2, dtype=torch.int64), num_decodes=2, block_size=bs,
        decode_block_table=table, decode_ctx_lens=ctx, decode_max_ctx=n, decode_ctx_slots=None, decode_mask=None,
        prefills=[], logits_indices=None,
    )  # fmt: skip
    out = torch.empty(2, H * D)
    ops.decode_attention(torch.stack((q[n - 1], q[3])), kc, vc, meta, 0.3, out, window=window, softcap=softcap)
    assert max_rel_diff(out, torch.stack((ref[n - 1], ref[3]))) < 1e-5
