"""Which part of the model a tensor-parallel rank holds (Megatron-LM's split).

Column-parallel (rows of the [out, in] weight): Q, K, V and gate, up; each rank computes its
heads and its slice of the MLP with no communication. Row-parallel (columns): o_proj and down;
each rank's partial sums are all-reduced. Embedding and LM head: each rank holds a contiguous
slice of the vocabulary. Norms are replicated.

A MoE layer is split the same way inside every expert (vLLM's tensor-parallel MoE, not expert
parallelism): each rank holds every expert's slice of the intermediate dimension and the whole
router, so every rank routes each token alike, and the layer's output is all-reduced once. A shared
expert (Qwen2-MoE) is split like a dense MLP and its gate replicated.

KV heads split across ranks like the query heads; with fewer KV heads than ranks, each KV head
is replicated on the ranks whose query heads read it (vLLM's rule), so every rank holds one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from servelab.errors import InvalidArgument
from servelab.spec.model import ModelSpec


@dataclass(frozen=True, slots=True)
class Slice:
    """A contiguous range of one dimension of an HF-layout tensor: 0 = rows (out), 1 = columns (in)."""

    dim: int
    start: int
    stop: int


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """InvalidArgument, naming the model's numbers, when `size` ranks cannot split it."""
    if size < 1:
        raise InvalidArgument(f"tensor_parallel_size must be >= 1, got {size}", param="tensor_parallel_size")
    if spec.num_heads % size:
        raise InvalidArgument(
            f"tensor_parallel_size={size} must divide the model's {spec.num_heads} attention heads",
            param="tensor_parallel_size",
        )
    if spec.num_kv_heads % size and size % spec.num_kv_heads:
        raise InvalidArgument(
            f"tensor_parallel_size={size} must divide the model's {spec.num_kv_heads} KV heads or be a multiple "
            f"of them", param="tensor_parallel_size",
        )  # fmt: skip
    if spec.ffn_size % size:
        what = "each expert's MLP size" if spec.is_moe else "the model's MLP size"
        raise InvalidArgument(
            f"tensor_parallel_size={size} must divide {what} {spec.ffn_size}",
            param="tensor_parallel_size",
        )
    if spec.shared_ffn_size % size:
        raise InvalidArgument(
            f"tensor_parallel_size={size} must divide the shared expert's MLP size {spec.shared_ffn_size}",
            param="tensor_parallel_size",
        )
    if spec.dense_layers and spec.dense_ffn_size is not None and spec.dense_ffn_size % size:
        raise InvalidArgument(
            f"tensor_parallel_size={size} must divide the MLP size {spec.dense_ffn_size} of the model's dense layers",
            param="tensor_parallel_size",
        )
    if spec.vocab_size < size:
        raise InvalidArgument(
            f"tensor_parallel_size={size} exceeds the vocabulary of {spec.vocab_size}", param="tensor_parallel_size"
        )


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `size`: its slices of `spec`'s weights."""

    spec: ModelSpec  # the whole model's
    rank: int
    size: int

    def __post_init__(self) -> None:
        check_tensor_parallel(self.spec, self.size)

    @property
    def num_heads(self) -> int:
        return self.spec.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.spec.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        if self.spec.num_kv_heads >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // self.spec.num_kv_heads)  # replicated: the head this rank's queries read

    @property
    def ffn_size(self) -> int:
        return self.spec.ffn_size // self.size

    @property
    def dense_ffn_size(self) -> int:
        """A dense layer's MLP slice (a MoE's dense layers' own size where it has one)."""
        return (self.spec.dense_ffn_size or self.spec.ffn_size) // self.size

    @property
    def vocab_per_rank(self) -> int:
        """Rows of every rank's vocabulary slice; the last may hold fewer (padded when gathered)."""
        return -(-self.spec.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        start = min(self.rank * self.vocab_per_rank, self.spec.vocab_size)
        return start, min(self.spec.vocab_size, start + self.vocab_per_rank)

    def local_spec(self) -> ModelSpec:
        """The shape this rank's model and KV cache have: its heads and its slice of the MLP."""
        dense_ffn = None if self.spec.dense_ffn_size is None else self.dense_ffn_size
        return replace(self.spec, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, ffn_size=self.ffn_size,
                       dense_ffn_size=dense_ffn, shared_ffn_size=self.spec.shared_ffn_size // self.size)  # fmt: skip

    def slice_of(self, name: str) -> Slice | None:
        """The part of HF tensor `name` this rank holds; None: the whole tensor (norms)."""
        d = self.spec.head_dim
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            q0 = self.rank * self.num_heads * d
            return Slice(0, q0, q0 + self.num_heads * d)
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                          "self_attn.v_proj.bias")):  # fmt: skip
            k0 = self.first_kv_head * d
            return Slice(0, k0, k0 + self.num_kv_heads * d)
        if name.endswith("self_attn.o_proj.weight"):
            q0 = self.rank * self.num_heads * d
            return Slice(1, q0, q0 + self.num_heads * d)
        if ".mlp.experts." in name:  # every expert's slice of its intermediate dimension
            ffn = self.ffn_size
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                return Slice(0, self.rank * ffn, (self.rank + 1) * ffn)
            if name.endswith("down_proj.weight"):
                return Slice(1, self.rank * ffn, (self.rank + 1) * ffn)
        if ".mlp.shared_expert." in name:  # the shared expert's slice, as a dense MLP's
            ffn = self.spec.shared_ffn_size // self.size
            if name.endswith(("gate_proj.weight", "up_proj.weight")):
                return Slice(0, self.rank * ffn, (self.rank + 1) * ffn)
            if name.endswith("down_proj.weight"):
                return Slice(1, self.rank * ffn, (self.rank + 1) * ffn)
        ffn = self.dense_ffn_size
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return Slice(0, self.rank * ffn, (self.rank + 1) * ffn)
        if name.endswith("mlp.down_proj.weight"):
            return Slice(1, self.rank * ffn, (self.rank + 1) * ffn)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return Slice(0, *self.vocab_range)
        return None
