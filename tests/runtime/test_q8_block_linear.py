"""Int8 dot products over GGUF blocks (csrc/q8_block_linear.c, block_quant.with_q8) at every ISA
level this host has (others skip, saying why): the activations quantized as specified, the
kernel equal to a float64 evaluation of the same quantized arithmetic (tight) and close to the
exact fp32 path (loose, by how many bits the activations keep), each row's bits its own, and the
dispatch between the exact and the int8 paths by row count."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from servelab.runtime import block_quant
from servelab.runtime.block_quant import BlockQuantLinear

from .test_block_quant import FORMATS, _packed

_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def _quantized_activations(kernels, x: torch.Tensor, passes: int) -> dict[str, torch.Tensor]:
    """The kernel's quantization of x [rows, in], read back from its buffer."""
    rows, in_features = x.shape
    nb = in_features // 32
    buf = torch.empty(kernels.q8_act_bytes(rows, in_features), dtype=torch.uint8)
    kernels.q8_quantize(x.data_ptr(), rows, in_features, passes, buf.data_ptr(), 2)
    q = buf[: rows * in_features].view(torch.int8).view(rows, nb, 32)
    q2 = buf[rows * in_features : 2 * rows * in_features].view(torch.int8).view(rows, nb, 32)
    tail = buf[2 * rows * in_features :]
    d = tail[: 4 * rows * nb].view(torch.float32).view(rows, nb)
    s = tail[4 * rows * nb : 8 * rows * nb].view(torch.float32).view(rows, nb)
    qsum = tail[8 * rows * nb :].view(torch.int32).view(rows, nb)
    return {"q": q.clone(), "q2": q2.clone(), "d": d.clone(), "s": s.clone(), "qsum": qsum.clone()}


