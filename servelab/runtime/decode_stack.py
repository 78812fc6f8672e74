"""Every decoder layer of a decode-only step in one native call (csrc/decode_stack.c).

The per-op path calls a kernel per op from Python: at batch 1 that was ~270 ctypes calls and
~190 torch ops a step, a third of the step in Python and dispatch (docs/benchmarks.md, "Where
a step's time goes"). A `DecodeStack` describes the layers to C once, at load (pointers to the norms and
to each linear's packed blocks or int8 codes), and a step is one call over buffers taken from
an arena it keeps, grown only when a step needs more. The C side runs the very kernels the
per-op path runs, in the same order, so the results are the same bits.

Where every row samples (a decode step without prompt scoring) and the stack can describe the
LM head, the call goes on through the final norm and the head and returns the logits: the step
then makes no torch op between the weights' stream and sampling. That matters because the stream
(~100 MB a step for SmolLM2) evicts every cache level, and each torch op after it ran 10-50x its
warm time (docs/benchmarks.md, "Batch 1: cold caches after the weights' stream").

It covers what it can describe: linears held as GGUF blocks (block_quant.BlockQuantLinear),
int8 codes or bf16 weights (quantization.Int8Linear, Bf16Linear) or 16-bit weights under fp32
sums (linear.HalfLinear), steps of decodes only, and up to block_quant.same_order_max_rows(kernels)
rows (linear.HALF_GEMM_MAX_ROWS with 16-bit weights) unless every linear is batch-invariant (above
that, the per-op path's MKL GEMM or k-major panel is faster).
Anything else (dense fp32 linears outside deterministic mode, tensor-parallel wrappers, prefill
chunks) keeps the per-op path.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import torch

from servelab.runtime import block_quant, native
from servelab.runtime.block_quant import BlockQuantLinear
from servelab.runtime.linear import HALF_GEMM_MAX_ROWS, HALF_GEMV_MAX_ROWS, HalfLinear
from servelab.runtime.quantization import QUANTIZED, Bf16Linear, Int8Linear
from servelab.spec.model import ModelSpec

_MAX_SEGMENTS = 4  # SL_MAX_SEGMENTS in the C file
_BLOCKS, _INT8, _HALF, _BF16 = 0, 1, 2, 3
_ptr, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Segment(ctypes.Structure):
    _fields_ = [("fmt", _i64), ("data", _ptr), ("row_bytes", _i64), ("rows", _i64), ("start", _i64)]


class _Q8Segment(ctypes.Structure):
    _fields_ = [("fmt", _i64), ("data", _ptr), ("rows", _i64), ("start", _i64)]


class _Linear(ctypes.Structure):
    _fields_ = [
        ("kind", _i64),
        ("in_features", _i64),
        ("out_features", _i64),
        ("bias", _ptr),
        ("invariant", _i64),
        ("fused_formats", _i64),
        ("num_segments", _i64),
        ("seg", _Segment * _MAX_SEGMENTS),
        ("int8_packed", _ptr),
        ("int8_scale", _ptr),
        ("int8_zero", _ptr),
        ("int8_kp", _i64),
        ("half_weight", _ptr),
        ("half_format", _i64),
        ("half_gemv_max_rows", _i64),
        ("q8_min_rows", _i64),
        ("q8_passes", _i64),
        ("q8", _Q8Segment * _MAX_SEGMENTS),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _ptr),
        ("post_norm", _ptr),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
    ]


class _Stack(ctypes.Structure):
    _fields_ = [
        ("layers", ctypes.POINTER(_Layer)),
        ("num_layers", _i64),
        ("hidden", _i64),
        ("num_heads", _i64),
        ("num_kv_heads", _i64),
        ("head_dim", _i64),
        ("intermediate", _i64),
        ("eps", _f32),
        ("scale", _f32),
        ("paged_attention", _i64),
        ("fused_max_rows", _i64),
        ("panel_outputs", _i64),
        ("final_norm", _ptr),
        ("head", _Linear),
        ("embed", _ptr),
        ("embed_rows", _i64),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("cos", _ptr),
        ("sin", _ptr),
        ("positions", _ptr),
        ("slots", _ptr),
        ("k_cache", _ptr),
        ("v_cache", _ptr),
        ("num_slots", _i64),
        ("kv_format", _i64),
        ("block_table", _ptr),
        ("table_stride", _i64),
        ("block_size", _i64),
        ("ctx_lens", _ptr),
        ("max_ctx", _i64),
        ("threads", _i64),
        ("logits", _ptr),
        ("ids", _ptr),
        ("greedy", _ptr),
    ]


def _fp32_contiguous(t: torch.Tensor | None) -> bool:
    return t is None or (t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous())


def _describe(lin: Any, kernels: native.NativeKernels) -> _Linear | None:
    """The C description of one linear, or None where the stack cannot run it."""
    if not _fp32_contiguous(lin.bias):
        return None
    out_features, in_features = lin.shape
    d = _Linear(
        in_features=in_features, out_features=out_features, bias=None if lin.bias is None else lin.bias.data_ptr()
    )
    if isinstance(lin, HalfLinear):
        if lin.kernels is not kernels:
            return None
        d.kind, d.invariant, d.half_weight = _HALF, int(lin.invariant), lin.weight.data_ptr()
        d.half_format, d.half_gemv_max_rows = native.KV_FORMATS[lin.weight.dtype], HALF_GEMV_MAX_ROWS
        return d
    if isinstance(lin, Bf16Linear):
        if lin.kernels is not kernels:
            return None
        d.kind, d.half_weight = _BF16, lin.packed.data_ptr()
        return d
    if isinstance(lin, Int8Linear):
        if lin.kernels is not kernels:
            return None
        d.kind, d.int8_kp = _INT8, lin.packed.shape[1] * 4
        d.int8_packed, d.int8_scale, d.int8_zero = lin.packed.data_ptr(), lin.scale.data_ptr(), lin.zero.data_ptr()
        return d
    if not isinstance(lin, BlockQuantLinear) or lin.kernels is not kernels or len(lin.segments) > _MAX_SEGMENTS:
        return None
    d.kind, d.invariant, d.num_segments = _BLOCKS, int(lin.invariant), len(lin.segments)
    d.fused_formats = int(block_quant.fused_formats(lin))
    for i, seg in enumerate(lin.segments):
        if not seg.data.is_contiguous():
            return None
        d.seg[i] = _Segment(seg.fmt, seg.data.data_ptr(), seg.data.shape[1], seg.data.shape[0], seg.start)
    if lin.q8 is not None and lin.q8_min_rows is not None:
        if len(lin.q8) != len(lin.segments) or not all(seg.data.is_contiguous() for seg in lin.q8):
            return None
        d.q8_min_rows, d.q8_passes = max(lin.q8_min_rows, 1), lin.q8_passes
        for i, q8seg in enumerate(lin.q8):
            d.q8[i] = _Q8Segment(q8seg.fmt, q8seg.data.data_ptr(), q8seg.rows, q8seg.start)
    return d


def _row_limit(lin: Any, kernels: native.NativeKernels) -> int | None:
    """The most rows at which the stack runs `lin` as its own __call__ does (None: any): past it
    the per-op path takes MKL's GEMM or the k-major panel, which sum in another order."""
    if isinstance(lin, QUANTIZED) or lin.invariant:
        return None
    if isinstance(lin, HalfLinear):
        return HALF_GEMM_MAX_ROWS
    same_order = block_quant.same_order_max_rows(kernels)
    if lin.q8 is not None and lin.q8_min_rows is not None and lin.q8_min_rows <= same_order + 1:
        return None  # from q8_min_rows rows on, the int8 dot products in both paths
    return same_order


