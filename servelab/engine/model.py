"""A Llama-family decoder written for serving: Llama 2/3/3.1, Mistral, Qwen2 (qkv bias), SmolLM.

One forward pass takes a flattened batch of tokens from mixed prefill chunks and decodes
(varlen). Each token carries its position and its KV slot; K/V go into the paged cache and each
sequence attends over its own blocks. Only the positions that sample get logits.

Shapes follow the HF checkpoint layout (weights are [out, in]) with Q/K/V fused into one matrix
and gate/up into another, so a layer is four GEMMs. RoPE uses the HF rotate-half convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from servelab.engine import block_quant, native
from servelab.engine.block_quant import BlockQuantLinear
from servelab.engine.quantization import Int8Linear
from servelab.errors import InvalidArgument
from servelab.spec.model import ModelSpec


def rope_inv_freq(config: ModelSpec, freq_divisors: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse frequencies (fp32, [head_dim/2]), with llama3 / linear scaling applied like HF does."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if freq_divisors is not None:  # GGUF stores llama3 scaling as precomputed per-dimension divisors
        return inv_freq / freq_divisors.float()
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling["low_freq_factor"])
        high_freq_factor = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise InvalidArgument(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")


# Up to this many sampling rows the pre-transposed fp32 head is faster (see LlamaModel.__init__).
_MAX_ROWS_FOR_TRANSPOSED_HEAD = 2

# A linear's weight: a tensor [out, in]; that tensor with its GGUF blocks (block_quant.py); or
# int8 codes under the opt-in int8 quantization (quantization.py).
Weight = torch.Tensor | BlockQuantLinear | Int8Linear


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    if isinstance(weight, BlockQuantLinear):
        return weight(x, bias)
    return weight(x)  # an Int8Linear carries its bias packed with it


def _nbytes(weight: Weight) -> int:
    return weight.numel() * weight.element_size() if isinstance(weight, torch.Tensor) else weight.nbytes


def _dense(weight: Weight) -> torch.Tensor:
    return weight.dense if isinstance(weight, BlockQuantLinear) else weight


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # None once packed into an Int8Linear qkv
    o: Weight  # [hidden, q_size]
    post_norm: torch.Tensor
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]

    def linears(self) -> tuple[Weight, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors shared by every layer; built once by the executor.

    Tokens are ordered: all decode tokens first (one per sequence), then the prefill chunks.
    Decodes attend together: in the native kernel straight from their block tables, otherwise in
    one batched SDPA over a padded gather of their context. Each prefill chunk attends on its own
    (there are few per step and they are long, so padding them would waste).
    """

    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64: flat KV slot per token
    num_decodes: int
    block_size: int
    decode_block_table: torch.Tensor | None  # [B, max_blocks] int64 (padded with 0)
    decode_ctx_lens: torch.Tensor | None  # [B] int64: context length including the new token
    decode_max_ctx: int
    # For the SDPA path only (None when the model uses the native kernel):
    decode_ctx_slots: torch.Tensor | None  # [B, max_ctx] flat slots of each decode's context (padded with 0)
    decode_mask: torch.Tensor | None  # [B, 1, 1, max_ctx] bool: True where the key is real
    # Prefill chunks: (token offset in the batch, num tokens, start_pos, context slots [ctx] or None when start_pos == 0)
    prefills: list[tuple[int, int, int, torch.Tensor | None]]
    logits_indices: torch.Tensor  # [S] rows of the hidden states that sample


