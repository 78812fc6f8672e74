"""The kernels a decoder layer runs, behind one object chosen once at load.

The model calls an `Ops` for everything but its linears (which are objects of their own,
runtime/linear.py): residual add + RMSNorm, RoPE with the K/V store, paged attention (with a
sliding window and soft-capping where the layer has them), SwiGLU and GeGLU. Implementations:

- `TorchOps`: plain PyTorch, any device and dtype. The reference, and what CUDA runs.
- `NativeOps`: our C kernels (runtime/native.py) for fp32 on the CPU, built for one ISA level
  (the linears' own kernels too). The same values as TorchOps up to fp32 summation order; or,
  with `with_q8` (the engine's default), GGUF-block linears of many rows on int8 dot products
  (block_quant.py), within docs/accuracy.md's contract. A
  decode-only step runs every layer in one native call where the linears allow
  (runtime/decode_stack.py): the same kernels in the same order, the same bits. The C attention
  kernels have no sliding window or soft-capping: attention whose window cuts the context, or
  that soft-caps (Gemma), runs TorchOps's.
- `InvariantOps`: `--deterministic`. NativeOps with every row's arithmetic independent of the
  rest of the batch: decode attention in the prefill kernel's order, the per-row final norm,
  and every linear on one kernel for every row count.

`select_ops` picks one from the device, the dtype and the CPU; a new ISA level arrives as a
NativeOps over another build (native.ISA_LEVELS), or as a subclass where it needs other calls.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from servelab.runtime import block_quant, native
from servelab.runtime.decode_stack import DecodeStack
from servelab.runtime.linear import HalfLinear, Linear
from servelab.runtime.quantization import QUANTIZED
from servelab.errors import InvalidArgument


class OpsUnavailable(Exception):
    """An ops implementation that cannot run here; the message says why."""


class TorchOps:
    """The reference: PyTorch ops over any device and dtype."""

    name = "torch"
    batch_invariant = False
    # Decode attention reads the block tables itself; else the executor passes each decode's
    # context as flat slots and a mask (AttentionMetadata).
    reads_block_tables = False

    def __repr__(self) -> str:
        return f"<ops {self.name}>"

    def prepare_linear(self, linear: Linear) -> Linear:
        """The linear as these ops run it (deterministic mode swaps in invariant kernels)."""
        return linear

    def with_q8(self, min_rows: int | None) -> Ops:
        """These ops with GGUF-block linears taking the int8 dot products from `min_rows` rows
        (None: exact fp32 at every row count), where the ops have them; else these ops."""
        return self

    def decode_stack(
        self, config: Any, layers: list[Any], scale: float, embed: torch.Tensor, final_norm: torch.Tensor, head: Any
    ) -> DecodeStack | None:
        """The model's layers (and, where it can, its embedding, final norm and LM head) as one
        native call for decode-only steps (runtime/decode_stack.py), or None: these ops run every
        step op by op."""
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op instead of seven
            return F.rms_norm(x, weight.shape, weight, eps)
        # Variance in fp32 as HF does: bf16 squares lose too much.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm(x + delta) * weight); delta None adds nothing."""
        if delta is not None:
            x = x + delta
        return x, self.rms_norm(x, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU of a fused [rows, 2 * inter] gate/up output."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """GeGLU (Gemma: GELU's tanh approximation) of a fused [rows, 2 * inter] gate/up output."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> Any:
        """Per step, from the [max_pos, D] tables: what rope_store_kv needs for these positions."""
        return cos.index_select(0, positions).unsqueeze(1), sin.index_select(0, positions).unsqueeze(1)  # [T, 1, D]

    def rope_store_kv(
        self,
        qkv: torch.Tensor,
        rotary: Any,
        slots: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """RoPE (HF rotate-half) on Q and K of a fused qkv [T, (H + 2 KV) * D], K and V stored into
        their slots of one layer's cache; returns q [T, H, D], k and v [T, KV, D]."""
        T, H, KV, D = qkv.shape[0], num_heads, num_kv_heads, head_dim
        cos, sin = rotary
        x = qkv[:, : (H + KV) * D].view(T, H + KV, D)
        rotated = torch.cat((-x[..., D // 2 :], x[..., : D // 2]), dim=-1)
        qk = x * cos + rotated * sin
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + KV) * D :].view(T, KV, D)
        kc.index_copy_(1, slots, k.transpose(0, 1).to(kc.dtype))
        vc.index_copy_(1, slots, v.transpose(0, 1).to(vc.dtype))
        return q, k, v

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        meta: Any,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """[T, H * D]: the decodes (the first meta.num_decodes tokens) over their blocks of the
        cache, then each prefill chunk over its context. `meta`: model.AttentionMetadata. A query
        at position p attends to the keys in (p - window, p] (window None: [0, p]); `softcap`:
        scores become softcap * tanh(score / softcap) before the softmax."""
        T, H, D = q.shape
        out = torch.empty(T, H * D, dtype=q.dtype, device=q.device)
        B = meta.num_decodes
        if B:
            self.decode_attention(q[:B], kc, vc, meta, scale, out[:B], window=window, softcap=softcap)
        self.prefills_attention(q, k, v, kc, vc, meta.prefills, scale, out, window=window, softcap=softcap)
        return out

    def prefills_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        prefills: list,
        scale: float,
        out: torch.Tensor,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """Each prefill chunk's rows of out [T, H * D] (`prefills`: AttentionMetadata.prefills), one
        chunk at a time."""
        for offset, n, start_pos, ctx_slots in prefills:
            if ctx_slots is None:  # the chunk is the whole context
                kp, vp = k[offset : offset + n], v[offset : offset + n]  # [n, KV, D]
                if kc.dtype != q.dtype:  # the values the cache holds, as a later chunk will read them
                    kp, vp = kp.to(kc.dtype).to(q.dtype), vp.to(vc.dtype).to(q.dtype)
            else:  # earlier context is in the cache (a previous chunk or a prefix-cache hit)
                kp = kc.index_select(1, ctx_slots).to(q.dtype).transpose(0, 1)  # [ctx, KV, D]
                vp = vc.index_select(1, ctx_slots).to(q.dtype).transpose(0, 1)
            out[offset : offset + n] = self.prefill_attention(
                q[offset : offset + n], kp, vp, start_pos, scale, window=window, softcap=softcap
            )

    def decode_attention(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        meta: Any,
        scale: float,
        out: torch.Tensor,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        """out [B, H * D] = each decode's query q [B, H, D] over its context: one batched SDPA
        over a padded gather of the contexts (of a window layer's last `window` positions)."""
        B, H, D = q.shape
        KV = kc.shape[0]
        slots, mask = meta.decode_ctx_slots, meta.decode_mask
        if slots is None:  # metadata for ops that read the block tables: the same gather from them
            slots, mask = _decode_context(meta)
        if window is not None and meta.decode_max_ctx > window:  # gather each decode's last `window` keys only
            ctx_lens = meta.decode_ctx_lens.view(B, 1)
            pos = (ctx_lens - window).clamp(min=0) + torch.arange(window, device=q.device)
            slots, mask = slots.gather(1, pos), (pos < ctx_lens).view(B, 1, 1, window)
        # index_select over the flat slot list: the same copy as kc[slots_2d], several times faster
        flat_slots = slots.reshape(-1)
        kd = kc.index_select(1, flat_slots).view(KV, B, -1, D).transpose(0, 1).to(q.dtype)  # [B, KV, ctx, D]
        vd = vc.index_select(1, flat_slots).view(KV, B, -1, D).transpose(0, 1).to(q.dtype)
        o = _attend(q.unsqueeze(2), kd, vd, mask, scale, softcap)
        out.copy_(o.reshape(B, H * D))

    def prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start_pos: int,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Causal attention [n, H * D] of q [n, H, D] at positions start_pos.. over k, v [ctx, KV, D]."""
        n, H, D = q.shape
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, tokens, D]
        gqa = H != k.shape[1]
        if start_pos == 0 and softcap is None and (window is None or n <= window):  # plain causal attention
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            qpos = torch.arange(start_pos, start_pos + n, device=q.device)[:, None]
            kpos = torch.arange(k.shape[2], device=q.device)[None, :]
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
            o = _attend(q, k, v, mask, scale, softcap)
        return o[0].transpose(0, 1).reshape(n, H * D)


class NativeOps(TorchOps):
    """Our C kernels, fp32 on the CPU, built for one ISA level: one pass each for add + RMSNorm,
    SwiGLU and RoPE + K/V store; decode attention straight from the block pool; blocked prefill
    attention. The final norm stays torch's fused one."""

    reads_block_tables = True

    def __init__(self, kernels: native.NativeKernels, level: str, q8_min_rows: int | None = None):
        self.kernels = kernels
        self.level = level
        self.name = f"native-{level}"
        # GGUF-block linears from this many rows: int8 dot products (block_quant.with_q8); None: exact
        self.q8_min_rows = q8_min_rows

    def prepare_linear(self, linear: Linear) -> Linear:
        # the linears' own C kernels at this ISA level too (the loader packs with the best one's)
        if isinstance(linear, block_quant.BlockQuantLinear):
            return block_quant.with_q8(replace(linear, kernels=self.kernels), self.q8_min_rows)
        if isinstance(linear, (HalfLinear, *QUANTIZED)):
            return replace(linear, kernels=self.kernels)
        return linear

    def with_q8(self, min_rows: int | None) -> Ops:
        return NativeOps(self.kernels, self.level, min_rows)

    def decode_stack(
        self, config: Any, layers: list[Any], scale: float, embed: torch.Tensor, final_norm: torch.Tensor, head: Any
    ) -> DecodeStack | None:
        return DecodeStack.build(
            self.kernels,
            config,
            layers,
            scale,
            paged_attention=self.batch_invariant,
            embed=embed,
            final_norm=final_norm,
            head=head,
        )

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return x, native.add_rms_norm(self.kernels, x, delta, weight, eps)  # the add is in place

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # the final norm too: one call on this thread (torch's wakes its pool), and a row's
        # result never depends on the row count (torch's may)
        return native.add_rms_norm(self.kernels, x.contiguous(), None, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return native.silu_mul(self.kernels, gate_up)

    def rotary(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> Any:
        return cos, sin, positions  # the kernel reads the tables by position itself

    def rope_store_kv(
        self,
        qkv: torch.Tensor,
        rotary: Any,
        slots: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T, H, KV, D = qkv.shape[0], num_heads, num_kv_heads, head_dim
        cos, sin, positions = rotary
        native.rope_store_kv(self.kernels, qkv, H, KV, D, cos, sin, positions, slots, kc, vc)  # RoPE in place
        return (
            qkv[:, : H * D].view(T, H, D),
            qkv[:, H * D : (H + KV) * D].view(T, KV, D),
            qkv[:, (H + KV) * D :].view(T, KV, D),
        )

    def prefills_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        prefills: list,
        scale: float,
        out: torch.Tensor,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        # the chunks that are whole prompts in one call, straight into out (the same bits as one by
        # one); those with earlier context in the cache one by one
        whole = [(offset, n) for offset, n, _, ctx in prefills if ctx is None and _plain(n, window, softcap)]
        if whole:
            if kc.dtype != q.dtype:  # the values the cache holds, as a later chunk will read them
                k, v = k.to(kc.dtype).to(q.dtype), v.to(vc.dtype).to(q.dtype)
            native.prefill_attention_chunks(self.kernels, q, k, v, whole, scale, out)
            prefills = [p for p in prefills if p[3] is not None or not _plain(p[1], window, softcap)]
        super().prefills_attention(q, k, v, kc, vc, prefills, scale, out, window=window, softcap=softcap)

    def decode_attention(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        meta: Any,
        scale: float,
        out: torch.Tensor,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        if not _plain(meta.decode_max_ctx, window, softcap):
            TorchOps.decode_attention(self, q, kc, vc, meta, scale, out, window=window, softcap=softcap)
            return
        native.decode_attention(
            self.kernels,
            q,
            kc,
            vc,
            meta.decode_block_table,
            meta.decode_ctx_lens,
            meta.decode_max_ctx,
            meta.block_size,
            scale,
            out,
        )

    def prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        start_pos: int,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if not _plain(start_pos + q.shape[0], window, softcap):
            return super().prefill_attention(q, k, v, start_pos, scale, window=window, softcap=softcap)
        return native.prefill_attention(self.kernels, q, k, v, start_pos, scale)


class InvariantOps(NativeOps):
    """Deterministic mode: each row's result depends on that row alone, bit for bit, whatever the
    batch, the chunking of its prompt or whether it is decoded or recomputed. Costs speed
    (docs/benchmarks.md, "The dtype paths")."""

    batch_invariant = True

    def __init__(self, kernels: native.NativeKernels, level: str):
        super().__init__(kernels, level)
        self.name = f"invariant-{level}"

    def with_q8(self, min_rows: int | None) -> Ops:
        return self  # one kernel a linear at every row count: the exact panel kernel

    def prepare_linear(self, linear: Linear) -> Linear:
        linear = super().prepare_linear(linear)
        if isinstance(linear, QUANTIZED):  # already one kernel for every row count
            return linear
        if isinstance(linear, HalfLinear):  # its own kernel at every row count (no MKL)
            return replace(linear, invariant=True)
        try:  # the panel kernel for every row count
            return block_quant.batch_invariant(linear, self.kernels)
        except ValueError as exc:
            raise InvalidArgument(f"deterministic mode cannot run this model: {exc}", param="deterministic") from exc

    def decode_attention(
        self,
        q: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        meta: Any,
        scale: float,
        out: torch.Tensor,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        if not _plain(meta.decode_max_ctx, window, softcap):  # LlamaModel.make_batch_invariant refuses these
            raise InvalidArgument("deterministic mode has no sliding-window or soft-capped attention", param="model")
        # the prefill kernel's order: a token decoded gets the bits it gets recomputed
        native.paged_attention(
            self.kernels,
            q,
            kc,
            vc,
            meta.decode_block_table,
            meta.decode_ctx_lens,
            meta.decode_max_ctx,
            meta.block_size,
            scale,
            out,
        )


Ops = TorchOps  # the interface: TorchOps's methods, which the others override


def _plain(end_pos: int, window: int | None, softcap: float | None) -> bool:
    """Whether attention over positions [0, end_pos) is plain causal attention, the C kernels' kind:
    no soft-capping, and no window that cuts any query's context."""
    return softcap is None and (window is None or end_pos <= window)


def _decode_context(meta: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Each decode's context slots [B, max_ctx] (padding: slot 0) and mask [B, 1, 1, max_ctx] from
    the block tables, as the executor builds them for ops that do not read the tables."""
    bs, max_ctx, table = meta.block_size, meta.decode_max_ctx, meta.decode_block_table
    pos = torch.arange(max_ctx, device=table.device)
    slots = table.index_select(1, pos // bs) * bs + pos % bs
    mask = pos[None, :] < meta.decode_ctx_lens[:, None]
    return slots * mask, mask.view(-1, 1, 1, max_ctx)


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """Attention of q [B, H, n, D] over k, v [B, KV, ctx, D] where mask (broadcast to [B, H, n, ctx])
    is True. SDPA has no soft-capping: with it, the scores in full, as transformers' eager Gemma 2
    computes them (softmax in fp32)."""
    H, KV = q.shape[1], k.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=H != KV)
    if H != KV:
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


# Every implementation by name, for make_ops and the tests; "native-*" and "invariant-*" for
# each ISA level of native.ISA_LEVELS.
OPS_NAMES = (
    "torch",
    *(f"native-{level.name}" for level in native.ISA_LEVELS),
    *(f"invariant-{level.name}" for level in native.ISA_LEVELS),
)


def make_ops(name: str, device: torch.device, dtype: torch.dtype) -> Ops:
    """The implementation called `name` (an OPS_NAMES entry) for a model on `device` in `dtype`;
    OpsUnavailable, saying why, where it cannot run."""
    if name == "torch":
        return TorchOps()
    kind, _, level = name.partition("-")
    if kind not in ("native", "invariant") or level not in {lv.name for lv in native.ISA_LEVELS}:
        raise ValueError(f"unknown ops {name!r} (known: {', '.join(OPS_NAMES)})")
    if device.type != "cpu" or dtype != torch.float32:
        raise OpsUnavailable(f"servelab's native kernels compute in float32 on the CPU, not {dtype} on {device.type}")
    kernels = native.native_kernels(level)
    if kernels is None:
        raise OpsUnavailable(f"native kernels for {level} unavailable: {native.kernels_unavailable(level)}")
    return (InvariantOps if kind == "invariant" else NativeOps)(kernels, level)


def select_ops(device: torch.device, dtype: torch.dtype, *, deterministic: bool = False) -> Ops:
    """The ops a model on `device` in `dtype` runs: the C kernels at this CPU's best ISA level
    for fp32 on the CPU where they build, else PyTorch; `deterministic` wants the invariant ones
    (InvalidArgument where they cannot run)."""
    level = native.best_level()
    if deterministic:
        try:
            return make_ops(f"invariant-{level}", device, dtype)
        except OpsUnavailable as exc:
            raise InvalidArgument(
                f"deterministic mode needs float32 compute on the CPU with servelab's native kernels ({exc})",
                param="deterministic",
            ) from exc
    try:
        return make_ops(f"native-{level}", device, dtype)
    except OpsUnavailable:
        return TorchOps()