def _min_rows(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


class DecodeStack:
    """The model's layers as csrc/decode_stack.c runs them; `build` says whether it can."""

    def __init__(
        self,
        kernels: native.NativeKernels,
        stack: _Stack,
        layers: Any,
        invariant: bool,
        max_rows: int | None,
        head_max_rows: int | None,
        vocab: int,
        keep: list,
    ):
        self.kernels = kernels
        self._stack = stack
        self._stack_ptr = ctypes.addressof(stack)
        self._layers_array = layers
        self._keep = keep  # the tensors whose memory the C structs point into
        self.invariant = invariant  # every linear on the panel kernel: any row count, bit-exact per row
        self.max_rows = max_rows  # the most rows it takes (None: any; and any when invariant)
        self.has_head = bool(stack.final_norm)  # the final norm and LM head can run in the call too
        self.head_max_rows = head_max_rows  # ... for up to this many rows (None: any)
        self.vocab = vocab
        self._arena = torch.empty(0, dtype=torch.float32)
        self._step = _Step()
        self._step_ptr = ctypes.addressof(self._step)
        self._kv: tuple[Any, ...] = ()  # the last step's cache lists and their pointer arrays
        self._greedy = (ctypes.c_int64 * 0)()  # the argmax of each row of `_greedy_of`, when asked
        self._greedy_of: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        kernels: native.NativeKernels,
        config: ModelSpec,
        layers: Sequence[Any],
        scale: float,
        *,
        paged_attention: bool,
        embed: torch.Tensor | None = None,
        final_norm: torch.Tensor | None = None,
        head: Any = None,
    ) -> DecodeStack | None:
        """The stack for `layers` (model.LayerWeights) on `kernels`, attention scaled by `scale`, or
        None where a part of them is something it cannot describe (then the model keeps its per-op
        path). With the model's embedding, final norm and LM head, where the stack can describe
        them too, a step can run from token ids to logits (`logits`)."""
        H, KV, D = config.num_heads, config.num_kv_heads, config.head_dim
        if not layers or H % KV:
            return None
        hidden, inter = layers[0].o.shape[0], layers[0].down.shape[1]
        want = {
            "qkv": ((H + 2 * KV) * D, hidden),
            "o": (hidden, H * D),
            "gate_up": (2 * inter, hidden),
            "down": (hidden, inter),
        }
        array = (_Layer * len(layers))()
        keep: list[Any] = []
        invariant, max_rows = True, None
        for i, layer in enumerate(layers):
            if not (_fp32_contiguous(layer.input_norm) and _fp32_contiguous(layer.post_norm)):
                return None
            array[i].input_norm, array[i].post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            for name, shape in want.items():
                lin = getattr(layer, name)
                d = _describe(lin, kernels)
                if d is None or tuple(lin.shape) != shape:
                    return None
                invariant &= isinstance(lin, QUANTIZED) or bool(d.invariant)
                max_rows = _min_rows(max_rows, _row_limit(lin, kernels))
                setattr(array[i], name, d)
                keep.append(lin)
            keep += [layer.input_norm, layer.post_norm]
        stack = _Stack(
            layers=array,
            num_layers=len(layers),
            hidden=hidden,
            num_heads=H,
            num_kv_heads=KV,
            head_dim=D,
            intermediate=inter,
            eps=config.rms_norm_eps,
            scale=scale,
            paged_attention=int(paged_attention),
            fused_max_rows=block_quant.FUSED_MAX_ROWS,
            panel_outputs=block_quant.PANEL_OUTPUTS,
        )
        head_max_rows, vocab = None, 0
        if head is not None and embed is not None and final_norm is not None:
            ends = _fp32_contiguous(final_norm) and _fp32_contiguous(embed)
            d = _describe(head, kernels) if ends else None
            if d is not None and head.shape[1] == hidden and embed.dim() == 2 and embed.shape[1] == hidden:
                stack.final_norm, stack.head = final_norm.data_ptr(), d
                stack.embed, stack.embed_rows = embed.data_ptr(), embed.shape[0]
                head_max_rows, vocab = _row_limit(head, kernels), head.shape[0]
                keep += [embed, final_norm, head]
        return cls(kernels, stack, array, invariant, max_rows, head_max_rows, vocab, keep)

    def accepts(self, meta: Any, rows: int) -> bool:
        """Whether this step is one the stack runs: decodes only, few enough rows for the packed kernels."""
        return (
            not meta.prefills
            and meta.num_decodes == rows > 0
            and (self.invariant or self.max_rows is None or rows <= self.max_rows)
        )

    def accepts_head(self, rows: int) -> bool:
        """Whether a step of `rows` accepted decodes can end in the head here (`logits`)."""
        return self.has_head and (self.head_max_rows is None or rows <= self.head_max_rows)

    def __call__(
        self,
        x: torch.Tensor,
        meta: Any,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over the embedded decodes x [rows, hidden] (updated in place); returns
        (x, delta), the residual stream and the last MLP output still to be added to it, as the
        model's per-op loop leaves them. cos/sin: the model's RoPE tables."""
        delta = torch.empty_like(x)
        self._run(x.shape[0], x.data_ptr(), delta.data_ptr(), None, None, meta, cos, sin, k_cache, v_cache, None)
        return x, delta

    def logits(
        self,
        ids: torch.Tensor,
        meta: Any,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: Sequence[torch.Tensor],
        v_cache: Sequence[torch.Tensor],
    ) -> torch.Tensor:
        """From the decodes' token ids (int64 [rows]) to fp32 logits [rows, vocab] in one call: the
        embedding, the layers, the final norm and the LM head over every row, the bits the model's
        own path gives (where accepts_head). IndexError for an id outside the embedding."""
        rows = ids.shape[0]
        out = torch.empty(rows, self.vocab, dtype=torch.float32)
        greedy = None
        if meta.argmax:  # and each row's argmax, read in the call while the logits are in cache
            if len(self._greedy) < rows:
                self._greedy = (ctypes.c_int64 * max(rows, 2 * len(self._greedy)))()
            greedy = ctypes.addressof(self._greedy)
        self._greedy_of = None
        self._run(rows, None, None, ids.data_ptr(), out.data_ptr(), meta, cos, sin, k_cache, v_cache, greedy)
        if greedy is not None:
            self._greedy_of = out
        return out

    def greedy_tokens(self, logits: torch.Tensor) -> list[int] | None:
        """Each row's argmax as the call that returned `logits` read it (with meta.argmax set),
        as native.argmax_rows gives it, -1 for a row holding a NaN or an inf; else None."""
        if logits is not self._greedy_of:
            return None
        self._greedy_of = None
        return self._greedy[: logits.shape[0]]

    def _run(self, rows, x, delta, ids, logits, meta, cos, sin, k_cache, v_cache, greedy) -> None:
        """x, delta, ids, logits, greedy: addresses (or None), as servelab_decode_stack takes them."""
        threads = torch.get_num_threads()
        need = self.kernels.decode_stack_arena(self._stack_ptr, rows, meta.decode_max_ctx, threads)
        if self._arena.numel() < need:  # grows with the batch and the context, then stays
            self._arena = torch.empty(max(need, 2 * self._arena.numel()), dtype=torch.float32)
        if not self._kv or self._kv[0] is not k_cache or self._kv[1] is not v_cache:  # the cache's lists: fixed
            k_ptrs = (ctypes.c_void_p * len(k_cache))(*[t.data_ptr() for t in k_cache])
            v_ptrs = (ctypes.c_void_p * len(v_cache))(*[t.data_ptr() for t in v_cache])
            self._kv = (k_cache, v_cache, k_ptrs, v_ptrs)
        kc, k_ptrs, v_ptrs = k_cache[0], self._kv[2], self._kv[3]
        table = meta.decode_block_table
        s = self._step
        s.rows, s.cos, s.sin = rows, cos.data_ptr(), sin.data_ptr()
        s.positions, s.slots = meta.positions.data_ptr(), meta.slots.data_ptr()
        s.k_cache, s.v_cache = ctypes.addressof(k_ptrs), ctypes.addressof(v_ptrs)
        s.num_slots, s.kv_format = kc.shape[1], native.KV_FORMATS[kc.dtype]
        s.block_table, s.table_stride, s.block_size = table.data_ptr(), table.stride(0), meta.block_size
        s.ctx_lens, s.max_ctx, s.threads = meta.decode_ctx_lens.data_ptr(), meta.decode_max_ctx, threads
        s.logits, s.ids, s.greedy = logits, ids, greedy
        err = self.kernels.decode_stack(self._stack_ptr, self._step_ptr, x, delta, self._arena.data_ptr())
        if err == -2:
            raise IndexError(f"a token id of this step is outside the embedding's {self._stack.embed_rows} rows")
        if err:
            raise MemoryError(f"decode stack: a linear found no memory for {rows} rows of activations")
