"""Consistency checks of a scheduler's and a block manager's state, for tests: they read private bookkeeping."""

from __future__ import annotations

from servelab.core.block_manager import NULL_BLOCK, BlockManager
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import SequenceStatus
from servelab.sim.implicit_decodes import ImplicitDecodeScheduler


def check_invariants(s: Scheduler) -> None:
    """Raise AssertionError if the scheduler's state is inconsistent."""
    bm = s.block_manager
    check_block_manager(bm)
    running_ids = [q.request_id for q in s.running]
    assert len(set(running_ids)) == len(running_ids), "a sequence runs twice"
    assert len(s.running) <= s.config.max_num_seqs, "more running sequences than max_num_seqs"
    keys = [q.order_key for q in s.running]
    assert keys == sorted(keys), "running is out of order"
    waiting = list(s.waiting)
    assert len(waiting) == s.num_waiting, "waiting count is off"
    assert not set(running_ids) & {q.request_id for q in waiting}, "a sequence is both running and waiting"
    for q in s.running:
        assert q.status is SequenceStatus.RUNNING
        assert q.num_computed_tokens < len(q.token_ids), f"{q.request_id}: nothing left to compute"
        assert len(q.block_table) * bm.block_size >= q.num_computed_tokens, f"{q.request_id}: KV beyond its blocks"
    for q in waiting:
        assert not q.block_table and q.num_computed_tokens == 0, f"{q.request_id}: waiting but holds KV"
    live = set(running_ids) | {q.request_id for q in waiting}
    assert live == set(s._live), "live requests are neither running nor waiting"
    owners = {q.request_id for q in bm._owners.values()}
    assert owners <= set(running_ids), "a non-running sequence owns blocks"
    res = s._reservation
    if res is not None:
        assert res.booked_blocks == sum(q.kv_booked_blocks for q in s.running), "KV bookings out of step"
        assert all(not q.kv_booked_blocks for q in waiting), "a waiting sequence holds a KV booking"
        if s.config.admission == "no-evict":
            assert res.booked_blocks <= s.config.num_blocks, "no-evict booked more blocks than the pool"
    if isinstance(s, ImplicitDecodeScheduler):
        check_implicit_invariants(s)


def check_implicit_invariants(s: ImplicitDecodeScheduler) -> None:
    running = s.running
    implicit = [q for q in running if q.implicit_from >= 0]
    assert s._explicit == [q for q in running if q.implicit_from < 0], "explicit list out of step"
    assert s._num_implicit == len(implicit), "implicit count is off"
    assert s._implicit_base == sum(len(q.token_ids) - q.implicit_from for q in implicit), "implicit sums off"
    tick = len(s._clock)
    bs = s.config.block_size
    for q in implicit:
        # Its context at the next tick fits its blocks, or its block just filled and it is
        # queued for a new one; otherwise it has an event ahead.
        next_end = len(q.token_ids) + tick - q.implicit_from
        table_end = len(q.block_table) * bs
        if q.implicit_needs_block:
            assert next_end == table_end + 1 and q in s._needs_block, f"{q.request_id}: lost its block"
        else:
            assert next_end <= table_end, f"{q.request_id}: implicit past its blocks"
            assert q.implicit_wake >= tick and q in s._wake.get(q.implicit_wake, ()), f"{q.request_id}: no wake"


def check_block_manager(bm: BlockManager, held: list[list[int]] = ()) -> None:
    """Raise AssertionError if the pool is inconsistent: a block both free and owned, a
    reference count that does not match the block tables (and the `held` lists of
    BlockManager.hold), a leaked or double-freed block, or a hash map out of step with the blocks."""
    expected = [0] * bm.num_blocks
    for blocks in held:
        for b in blocks:
            expected[b] += 1
    for seq in bm._owners.values():
        tables = [seq.block_table, *seq.group_tables]
        assert len(tables) == bm.num_groups, f"{seq.request_id}: {len(tables)} block tables for {bm.num_groups} groups"
        for g, table in enumerate(tables):
            assert len(table) == len(seq.block_table), f"{seq.request_id}: group {g}'s table is out of step"
            live = [b for b in table if b != NULL_BLOCK]
            assert table[len(table) - len(live) :] == live, f"{seq.request_id}: a freed entry after a live one"
            assert not live or bm.group_windows[g] is not None or len(live) == len(table), "a full group lost a block"
            assert len(set(live)) == len(live), f"{seq.request_id}: block twice in a table"
            unpublished = [b for b in table[seq.prefix.num_committed :] if b != NULL_BLOCK]
            assert all(bm._block_hash[b] is None for b in unpublished), (
                f"{seq.request_id}: uncommitted block has a hash"
            )
            for b in live:
                expected[b] += 1
    assert expected == bm._ref_counts, "reference counts differ from the block tables"
    free_uncached = set(bm._free_uncached)
    lru_blocks = [b for run in bm._lru for b in run]
    free_cached = set(lru_blocks)
    assert len(free_cached) == len(lru_blocks) == bm._num_free_cached, "LRU runs out of step"
    assert all(bm._run_of[b] is run for run in bm._lru for b in run), "a block's run is stale"
    assert len(free_uncached) == len(bm._free_uncached), "a block is twice in the free pool"
    assert not free_uncached & free_cached, "a block is in both free pools"
    free = free_uncached | free_cached
    for b in range(bm.num_blocks):
        owned = bm._ref_counts[b] > 0
        assert owned != (b in free), f"block {b} is {'both free and owned' if owned else 'leaked'}"
    for b in free_uncached:
        assert bm._block_hash[b] is None, f"uncached free block {b} has a hash"
    for b in free_cached:
        assert bm._block_hash[b] is not None, f"cached free block {b} has no hash"
    for h, b in bm._hash_to_block.items():
        assert bm._block_hash[b] == h, f"hash map points to block {b} holding another hash"
    num_published = sum(h is not None for h in bm._block_hash)
    assert num_published == len(bm._hash_to_block), "stale block hash"


def waiting_in_order(s: Scheduler) -> list:
    """The waiting sequences in the order they would be admitted."""
    return list(s.waiting)
