"""Linears that keep their GGUF block-quantized weights, for every step but the largest on AVX2.

A GGUF model's weights arrive block-quantized (SmolLM2's layers as Q4_1, its head as Q8_0). The
loader dequantizes them to fp32, the exact values transformers computes, and a step with few
rows is bound by the bytes of weights it reads, 4-6x more in fp32 than in the file. So the C
kernels in csrc/block_quant_linear.c multiply straight from the packed blocks: up to
FUSED_MAX_ROWS rows widening them in registers, then expanding PANEL_OUTPUTS outputs at a time to
fp32 for a register-blocked GEMM; at AVX2 and below, above MAX_ROWS MKL's GEMM over the fp32 copy is
faster, while at the AVX-512 levels the panel kernel is ahead at every row count (max_rows), and
from KMAJOR_MIN_ROWS rows a k-major panel with one output a lane takes over. At those levels
Q4_1 is kept regrouped sixteen outputs a group (Q4_1_G16, the same bytes moved), so that the
in-register kernel too runs one output a lane and the k-major panel fills without transposing:
it takes every step past the in-register kernel. Same
weights, fp32 sums either way (only the rounding order differs), so this is on by default,
unlike the approximate `--quantization int8`. Costs the packed copy's memory. Timings:
docs/benchmarks.md, "GGUF blocks kept packed".

Steps of many rows (from the engine's q8_min_rows, prefill and batched decode) are bound by the
multiply-adds instead, and there the default runs csrc/q8_block_linear.c: each row's activations
quantized to int8 per 32-input block, int8 dot products (VNNI's vpdpbusd) with the blocks' own
quants, scaled by both blocks' scales: llama.cpp's Q4_1 x Q8_1 / Q8_0 x Q8_0 method, within the
accuracy contract of docs/accuracy.md but not exact, so `--exact` (and deterministic mode) keeps
the fp32 kernels at every row count. Q4_1 is read in its Q4_1_G16 bytes; Q4_0 and Q8_0 weights
get a copy in the same sixteen-outputs-a-group shape (q8_segments).

Formats: Q8_0, Q4_0, Q4_1 (32 weights a block; both kernels) and Q4_K, Q6_K (256; the panel
kernel, also for one row). A fused matrix whose parts differ in format keeps one packed segment
per run of a format. F16 and BF16 tensors stay 16-bit (linear.HalfLinear); others (Q5_K, ...)
keep the fp32 path.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from servelab.runtime import native
from servelab.spec.ggml_types import GGML_TYPE_BY_NAME, GGML_TYPES, Kernel
from servelab.runtime.linear import DenseLinear, Linear


def _kernel_code(name: str) -> int:
    """Our kernel's format code for the ggml type `name`, one the kernels take."""
    code = GGML_TYPE_BY_NAME[name].kernel_code
    if code is None:
        raise ValueError(f"ggml type {name} has no kernel format")
    return code


# Views of ggml's type table (spec/ggml_types.py) in the shapes the kernels use.
# ggml type id -> (our kernel's format code, weights a block, bytes a block)
GGUF_BLOCK_FORMATS = {
    t.type_id: (t.kernel_code, t.block_weights, t.block_bytes)
    for t in GGML_TYPES
    if t.kernel_code is not None and t.is_block_format
}
_Q4_1 = _kernel_code("Q4_1")
# Q4_1's bytes regrouped sixteen outputs a group, one output a vector lane (the C file's Q4_1_G16):
# at the AVX-512 levels outside deterministic mode, the 1-4-row kernel then needs no horizontal
# sums and half the instructions a block (docs/benchmarks.md, "GGUF blocks kept packed").
Q4_1_G16 = 6
FORMAT_NAMES = {t.kernel_code: t.name for t in GGML_TYPES if t.kernel_code is not None} | {Q4_1_G16: "Q4_1"}
_FUSED_FORMATS = (*(t.kernel_code for t in GGML_TYPES if t.kernel is Kernel.PANEL_AND_ROWS), Q4_1_G16)
_GROUP = 16  # outputs a Q4_1_G16 group
_F32 = _kernel_code("F32")  # a plain fp32 weight, through the panel kernel (deterministic mode)
_Q8_0, _Q4_0 = _kernel_code("Q8_0"), _kernel_code("Q4_0")
# csrc/q8_block_linear.c's layouts of Q8_0 and Q4_0, sixteen outputs a group like Q4_1_G16
Q8_0_G16, Q4_0_G16 = 7, 8

