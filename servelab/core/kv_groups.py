"""What a pool of pages holds when a model's layers are in KV groups (spec/kv_groups.py), each
group's pages counted by its window: `windows[g]` is group g's (None: full attention). A model
with one full group, (None,), holds one block of every layer per block_size positions."""

from __future__ import annotations

FULL: tuple[int | None, ...] = (None,)  # one group of full-attention layers: every plain model


def pages_for(windows: tuple[int | None, ...], num_tokens: int, block_size: int, chunk_tokens: int = 1) -> int:
    """Pages one sequence of `num_tokens` positions holds at most when its steps compute up to
    `chunk_tokens` positions each: every block of a full group; of a windowed group, the blocks a
    step's chunk and the window before it span (a decode: ceil(window / block_size) + 1), since a
    step writes its whole chunk before the pages behind the window are freed."""
    blocks = -(-num_tokens // block_size)
    total = 0
    for w in windows:
        total += blocks if w is None else min(blocks, -(-(w - 1 + chunk_tokens) // block_size) + 1)
    return total


def max_context_tokens(
    windows: tuple[int | None, ...], num_blocks: int, block_size: int, chunk_tokens: int | None
) -> int | None:
    """The longest sequence a pool of `num_blocks` pages holds on its own, its steps computing up
    to `chunk_tokens` positions (None: a whole context in one step, as a whole prompt or its
    recompute after preemption is); None when no length is too long (no full group)."""
    if chunk_tokens is None or windows == FULL:
        return num_blocks // len(windows) * block_size
    if None not in windows and pages_for(windows, 2**62, block_size, chunk_tokens) <= num_blocks:
        return None
    lo, hi = 0, num_blocks  # blocks: pages_for(lo) fits, pages_for(hi + 1) does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pages_for(windows, mid * block_size, block_size, chunk_tokens) <= num_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo * block_size