def _expected_activations(x: torch.Tensor, passes: int) -> dict[str, torch.Tensor]:
    """The specification: per row and block of 32, q = round_half_even(x * (127 / amax)); with two
    passes q2 = round(256 (x * (127 / amax) - q)) in [-127, 127], the integers 256 q + q2 at a
    scale of amax / 127 / 256; all in fp32 as the C code computes it."""
    rows, in_features = x.shape
    xb = x.view(rows, in_features // 32, 32)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    t = xb * inv[..., None]
    q = torch.round(t).clamp(-127, 127)
    q2 = torch.round(((t - q) * 256).clamp(-127, 127)) if passes == 2 else torch.zeros_like(q)
    ints = (256 * q + q2).to(torch.int64) if passes == 2 else q.to(torch.int64)
    d = amax / 127 / 256 if passes == 2 else amax / 127
    return {"q": q.to(torch.int8), "q2": q2.to(torch.int8), "d": d, "ints": ints}


def _blocks(fmt: str, raw: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(integer quants [out, nb, 32] as the kernel multiplies them, d [out, nb], m [out, nb]) of
    raw GGUF blocks: Q4_0's quants already less 8, m zero but for Q4_1."""
    out = raw.shape[0]
    blk = raw.numpy().reshape(out, -1, _BLOCK_BYTES[fmt])
    d = blk[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    m = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64) if fmt == "Q4_1" else np.zeros_like(d)
    if fmt == "Q8_0":
        q = blk[..., 2:].view(np.int8).astype(np.int64)
    else:
        qs = blk[..., 4:] if fmt == "Q4_1" else blk[..., 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int64) - (8 if fmt == "Q4_0" else 0)
    return q, d, m


def _reference(fmt: str, raw: torch.Tensor, act: dict[str, torch.Tensor], bias: torch.Tensor | None) -> torch.Tensor:
    """The same quantized arithmetic in float64: per block the exact integer sum times both
    scales, plus Q4_1's m times the activations' block sum, summed over blocks."""
    q, d, m = _blocks(fmt, raw)
    ints = act["ints"].numpy()
    da = act["d"].double().numpy()
    sums = np.einsum("obe,rbe->rob", q, ints)  # exact: int64
    y = np.einsum("rob,ob,rb->ro", sums.astype(np.float64), d, da)
    y += np.einsum("ob,rb->ro", m, da * ints.sum(-1))
    out = torch.from_numpy(y)
    return out if bias is None else out + bias.double()


def _linear(kernels, fmt: str, out_features: int, in_features: int, seed: int) -> tuple[BlockQuantLinear, torch.Tensor]:
    raw, dense = _packed(fmt, out_features, in_features, seed=seed)
    linear = block_quant.pack(dense, [(FORMATS[fmt], raw)], kernels)
    assert isinstance(linear, BlockQuantLinear)
    return linear, raw


@pytest.mark.parametrize("passes", [1, 2])
def test_activations_quantize_as_specified_at_every_level(isa_kernels, passes):
    _, kernels = isa_kernels
    g = torch.Generator().manual_seed(passes)
    x = torch.randn(7, 96, generator=g) * torch.logspace(-3, 2, 96)  # blocks of every scale
    x[2, 32:64] = 0.0  # an all-zero block: scale 0, no division by zero
    x[3, 5] = 1e4  # an outlier that sets its block's scale
    got = _quantized_activations(kernels, x, passes)
    want = _expected_activations(x, passes)
    assert torch.equal(got["q"], want["q"]) and torch.equal(got["d"], want["d"].float())
    if passes == 2:
        assert torch.equal(got["q2"], want["q2"])
    assert torch.equal(got["qsum"].long(), want["ints"].sum(-1))
    assert torch.equal(got["s"], got["d"] * got["qsum"].float())
    assert got["q"].abs().max() <= 127 and got["q2"].abs().max() <= 127


@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_0", "Q8_0"])
@pytest.mark.parametrize("passes", [1, 2])
def test_kernel_is_the_quantized_arithmetic_and_near_the_exact_path(isa_kernels, fmt, passes):
    """Odd row counts (ragged row tiles), outputs not a multiple of 16 (a padded last group) and
    the k-multiple-of-32 input sizes, with and without a bias; Q4_1 both regrouped (whole groups)
    and as GGUF rows (40 outputs, copied into groups)."""
    name, kernels = isa_kernels
    for out_features, in_features in ((37, 32), (64, 96), (40, 1056)):
        linear, raw = _linear(kernels, fmt, out_features, in_features, seed=out_features + passes)
        q8 = block_quant.with_q8(linear, 1, passes)
        assert q8.q8 is not None and q8.q8_passes == passes
        for rows in (1, 3, 9, 17):
            g = torch.Generator().manual_seed(rows)
            x = torch.randn(rows, in_features, generator=g)
            bias = torch.randn(out_features, generator=g) if rows % 2 else None
            got = replace(q8, bias=bias)(x)
            assert got.shape == (rows, out_features) and got.dtype == torch.float32
            ref = _reference(fmt, raw, _expected_activations(x, passes), bias)
            # fp32 sums over the blocks in order: a few ulps of the terms' scale
            q, d, m = _blocks(fmt, raw)
            scale = float(np.abs(x.numpy()).sum(-1).max() * np.abs(d[..., None] * q + m[..., None]).max())
            assert (got.double() - ref).abs().max() <= 2e-6 * scale, (name, fmt, out_features, rows)
            exact = F.linear(x.double(), linear.dequantize().double(), None if bias is None else bias.double())
            # the activations' rounding: 8 bits a block, or 16 with the second pass
            tol = (2e-2 if passes == 1 else 1e-4) * exact.abs().max()
            assert (got.double() - exact).abs().max() <= tol, (name, fmt, rows)


@pytest.mark.parametrize("passes", [1, 2])
def test_each_row_gets_its_bits_alone_and_threads_change_none(isa_kernels, passes):
    _, kernels = isa_kernels
    for fmt in ("Q4_1", "Q8_0"):
        linear, _ = _linear(kernels, fmt, 53, 96, seed=5)
        q8 = block_quant.with_q8(replace(linear, bias=torch.randn(53)), 1, passes)
        x = torch.randn(19, 96)
        together = q8(x)
        for i in (0, 7, 8, 18):  # first and last rows of the 8-row tiles, and the ragged tail
            assert torch.equal(q8(x[i : i + 1]), together[i : i + 1]), (fmt, i)
        assert torch.equal(q8(x[3:14]), together[3:14])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(q8(x), together)
        finally:
            torch.set_num_threads(threads)


def test_a_row_with_inf_or_nan_gives_nan_outputs_for_that_row_only(kernel):
    linear, _ = _linear(kernel, "Q4_1", 32, 64, seed=1)
    q8 = block_quant.with_q8(linear, 1)
    x = torch.randn(4, 64)
    x[1, 3], x[2, 40] = float("inf"), float("nan")
    y = q8(x)
    assert y[1].isnan().all() and y[2].isnan().all()
    assert y[[0, 3]].isfinite().all()
    assert torch.equal(y[[0, 3]], q8(x[[0, 3]]))


def test_rows_below_the_threshold_keep_the_exact_kernels(kernel):
    linear, _ = _linear(kernel, "Q4_1", 48, 96, seed=2)
    q8 = block_quant.with_q8(linear, 4)
    x = torch.randn(6, 96)
    for rows in (1, 2, 3):  # below: the exact path's bits
        assert torch.equal(q8(x[:rows]), linear(x[:rows]))
    assert torch.equal(q8(x), block_quant.with_q8(linear, 1)(x))  # from 4 rows: the int8 path
    assert not torch.equal(q8(x), linear(x))
    exact = block_quant.with_q8(q8, None)
    assert exact.q8 is None and torch.equal(exact(x), linear(x))
    invariant = replace(q8, invariant=True)  # deterministic mode: the panel kernel at every row count
    assert torch.equal(invariant(x), block_quant.batch_invariant(linear, kernel)(x))


def test_formats_without_an_int8_kernel_stay_exact(kernel):
    raw, dense = _packed("Q4_K", 32, 256, seed=3)
    linear = block_quant.pack(dense, [(FORMATS["Q4_K"], raw)], kernel)
    assert block_quant.with_q8(linear, 1).q8 is None
    # a fused weight with a Q4_K part: all segments or none
    raw1, dense1 = _packed("Q4_1", 32, 256, seed=4)
    mixed = block_quant.pack(torch.cat([dense1, dense]), [(FORMATS["Q4_1"], raw1), (FORMATS["Q4_K"], raw)], kernel)
    assert len(mixed.segments) == 2 and block_quant.with_q8(mixed, 1).q8 is None
    with pytest.raises(ValueError, match="passes"):
        block_quant.with_q8(linear, 1, 3)


def test_a_fused_weight_of_two_formats_quantizes_once_for_both(kernel):
    raw1, dense1 = _packed("Q4_1", 48, 96, seed=6)
    raw8, dense8 = _packed("Q8_0", 21, 96, seed=7)
    fused = block_quant.pack(torch.cat([dense1, dense8]), [(FORMATS["Q4_1"], raw1), (FORMATS["Q8_0"], raw8)], kernel)
    q8 = block_quant.with_q8(fused, 1, 2)
    assert [seg.fmt for seg in q8.q8] == [block_quant.Q4_1_G16, block_quant.Q8_0_G16]
    x = torch.randn(5, 96)
    y = q8(x)
    one = block_quant.with_q8(block_quant.pack(dense1, [(FORMATS["Q4_1"], raw1)], kernel), 1, 2)(x)
    eight = block_quant.with_q8(block_quant.pack(dense8, [(FORMATS["Q8_0"], raw8)], kernel), 1, 2)(x)
    assert torch.equal(y, torch.cat([one, eight], dim=1))


@pytest.fixture(scope="module")
def tiny_q4_1(tiny_llama, tmp_path_factory):
    from .test_weights import _write_gguf

    return _write_gguf(tiny_llama, tmp_path_factory.mktemp("q8-engine") / "tiny-Q4_1.gguf", "Q4_1")


def _engine(path, **kwargs):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    return LLMEngine.from_args(EngineArgs.from_kwargs(model=str(path), **kwargs))


def test_the_default_engine_takes_int8_from_the_threshold_and_the_flags_keep_fp32(kernel, tiny_q4_1, caplog):
    """On a CPU the default runs a GGUF model's many-row linears on the int8 dot products (two
    passes) and says so at load; --exact, an explicit --dtype float32 and --deterministic keep
    the exact kernels at every row count."""
    import logging

    with caplog.at_level(logging.INFO, logger="servelab.engine"):
        model = _engine(tiny_q4_1).executor.model
    assert model.q8_linears() == len(model.layers) * 4 + 1
    lin = model.layers[0].gate_up
    assert lin.q8_min_rows == block_quant.Q8_MIN_ROWS >= 2 and lin.q8_passes == 2  # batch-1 decode stays exact
    assert f"below {block_quant.Q8_MIN_ROWS} rows" in caplog.text and "--exact keeps fp32 everywhere" in caplog.text
    for flags in ({"exact": True}, {"dtype": "float32"}, {"deterministic": True}):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="servelab.engine"):
            exact = _engine(tiny_q4_1, **flags).executor.model
        assert exact.q8_linears() == 0, flags
        assert "exact fp32 over GGUF blocks at every row count" in caplog.text, flags


def test_exact_refuses_what_it_cannot_keep():
    from servelab.engine.args import EngineArgs
    from servelab.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="quantization") as exc:
        EngineArgs(exact=True, quantization="int8")
    assert exc.value.param == "exact"
    with pytest.raises(InvalidArgument, match="float32") as exc:
        EngineArgs(exact=True, dtype="bfloat16")
    assert exc.value.param == "dtype"
    with pytest.raises(InvalidArgument, match="True or False"):
        EngineArgs(exact="yes")
    assert EngineArgs(exact=True, dtype="float32").exact