# Where one kernel overtakes the other, measured over SmolLM2's matrices (docs/benchmarks.md).
FUSED_MAX_ROWS = 4  # up to here the in-register kernel, then the panel kernel
MAX_ROWS = 128  # at AVX2 and below, above this MKL (it pulls ahead by 256 rows)
# At these the panel kernel runs 1.7-1.9x MKL's sgemm at 128-2048 rows: no switch to MKL.
PANEL_ONLY_LEVELS = frozenset({"avx512", "avx512_vnni", "avx512_bf16"})
PANEL_OUTPUTS = 48  # outputs the panel kernel expands at a time (PANEL in the C file)
# At those levels, from here the k-major panel (one output a lane; sums in another order, so not in
# deterministic mode): 0.91-0.96x the panel kernel's time at 48 rows, 0.81-0.88x at 128, 0.79-0.84x
# at 512; 1.01x at 32, where filling its transposed panel costs what the tiles save.
KMAJOR_MIN_ROWS = 48
# From this many rows the engine's default takes the int8 dot products (with_q8): the crossover
# against the exact kernels measured in docs/benchmarks.md ("Int8 dot products over the blocks");
# batch-1 decode stays exact.
Q8_MIN_ROWS = 2
# The ISA each level's int8 dot products run on, for the load log
_Q8_ISA = {"avx512_bf16": "AVX512-VNNI", "avx512_vnni": "AVX512-VNNI", "avx512": "AVX-512 vpmaddubsw",
           "avx2": "AVX2 vpmaddubsw", "portable": "portable C"}  # fmt: skip


@dataclass(slots=True)
class PackedRows:
    """Outputs [start, start + len(data)) of a weight as GGUF blocks of one format: `data` is
    [rows, in / block_weights * block_bytes] uint8, row o holding output start + o's blocks."""

    fmt: int  # a key of FORMAT_NAMES
    data: torch.Tensor
    start: int


@dataclass(slots=True)
class Q8Rows:
    """Outputs [start, start + rows) of a weight in a layout of csrc/q8_block_linear.c: `data`
    holds ceil(rows / 16) groups of sixteen outputs (the last padded with zero scales)."""

    fmt: int  # Q4_1_G16, Q4_0_G16 or Q8_0_G16
    data: torch.Tensor
    start: int
    rows: int