class LlamaModel:
    """Weights plus a forward pass; holds no per-request state (that lives in the KV cache)."""

    def __init__(
        self,
        config: ModelSpec,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        rope_freq_divisors: torch.Tensor | None = None,
        lm_head_packed: BlockQuantLinear | None = None,
    ):
        self.config = config
        self.embed = embed
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = lm_head
        # fp32: for one or two sampling rows, `x @ W^T` over a pre-transposed [hidden, vocab]
        # head streams it about twice as fast as F.linear on [vocab, hidden] (SmolLM2's
        # 49152 x 576 head, AVX2, 1 thread: 8 vs 15 ms at 1 row, 17 vs 32 ms at 2); from 4 rows
        # on MKL's F.linear wins (4: 38 vs 55 ms, 32: 82 vs 100 ms), so the choice is per step.
        # In bf16 without native bf16 kernels `x @ W^T` is 10x slower than F.linear, so other
        # dtypes keep F.linear. One extra copy of the head, unless it came block-quantized: then
        # up to block_quant.MAX_ROWS rows read the packed blocks (SmolLM2's Q8_0 head: ~4 ms at 1 row).
        self.lm_head_packed = lm_head_packed
        self.lm_head_t = (
            lm_head.t().contiguous() if lm_head.dtype == torch.float32 and lm_head_packed is None else None
        )
        self.lm_head_int8: Int8Linear | None = None
        self.batch_invariant = False  # deterministic mode (make_batch_invariant)
        self.dtype = embed.dtype
        self.device = embed.device
        self.inv_freq = rope_inv_freq(config, rope_freq_divisors).to(self.device)
        self._rope_len = 0
        self._cos = self._sin = torch.empty(0)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        # On CPU in fp32, when a C compiler is there (engine/native.py): decode attention in C
        # straight from the block pool (2-3x faster than gather + SDPA at 32 sequences), and
        # RoPE + K/V store, residual add + RMSNorm and SwiGLU in one pass each. Elsewhere (CUDA,
        # bf16, no compiler) the PyTorch path; the same values up to fp32 summation order.
        self.native = native.native_kernels() if self.device.type == "cpu" and self.dtype == torch.float32 else None

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    @property
    def quantization(self) -> str | None:
        return None if self.lm_head_int8 is None else "int8"

    def quantize_int8(self) -> None:
        """Opt-in: every linear and the LM head become int8 (see `quantization`), at every row count,
        so the output stays batch-invariant; the fp32 and GGUF-block copies are dropped. The
        embedding and norms stay in the compute dtype. Numerics change, so the default never does
        this."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise InvalidArgument(
                f"quantization 'int8' computes in float32 on the CPU, not {self.dtype} on {self.device.type}",
                param="dtype",
            )
        if self.lm_head_int8 is not None:  # already done
            return
        for layer in self.layers:
            layer.qkv, layer.qkv_bias = Int8Linear.from_weight(_dense(layer.qkv), layer.qkv_bias), None
            layer.o, layer.gate_up, layer.down = (Int8Linear.from_weight(_dense(w)) for w in (layer.o, layer.gate_up, layer.down))
        self.lm_head_int8 = Int8Linear.from_weight(self.lm_head)
        self.lm_head_packed = self.lm_head_t = None

    def make_batch_invariant(self) -> None:
        """Deterministic mode: each row's result depends on that row alone, bit for bit, whatever
        the batch, the chunking of its prompt or whether it is decoded or recomputed. Every linear
        and the head take one kernel for every row count (block_quant's panel kernel; int8 ones
        already do), decode attention takes the prefill kernel's order (native.paged_attention),
        and the final norm the native per-row one. Costs speed (docs/benchmarks.md)."""
        kernels = self.native
        if kernels is None:
            raise InvalidArgument(
                f"deterministic mode needs float32 compute on the CPU with servelab's native kernels "
                f"(here: {self.dtype} on {self.device.type}"
                f"{', native kernels unavailable: ' + str(native.load_error) if native.load_error else ''})",
                param="deterministic",
            )

        def invariant(weight: Weight) -> Weight:
            if isinstance(weight, Int8Linear):
                return weight
            try:
                return block_quant.batch_invariant(weight, kernels)
            except ValueError as exc:
                raise InvalidArgument(f"deterministic mode cannot run this model: {exc}", param="deterministic") from exc

        for layer in self.layers:
            layer.qkv, layer.o, layer.gate_up, layer.down = (invariant(w) for w in layer.linears())
        if self.lm_head_int8 is None:
            self.lm_head_packed = invariant(self.lm_head_packed or self.lm_head)
            self.lm_head_t = None
        self.batch_invariant = True

    def num_parameters(self) -> int:
        n = self.embed.numel() + self.final_norm.numel()
        if self.lm_head.data_ptr() != self.embed.data_ptr():
            n += self.lm_head.numel()
        for layer in self.layers:
            n += layer.input_norm.numel() + layer.post_norm.numel() + sum(w.numel() for w in layer.linears())
            n += 0 if layer.qkv_bias is None else layer.qkv_bias.numel()
        return n

    def weight_bytes(self) -> int:
        """Bytes one decode step reads: every weight once (the embedding row gather is negligible;
        the head is read whole even when tied to the embedding)."""
        head = self.lm_head_int8 or self.lm_head_packed or self.lm_head
        n = _nbytes(head) + _nbytes(self.final_norm)
        for layer in self.layers:
            n += _nbytes(layer.input_norm) + _nbytes(layer.post_norm) + sum(_nbytes(w) for w in layer.linears())
            n += 0 if layer.qkv_bias is None else _nbytes(layer.qkv_bias)
        return n

    def _rope_tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        if max_pos > self._rope_len:
            n = max(max_pos, 2 * self._rope_len, 4096)
            # Same fp32 arithmetic as HF's rotary embedding, so positions far out agree bit for bit.
            freqs = torch.arange(n, device=self.device, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos, self._sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
            self._rope_len = n
        return self._cos, self._sin

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op instead of seven: the norm runs 61 times a step
            return F.rms_norm(x, weight.shape, weight, self.config.rms_norm_eps)
        # Variance in fp32 as HF does: bf16 squares lose too much.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, RMSNorm(x + delta) * weight); the native kernel adds in place, in one pass."""
        if self.native is not None:
            return x, native.add_rms_norm(self.native, x, delta, weight, self.config.rms_norm_eps)
        if delta is not None:
            x = x + delta
        return x, self._rms_norm(x, weight)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> torch.Tensor:
        """Returns fp32 logits [S, vocab] for the rows in `meta.logits_indices`.

        `k_cache[l]` / `v_cache[l]` are layer l's cache, [kv_heads, num_slots, head_dim], in the
        compute dtype or another (a 16-bit cache under fp32 compute): values are rounded to it as
        they are stored and every attention reads them back from it, so a token attends to the
        same keys whether they were computed in this step or an earlier one.
        """
        cfg = self.config
        T = input_ids.shape[0]
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos_table, sin_table = self._rope_tables(int(meta.positions.max()) + 1)
        if self.native is None:  # the native kernel reads the tables by position itself
            cos = cos_table.index_select(0, meta.positions).unsqueeze(1)  # [T, 1, D]
            sin = sin_table.index_select(0, meta.positions).unsqueeze(1)
        half = D // 2

        def rope(x: torch.Tensor) -> torch.Tensor:  # [T, heads, D]: Q and K heads together
            rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
            return x * cos + rotated * sin

        x = self.embed.index_select(0, input_ids)
        delta: torch.Tensor | None = None  # the residual stream's pending addend: x + delta is the true x
        for li, layer in enumerate(self.layers):
            x, h = self._add_norm(x, delta, layer.input_norm)
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            kc, vc = k_cache[li], v_cache[li]
            if self.native is not None:  # RoPE in place and the K/V store, one pass
                native.rope_store_kv(self.native, qkv, H, KV, D, cos_table, sin_table, meta.positions, meta.slots, kc, vc)
                q = qkv[:, : cfg.q_size].view(T, H, D)
                k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(T, KV, D)
                v = qkv[:, cfg.q_size + cfg.kv_size :].view(T, KV, D)
            else:
                qk = rope(qkv[:, : cfg.q_size + cfg.kv_size].view(T, H + KV, D))
                q, k = qk[:, :H], qk[:, H:]
                v = qkv[:, cfg.q_size + cfg.kv_size :].view(T, KV, D)
                kc.index_copy_(1, meta.slots, k.transpose(0, 1).to(kc.dtype))
                vc.index_copy_(1, meta.slots, v.transpose(0, 1).to(vc.dtype))
            attn = self._attention(q, k, v, kc, vc, meta)  # [T, H * D]
            x, h = self._add_norm(x, linear(attn, layer.o), layer.post_norm)
            gate_up = linear(h, layer.gate_up)
            if self.native is not None:
                act = native.silu_mul(self.native, gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            delta = linear(act, layer.down)
        x = x[meta.logits_indices] + delta[meta.logits_indices]
        if self.batch_invariant:  # torch's norm may reduce a row differently by row count
            x = native.add_rms_norm(self.native, x, None, self.final_norm, self.config.rms_norm_eps)
        else:
            x = self._rms_norm(x, self.final_norm)
        if self.lm_head_int8 is not None:
            return self.lm_head_int8(x)
        if self.lm_head_packed is not None and (x.shape[0] <= block_quant.MAX_ROWS or self.batch_invariant):
            return self.lm_head_packed(x)
        if self.lm_head_t is not None and x.shape[0] <= _MAX_ROWS_FOR_TRANSPOSED_HEAD:
            return x @ self.lm_head_t
        return F.linear(x, self.lm_head).float()

    def _attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kc: torch.Tensor,
        vc: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.config
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        out = torch.empty(q.shape[0], H * D, dtype=q.dtype, device=q.device)
        B = meta.num_decodes
        if B and self.batch_invariant:  # the prefill kernel's order: decoded = recomputed, bit for bit
            native.paged_attention(
                self.native, q[:B], kc, vc, meta.decode_block_table, meta.decode_ctx_lens,
                meta.decode_max_ctx, meta.block_size, self.scale, out[:B],
            )
        elif B and self.native is not None:
            native.decode_attention(
                self.native, q[:B], kc, vc, meta.decode_block_table, meta.decode_ctx_lens,
                meta.decode_max_ctx, meta.block_size, self.scale, out[:B],
            )
        elif B:
            qd = q[:B].unsqueeze(2)  # [B, H, 1, D]
            # index_select over the flat slot list, not kc[slots_2d]: the same copy, but the
            # advanced-indexing kernel took 1.13 ms for K+V of 32 x 48 slots against 0.13 ms for
            # index_select (1 thread, this AVX2 host), and the gather runs twice per layer.
            flat_slots = meta.decode_ctx_slots.view(-1)
            kd = kc.index_select(1, flat_slots).view(KV, B, -1, D).transpose(0, 1).to(q.dtype)  # [B, KV, ctx, D]
            vd = vc.index_select(1, flat_slots).view(KV, B, -1, D).transpose(0, 1).to(q.dtype)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=H != KV)
            out[:B] = o.reshape(B, H * D)
        for offset, n, start_pos, ctx_slots in meta.prefills:
            qp = q[offset : offset + n]  # [n, H, D]
            if ctx_slots is None:  # the chunk is the whole context
                kp, vp = k[offset : offset + n], v[offset : offset + n]  # [n, KV, D]
                if kc.dtype != q.dtype:  # the values the cache holds, as a later chunk will read them
                    kp, vp = kp.to(kc.dtype).to(q.dtype), vp.to(vc.dtype).to(q.dtype)
            else:  # earlier context is in the cache (a previous chunk or a prefix-cache hit)
                kp = kc.index_select(1, ctx_slots).to(q.dtype).transpose(0, 1)  # [ctx, KV, D]
                vp = vc.index_select(1, ctx_slots).to(q.dtype).transpose(0, 1)
            if self.native is not None:  # in C: 1.6x SDPA's flash kernel at 512 tokens (csrc/prefill_attention.c)
                out[offset : offset + n] = native.prefill_attention(self.native, qp, kp, vp, start_pos, self.scale)
                continue
            qp, kp, vp = (t.transpose(0, 1).unsqueeze(0) for t in (qp, kp, vp))  # [1, heads, tokens, D]
            if ctx_slots is None:  # plain causal attention
                o = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=self.scale, enable_gqa=H != KV)
            else:
                qpos = torch.arange(start_pos, start_pos + n, device=q.device)[:, None]
                mask = torch.arange(kp.shape[2], device=q.device)[None, :] <= qpos
                o = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=self.scale, enable_gqa=H != KV)
            out[offset : offset + n] = o[0].transpose(0, 1).reshape(n, H * D)
        return out
