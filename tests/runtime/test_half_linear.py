"""Linears over bf16/fp16 weights with fp32 sums (linear.HalfLinear, csrc/half_linear.c): the
kernel against F.linear over the widened weight at every ISA level this host has; its GEMV and
GEMM paths give a row the same bits whatever the other rows; and a bf16 or fp16 checkpoint loads
with its linears kept 16-bit and computes what the same values widened to fp32 compute."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from servelab.runtime import native
from servelab.runtime.linear import HALF_GEMM_MAX_ROWS, HALF_GEMV_MAX_ROWS, DenseLinear, HalfLinear, TransposedHead
from servelab.runtime.loader import load_model
from servelab.runtime.ops import OPS_NAMES, OpsUnavailable, make_ops
from servelab.core.sequence import SamplingParams
from tests.tiny_models import prefill_logits, write_tiny_llama

from .test_decode_stack import _Pool, _stack_against_per_op
from .test_weights import _write_gguf

LEVELS = [level.name for level in native.ISA_LEVELS]
NATIVE_OPS = [name for name in OPS_NAMES if name != "torch"]
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _kernels(level: str) -> native.NativeKernels:
    k = native.native_kernels(level)
    if k is None:
        pytest.skip(f"{level}: {native.kernels_unavailable(level)}")
    return k


def _run(k, w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, gemm: bool) -> torch.Tensor:
    y = torch.full((x.shape[0], w.shape[0]), float("nan"))
    rc = k.half_linear(native.KV_FORMATS[w.dtype], w.data_ptr(), w.shape[1], w.shape[0], x.data_ptr(), x.shape[0],
                       None if bias is None else bias.data_ptr(), y.data_ptr(), int(gemm), 2)  # fmt: skip
    assert rc == 0
    return y


# in: under one vector, not a multiple of 8 or 16, and a multiple, and 57 for the single-vector
# step after the two-vector loop at 8 and at 16 lanes; out: tails of the 3-output tile, of the
# one-row GEMV's 4-output tile (1, 2 and 3 left) and of the 24-output panel
@pytest.mark.parametrize("half", list(HALF))
@pytest.mark.parametrize(("out_features", "in_features"), [(5, 3), (37, 77), (50, 64), (25, 141), (39, 57)])
def test_kernel_is_f_linear_over_the_widened_weight_at_every_row_count(isa_kernels, half, out_features, in_features):
    _, k = isa_kernels  # every ISA level: native, or on SIMDe where this CPU lacks it
    g = torch.Generator().manual_seed(out_features * in_features)
    w = torch.randn(out_features, in_features, generator=g).to(HALF[half])
    bias = torch.randn(out_features, generator=g)
    x = torch.randn(70, in_features, generator=g)
    ref = F.linear(x, w.float(), bias)
    tol = 1e-5 * (1 + ref.abs().max())
    gemv, gemm = _run(k, w, x, bias, False), _run(k, w, x, bias, True)
    assert (gemv - ref).abs().max() < tol
    # both paths sum a row in the same order: the same bits, whatever the other rows
    assert torch.equal(gemv, gemm)
    for rows in (1, 2, 3, 4, 5, 9, 23):
        assert torch.equal(_run(k, w, x[:rows].contiguous(), bias, rows % 2 == 0), gemv[:rows])
    no_bias = _run(k, w, x[:7].contiguous(), None, False)
    assert (no_bias - F.linear(x[:7], w.float())).abs().max() < tol


@pytest.mark.parametrize("half", list(HALF))
def test_linear_takes_mkl_above_its_gemm_rows_and_keeps_half_the_bytes(kernel, half):
    w = torch.randn(40, 32).to(HALF[half])
    lin = HalfLinear(w, None, kernels=kernel)
    assert lin.nbytes == 40 * 32 * 2 and lin.numel() == 40 * 32 and lin.shape == (40, 32)
    assert torch.equal(lin.dequantize(), w.float())
    x = torch.randn(HALF_GEMM_MAX_ROWS + 5, 32)
    assert (lin(x) - F.linear(x, w.float())).abs().max() < 1e-4
    assert lin(x[:, None, :]).shape == (HALF_GEMM_MAX_ROWS + 5, 1, 40)  # leading dims kept
    invariant = HalfLinear(w, None, kernels=kernel, invariant=True)
    assert torch.equal(invariant(x)[:3], invariant(x[:3]))


# ------------------------------------------------------------------ a 16-bit checkpoint


def _to_dtype(src, dst, dtype: torch.dtype):
    """A copy of the tiny checkpoint directory `src` with every tensor in `dtype`."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            save_file({n: t.to(dtype).contiguous() for n, t in load_file(str(f)).items()}, str(dst / f.name))
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per case: the 16-bit checkpoint, and the same values widened to fp32."""
    root = tmp_path_factory.mktemp("half")
    out = {}
    for name, tied, half in (("bf16", False, "bf16"), ("fp16-tied", True, "fp16")):
        fp32 = write_tiny_llama(root / f"{name}-src", tie_embeddings=tied, seed=3)
        stored = _to_dtype(fp32, root / name, HALF[half])
        out[name] = (stored, _to_dtype(stored, root / f"{name}-widened", torch.float32))
    return out


@pytest.mark.parametrize("name", ["bf16", "fp16-tied"])
def test_checkpoint_keeps_its_linears_16_bit_and_the_logits_of_the_widened_one(checkpoints, name, kernel, caplog):
    stored, widened = checkpoints[name]
    with caplog.at_level(logging.INFO, logger="servelab.runtime.loader"):
        half = load_model(stored, dtype=torch.float32).model
    fp32 = load_model(widened, dtype=torch.float32).model
    assert "linears kept in their checkpoint's" in caplog.text
    assert all(isinstance(w, HalfLinear) for layer in half.layers for w in layer.linears())
    assert isinstance(half.lm_head, HalfLinear) and isinstance(fp32.lm_head, TransposedHead)
    assert half.dtype == torch.float32 and half.embed.dtype == torch.float32
    assert half.tied_head == (name == "fp16-tied")
    assert half.num_parameters() == fp32.num_parameters()
    dense_bytes = sum(w.nbytes for layer in fp32.layers for w in layer.linears()) + fp32.lm_head.nbytes
    assert sum(w.nbytes for layer in half.layers for w in layer.linears()) + half.lm_head.nbytes == dense_bytes // 2
    ids = [5, 17, 42, 9, 300, 7, 88, 1, 2, 3] * 14  # 140 rows: past HALF_GEMM_MAX_ROWS, MKL
    for chunk in (None, 40, 1):  # one chunk (MKL), GEMM-sized chunks, every token a decode (the stack)
        ours, ref = prefill_logits(half, ids, chunk=chunk), prefill_logits(fp32, ids, chunk=chunk)
        assert (ours - ref).abs().max() < 1e-5 * ref.abs().max()


@pytest.mark.parametrize("fmt", ["F16", "BF16"])
def test_gguf_16_bit_tensors_are_kept_too(tiny_llama, tmp_path, kernel, monkeypatch, fmt):
    path = _write_gguf(tiny_llama, tmp_path / f"tiny-{fmt}.gguf", fmt)
    half = load_model(path, dtype=torch.float32).model
    assert all(isinstance(w, HalfLinear) for layer in half.layers for w in layer.linears())
    assert isinstance(half.lm_head, HalfLinear)
    monkeypatch.setenv("SERVELAB_HALF_WEIGHTS", "0")
    fp32 = load_model(path, dtype=torch.float32).model
    assert all(isinstance(w, DenseLinear) for layer in fp32.layers for w in layer.linears())
    ids = list(range(3, 60))
    ours, ref = prefill_logits(half, ids), prefill_logits(fp32, ids)
    assert (ours - ref).abs().max() < 1e-5 * ref.abs().max()


def test_an_environment_switch_widens_them_at_load(checkpoints, monkeypatch):
    monkeypatch.setenv("SERVELAB_HALF_WEIGHTS", "0")
    model = load_model(checkpoints["bf16"][0], dtype=torch.float32).model
    assert all(isinstance(w, DenseLinear) for layer in model.layers for w in layer.linears())


def test_bf16_compute_keeps_the_plain_bf16_path(checkpoints):
    model = load_model(checkpoints["bf16"][0], dtype=torch.bfloat16).model
    assert all(
        type(w) is DenseLinear and w.weight.dtype == torch.bfloat16 for layer in model.layers for w in layer.linears()
    )


@pytest.mark.parametrize("ops", NATIVE_OPS)
def test_decode_stack_runs_half_linears_with_the_per_op_bits(checkpoints, ops):
    model = load_model(checkpoints["bf16"][0], dtype=torch.float32).model
    try:
        model.use_ops(make_ops(ops, torch.device("cpu"), torch.float32))
    except OpsUnavailable as exc:
        pytest.skip(f"{ops}: {exc}")
    assert model.decode_stack is not None
    _stack_against_per_op(model)


def test_decode_stack_takes_gemm_sized_batches_with_the_per_op_bits(checkpoints, kernel):
    """20 decodes: past HALF_GEMV_MAX_ROWS, so both sides run the panel path (the first step's
    stack through the LM head too, the second's leaving it to the model)."""
    model = load_model(checkpoints["bf16"][0], dtype=torch.float32).model
    stack = model.decode_stack
    prompts = [[7 + i, 30 + 2 * i, 100 + i][: 1 + i % 3] for i in range(HALF_GEMV_MAX_ROWS + 4)]
    pools = [_Pool(model, prompts, torch.float32) for _ in range(2)]
    model.decode_stack = None
    for pool in pools:
        pool.prefill()
    tokens = [1] * len(prompts)
    for every_row in (True, False):
        model.decode_stack = stack
        fused = pools[0].step(tokens, every_row=every_row)
        model.decode_stack = None
        assert torch.equal(fused, pools[1].step(tokens))
        tokens = fused.argmax(-1).tolist()
    assert stack.accepts(pools[0].decode_meta(), len(prompts)) and stack._arena.numel() > 0


def _greedy(path, **kwargs) -> dict[str, list[int]]:
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs(model=str(path), **kwargs))
    try:
        prompts = [[5, 17, 42, 9, 300, 7, 88], [11, 12, 13], list(range(40, 120))]
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        out: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return out
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("kwargs", [{}, {"dtype": "float32"}, {"deterministic": True}, {"tensor_parallel_size": 2}])
def test_engine_greedy_tokens_equal_the_widened_checkpoints(checkpoints, kernel, kwargs):
    stored, widened = checkpoints["bf16"]
    assert _greedy(stored, **kwargs) == _greedy(widened, **kwargs)
