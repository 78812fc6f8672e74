"""A Llama-family decoder written for serving: Llama 2/3/3.x, Mistral, Qwen2/2.5 (qkv bias), Qwen3
(per-head Q/K RMSNorm), Phi-3/Phi-4 (LongRoPE), SmolLM; Gemma 2/3 (norms after attention and the
MLP too, GeGLU, scaled embeddings, soft-capping, local RoPE base); and the mixtures of experts
Mixtral, Qwen3-MoE and OLMoE (whole-projection Q/K RMSNorm, clip_qkv), whose MLPs are
runtime/moe.py's.

One forward pass takes a flattened batch of tokens from mixed prefill chunks and decodes
(varlen). Each token carries its position and its KV slot; K/V go into the paged cache and each
sequence attends over its own blocks. Only the positions that sample get logits.

Shapes follow the HF checkpoint layout (weights are [out, in]) with Q/K/V fused into one matrix
and gate/up into another, so a layer is four GEMMs. RoPE uses the HF rotate-half convention; its
scalings live in rope.py, as tables. Sliding-window layers attend to the last `window` positions;
the block manager frees their KV as it leaves the window, and where the model mixes windowed and
full layers each KV group (spec/kv_groups.py) has its own block tables and attention metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import InitVar, dataclass, replace
from functools import partial

import torch

from servelab.runtime import linear
from servelab.runtime.linear import Linear
from servelab.runtime.moe import MoEMLP
from servelab.runtime.ops import Ops, select_ops
from servelab.runtime.quantization import LINEARS
from servelab.runtime.rope import Rope
from servelab.errors import InvalidArgument
from servelab.spec.kv_groups import KVGroups
from servelab.spec.model import ModelSpec


@dataclass(slots=True)
class LayerWeights:
    """One decoder layer: its norms' weights and its four linears (runtime/linear.py); a MoE
    layer has its experts (`moe`) in place of gate_up and down."""

    input_norm: torch.Tensor
    qkv: Linear  # [q_size + 2 * kv_size, hidden], with the qkv bias when the model has one
    o: Linear  # [hidden, q_size]
    post_norm: torch.Tensor
    gate_up: Linear | None = None  # [2 * intermediate, hidden]; None in a MoE layer
    down: Linear | None = None  # [hidden, intermediate]; None in a MoE layer
    qkv_bias: InitVar[torch.Tensor | None] = None  # as the loader hands it over: folded into qkv
    # RMSNorm weights of Q and K before RoPE: [head_dim], applied to each head (Qwen3, Gemma 3), or
    # [q_size] and [kv_size], applied to the whole projection (OLMoE)
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # [hidden]: on attention's output before the residual add (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: on the MLP's output before the residual add (Gemma)
    moe: MoEMLP | None = None

    def __post_init__(self, qkv_bias: torch.Tensor | None) -> None:
        if qkv_bias is not None:
            self.qkv = replace(self.qkv, bias=qkv_bias)

    def linears(self) -> tuple[Linear, ...]:
        mlp = self.moe.linears() if self.moe is not None else (self.gate_up, self.down)
        return (self.qkv, self.o, *(w for w in mlp if w is not None))

    def map_linears(self, fn: Callable[[Linear], Linear], *, router: bool = False) -> None:
        """Every linear of the layer replaced by `fn` of it; a MoE router too with `router`."""
        self.qkv, self.o = fn(self.qkv), fn(self.o)
        if self.moe is not None:
            self.moe.map_linears(fn, router=router)
        else:
            self.gate_up = None if self.gate_up is None else fn(self.gate_up)
            self.down = None if self.down is None else fn(self.down)

    def mlp(self, h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The SwiGLU MLP, or the experts `h`'s tokens are routed to; `act` is SwiGLU's gate."""
        if self.moe is not None:
            return self.moe(h, act)
        assert self.gate_up is not None and self.down is not None  # a dense layer has both
        return self.down(act(self.gate_up(h)))

    def norms(self) -> tuple[torch.Tensor, ...]:
        extra = (self.q_norm, self.k_norm, self.attn_out_norm, self.mlp_out_norm)
        return (self.input_norm, self.post_norm, *(t for t in extra if t is not None))


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
    logits_indices: torch.Tensor | None  # [S] rows of the hidden states that sample; None: all, in order
    # Every row samples greedily from the logits as they are: the forward may read each row's
    # argmax with them (LlamaModel.greedy_tokens), where it has them in cache.
    argmax: bool = False
    # Rows whose final hidden states (after the final norm) are also returned, for pooling
    # requests (embeddings); None on every step that has none.
    pooled_indices: torch.Tensor | None = None
    # A model with several KV groups: each group's metadata (this one is group 0's), by group;
    # only the slot-dependent fields differ. None: one group.
    by_group: list[AttentionMetadata] | None = None