@dataclass(slots=True)
class BlockQuantLinear:
    """y = x @ W^T (+ bias). `segments` hold W as GGUF blocks (one per run of outputs in one
    format: a fused QKV may mix Q4_K and Q6_K), used for up to max_rows(kernels) rows; `dense`, W
    in fp32 [out, in], serves bigger steps. Where the kernels take every row count (the AVX-512
    levels) no fp32 copy is kept (None): 4 bytes a weight less; should a level with a switch run
    this linear later (SERVELAB_ISA, another ops' kernels), the blocks are expanded then."""

    segments: tuple[PackedRows, ...]
    kernels: native.NativeKernels
    dense: torch.Tensor | None
    shape: tuple[int, int]
    # Deterministic mode: the panel kernel for every row count, so a row's result never depends
    # on how many rows share the call (the in-register kernel, the panel kernel and MKL each sum
    # in their own order).
    invariant: bool = False
    bias: torch.Tensor | None = None  # fp32 [out]
    # From this many rows (None: never) a call takes the int8 dot products over `q8`, the weight
    # in csrc/q8_block_linear.c's layouts (with_q8); not in deterministic mode.
    q8_min_rows: int | None = None
    q8: tuple[Q8Rows, ...] | None = None
    q8_passes: int = 2  # int8 passes over each activation: 1 (8 bits) or 2 (16 bits, 256 q + q2)

    def __post_init__(self) -> None:
        # Q4_1 segments in the layout these kernels and this mode read best (so also after
        # dataclasses.replace, e.g. batch_invariant or other kernels): grouped where grouped_q4_1
        # says so and the segment is whole groups, as GGUF rows elsewhere.
        group = grouped_q4_1(self.kernels) and not self.invariant
        self.segments = tuple(
            regrouped(seg, group and seg.data.shape[0] % _GROUP == 0) if seg.fmt in (_Q4_1, Q4_1_G16) else seg
            for seg in self.segments
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, limit = x.shape[0], max_rows(self.kernels)
        if rows == 0:
            return x.new_zeros(0, self.shape[0])
        if self.q8 is not None and self.q8_min_rows is not None and rows >= self.q8_min_rows and not self.invariant:
            return self._q8_call(x)
        if limit is not None and rows > limit and not self.invariant:
            if self.dense is None:  # packed where the kernels needed no copy, run where they do
                self.dense = self.dequantize()
            return F.linear(x, self.dense, self.bias)
        x = x.contiguous()
        out_features, in_features = self.shape
        threads = torch.get_num_threads()
        y = torch.empty(rows, out_features, dtype=torch.float32)
        fused = rows <= FUSED_MAX_ROWS and not self.invariant and fused_formats(self)
        if fused:
            scratch = torch.empty(rows * (in_features // 32) + threads * in_features, dtype=torch.float32)
            kernel = self.kernels.block_quant_linear
        else:
            scratch = torch.empty(threads * PANEL_OUTPUTS * in_features, dtype=torch.float32)  # a panel each
            # past same_order_max_rows (AVX2's returned to MKL above): the k-major panel, which
            # Q4_1_G16 takes at every row count through either entry point
            kmajor = not self.invariant and rows > same_order_max_rows(self.kernels)
            kernel = self.kernels.block_quant_gemm_kmajor if kmajor else self.kernels.block_quant_gemm
        bias = None if self.bias is None else self.bias.data_ptr()
        for seg in self.segments:  # each writes its columns of y (4 bytes an fp32)
            kernel(
                seg.fmt,
                seg.data.data_ptr(),
                seg.data.shape[1],
                in_features,
                seg.data.shape[0],
                x.data_ptr(),
                rows,
                None if bias is None else bias + 4 * seg.start,
                y.data_ptr() + 4 * seg.start,
                out_features,
                scratch.data_ptr(),
                threads,
            )
        return y

    def _q8_call(self, x: torch.Tensor) -> torch.Tensor:
        """y over the int8 dot products: x quantized once, then each segment's columns."""
        x = x.float().contiguous()
        rows, (out_features, in_features) = x.shape[0], self.shape
        threads = torch.get_num_threads()
        act = torch.empty(self.kernels.q8_act_bytes(rows, in_features), dtype=torch.uint8)
        self.kernels.q8_quantize(x.data_ptr(), rows, in_features, self.q8_passes, act.data_ptr(), threads)
        y = torch.empty(rows, out_features, dtype=torch.float32)
        bias = None if self.bias is None else self.bias.data_ptr()
        for seg in self.q8 or ():
            self.kernels.q8_block_linear(
                seg.fmt,
                seg.data.data_ptr(),
                in_features,
                seg.rows,
                act.data_ptr(),
                self.q8_passes,
                rows,
                None if bias is None else bias + 4 * seg.start,
                y.data_ptr() + 4 * seg.start,
                out_features,
                threads,
            )
        return y

    def numel(self) -> int:
        return self.shape[0] * self.shape[1] + (0 if self.bias is None else self.bias.numel())

    @property
    def format_name(self) -> str:
        """The blocks' format, e.g. "Q4_1" (formats joined with "+" when they differ by outputs)."""
        return "+".join(FORMAT_NAMES[seg.fmt] for seg in self.segments)

    @property
    def nbytes(self) -> int:
        """Bytes a step with few rows reads: the packed blocks (and the bias)."""
        bias = 0 if self.bias is None else 4 * self.bias.numel()
        return sum(seg.data.numel() for seg in self.segments) + bias

    def dequantize(self) -> torch.Tensor:
        """The packed blocks expanded by the kernel, [out, in] fp32 (tests check it equals `dense`)."""
        out_features, in_features = self.shape
        w = torch.empty(out_features, in_features, dtype=torch.float32)
        for seg in self.segments:
            n = seg.data.shape[0]
            self.kernels.block_dequant(
                seg.fmt, seg.data.data_ptr(), seg.data.shape[1], in_features, 0, n, w[seg.start :].data_ptr()
            )
        return w


def max_rows(kernels: native.NativeKernels) -> int | None:
    """The most rows the packed kernels built as `kernels` take before MKL's GEMM over the fp32
    copy does better (None: every row count)."""
    return None if kernels.level in PANEL_ONLY_LEVELS else MAX_ROWS


def same_order_max_rows(kernels: native.NativeKernels) -> int:
    """The most rows at which a linear outside deterministic mode still sums a row as at fewer
    rows' panel kernel: past it, MKL (AVX2 and below) or the k-major panel (AVX-512)."""
    return KMAJOR_MIN_ROWS - 1 if kernels.level in PANEL_ONLY_LEVELS else MAX_ROWS


def grouped_q4_1(kernels: native.NativeKernels) -> bool:
    """Whether kernels built as `kernels` read Q4_1 regrouped (Q4_1_G16): the AVX-512 levels,
    native or on SIMDe (whose level names carry a suffix)."""
    return kernels.level.split("-")[0] in PANEL_ONLY_LEVELS


def regrouped(seg: PackedRows, group: bool) -> PackedRows:
    """A Q4_1 segment as Q4_1_G16 (group) or as GGUF rows, the same bytes moved: per group of 16
    outputs and block, their 16 d, their 16 m, then quant bytes 4c..4c+3 of each output as dword
    lane k of vector c (csrc/block_quant_linear.c)."""
    if (seg.fmt == Q4_1_G16) == group:
        return seg
    rows, row_bytes = seg.data.shape
    nblocks = row_bytes // 20
    if group:  # [G, 16 outputs, blocks, 20 bytes] -> [G, blocks, d | m | quants]
        blk = seg.data.view(rows // _GROUP, _GROUP, nblocks, 20).permute(0, 2, 1, 3)
        quants = blk[..., 4:].reshape(rows // _GROUP, nblocks, _GROUP, 4, 4).transpose(2, 3)
        data = torch.cat([blk[..., :2].flatten(2), blk[..., 2:4].flatten(2), quants.flatten(2)], dim=2)
        return PackedRows(Q4_1_G16, data.reshape(rows, row_bytes).contiguous(), seg.start)
    grp = seg.data.view(rows // _GROUP, nblocks, 320)
    d, m = grp[..., :32].unflatten(2, (_GROUP, 2)), grp[..., 32:64].unflatten(2, (_GROUP, 2))
    quants = grp[..., 64:].unflatten(2, (4, _GROUP, 4)).transpose(2, 3).flatten(3)
    data = torch.cat([d, m, quants], dim=3).permute(0, 2, 1, 3)
    return PackedRows(_Q4_1, data.reshape(rows, row_bytes).contiguous(), seg.start)


def q8_layout(seg: PackedRows) -> Q8Rows | None:
    """A segment in csrc/q8_block_linear.c's layout: Q4_1_G16's own bytes, else a copy grouped
    sixteen outputs a group (the last padded with zero rows), per group and block the 16 fp16 d,
    16 fp16 m (zero but for Q4_1), then the quants four bytes an output a 64-byte vector. None
    for a format it has no kernel for (Q4_K, Q6_K, F32)."""
    if seg.fmt == Q4_1_G16:
        return Q8Rows(Q4_1_G16, seg.data, seg.start, seg.data.shape[0])
    if seg.fmt not in (_Q4_1, _Q4_0, _Q8_0):
        return None
    rows, row_bytes = seg.data.shape
    padded = -(-rows // _GROUP) * _GROUP
    data = torch.cat([seg.data, seg.data.new_zeros(padded - rows, row_bytes)]) if padded != rows else seg.data
    if seg.fmt == _Q4_1:
        return Q8Rows(Q4_1_G16, regrouped(PackedRows(_Q4_1, data.contiguous(), seg.start), True).data, seg.start, rows)
    block_bytes, lanes = (34, 8) if seg.fmt == _Q8_0 else (18, 4)  # lanes: 64-byte vectors a block
    nblocks = row_bytes // block_bytes
    blk = data.view(padded // _GROUP, _GROUP, nblocks, block_bytes).permute(0, 2, 1, 3)  # [G, blocks, 16, bytes]
    quants = blk[..., 2:].reshape(padded // _GROUP, nblocks, _GROUP, lanes, 4).transpose(2, 3)
    d = blk[..., :2].flatten(2)
    grouped = torch.cat([d, torch.zeros_like(d), quants.flatten(2)], dim=2)
    return Q8Rows(Q8_0_G16 if seg.fmt == _Q8_0 else Q4_0_G16, grouped.contiguous(), seg.start, rows)


def with_q8(linear: BlockQuantLinear, min_rows: int | None, passes: int = 2) -> BlockQuantLinear:
    """`linear` taking the int8 dot products from `min_rows` rows (None: never) with `passes`
    int8 passes over each activation, where every segment's format has them; else as it is, on
    its exact kernels at every row count."""
    if passes not in (1, 2):
        raise ValueError(f"q8 passes must be 1 or 2, got {passes}")
    if min_rows is None:
        return replace(linear, q8_min_rows=None, q8=None)
    if linear.q8 is not None:
        return replace(linear, q8_min_rows=min_rows, q8_passes=passes)
    layouts = [q8_layout(seg) for seg in linear.segments]
    segments = tuple(seg for seg in layouts if seg is not None)
    if len(segments) != len(layouts):
        return replace(linear, q8_min_rows=None, q8=None)
    return replace(linear, q8_min_rows=min_rows, q8=segments, q8_passes=passes)


def fused_formats(linear: BlockQuantLinear) -> bool:
    """Whether every segment's format has the in-register kernel (for up to FUSED_MAX_ROWS rows)."""
    return all(seg.fmt in _FUSED_FORMATS for seg in linear.segments)


def batch_invariant(weight: Linear, kernels: native.NativeKernels) -> BlockQuantLinear:
    """A linear whose every row count runs the panel kernel: a packed weight as it is, a dense
    fp32 one as a single F32 segment (no copy). ValueError for a weight the kernel cannot take."""
    if isinstance(weight, BlockQuantLinear):
        return replace(weight, invariant=True)
    if not isinstance(weight, DenseLinear):
        raise ValueError(f"a batch-invariant linear needs a dense or GGUF-block weight, not {type(weight).__name__}")
    dense = weight.weight
    out_features, in_features = dense.shape
    if dense.dtype != torch.float32 or dense.device.type != "cpu" or in_features % 32:
        raise ValueError(
            f"a batch-invariant linear needs an fp32 CPU weight with a multiple of 32 inputs, got {dense.dtype} "
            f"{tuple(dense.shape)} on {dense.device.type}"
        )
    dense = dense.contiguous()
    data = dense.view(torch.uint8).view(out_features, in_features * 4)
    return BlockQuantLinear(
        (PackedRows(_F32, data, 0),), kernels, dense, (out_features, in_features), invariant=True, bias=weight.bias
    )


def pack(
    dense: torch.Tensor, parts: list[tuple[int, torch.Tensor]] | None, kernels: native.NativeKernels | None
) -> BlockQuantLinear | DenseLinear:
    """`dense` with its packed form when every part (ggml type, [rows, row_bytes] uint8; the
    parts are dense's rows in order) is a supported format, the weight is fp32 on the CPU and the
    kernels are there; else `dense` alone. Consecutive parts of one format share a segment."""
    if kernels is None or parts is None or dense.dtype != torch.float32 or dense.device.type != "cpu":
        return DenseLinear(dense)
    out_features, in_features = dense.shape
    runs: list[tuple[int, list[torch.Tensor]]] = []
    for gtype, rows in parts:
        if gtype not in GGUF_BLOCK_FORMATS:
            return DenseLinear(dense)
        _, block_weights, block_bytes = GGUF_BLOCK_FORMATS[gtype]
        if in_features % block_weights or rows.shape[1] != in_features // block_weights * block_bytes:
            return DenseLinear(dense)
        if runs and runs[-1][0] == gtype:
            runs[-1][1].append(rows)
        else:
            runs.append((gtype, [rows]))
    segments, start = [], 0
    for gtype, chunks in runs:
        data = torch.cat(chunks, dim=0).contiguous()
        segments.append(PackedRows(GGUF_BLOCK_FORMATS[gtype][0], data, start))
        start += data.shape[0]
    if start != out_features:
        return DenseLinear(dense)
    keep = dense if max_rows(kernels) is not None else None  # the fp32 copy only where MKL may run
    return BlockQuantLinear(tuple(segments), kernels, keep, (out_features, in_features))


def _block_linears(linears: Sequence[Linear]) -> list[BlockQuantLinear]:
    return [w for w in (getattr(w, "inner", w) for w in linears) if isinstance(w, BlockQuantLinear)]


def q8_linears(linears: Sequence[Linear]) -> list[BlockQuantLinear]:
    """Those of `linears` that take the int8 dot products over their GGUF blocks for many rows."""
    return [w for w in _block_linears(linears) if w.q8 is not None and w.q8_min_rows is not None]


def linear_paths(linears: list[Linear], q8_min_rows: int | None) -> str | None:
    """One line for the load log: which kernels a model's GGUF-block linears (`linears`, every
    layer's and the head) take at which row counts, and why; None for a model without any."""
    blocks = _block_linears(linears)
    if not blocks:
        return None
    if q8_min_rows is None or blocks[0].invariant:
        return "linears: exact fp32 over GGUF blocks at every row count (--exact, --dtype float32 or --deterministic)"
    q8 = q8_linears(blocks)
    if not q8:
        return f"linears: exact fp32 over GGUF blocks at every row count ({blocks[0].format_name} has no int8 kernel)"
    isa = _Q8_ISA.get(q8[0].kernels.level.split("-")[0], q8[0].kernels.level)
    some = "" if len(q8) == len(linears) else f" for {len(q8)} of {len(linears)} linears (the rest exact)"
    return (
        f"linears: exact fp32 over GGUF blocks below {q8_min_rows} rows (decode of one sequence, bound by the "
        f"weights' bytes), Q8 activations x GGUF blocks ({isa}) from {q8_min_rows} rows{some} (compute-bound; "
        "within the accuracy contract, KL vs fp32 in docs/accuracy.md); --exact keeps fp32 everywhere"
    )
