"""Linears that keep their GGUF blocks (runtime/block_quant.py, csrc/block_quant_linear.c): the
kernel's weights are bit-identical to the loader's dequantization, its products match fp32
F.linear at every ISA level (tests/runtime/isa_levels.py), and a GGUF model gives the same logits with
and without the packed path."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.runtime import block_quant, native
from servelab.runtime.block_quant import BlockQuantLinear
from servelab.runtime.linear import DenseLinear, TransposedHead
from servelab.runtime.loader import load_model
from servelab.runtime.quantization import Int8Linear
from servelab.runtime.weight_layout import GGUFTensor, dequantize_gguf_tensor
from servelab.spec.ggml_types import GGML_TYPE_BY_NAME
from tests.tiny_models import max_rel_diff, prefill_logits

from .test_weights import _write_gguf

FORMATS = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3, "Q4_K": 12, "Q6_K": 14}
K_QUANTS = {"Q4_K": (144, [0, 2]), "Q6_K": (210, [208])}  # block bytes, where the fp16 scales sit


def _packed(fmt: str, out_features: int, in_features: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw blocks [out, row_bytes] uint8, the loader's fp32 dequantization [out, in]) of a random
    weight with an offset (so Q4_1's minimum matters) quantized by the gguf package."""
    rng = np.random.default_rng(seed)
    qt = gguf.GGMLQuantizationType[fmt]
    if fmt in K_QUANTS:  # gguf cannot quantize these: random blocks with sane fp16 scales
        block_bytes, f16_at = K_QUANTS[fmt]
        raw = rng.integers(0, 256, size=(out_features * in_features // 256, block_bytes), dtype=np.uint8)
        for at in f16_at:
            raw[:, at : at + 2] = (
                rng.uniform(0.001, 0.05, size=len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
            )
        raw = raw.reshape(out_features, -1)
    else:
        w = (rng.standard_normal((out_features, in_features)) * 0.05 + rng.uniform(-0.02, 0.02)).astype(np.float32)
        raw = gguf.quants.quantize(w, qt).view(np.uint8).reshape(out_features, -1)
    dense = dequantize_gguf_tensor(GGUFTensor("w", (in_features, out_features), int(qt), raw))
    return torch.from_numpy(raw.copy()), dense


def _check(linear: BlockQuantLinear, rows: int, with_bias: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    out_features, in_features = linear.shape
    x = torch.randn(rows, in_features, generator=g)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    got = replace(linear, bias=bias)(x)
    ref = F.linear(x.double(), linear.dequantize().double(), None if bias is None else bias.double())
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # fp32 sums of ~in_features terms in another order: errors of a few ulps of the row's scale
    assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize(
    ("fmt", "in_features"),
    # past 1,024 inputs the k-major panel fills its rows in two chunks
    [(fmt, n) for fmt in FORMATS for n in ((256, 512, 1280) if fmt in K_QUANTS else (32, 96, 512, 1056))],
)
def test_kernel_weights_are_the_loaders_and_products_match_fp32(kernel, fmt, in_features):
    raw, dense = _packed(fmt, 37, in_features, seed=in_features)
    linear = block_quant.pack(dense, [(FORMATS[fmt], raw)], kernel)
    assert isinstance(linear, BlockQuantLinear) and linear.format_name == fmt
    assert torch.equal(linear.dequantize(), dense)  # bit for bit, Q4_1's d * q + m and Q4_K's included
    # both kernels (up to 4 rows, then 48-output panels; from 48 rows at AVX-512 the k-major
    # panel), every row-group size and remainder
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 33, 50, block_quant.MAX_ROWS):
        _check(linear, rows, with_bias=rows % 2 == 1, seed=rows)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_threads_split_the_outputs_without_changing_a_bit(kernel, fmt):
    raw, dense = _packed(fmt, 1000, 512, seed=5)  # big enough for the pool to use every thread
    linear = block_quant.pack(dense, [(FORMATS[fmt], raw)], kernel)
    before = torch.get_num_threads()
    for rows in (3, 21, 50):  # the in-register kernel (but K-quants), the panel kernel, the k-major one
        x = torch.randn(rows, 512)
        try:
            results = []
            for threads in (1, 2, 3, 7):
                torch.set_num_threads(threads)
                results.append(linear(x))
        finally:
            torch.set_num_threads(before)
        assert all(torch.equal(r, results[0]) for r in results)  # each output is one thread's sum
        _check(linear, rows, with_bias=rows % 2 == 1, seed=rows)


def test_many_rows_take_the_dense_gemm_where_it_is_faster(isa_kernels):
    """Up to AVX2, steps over MAX_ROWS rows take MKL over the fp32 copy; at the AVX-512 levels the
    packed kernels take every row count."""
    name, kernels = isa_kernels
    raw, dense = _packed("Q4_1", 8, 64, seed=1)
    linear = block_quant.pack(dense, [(3, raw)], kernels)
    for seg in linear.segments:
        seg.data.zero_()  # garbage in the packed copy: only the fp32 path can still be right
    limit = block_quant.max_rows(kernels)  # SIMDe's emulated levels keep the switch: slow, for correctness
    assert limit == (None if kernels.level in block_quant.PANEL_ONLY_LEVELS else block_quant.MAX_ROWS), name
    x = torch.randn(3 * block_quant.MAX_ROWS, 64)
    if limit is not None:
        assert torch.equal(linear(x[: limit + 1]), F.linear(x[: limit + 1], dense))
    for rows in (1, 5, block_quant.MAX_ROWS) + (() if limit else (block_quant.MAX_ROWS + 1, x.shape[0])):
        assert not torch.allclose(linear(x[:rows]), F.linear(x[:rows], dense)), rows  # a packed kernel read it
    assert (linear.dense is None) == (limit is None)  # no fp32 copy where no step can use it


def test_a_linear_packed_without_its_fp32_copy_expands_it_where_a_step_needs_it(isa_kernels):
    """Packed at an AVX-512 level (no fp32 copy), then run on avx2's kernels (SERVELAB_ISA, or
    another ops' kernels): a step past MAX_ROWS gets the fp32 copy from the blocks, bit for bit."""
    name, kernels = isa_kernels
    avx2 = native.native_kernels("avx2")
    if block_quant.max_rows(kernels) is not None or avx2 is None:
        pytest.skip(
            f"needs kernels without the MKL switch (a native AVX-512 level) and avx2; {name} is {kernels.level}"
        )
    raw, dense = _packed("Q4_1", 40, 64, seed=3)
    linear = replace(block_quant.pack(dense, [(3, raw)], kernels), kernels=avx2)
    assert linear.dense is None
    x = torch.randn(block_quant.MAX_ROWS + 1, 64)
    assert torch.equal(linear(x), F.linear(x, dense))
    assert torch.equal(linear.dense, dense)  # kept from then on
    assert linear(x[:0]).shape == (0, 40)


@pytest.mark.parametrize(
    ("formats", "in_features"),
    [(["Q8_0", "Q4_1", "Q4_1"], 64), (["Q4_K", "Q4_K", "Q6_K"], 256)],  # a fused QKV of Q4_K_M mixes these
)
def test_parts_in_different_formats_pack_as_segments(kernel, formats, in_features):
    parts = [_packed(fmt, n, in_features, seed=n) for fmt, n in zip(formats, (5, 3, 7))]
    dense = torch.cat([d for _, d in parts])
    linear = block_quant.pack(dense, [(FORMATS[fmt], raw) for fmt, (raw, _) in zip(formats, parts)], kernel)
    assert isinstance(linear, BlockQuantLinear) and len(linear.segments) == 2
    assert linear.format_name == f"{formats[0]}+{formats[2]}"
    expected_starts = [0, 5] if formats[0] != formats[1] else [0, 8]  # runs of one format share a segment
    assert [seg.start for seg in linear.segments] == expected_starts
    assert torch.equal(linear.dequantize(), dense)
    for rows in (1, 3, 6, 20, 50):  # the in-register kernel (legacy formats), then panels, then k-major
        _check(linear, rows, with_bias=True, seed=rows)


def test_parts_that_cannot_be_packed_stay_dense(kernel):
    raw8, dense8 = _packed("Q8_0", 4, 64, seed=2)

    def stays_dense(linear) -> bool:
        return isinstance(linear, DenseLinear) and linear.weight is dense8

    assert stays_dense(block_quant.pack(dense8, [(13, raw8)], kernel))  # Q5_K: not handled
    assert stays_dense(block_quant.pack(dense8, [(8, raw8), (13, raw8)], kernel))  # one part unhandled
    assert stays_dense(block_quant.pack(dense8, [(8, raw8[:3])], kernel))  # rows missing
    assert stays_dense(block_quant.pack(dense8, [(8, raw8)], None))  # no kernels
    assert stays_dense(block_quant.pack(dense8, None, kernel))  # not from a GGUF block format
    assert isinstance(block_quant.pack(dense8.bfloat16(), [(8, raw8)], kernel), DenseLinear)


def test_batch_invariant_refuses_a_linear_the_panel_kernel_cannot_take(kernel):
    """Deterministic mode runs dense fp32 and GGUF-block weights on the panel kernel; it names
    any other linear or shape it cannot take (ops.InvariantOps answers that as a user error)."""
    with pytest.raises(ValueError, match="dense or GGUF-block weight, not Int8Linear"):
        block_quant.batch_invariant(Int8Linear.from_weight(torch.randn(64, 64)), kernel)
    with pytest.raises(ValueError, match="multiple of 32 inputs"):
        block_quant.batch_invariant(DenseLinear(torch.randn(8, 48)), kernel)


def test_every_isa_level_reads_the_blocks_as_the_loader_and_matches_fp32(isa_kernels):
    """At each ISA level (portable, AVX2, AVX-512...: native, or on SIMDe where the CPU lacks it)
    the weights are the loader's bit for bit, both packed kernels match fp32, and the invariant
    (panel) kernel gives a row the same bits alone as with others, as deterministic mode needs."""
    name, kernels = isa_kernels
    for fmt, code in FORMATS.items():
        raw, dense = _packed(fmt, 53, 256 if fmt in K_QUANTS else 96, seed=code)
        linear = block_quant.pack(dense, [(code, raw)], kernels)
        assert torch.equal(linear.dequantize(), dense), (name, fmt)
        for rows in (1, 3, 4, 5, 9):  # the in-register kernel, then the panel kernel
            _check(linear, rows, with_bias=rows % 2 == 1, seed=rows)
        invariant = replace(linear, invariant=True, bias=torch.randn(53))
        x = torch.randn(6, dense.shape[1])
        together = invariant(x)  # a 4-row tile, then two rows alone
        for i in range(6):
            assert torch.equal(invariant(x[i : i + 1]), together[i : i + 1]), (name, fmt, i)
    dense = torch.randn(50, 64)
    invariant = block_quant.batch_invariant(DenseLinear(dense, None), kernels)  # fp32 rows through the panels
    x = torch.randn(5, 64)
    torch.testing.assert_close(invariant(x), F.linear(x, dense), rtol=1e-5, atol=1e-5)
    assert torch.equal(invariant(x[4:]), invariant(x)[4:])


def _call(kernel, seg, in_features: int, x: torch.Tensor) -> torch.Tensor:
    """One segment through a kernel entry point, as BlockQuantLinear calls it."""
    rows, out_features = x.shape[0], seg.data.shape[0]
    y, scratch = (
        torch.empty(rows, out_features),
        torch.empty(2 * block_quant.PANEL_OUTPUTS * in_features + rows * in_features),
    )
    kernel(
        seg.fmt,
        seg.data.data_ptr(),
        seg.data.shape[1],
        in_features,
        out_features,
        x.data_ptr(),
        rows,
        None,
        y.data_ptr(),
        out_features,
        scratch.data_ptr(),
        2,
    )
    return y


def test_q4_1_regrouped_sixteen_outputs_a_lane_at_the_avx512_levels(isa_kernels):
    """At the AVX-512 levels (native or SIMDe) Q4_1 of whole 16-output groups is kept regrouped
    (Q4_1_G16), elsewhere and in deterministic mode as GGUF rows: the same bytes either way (the
    weights the loader's, bit for bit), the in-register kernel matches fp32, and the panel
    kernels read the same weights from both layouts (same bits); past the in-register kernel the
    k-major panel takes a regrouped weight, each row's sums its own at any row count."""
    name, kernels = isa_kernels
    q4_1 = GGML_TYPE_BY_NAME["Q4_1"].kernel_code  # the kernels' code for GGUF rows
    in_features = 1056  # two of the panels' 1,024-input fill chunks
    raw, dense = _packed("Q4_1", 64, in_features, seed=11)
    linear = block_quant.pack(dense, [(FORMATS["Q4_1"], raw)], kernels)
    grouped = block_quant.grouped_q4_1(kernels)
    assert [seg.fmt for seg in linear.segments] == [block_quant.Q4_1_G16 if grouped else q4_1], name
    assert linear.format_name == "Q4_1" and linear.nbytes == raw.numel()
    assert torch.equal(linear.dequantize(), dense), name
    invariant = block_quant.batch_invariant(linear, kernels)
    assert [seg.fmt for seg in invariant.segments] == [q4_1] and torch.equal(invariant.segments[0].data, raw)
    assert [seg.fmt for seg in replace(invariant, invariant=False).segments] == [linear.segments[0].fmt]
    ragged = block_quant.pack(dense[:40], [(FORMATS["Q4_1"], raw[:40])], kernels)  # not whole groups: GGUF rows
    assert [seg.fmt for seg in ragged.segments] == [q4_1]
    for rows in (1, 2, 3, 4, 5, 9, 33, 50):
        _check(linear, rows, with_bias=rows % 2 == 1, seed=rows)
    if not grouped:
        return
    x = torch.randn(50, in_features)
    for rows in (5, 50):  # the k-major panel's bits from GGUF rows, through either panel entry point
        want = _call(kernels.block_quant_gemm_kmajor, invariant.segments[0], in_features, x[:rows])
        for entry in (kernels.block_quant_gemm, kernels.block_quant_gemm_kmajor):
            assert torch.equal(_call(entry, linear.segments[0], in_features, x[:rows]), want), (name, rows)
    default = linear(x)
    assert torch.equal(linear(x[:5]), default[:5]) and torch.equal(linear(x[:17]), default[:17]), name


_LEGACY = ("Q8_0", "Q4_0", "Q4_1")  # the 32-weight formats: dequant_blocks and the in-register kernels


@settings(max_examples=12, deadline=None)
@given(
    data=st.data(),
    formats=st.lists(st.sampled_from(_LEGACY), min_size=1, max_size=2),
    in_features=st.sampled_from([32, 96, 256]),
    rows=st.one_of(st.sampled_from([4, 5, 37, 127, block_quant.MAX_ROWS]), st.integers(4, block_quant.MAX_ROWS)),
)
def test_panel_rows_of_any_shape_give_each_row_its_bits_alone(isa_kernels, data, formats, in_features, rows):
    """The panel kernel at 4-128 rows (ragged tiles, outputs not a multiple of its 4x3 tile or of
    a 48-output panel, segments writing their columns of a wider output) at every ISA level: each
    row gets the bits the 1-row kernel gives it alone, the weights as the loader rounds them, and
    the default linear (the panel kernel above 4 rows) gives the invariant one's bits up to
    same_order_max_rows; past that, at the AVX-512 levels, the k-major panel, whose rows are
    their own too and within fp32 rounding of the same sums."""
    name, kernels = isa_kernels
    sizes = [data.draw(st.integers(1, 100), label=f"outputs of part {i}") for i in range(len(formats))]
    parts = [_packed(fmt, n, in_features, seed=n + i) for i, (fmt, n) in enumerate(zip(formats, sizes))]
    dense = torch.cat([d for _, d in parts])
    linear = block_quant.pack(dense, [(FORMATS[fmt], raw) for fmt, (raw, _) in zip(formats, parts)], kernels)
    assert torch.equal(linear.dequantize(), dense), name
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g)
    linear = replace(linear, bias=torch.randn(dense.shape[0], generator=g))
    invariant = replace(linear, invariant=True)
    together = invariant(x)
    for i in sorted({0, rows // 2, rows - 5, rows - 1}):  # the first and last tiles, the ragged rest
        assert torch.equal(invariant(x[i : i + 1]), together[i : i + 1]), (name, i)
    default = linear(x)
    same_order = block_quant.same_order_max_rows(kernels)
    grouped = any(seg.fmt == block_quant.Q4_1_G16 for seg in linear.segments)  # the k-major panel past 4 rows
    if block_quant.FUSED_MAX_ROWS < rows <= same_order and not grouped:
        assert torch.equal(default, together), name
    elif (
        rows > block_quant.FUSED_MAX_ROWS
        and rows <= (block_quant.max_rows(kernels) or rows)
        and (grouped or rows > same_order)
    ):
        # from the fewest rows at which each segment takes the kernel it takes here
        first = same_order + 1 if rows > same_order else block_quant.FUSED_MAX_ROWS + 1
        some = first + (rows - first) // 2
        assert torch.equal(linear(x[:some]), default[:some]), name  # a row's sums do not depend on the others
    ref = F.linear(x.double(), dense.double(), linear.bias.double())
    for got in (together, default):
        assert (got.double() - ref).abs().max() <= 1e-5 * ref.abs().max(), name


def _strip_packed(model) -> None:
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            w = getattr(layer, name)
            if isinstance(w, BlockQuantLinear):
                setattr(layer, name, DenseLinear(w.dequantize(), w.bias))
    model.lm_head = TransposedHead(model.lm_head.dequantize())  # what an fp32 head without blocks gets


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_gguf_model_gives_the_same_logits_with_its_packed_weights(kernel, tiny_llama, tmp_path, fmt):
    path = _write_gguf(tiny_llama, tmp_path / f"tiny-{fmt}.gguf", fmt)
    packed = load_model(path, dtype=torch.float32).model
    dense = load_model(path, dtype=torch.float32).model
    _strip_packed(dense)
    layer = packed.layers[0]
    assert all(isinstance(w, BlockQuantLinear) and w.format_name == fmt for w in layer.linears())
    assert isinstance(packed.lm_head, BlockQuantLinear)  # picked at load, for every row count
    assert packed.weight_bytes() < dense.weight_bytes() / 3  # what a few-row step streams
    ids = list(range(3, 70))
    for chunk in (1, 3, 7):  # decode steps (1 row), the in-register kernel's 3 rows, the panels' 7
        ours, ref = prefill_logits(packed, ids, chunk=chunk), prefill_logits(dense, ids, chunk=chunk)
        assert max_rel_diff(ours, ref) <= 1e-5
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_fp16_and_hf_models_have_no_packed_weights(tiny_llama, tmp_path):
    assert all(
        isinstance(w, DenseLinear) for w in load_model(tiny_llama, dtype=torch.float32).model.layers[0].linears()
    )
    path = _write_gguf(tiny_llama, tmp_path / "tiny-f16.gguf", "F16")
    model = load_model(path, dtype=torch.float32).model  # F16 weights stay 16-bit (test_half_linear.py), unpacked
    assert not any(isinstance(w, BlockQuantLinear) for w in [*model.layers[0].linears(), model.lm_head])


def test_int8_quantization_replaces_the_packed_blocks_at_every_row_count(kernel, tiny_llama, tmp_path):
    """Under int8 a GGUF model's linears and head are int8 for one row too (batch invariance needs
    one arithmetic whatever the step's size), and the packed and fp32 copies are dropped."""
    from servelab.runtime.quantization import Int8Linear

    path = _write_gguf(tiny_llama, tmp_path / "tiny-q4_1.gguf", "Q4_1")
    exact = load_model(path, dtype=torch.float32).model
    int8 = load_model(path, dtype=torch.float32).model
    assert all(isinstance(w, BlockQuantLinear) for w in int8.layers[0].linears())
    int8.quantize("int8")
    assert all(isinstance(w, Int8Linear) for layer in int8.layers for w in layer.linears())
    assert isinstance(int8.lm_head, Int8Linear)
    ids = list(range(3, 40))
    one_row = prefill_logits(int8, ids, chunk=1)
    assert 0 < max_rel_diff(one_row, prefill_logits(exact, ids, chunk=1)) < 0.1
    # each row has its own activation scales: a 37-row prefill gives what one row at a time gives,
    # up to attention's fp32 summation order
    assert max_rel_diff(prefill_logits(int8, ids), one_row) < 1e-4
