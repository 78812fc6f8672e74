"""The layers that communicate under tensor parallelism, wrapped around a rank's own linears.

Each holds the linear that carries the weight shard as `inner` (any runtime/linear.py kind:
dense, GGUF blocks, int8, bf16) and adds one collective after it; `with_inner` lets the model's
use_ops and quantize swap the inner linear (linear.map_weight). The model's forward never
sees the process group. The collectives are called on the group itself, not through
torch.distributed's functions, which only know groups made from its default group (group.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from servelab.runtime.linear import Linear
from servelab.runtime.parallel.sharding import Shard


@dataclass(slots=True)
class _Wrapped:
    inner: Linear
    group: Any  # a gloo process group (group.Groups.compute)

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def numel(self) -> int:
        return self.inner.numel()

    def dequantize(self) -> torch.Tensor:
        return self.inner.dequantize()

    def with_inner(self, inner: Linear) -> _Wrapped:
        return replace(self, inner=inner)


@dataclass(slots=True)
class RowParallelLinear(_Wrapped):
    """o_proj and down: this rank's columns of the weight times its slice of the input, summed
    over the ranks: the layer's one all-reduce."""

    @property
    def shape(self) -> tuple[int, int]:
        return self.inner.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        self.group.allreduce([y]).wait()
        return y


@dataclass(slots=True)
class VocabParallelHead(_Wrapped):
    """The LM head: this rank's vocabulary slice of the logits, all-gathered into the whole
    vocabulary on every rank (rank 0 samples; a gather to rank 0 alone would save the other
    ranks' receive, at the same latency)."""

    vocab_size: int = 0
    vocab_per_rank: int = 0
    world: int = 1

    @property
    def shape(self) -> tuple[int, int]:
        return (self.vocab_size, self.inner.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        local = self.inner(x)
        if local.shape[1] < self.vocab_per_rank:  # the last slice of a vocabulary that does not divide
            local = torch.nn.functional.pad(local, (0, self.vocab_per_rank - local.shape[1]))
        parts = [torch.empty_like(local) for _ in range(self.world)]
        self.group.allgather([parts], [local.contiguous()]).wait()
        return torch.cat(parts, dim=1)[:, : self.vocab_size]


def _all_reduce(group: Any, x: torch.Tensor) -> None:
    group.allreduce([x]).wait()


@dataclass(slots=True)
class VocabParallelEmbedding:
    """This rank's rows of the embedding; a token outside them contributes zeros, so the
    all-reduce gives every rank the token's row exactly."""

    weight: torch.Tensor  # [rows of this rank's vocabulary slice, hidden]
    start: int
    group: Any

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = self.weight.index_select(0, local.clamp(0, self.weight.shape[0] - 1))
        x *= inside.unsqueeze(1).to(x.dtype)
        self.group.allreduce([x]).wait()
        return x


def parallelize(model: Any, shard: Shard, group: Any) -> None:
    """Turns a model loaded from `shard`'s slices (loader.load_model's tp_rank/tp_size) into this
    rank's part of the whole: the row-parallel linears reduce, the head gathers, the embedding
    reduces. `model`: runtime.model.LlamaModel."""
    for layer in model.layers:
        if layer.o.bias is not None or (layer.down is not None and layer.down.bias is not None):
            raise ValueError("row-parallel linears with a bias are not supported")
        layer.o = RowParallelLinear(layer.o, group)
        if layer.moe is not None:  # every expert's partial sums, weighted and added, then one all-reduce
            layer.moe.reduce = partial(_all_reduce, group)
        else:
            layer.down = RowParallelLinear(layer.down, group)
    model.lm_head = VocabParallelHead(model.lm_head, group, shard.spec.vocab_size, shard.vocab_per_rank, shard.size)
    model.embedding = VocabParallelEmbedding(model.embed, shard.vocab_range[0], group)
    model.use_ops(model.ops)  # the ops see the wrapped linears (no one-call decode stack over them)
