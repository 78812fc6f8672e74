"""KV cache groups: how a model's layers share the paged pool when some attend over a window.

As vLLM's hybrid KV cache manager does, the layers are partitioned into groups of S layers each,
every group homogeneous: all full attention, or all over the same window. S is the smallest
per-kind layer count, and the last group of a kind is padded with unused slots. A page (a "block"
to the block manager) holds `block_size` positions of S layers, so one free list serves every
group, and memory moves between full and windowed groups as the load needs it. Each sequence holds
a block table per group; a windowed group's pages that fall out of the window go back to the pool
(core/block_manager.py), which sees only each group's window (core/kv_groups.py prices them).

A model whose layers are all of one kind (all full attention, or all one window) has one group of
all its layers: the layout of a plain per-layer cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from servelab.spec.model import ModelSpec


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
    def of_model(cls, model: ModelSpec) -> KVGroups:
        """The groups of `model`'s layers, by window."""
        return cls.from_layer_windows([model.layer_window(i) for i in range(model.num_layers)])

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def pages_in(self, num_blocks: int) -> int:
        """Pages of `slots_per_page` layers in the memory of `num_blocks` blocks of every layer."""
        return num_blocks * len(self.layer_slot) // self.slots_per_page
