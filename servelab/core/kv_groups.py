"""KV cache groups: how a model's layers share the paged pool when some attend over a window.

As vLLM's hybrid KV cache manager does, the layers are partitioned into groups of S layers each,
every group homogeneous: all full attention, or all over the same window. S is the smallest
per-kind layer count, and the last group of a kind is padded with unused slots. A page (a "block"
to the block manager) holds `block_size` positions of S layers, so one free list serves every
group, and memory moves between full and windowed groups as the load needs it. Each sequence holds
a block table per group; a windowed group's pages that fall out of the window go back to the pool
(`BlockManager.free_out_of_window`).

A model whose layers are all of one kind (all full attention, or all one window) has one group of
all its layers: the layout of a plain per-layer cache.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: its layers' window (None: full attention), full groups first
    slots_per_page: int  # S: layers per group, the cache's leading dimension
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its slot in the group's pages

    @classmethod
    def from_layer_windows(cls, layer_windows: list[int | None]) -> KVGroups:
        """The groups of a model whose layer i attends over `layer_windows[i]` (None: everything)."""
        if not layer_windows:
            raise ValueError("a model has at least one layer")
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) == 1:
            (window,) = kinds
            n = len(layer_windows)
            return cls((window,), n, (0,) * n, tuple(range(n)))
        size = min(len(layers) for layers in kinds.values())
        windows: list[int | None] = []
        group = [0] * len(layer_windows)
        slot = [0] * len(layer_windows)
        # full attention first, so that group 0 (Sequence.block_table) holds every block
        for window in sorted(kinds, key=lambda w: -1 if w is None else w):
            layers = kinds[window]
            for start in range(0, len(layers), size):
                for s, layer in enumerate(layers[start : start + size]):
                    group[layer], slot[layer] = len(windows), s
                windows.append(window)
        return cls(tuple(windows), size, tuple(group), tuple(slot))

    @classmethod
    def single(cls, num_layers: int = 1, window: int | None = None) -> KVGroups:
        return cls.from_layer_windows([window] * num_layers)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_full_groups(self) -> int:
        return sum(w is None for w in self.windows)

    def pages_for(self, num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
        """Pages one sequence of `num_tokens` positions holds at most when its steps compute up to
        `chunk_tokens` positions each: every block of a full group; of a windowed group, the
        blocks a step's chunk and the window before it span (a decode: ceil(window / block_size)
        + 1), since a step writes its whole chunk before the pages behind the window are freed."""
        blocks = -(-num_tokens // block_size)
        total = 0
        for w in self.windows:
            total += blocks if w is None else min(blocks, -(-(w - 1 + chunk_tokens) // block_size) + 1)
        return total

    def max_context_tokens(self, num_blocks: int, block_size: int, chunk_tokens: int | None) -> int | None:
        """The longest sequence a pool of `num_blocks` pages holds on its own, its steps computing
        up to `chunk_tokens` positions (None: a whole context in one step, as a whole prompt or
        its recompute after preemption is); None when no length is too long (no full group)."""
        if chunk_tokens is None or len(self.windows) == 1 and self.windows[0] is None:
            return num_blocks // len(self.windows) * block_size
        if self.num_full_groups == 0 and self.pages_for(2**62, block_size, chunk_tokens) <= num_blocks:
            return None
        lo, hi = 0, num_blocks  # blocks: pages_for(lo) fits, pages_for(hi + 1) does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.pages_for(mid * block_size, block_size, chunk_tokens) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo * block_size
