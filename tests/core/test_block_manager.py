"""BlockManager: pool accounting, block tables, the hash-chained prefix cache and LRU eviction."""

from __future__ import annotations

import pytest

from servelab.core.block_manager import BlockManager
from servelab.core.sequence import SamplingParams, Sequence
from tests.scheduler_checks import check_block_manager


def seq(rid: str, tokens: list[int]) -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=8))


def admit(bm: BlockManager, s: Sequence, num_tokens: int | None = None) -> int:
    """Allocate like the scheduler does; mark everything computed and publish full blocks.
    Returns the number of tokens served from the cache."""
    hits = bm.find_cached_prefix(s)
    num_tokens = len(s.token_ids) if num_tokens is None else num_tokens
    assert bm.allocate(s, hits, num_tokens)
    s.num_computed_tokens = num_tokens
    bm.commit_computed_blocks(s)
    return len(hits) * bm.block_size


def test_allocate_and_free_return_the_pool_whole():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", range(10))  # 3 blocks
    admit(bm, a)
    assert len(a.block_table) == 3
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.usage) == (3, 5, 3 / 8)
    assert bm.append_slots(a, 13)  # a 4th block for position 12
    assert len(a.block_table) == 4 and bm.num_used_blocks == 4
    assert bm.append_slots(a, 16)  # still inside block 4
    assert len(a.block_table) == 4
    check_block_manager(bm)
    bm.free(a)
    assert a.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0
    check_block_manager(bm)


def test_short_pool_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a, b = seq("a", range(12)), seq("b", range(100, 108))
    admit(bm, a)  # 3 of 4 blocks
    assert not bm.can_allocate(b, [], 8)
    assert not bm.allocate(b, [], 8)
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert not bm.append_slots(a, 20)  # needs 2 more blocks, 1 free
    assert len(a.block_table) == 3 and bm.num_free_blocks == 1
    check_block_manager(bm)


def test_second_request_sharing_a_1000_token_prefix_computes_only_its_suffix():
    bm = BlockManager(num_blocks=400, block_size=8)  # 1,000 = 125 full blocks
    prefix = list(range(1000, 2000))
    a = seq("a", prefix + list(range(50)))
    assert admit(bm, a) == 0
    b = seq("b", prefix + list(range(500, 530)))
    assert admit(bm, b) == 1000  # computes only its own 30 tokens
    assert b.block_table[:125] == a.block_table[:125]  # shared, not copied
    assert len(set(b.block_table[125:]) & set(a.block_table)) == 0
    assert bm.prefix_cache_hits == 1000
    assert bm.prefix_cache_queries == 1050 + 1030
    check_block_manager(bm)


def test_default_block_size_shares_every_full_block_of_the_prefix():
    bm = BlockManager(num_blocks=200)
    prefix = list(range(1000, 2000))
    admit(bm, seq("a", prefix + [1, 2, 3]))
    # 1,000 = 62 full blocks of 16 + 8 tokens: the partial block is recomputed.
    assert admit(bm, seq("b", prefix + [7, 8, 9])) == 62 * 16


