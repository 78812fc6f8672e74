"""A step's cost split by operator, as LLM-Viewer draws it: the QKV projection, attention, the
output projection, the MLP and the LM head, each its own point on the roofline.

Every operator is summed over the layers and priced as a roofline of its own at the end-to-end
achievable rates (`Roofline.achievable_*`): its time is the longer of its FLOPs at the compute
rate and its bytes (weights at the format's rate, activations and KV at the plain one). A linear
operator's compute time counts the rows its GEMMs run (whole tiles of `Roofline.tile_tokens`; each
hit expert over its share of the tokens), as the step's does; its FLOPs are the useful ones. Bytes are
per device: each operator reads its weights and input activations and writes its output;
attention reads every sequence's K and V (a sliding-window layer's last `window` positions only)
and writes the step's new K and V, so a decode step's
attention has the same intensity at any batch (each sequence brings its own KV), while a linear
layer's weights are shared by the batch and its intensity grows with it.

The FLOPs add up to `Roofline.step`'s; the weights to its weight bytes less the norms' (no
operator here owns them). The step's own time also pays fixed overheads and all-reduces, which
belong to no operator.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.cost.memory import kv_heads_per_device
from servelab.cost.roofline import Roofline, tiled_rows
from servelab.cost.step_cost import Bound, Shape
from servelab.spec.dtypes import ACTIVATION_BYTES
from servelab.spec.dtypes import weight_dtype as _weight_dtype

OPERATORS = ("qkv_proj", "attention", "o_proj", "mlp", "lm_head")
OPERATOR_LABELS = {
    "qkv_proj": "QKV projection",
    "attention": "attention",
    "o_proj": "output projection",
    "mlp": "MLP",
    "lm_head": "LM head",
}


@dataclass(frozen=True, slots=True)
class OperatorCost:
    """One operator of a step, summed over the layers (bytes and FLOPs per device)."""

    name: str
    flops: float
    weight_bytes: float
    other_bytes: float  # activations in and out, and KV read and written
    compute_time_s: float
    memory_time_s: float

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.other_bytes

    @property
    def time_s(self) -> float:
        return max(self.compute_time_s, self.memory_time_s)

    @property
    def bound(self) -> Bound:
        return "compute" if self.compute_time_s > self.memory_time_s else "memory"

    @property
    def arithmetic_intensity(self) -> float:
        return self.flops / self.total_bytes if self.total_bytes else 0.0

    @property
    def attained_flops_per_s(self) -> float:
        return self.flops / self.time_s if self.time_s else 0.0

    def to_dict(self) -> dict[str, float | str]:
        return {
            "name": self.name,
            "label": OPERATOR_LABELS[self.name],
            "flops": self.flops,
            "bytes": self.total_bytes,
            "weight_bytes": self.weight_bytes,
            "time_s": self.time_s,
            "compute_time_s": self.compute_time_s,
            "memory_time_s": self.memory_time_s,
            "bound": self.bound,
            "arithmetic_intensity": self.arithmetic_intensity,
            "attained_flops_per_s": self.attained_flops_per_s,
        }


def operator_costs(rl: Roofline, shape: Shape, logit_rows: int | None = None) -> list[OperatorCost]:
    """The step `shape` (see `servelab.cost.step_cost`) split into OPERATORS, in that order.
    `logit_rows`: positions that compute logits (default one per sequence)."""
    num_tokens, num_seqs, context_tokens, pairs = rl.step_totals(shape)
    rows = num_seqs if logit_rows is None else logit_rows
    m, tp = rl.model, rl.tp
    layers = m.num_layers
    bpe = _weight_dtype(rl.weight_dtype).bytes_per_element
    q_width = max(1, m.num_heads // tp) * m.head_dim
    kv_width = kv_heads_per_device(m, tp) * m.head_dim
    hidden = m.hidden_size
    ffn = max(1, m.ffn_size // tp)
    flops_s, weight_bps, other_bps = (
        rl.achievable_flops_per_s,
        rl.achievable_weight_bytes_per_s,
        rl.achievable_bytes_per_s,
    )

    tile = rl.tile_tokens

    def op(
        name: str, flops: float, weight_bytes: float, other_bytes: float, tiled_flops: float | None = None
    ) -> OperatorCost:
        compute_s = (flops if tiled_flops is None else tiled_flops) / flops_s
        return OperatorCost(
            name, flops, weight_bytes, other_bytes, compute_s, weight_bytes / weight_bps + other_bytes / other_bps
        )

    def linear(name: str, tokens: int, n: int, k: int, copies: int = layers) -> OperatorCost:
        # An (tokens x k) @ (k x n) matmul: reads its weights and input, writes its output.
        return op(
            name,
            copies * 2.0 * tokens * n * k,
            copies * n * k * bpe,
            copies * tokens * (n + k) * ACTIVATION_BYTES,
            copies * 2.0 * tiled_rows(tokens, tile) * n * k,
        )

    qkv = linear("qkv_proj", num_tokens, q_width + 2 * kv_width, hidden)
    o_proj = linear("o_proj", num_tokens, hidden, q_width)
    attention = op(
        "attention",
        pairs * 4.0 * layers * m.num_heads * m.head_dim / tp,
        0.0,
        (context_tokens + num_tokens) * rl.kv_bytes_per_token + layers * num_tokens * 2 * q_width * ACTIVATION_BYTES,
    )
    # The MLP: each token through its active experts' gate, up and down; the weights of every
    # expert some token was routed to, and a MoE router; a dense layer's one MLP (every layer's
    # in a dense model, Qwen3-MoE's mlp_only_layers in a MoE).
    moe_layers, dense_layers = m.num_moe_layers, layers - m.num_moe_layers
    dense_ffn = max(1, (m.dense_ffn_size or m.ffn_size) // tp)
    experts_read = m.num_experts * (1.0 - (1.0 - m.num_active_experts / m.num_experts) ** num_tokens)
    mlp_flops = 2.0 * num_tokens * 3 * hidden * (moe_layers * m.num_active_experts * ffn + dense_layers * dense_ffn)
    # Each hit expert's GEMMs run its share of the tokens, the dense MLPs and the router all of them.
    expert_rows = (
        experts_read * tiled_rows(num_tokens * m.num_active_experts / experts_read, tile)
        if moe_layers and num_tokens
        else 0.0
    )
    mlp_tiled_flops = (
        2.0 * 3 * hidden * (moe_layers * expert_rows * ffn + tiled_rows(num_tokens, tile) * dense_layers * dense_ffn)
    )
    mlp_weights = 3 * hidden * (moe_layers * experts_read * ffn + dense_layers * dense_ffn) * bpe
    per_token = moe_layers * m.num_active_experts * (3 * ffn + 2 * hidden) + dense_layers * (3 * dense_ffn + 2 * hidden)
    mlp_activations = num_tokens * per_token * ACTIVATION_BYTES
    if m.is_moe:
        mlp_flops += moe_layers * 2.0 * num_tokens * hidden * m.num_experts
        mlp_tiled_flops += moe_layers * 2.0 * tiled_rows(num_tokens, tile) * hidden * m.num_experts
        mlp_weights += moe_layers * hidden * m.num_experts * bpe
    if m.shared_ffn_size:  # Qwen2-MoE's shared expert (split like a dense MLP) and its gate, every token
        shared = 3 * hidden * max(1, m.shared_ffn_size // tp) + hidden
        mlp_flops += moe_layers * 2.0 * num_tokens * shared
        mlp_tiled_flops += moe_layers * 2.0 * tiled_rows(num_tokens, tile) * shared
        mlp_weights += moe_layers * shared * bpe
        mlp_activations += (
            num_tokens * moe_layers * (3 * max(1, m.shared_ffn_size // tp) + 2 * hidden) * ACTIVATION_BYTES
        )
    mlp = op("mlp", mlp_flops, mlp_weights, mlp_activations, mlp_tiled_flops)
    lm_head = linear("lm_head", rows, max(1, m.vocab_size // tp), hidden, copies=1)
    return [qkv, attention, o_proj, mlp, lm_head]