class LlamaModel:
    """Weights plus a forward pass; holds no per-request state (that lives in the KV cache).

    The kernels come from `self.ops` (runtime/ops.py), chosen once at load from the device, the
    dtype and the CPU; the linears are objects that pick their own kernel (runtime/linear.py).
    """

    def __init__(
        self,
        config: ModelSpec,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        rope_freq_divisors: torch.Tensor | None = None,
        lm_head_packed: Linear | None = None,
        ops: Ops | None = None,
    ):
        self.config = config
        self.embed = embed
        # token ids -> rows; under tensor parallelism a vocab-parallel lookup (runtime/parallel)
        self.embedding: Callable[[torch.Tensor], torch.Tensor] = partial(torch.index_select, embed, 0)
        self.layers = layers
        self.final_norm = final_norm
        self.lm_head = linear.lm_head(lm_head, lm_head_packed)
        self.tied_head = lm_head.data_ptr() == embed.data_ptr()
        self.quantization: str | None = None  # "int8" or "bf16" after quantize
        self.dtype = embed.dtype
        self.device = embed.device
        self.rope = Rope.from_spec(config, rope_freq_divisors)
        # Gemma 3's sliding layers: their own base, without the global layers' scaling
        self.local_rope = None
        if config.local_rope_theta is not None:
            self.local_rope = Rope.from_spec(replace(config, rope_theta=config.local_rope_theta, rope_scaling=None))
        self._rope_len = 0
        self._cos = self._sin = self._local_cos = self._local_sin = torch.empty(0)
        self.scale = config.softmax_scale
        self.windows = [config.layer_window(i) for i in range(config.num_layers)]
        groups = KVGroups.of_model(config)
        self.layer_group = groups.layer_group  # each layer's attention metadata in meta.by_group
        self.num_kv_groups = groups.num_groups
        # HF multiplies by sqrt(hidden) rounded to the compute dtype
        self.embed_scale = (
            torch.tensor(config.hidden_size**0.5, dtype=self.dtype).item() if config.gemma_block else None
        )
        self.use_ops(ops or select_ops(self.device, self.dtype))

    def use_ops(self, ops: Ops) -> None:
        """Run on `ops` from now on; every linear is prepared for them."""
        self.ops = ops
        prepare = partial(linear.map_weight, ops.prepare_linear)
        for layer in self.layers:
            layer.map_linears(prepare, router=True)
        self.lm_head = prepare(self.lm_head)
        # decode-only steps in one native call where the ops and linears allow; None: op by op.
        # Whatever replaces a layer's linears afterwards calls use_ops again (parallel/layers.py).
        self.decode_stack = None
        # the native stack has no Q/K norm, clamp, experts, nothing of Gemma's block, and no
        # sliding window (forward skips it on the steps where a window cuts a decode's context)
        cfg = self.config
        # nor a block table per KV group
        if not (cfg.qk_norm or cfg.clip_qkv is not None or cfg.is_moe or cfg.gemma_block or self.num_kv_groups > 1):
            self.decode_stack = ops.decode_stack(
                self.config, self.layers, self.scale, self.embed, self.final_norm, self.lm_head
            )

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    @property
    def batch_invariant(self) -> bool:
        return self.ops.batch_invariant

    def quantize(self, kind: str) -> None:
        """Opt-in: every linear and the LM head become `kind` (quantization.LINEARS: "int8" or
        "bf16"), at every row count, so the output stays batch-invariant; the fp32, 16-bit and
        GGUF-block copies are dropped. The embedding and norms stay in the compute dtype. Numerics
        change, so the default never does this."""
        if self.dtype != torch.float32 or self.device.type != "cpu":
            raise InvalidArgument(
                f"quantization {kind!r} computes in float32 on the CPU, not {self.dtype} on {self.device.type}",
                param="dtype",
            )
        if self.quantization == kind:
            return
        if self.quantization is not None:
            raise InvalidArgument(
                f"the model's linears are already {self.quantization}, not {kind}", param="quantization"
            )
        make = LINEARS[kind].from_weight

        def quantized(w: Linear) -> Linear:
            return make(w.dequantize(), w.bias)

        for layer in self.layers:
            layer.map_linears(partial(linear.map_weight, quantized))
        self.lm_head = linear.map_weight(quantized, self.lm_head)
        self.quantization = kind
        self.use_ops(self.ops)  # the new linears on the ops' kernels

    def use_q8(self, min_rows: int | None) -> None:
        """GGUF-block linears take the int8 dot products over their blocks from `min_rows` rows
        (None: exact fp32 at every row count) where the ops have them (block_quant.with_q8)."""
        self.use_ops(self.ops.with_q8(min_rows))

    def q8_linears(self) -> int:
        """How many of the linears (the LM head included) take the int8 dot products for many rows."""
        all_linears = [w for layer in self.layers for w in layer.linears()] + [self.lm_head]
        return sum(
            getattr(w, "q8_min_rows", None) is not None and getattr(w, "q8", None) is not None for w in all_linears
        )

    def make_batch_invariant(self) -> None:
        """Deterministic mode: the invariant ops (runtime/ops.py, InvariantOps) and linears. Costs
        speed (docs/benchmarks.md)."""
        cfg = self.config
        if cfg.sliding_window is not None or cfg.attn_logit_softcap is not None:
            raise InvalidArgument(
                f"deterministic mode runs attention in the native kernels, which have no sliding window or "
                f"soft-capping; model {cfg.name!r} needs them", param="deterministic")  # fmt: skip
        self.use_ops(select_ops(self.device, self.dtype, deterministic=True))

    def num_parameters(self) -> int:
        n = self.embed.numel() + self.final_norm.numel() + (0 if self.tied_head else self.lm_head.numel())
        for layer in self.layers:
            n += sum(t.numel() for t in layer.norms()) + sum(w.numel() for w in layer.linears())
            n += 0 if layer.moe is None else sum(w.numel() for w in layer.moe.gates())
        return n

    def weight_bytes(self) -> int:
        """Bytes a decode step reads when it reads every weight once (the embedding row gather is
        negligible; the head is read whole even when tied to the embedding). A MoE step reads only
        the experts its tokens were routed to: `step_weight_bytes`."""
        n = self.dense_weight_bytes()
        for layer in self.layers:
            n += 0 if layer.moe is None else sum(layer.moe.expert_nbytes(e) for e in range(layer.moe.num_experts))
        return n

    def step_weight_bytes(self) -> int:
        """Weight bytes the last forward read: every dense weight once, and of each MoE layer's
        experts only those its tokens were routed to (weight_bytes() for a dense model)."""
        n = self.dense_weight_bytes()
        for layer in self.layers:
            n += 0 if layer.moe is None else sum(layer.moe.expert_nbytes(e) for e in layer.moe.experts_hit)
        return n

    def dense_weight_bytes(self) -> int:
        """Every weight one step reads whatever its tokens, the routers and shared experts included
        (not the routed experts)."""
        n = self.lm_head.nbytes + _nbytes(self.final_norm)
        for layer in self.layers:
            n += sum(_nbytes(t) for t in layer.norms()) + layer.qkv.nbytes + layer.o.nbytes
            if layer.moe is not None:
                n += layer.moe.dense_nbytes()
            else:
                n += sum(w.nbytes for w in (layer.gate_up, layer.down) if w is not None)
        return n

    def _rope_tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions up to max_pos (rope.Rope.tables; rows per set: self._rope_len)."""
        if max_pos > self._rope_len:
            n = max(max_pos, 2 * self._rope_len, 4096)
            self._cos, self._sin = self.rope.tables(n, self.dtype, self.device)
            if self.local_rope is not None:
                self._local_cos, self._local_sin = self.local_rope.tables(n, self.dtype, self.device)
            self._rope_len = n
        return self._cos, self._sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns fp32 logits [S, vocab] for the rows in `meta.logits_indices`; with
        `meta.pooled_indices`, the pair (logits, fp32 final hidden states [P, hidden] of those rows).

        `k_cache[l]` / `v_cache[l]` are layer l's cache, [kv_heads, num_slots, head_dim], in the
        compute dtype or another (a 16-bit cache under fp32 compute): values are rounded to it as
        they are stored and every attention reads them back from it, so a token attends to the
        same keys whether they were computed in this step or an earlier one.
        """
        cfg, ops = self.config, self.ops
        eps, heads = cfg.rms_norm_eps, (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        # the highest position + 1, from the plan's ints (a reduction over meta.positions is a torch op)
        cos, sin = self._rope_tables(max([meta.decode_max_ctx] + [start + n for _, n, start, _ in meta.prefills]))
        if self.rope.sets > 1:  # RoPE reads the tables at these rows (rope.Rope.table_rows)
            meta = replace(meta, positions=self.rope.table_rows(meta, self._rope_len))

        stack, rows, n = self.decode_stack, meta.logits_indices, input_ids.shape[0]
        if stack is not None and not stack.accepts(meta, n):
            stack = None  # every layer in one native call only for the steps it accepts
        window = cfg.sliding_window
        if stack is not None and window is not None and meta.decode_max_ctx > window:
            stack = None  # its attention reads the whole context
        if stack is not None and rows is None and stack.accepts_head(n) and input_ids.dtype == torch.int64:
            # from ids to logits in the call: no torch op after the weights' stream (decode_stack.py)
            return stack.logits(input_ids, meta, cos, sin, k_cache, v_cache)
        x = self.embedding(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        delta: torch.Tensor | None = None  # the residual stream's pending addend: x + delta is the true x
        if stack is not None:
            x, delta = stack(x, meta, cos, sin, k_cache, v_cache)
            layers = []
        else:
            layers = self.layers
        rotary = ops.rotary(cos, sin, meta.positions) if layers else None
        local_rotary = rotary
        if layers and self.local_rope is not None:
            local_rotary = ops.rotary(self._local_cos, self._local_sin, meta.positions)
        act = ops.gelu_tanh_mul if cfg.gemma_block else ops.silu_mul
        softcap = cfg.attn_logit_softcap
        metas = meta.by_group
        if metas is None and layers and self.num_kv_groups > 1:
            raise ValueError("this model keeps a block table per KV group: its metadata needs by_group")
        for layer, kc, vc, window, group in zip(layers, k_cache, v_cache, self.windows, self.layer_group):
            lmeta = meta if metas is None or group == 0 else metas[group]
            x, h = ops.add_rms_norm(x, delta, layer.input_norm, eps)
            qkv = layer.qkv(h)
            if layer.q_norm is not None:
                qkv = self._norm_heads(qkv, layer)
            if cfg.clip_qkv is not None:
                qkv = qkv.clamp(-cfg.clip_qkv, cfg.clip_qkv)
            q, k, v = ops.rope_store_kv(qkv, rotary if window is None else local_rotary, lmeta.slots, kc, vc, *heads)
            out = layer.o(ops.attention(q, k, v, kc, vc, lmeta, self.scale, window=window, softcap=softcap))
            if layer.attn_out_norm is not None:
                out = ops.rms_norm(out, layer.attn_out_norm, eps)
            x, h = ops.add_rms_norm(x, out, layer.post_norm, eps)
            delta = layer.mlp(h, act)
            if layer.mlp_out_norm is not None:
                delta = ops.rms_norm(delta, layer.mlp_out_norm, eps)

        pooled = meta.pooled_indices
        if pooled is not None:
            hidden = ops.rms_norm(_with_delta(x, delta, pooled), self.final_norm, eps).float()
        if rows is None:  # every row samples, in order
            _, x = ops.add_rms_norm(x, delta, self.final_norm, eps)
        else:
            x = ops.rms_norm(_with_delta(x, delta, rows), self.final_norm, eps)
        if pooled is None:
            return self._softcap(self.lm_head(x).float())
        # a step of pooling chunks alone samples nothing: no head to run
        logits = self.lm_head(x).float() if x.shape[0] else x.new_empty((0, self.vocab_size), dtype=torch.float32)
        return self._softcap(logits), hidden

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """cap * tanh(logits / cap) where the model caps its logits (Gemma 2), in place."""
        cap = self.config.final_logit_softcap
        if cap is None:
            return logits
        return logits.div_(cap).tanh_().mul_(cap)

    def _norm_heads(self, qkv: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        """The fused qkv [T, (H + 2 KV) * D] with Q and K RMS-normalised: each head (Qwen3's
        norms are [D]) or the whole projection (OLMoE's are [H * D] and [KV * D])."""
        cfg = self.config
        T, H, KV, D = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        assert layer.q_norm is not None and layer.k_norm is not None  # the caller checked: a Q/K-norm layer
        q = self.ops.rms_norm(qkv[:, : H * D].reshape(-1, layer.q_norm.numel()), layer.q_norm, cfg.rms_norm_eps)
        k_rows = qkv[:, H * D : (H + KV) * D].reshape(-1, layer.k_norm.numel())
        k = self.ops.rms_norm(k_rows, layer.k_norm, cfg.rms_norm_eps)
        return torch.cat((q.view(T, H * D), k.view(T, KV * D), qkv[:, (H + KV) * D :]), dim=1)

    def greedy_tokens(self, logits: torch.Tensor) -> list[int] | None:
        """Each row's argmax (-1: a row with a NaN or an inf) where the forward that returned
        `logits` read it (meta.argmax, in the decode stack's call), else None."""
        stack = self.decode_stack
        return None if stack is None else stack.greedy_tokens(logits)


def _with_delta(x: torch.Tensor, delta: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the residual stream x + delta (delta None: no layer ran, x is whole)."""
    return x[rows] if delta is None else x[rows] + delta[rows]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
