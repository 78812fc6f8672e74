"""A mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a router picks each token's
top-k experts, and each expert that got tokens runs its SwiGLU over them as one GEMM per linear.
Qwen2-MoE adds a shared expert that every token runs, its output scaled by sigmoid(gate . x).

Tokens are grouped by expert with one sort, so the Python loop runs over the experts a step hit,
never over tokens; an expert no token chose is not called, so its weights are not read. Each
expert's gate/up and down are `Linear`s (runtime/linear.py): GGUF-quantized experts keep their
blocks and kernels, and `quantize` and the ops' preparation reach them like any other linear.

Batch invariance: a token's output is the sum over its k slots, in slot order, of its routing
weight times its expert's output row; it depends on the other tokens of the step only through the
row count of each expert's GEMM (which may change the kernel's summation order where the linears
are not batch-invariant; under deterministic ops they are, and so is this layer).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from servelab.runtime.linear import Linear


@dataclass(slots=True)
class MoEMLP:
    """One layer's experts and router."""

    # [num_experts, hidden]: on the ops' kernels (batch-invariant ones in deterministic mode), never
    # quantized (vLLM and llama.cpp keep it unquantized too: routing is sensitive to it)
    router: Linear
    gate_up: list[Linear]  # per expert, [2 * ffn, hidden]: gate then up
    down: list[Linear]  # per expert, [hidden, ffn]
    top_k: int
    normalize: bool  # renormalise the k chosen probabilities to sum to one (norm_topk_prob)
    # Qwen2-MoE's shared expert, every token's (gate/up [2 * shared_ffn, hidden], down), and its
    # gate [1, hidden] (kept unquantized like the router); None: no shared expert
    shared_gate_up: Linear | None = None
    shared_down: Linear | None = None
    shared_gate: Linear | None = None
    experts_hit: tuple[int, ...] = field(default=(), init=False)  # the experts the last call ran
    # under tensor parallelism, sums the output over the ranks in place (parallel/layers.py)
    reduce: Callable[[torch.Tensor], None] | None = None

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def linears(self) -> tuple[Linear, ...]:
        """The experts' linears, the shared expert's included (not the router or the shared gate)."""
        shared = (self.shared_gate_up, self.shared_down)
        return (*self.gate_up, *self.down, *(w for w in shared if w is not None))

    def map_linears(self, fn: Callable[[Linear], Linear], *, router: bool = False) -> None:
        """Every expert's linears replaced by `fn` of them; with `router`, the router's (and the
        shared expert's gate) too."""
        self.gate_up = [fn(w) for w in self.gate_up]
        self.down = [fn(w) for w in self.down]
        if self.shared_gate_up is not None and self.shared_down is not None:
            self.shared_gate_up, self.shared_down = fn(self.shared_gate_up), fn(self.shared_down)
        if router:
            self.router = fn(self.router)
            if self.shared_gate is not None:
                self.shared_gate = fn(self.shared_gate)

    def gates(self) -> tuple[Linear, ...]:
        """The router and the shared expert's gate: never quantized, read every call."""
        return (self.router,) if self.shared_gate is None else (self.router, self.shared_gate)

    def dense_nbytes(self) -> int:
        """What every call reads whatever the routing: the gates and the shared expert."""
        shared = (self.shared_gate_up, self.shared_down)
        return sum(w.nbytes for w in self.gates()) + sum(w.nbytes for w in shared if w is not None)

    def expert_nbytes(self, expert: int) -> int:
        return self.gate_up[expert].nbytes + self.down[expert].nbytes

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights [T, k] fp32, expert ids [T, k] int64), the most probable first:
        softmax over every expert's logit, the top k, renormalised where the model does
        (which makes Mixtral's a softmax over the k chosen logits)."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def __call__(self, x: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `act` turns gate/up [n, 2 * ffn] into [n, ffn] (SwiGLU)."""
        tokens, k = x.shape[0], self.top_k
        weights, ids = self.route(x)
        flat = ids.reshape(-1)  # slot s of token t at t * k + s
        order = torch.argsort(flat, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = x.new_empty((tokens * k, x.shape[1]))
        hit, start = [], 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start : start + n]
            start += n
            rows = x.index_select(0, slots // k)
            out.index_copy_(0, slots, self.down[expert](act(self.gate_up[expert](rows))))
            hit.append(expert)
        self.experts_hit = tuple(hit)
        y = (out.view(tokens, k, -1) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)
        if self.shared_gate_up is not None and self.shared_down is not None and self.shared_gate is not None:
            # under TP each rank adds its slice's partial sums, gated alike: the all-reduce sums them
            gate = torch.sigmoid(self.shared_gate(x).float()).to(x.dtype)
            y = y + gate * self.shared_down(act(self.shared_gate_up(x)))
        if self.reduce is not None:
            self.reduce(y)
        return y


# The HF checkpoint names of a MoE layer's tensors, as the loader asks for them (Qwen3-MoE's and
# OLMoE's), and Mixtral's for the same tensors.
_MIXTRAL_NAMES = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_EXPERT_NAME = re.compile(r"^(model\.layers\.\d+\.)mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_ROUTER_NAME = re.compile(r"^(model\.layers\.\d+\.)mlp\.gate\.weight$")


def router_name(prefix: str) -> str:
    return prefix + "mlp.gate.weight"


def shared_expert_name(prefix: str, proj: str) -> str:
    """Qwen2-MoE's shared expert (`proj`: gate_proj, up_proj, down_proj) or, for "gate", its gate."""
    return prefix + ("mlp.shared_expert_gate.weight" if proj == "gate" else f"mlp.shared_expert.{proj}.weight")


def expert_name(prefix: str, expert: int, proj: str) -> str:
    return f"{prefix}mlp.experts.{expert}.{proj}.weight"


def mixtral_name(name: str) -> str | None:
    """Mixtral's checkpoint name (block_sparse_moe.gate, experts.N.w1/w2/w3) for a MoE tensor's
    name as the loader asks for it; None for any other tensor."""
    if m := _EXPERT_NAME.match(name):
        return f"{m[1]}block_sparse_moe.experts.{m[2]}.{_MIXTRAL_NAMES[m[3]]}.weight"
    if m := _ROUTER_NAME.match(name):
        return f"{m[1]}block_sparse_moe.gate.weight"
    return None


# llama.cpp stacks a layer's experts into one tensor per projection, [n_expert, out, in]; files
# converted before it did (early Mixtral GGUFs) keep one tensor per expert, `ffn_gate.E.weight`.
GGUF_STACKED = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GGUF_PER_EXPERT = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_GGUF_EXPERT_NAME = re.compile(r"^(ffn_(?:gate|up|down)(?:_exps)?)\.(\d+)\.weight$")


def gguf_expert_name(stacked: str, expert: int) -> str:
    """The name (after "blk.N.") of one expert's matrix cut from a stacked GGUF tensor."""
    return f"{stacked}.{expert}.weight"


def hf_name_of_gguf_expert(rest: str) -> str | None:
    """`mlp.experts.E.<proj>.weight` for `gguf_expert_name`'s names and the older per-expert
    tensors' (after "blk.N."); None for any other."""
    if m := _GGUF_EXPERT_NAME.match(rest):
        return f"mlp.experts.{m[2]}.{GGUF_STACKED.get(m[1]) or _GGUF_PER_EXPERT[m[1]]}.weight"
    return None