def test_hash_is_chained_over_the_parent_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit(bm, seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Same second block, different first block: no hit on either.
    assert admit(bm, seq("b", [9, 9, 9, 9, 5, 6, 7, 8, 0])) == 0
    assert admit(bm, seq("c", [1, 2, 3, 4, 9, 9, 9, 9, 0])) == 4


def test_a_fully_cached_prompt_still_computes_its_last_block():
    bm = BlockManager(num_blocks=16, block_size=4)
    admit(bm, seq("a", range(8)))
    again = seq("b", range(8))
    assert len(bm.find_cached_prefix(again)) == 1  # one token must be computed to sample from
    assert admit(bm, again) == 4


def test_cached_blocks_survive_their_first_owner():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq("a", range(17))
    admit(bm, a)
    shared = a.block_table[:4]
    bm.free(a)
    assert bm.num_free_blocks == 16 and bm.num_cached_blocks == 4 and bm.num_evictable_blocks == 4
    b = seq("b", list(range(16)) + [99, 98])
    assert admit(bm, b) == 16
    assert b.block_table[:4] == shared
    assert bm.num_evictable_blocks == 0  # revived: held again
    check_block_manager(bm)


def test_never_cached_blocks_go_first_and_cached_ones_are_evicted_lru():
    bm = BlockManager(num_blocks=10, block_size=4)
    x, y, z = seq("x", range(9)), seq("y", range(100, 109)), seq("z", range(200, 209))
    for s in (x, y, z):  # 2 full blocks + 1 partial each
        admit(bm, s)
    for s in (x, y, z):  # freed in this order: x is least recently used
        bm.free(s)
    assert bm.num_cached_blocks == 6
    # 4 never-hashed blocks are handed out before any cached content is dropped.
    filler = seq("f", range(500, 516))
    admit(bm, filler)
    assert bm.num_evictions == 0 and len(bm.find_cached_prefix(seq("x1", range(9)))) == 2
    # Two more blocks evict x's chain (tail first), and nothing of y or z.
    more = seq("g", range(600, 608))
    assert bm.allocate(more, [], 8)
    assert bm.num_evictions == 2
    assert bm.find_cached_prefix(seq("x2", range(9))) == []
    assert len(bm.find_cached_prefix(seq("y2", range(100, 109)))) == 2
    assert len(bm.find_cached_prefix(seq("z2", range(200, 209)))) == 2
    check_block_manager(bm)


def test_a_hit_refreshes_a_block_in_lru_order():
    bm = BlockManager(num_blocks=4, block_size=4)
    x, y = seq("x", range(5)), seq("y", range(100, 105))
    admit(bm, x)
    admit(bm, y)
    bm.free(x)
    bm.free(y)  # LRU order now: x's block, then y's
    reuse = seq("x-again", range(6))
    assert admit(bm, reuse) == 4  # x's block is used again ...
    bm.free(reuse)  # ... and goes back behind y's
    pressure = seq("p", range(900, 908))
    assert bm.allocate(pressure, [], 8)  # 2 uncached blocks exist; 0 evictions
    assert bm.allocate(seq("q", range(950, 954)), [], 4)  # now the LRU cached block goes: y's
    assert bm.find_cached_prefix(seq("y2", range(100, 105))) == []
    assert len(bm.find_cached_prefix(seq("x3", range(5)))) == 1
    check_block_manager(bm)


def test_generated_tokens_fill_cacheable_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq("a", [1, 2, 3])
    admit(bm, a)
    a.token_ids.extend([4, 5])  # two sampled tokens
    assert bm.append_slots(a, 5)
    a.num_computed_tokens = 5
    bm.commit_computed_blocks(a)
    assert bm.num_cached_blocks == 1  # [1, 2, 3, 4] was made partly of output and is cached
    assert admit(bm, seq("b", [1, 2, 3, 4, 9])) == 4


def test_duplicate_content_computed_twice_stays_private():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = seq("a", range(5)), seq("b", range(5))
    assert bm.allocate(a, [], 5) and bm.allocate(b, [], 5)  # same step: neither hits
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.commit_computed_blocks(s)
    assert bm.num_cached_blocks == 1
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 1
    check_block_manager(bm)


def test_without_prefix_caching_nothing_is_shared_or_counted():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    admit(bm, seq("a", range(9)))
    assert admit(bm, seq("b", range(9))) == 0
    assert (bm.num_cached_blocks, bm.prefix_cache_hits, bm.prefix_cache_queries) == (0, 0, 0)


def test_check_invariants_catches_a_block_both_free_and_owned():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = seq("a", range(4))
    admit(bm, a)
    bm._free_uncached.append(a.block_table[0])  # corrupt on purpose
    with pytest.raises(AssertionError, match="free"):
        check_block_manager(bm)


def test_check_invariants_catches_a_leaked_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm._free_uncached.pop()  # a block nobody owns and nobody can allocate
    with pytest.raises(AssertionError, match="leaked"):
        check_block_manager(bm)


def test_block_hashes_are_the_same_one_block_at_a_time_or_all_at_once():
    """A decode hashes one block when it fills, a prompt all its blocks at once: the chains agree."""
    bm = BlockManager(num_blocks=64, block_size=4)
    tokens = list(range(100, 141))  # 10 full blocks and one token
    whole = seq("whole", tokens)
    bm.find_cached_prefix(whole)
    grown = seq("grown", tokens[:3])
    for t in tokens[3:]:
        grown.token_ids.append(t)
        bm.find_cached_prefix(grown)
    assert len(whole.prefix.hashes) == 10 and len(set(whole.prefix.hashes)) == 10
    assert grown.prefix.hashes == whole.prefix.hashes
    other = seq("other", tokens[:20] + [7] + tokens[21:])  # differs in block 5 only
    bm.find_cached_prefix(other)
    assert other.prefix.hashes[:5] == whole.prefix.hashes[:5]
    assert not set(other.prefix.hashes[5:]) & set(whole.prefix.hashes)


def _pool_with_cached_and_uncached_free_blocks() -> tuple[BlockManager, list[Sequence]]:
    """A pool whose free blocks are 1 never-hashed block and 6 cached ones in 3 LRU runs, and
    four running sequences, each with its last block full."""
    bm = BlockManager(num_blocks=15, block_size=4)
    for i, rid in enumerate("xyz"):
        s = seq(rid, range(100 * i, 100 * i + 9))  # 2 full blocks + 1 partial
        admit(bm, s)
        bm.free(s)
    running = [seq(f"r{i}", range(1000 + 10 * i, 1000 + 10 * i + 8)) for i in range(4)]
    for s in running:
        admit(bm, s)
    return bm, running


@pytest.mark.parametrize("count", [1, 3, 4])
def test_one_block_each_is_what_append_slots_gives_one_by_one(count):
    together, a = _pool_with_cached_and_uncached_free_blocks()
    apart, b = _pool_with_cached_and_uncached_free_blocks()
    assert together.append_block_each(a[:count])
    for s in b[:count]:
        assert apart.append_slots(s, len(s.block_table) * 4 + 1)
    assert [s.block_table for s in a] == [s.block_table for s in b]
    assert together.num_evictions == apart.num_evictions == count - 1
    for name in ("_free_uncached", "_ref_counts", "_block_hash", "_hash_to_block"):
        assert getattr(together, name) == getattr(apart, name), name
    assert [list(run) for run in together._lru] == [list(run) for run in apart._lru]
    check_block_manager(together)


def test_one_block_each_changes_nothing_when_the_pool_is_short():
    bm, running = _pool_with_cached_and_uncached_free_blocks()
    filler = seq("f", range(5000, 5000 + 4 * bm.num_free_blocks - 8))
    admit(bm, filler)  # leaves 2 free
    tables = [list(s.block_table) for s in running]
    assert not bm.append_block_each(running[:3])
    assert [s.block_table for s in running] == tables and bm.num_free_blocks == 2
    assert bm.append_block_each(running[:2]) and bm.num_free_blocks == 0
    check_block_manager(bm)