def test_greedy_output_of_the_default_matches_exact_and_rows_stay_independent(kernel, tiny_q4_1):
    """The default's 16-bit activations keep greedy tokens on a tiny model; and each row's
    result is its own within the int8 path (batches above the threshold agree with each other)."""
    from servelab.core.sequence import SamplingParams

    prompts = [[5, 9, 17, 3], [100, 200, 7], [11] * 9, [42, 43, 44, 45, 46]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    def run(engine, batch):
        out = {}
        for start in range(0, len(prompts), batch):
            ids = [f"b{batch}-{start + i}" for i in range(len(prompts[start : start + batch]))]
            seqs = [engine.add_request(r, p, params) for r, p in zip(ids, prompts[start : start + batch])]
            while engine.has_unfinished():
                engine.step()
            out.update({start + i: s.output_token_ids for i, s in enumerate(seqs)})
        return out

    default, exact = _engine(tiny_q4_1, enable_prefix_caching=False), _engine(tiny_q4_1, exact=True)
    assert run(default, 4) == run(default, 2) == run(exact, 4)


def test_calibrate_reads_one_switch_below_the_int8_rows(kernel, tiny_q4_1):
    from servelab.commands.calibrate import kernel_rows_of

    rows = kernel_rows_of(_engine(tiny_q4_1))
    assert rows is not None and "int8 dot products" in rows["linears"]
    assert (rows["fused_max_rows"], rows["max_rows"]) == (block_quant.Q8_MIN_ROWS - 1, None)
    exact = kernel_rows_of(_engine(tiny_q4_1, exact=True))
    assert exact is not None and exact["max_rows"] == block_quant.same_order_max_rows(kernel)
