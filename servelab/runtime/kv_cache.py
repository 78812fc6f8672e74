"""The paged KV cache: per layer, K and V of shape [kv_heads, num_blocks * block_size, head_dim].

A model whose layers attend over different windows shares pages between KV groups
(spec/kv_groups.py): K and V are [S, kv_heads, num_blocks * block_size, head_dim], S layers per
page, and layer i is slot `layer_slot[i]` of the pages in its group's block table. A model with
one group (every plain model) has S = num_layers: one slot per layer, as above.

The scheduler's block manager owns which blocks belong to whom; this module owns only the
memory. A token at position p of a sequence lives at flat slot
`block_table[p // block_size] * block_size + p % block_size`, so the model sees each layer as
[kv_heads, num_slots, head_dim], writes with one index_copy_ along the slots and gathers with
one index_select. Heads outermost, so that what a gather returns is already SDPA's
[kv_heads, ctx, head_dim] with each head's keys contiguous: with slots outermost the gathered
keys were strided by kv_heads, and gather + SDPA took 13% longer (32 decodes x 160 tokens).
"""

from __future__ import annotations

import torch

from servelab.errors import DoesNotFit
from servelab.spec.kv_groups import KVGroups
from servelab.spec.model import ModelSpec


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class PagedKVCache:
    def __init__(
        self,
        config: ModelSpec,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype,
        device: str = "cpu",
        prefault: bool = False,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = config.num_layers
        self.dtype = dtype
        self.groups = KVGroups.of_model(config)
        shape = (self.groups.slots_per_page, config.num_kv_heads, num_blocks * block_size, config.head_dim)
        try:
            # empty, then zero only what must be: without prefault, pages are touched only as
            # blocks fill, so a generous pool costs no start-up time. A server prefaults (~1 s
            # per GiB here): lazily, its RSS crept up to the pool size over its first minutes of
            # traffic as never-used blocks were handed out (docs/benchmarks.md, Soak), and a pool
            # too big for the machine failed mid-service instead of at start. Block 0 must hold
            # finite values either way: padded (masked) keys of batched decode attention point
            # at slot 0, and NaN * 0 would still poison the sum.
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
            extent = num_blocks * block_size if prefault else block_size
            self.k[:, :, :extent].zero_()
            self.v[:, :, :extent].zero_()
        except RuntimeError as exc:  # out of memory: a configuration error, not a crash
            raise DoesNotFit(
                f"KV cache of {num_blocks} blocks x {block_size} tokens needs "
                f"{self.bytes_per_block(config, block_size, dtype) * num_blocks / 2**30:.2f} GiB "
                f"on {device}, which cannot be allocated ({exc}); lower num_blocks or kv_cache_memory_bytes"
            ) from exc
        k_slots, v_slots = self.k.unbind(0), self.v.unbind(0)
        self.k_layers = [k_slots[s] for s in self.groups.layer_slot]
        self.v_layers = [v_slots[s] for s in self.groups.layer_slot]

    @staticmethod
    def bytes_per_block(config: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
        """K and V of one block (a page) across its slots: every layer, for a model with one KV group."""
        slots = KVGroups.of_model(config).slots_per_page
        return 2 * slots * block_size * config.num_kv_heads * config.head_dim * dtype_size(dtype)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    # ---- export / import of whole blocks (disaggregated prefill/decode, cluster/kv_transfer.py)

    @property
    def device(self) -> torch.device:
        return self.k.device

    def block_slots(self, block_ids: list[int]) -> torch.Tensor:
        """The flat slots of `block_ids`, block by block, in table order."""
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.k.device)
        offsets = torch.arange(self.block_size, device=self.k.device)
        return (ids[:, None] * self.block_size + offsets).reshape(-1)

    def export_layer(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """K and V of one layer at `slots`, copied out: [2, kv_heads, len(slots), head_dim]."""
        return torch.stack((self.k_layers[layer].index_select(1, slots), self.v_layers[layer].index_select(1, slots)))

    def import_layer(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Writes export_layer's tensor from another cache into this one's `slots`."""
        self.k_layers[layer].index_copy_(1, slots, kv[0])
        self.v_layers[layer].index_copy_(1, slots, kv[1])

    def export_block(self, block: int) -> torch.Tensor:
        """Every layer's K and V of one block, copied out: [2, layers, kv_heads, block_size, head_dim]."""
        start = block * self.block_size
        return torch.stack(
            (self.k[:, :, start : start + self.block_size], self.v[:, :, start : start + self.block_size])
        )

    def import_block(self, block: int, kv: torch.Tensor) -> None:
        start = block * self.block_size
        self.k[:, :, start : start + self.block_size] = kv[0]
        self.v[:, :, start : start + self.block_size] = kv[1]

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        """export_layer's shape for `num_blocks` blocks."""
        _, kv_heads, _, head_dim = self.k.shape
        return (2, kv_heads, num_blocks * self.block_size, head_dim)

    def block_shape(self) -> tuple[int, ...]:
        layers, kv_heads, _, head_dim = self.k.shape
        return (2, layers, kv_heads, self.block_size, head_dim)
