"""The paged KV cache as bookkeeping: block pool, reference counts, block tables, prefix cache.

No tensor lives here. A block is an id in [0, num_blocks); the engine maps block b, offset o to
KV slot `b * block_size + o`. Each sequence's `block_table` lists its blocks in position order.

Prefix caching (as in vLLM V1): a full block is identified by a hash chained over its tokens and
its parent block's hash, so equal hashes mean equal prefixes (up to a 64-bit hash collision, the
same trade vLLM's builtin hash makes). When a sequence's block fills and its KV is computed, the
block is published under its hash. A new sequence looks its full blocks up in order and reuses
every hit, computing only the rest. A block whose last owner is freed keeps its hash and stays
reusable ("cached free") until it is evicted to make room, least recently used first. (The
simulator's implicit decodes publish the blocks a request generates when it stops decoding
implicitly: sim/implicit_decodes.py.)

Free blocks live in two pools: never-hashed blocks (any order) are handed out first, so cached
content is evicted only when nothing else is free; cached free blocks sit in an LRU order.

The LRU is a queue of runs: the cached blocks one `free` released, table tail first. A prompt's
allocation evicts ~64 blocks from the front runs with slices and one map() over dict.pop, and a
free appends one run, instead of an OrderedDict operation per block; the simulator runs millions
of blocks through here. A prefix hit on a cached free block takes it out of its run.

KV groups (spec/kv_groups.py): a model with sliding-window layers may split its layers into
groups, each with its own block table per sequence (group 0's is `seq.block_table`, the others'
`seq.group_tables`), all drawing pages from this one pool. A windowed group's entries that fall
out of the window become NULL_BLOCK and their pages go back to the pool, published ones to the
LRU, so a later prefix hit may still reuse them. Group g > 0 publishes a block under
hash((chain hash, g)); a prefix of n blocks is a hit when every full group holds all n and every
windowed group the blocks the query at position n * block_size reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from operator import invert, itemgetter

from servelab.core.kv_groups import FULL
from servelab.core.sequence import Sequence

# Parent "hash" of a sequence's first block. Any fixed int works; it only has to be shared.
_ROOT_HASH = 0x5E4E1AB
# A windowed group's table entry whose page was freed out of the window.
NULL_BLOCK = -1


def chain_block_hashes(token_ids: list[int], block_size: int, parent: int = _ROOT_HASH) -> list[int]:
    """The prefix cache's identity of every full block of `token_ids`: hash((parent's, hash(block's
    tokens))), chained from `parent` (the root for a prompt's start). Python hashes tuples of ints
    alike in every process, so a router in another process computes the same identities."""
    # A prompt: 64 blocks for 1,024 tokens. The grouper idiom (itertools recipes) cuts the
    # tokens into block_size-tuples and hashes them in C; only the chaining runs in Python.
    out: list[int] = []
    append = out.append
    for block_hash in map(hash, zip(*[iter(token_ids)] * block_size)):
        parent = hash((parent, block_hash))
        append(parent)
    return out


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        group_windows: tuple[int | None, ...] = FULL,
    ) -> None:
        # sizes >= 1: the scheduler's config checked them when it was made (SchedulerConfig.validate)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = group_windows  # each KV group's window (None: full attention), full ones first
        self.num_groups = len(group_windows)
        # (group, window) of each windowed group: the ones free_out_of_window visits
        self.windowed = [(g, w) for g, w in enumerate(group_windows) if w is not None]

        self._ref_counts: list[int] = [0] * num_blocks
        # Published blocks, both ways: block -> hash (None: unpublished) and hash -> block. The
        # first is a list: the simulator publishes and evicts millions of blocks, and an index
        # into a list is far cheaper than a dict operation on a large, churning dict.
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        # Popping from the end hands out low ids first: easier to read in tests and traces.
        self._free_uncached: list[int] = list(range(num_blocks - 1, -1, -1))
        # Cached free blocks, least recently used first: runs of blocks, each run in LRU order.
        self._lru: deque[list[int]] = deque()
        self._run_of: list[list[int] | None] = [None] * num_blocks  # a cached free block's run
        self._num_free_cached = 0
        self._owners: dict[str, Sequence] = {}

        self.prefix_cache_hits = 0  # tokens served from the cache
        self.prefix_cache_queries = 0  # tokens looked up
        self.num_evictions = 0  # cached blocks whose content was dropped to make room

    # ---- usage figures -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no live sequence holds, cached free blocks included (they can be evicted)."""
        return len(self._free_uncached) + self._num_free_cached

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_uncached) - self._num_free_cached

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a published prefix, in use or free."""
        return len(self._hash_to_block)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks that no live sequence holds: reusable until evicted."""
        return self._num_free_cached

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache lookup -------------------------------------------------------------------

    def _update_block_hashes(self, seq: Sequence) -> None:
        """Extend seq.prefix.hashes to every full block of seq.token_ids; each block is hashed once."""
        hashes = seq.prefix.hashes
        bs = self.block_size
        num_full = len(seq.token_ids) // bs
        if len(hashes) >= num_full:
            return
        tokens = seq.token_ids
        parent = hashes[-1] if hashes else _ROOT_HASH
        start = len(hashes) * bs
        if num_full - len(hashes) == 1:  # a decode filled one block
            hashes.append(hash((parent, hash(tuple(tokens[start : start + bs])))))
            return
        hashes += chain_block_hashes(tokens[start : num_full * bs], bs, parent)

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Blocks holding the longest cached prefix of seq's tokens (no side effects).

        At least one token is left to compute: the step that computes it produces the logits to
        sample from, so a fully cached sequence still recomputes its last block.
        """
        if not self.enable_prefix_caching:
            return []
        self._update_block_hashes(seq)
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        if self.windowed:
            return self._group_hits(seq.prefix.hashes[:max_blocks])[0]
        hits: list[int] = []
        lookup = self._hash_to_block
        for h in seq.prefix.hashes[:max_blocks]:
            block = lookup.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def _first_needed(self, window: int | None, pos: int) -> int:
        """The first block a query at `pos` reads under `window` (None: the whole context)."""
        return 0 if window is None else max(0, (pos - window + 1) // self.block_size)

    def _group_hits(self, hashes: list[int]) -> list[list[int]]:
        """Per group, its blocks of the longest prefix of `hashes` that every group can serve:
        the whole prefix for a full group, the blocks the next query's window reads for a windowed
        one (NULL_BLOCK before them). Every group's list has the same length."""
        lookup = self._hash_to_block.get
        found = [list(map(lookup, hashes if g == 0 else [hash((h, g)) for h in hashes]))
                 for g in range(self.num_groups)]  # fmt: skip
        n = len(hashes)
        for g, window in enumerate(self.group_windows):
            if window is None and None in found[g][:n]:
                n = found[g].index(None)
        bs = self.block_size
        while n and any(None in found[g][self._first_needed(w, n * bs) : n] for g, w in self.windowed):
            n -= 1
        hits: list[list[int]] = []
        for g, window in enumerate(self.group_windows):
            first = self._first_needed(window, n * bs)
            hits.append([NULL_BLOCK] * first + found[g][first:n])  # type: ignore[operator]  # no None left in [first, n)
        return hits

    def _hits_of_groups(self, seq: Sequence, cached_blocks: list[int]) -> list[list[int]]:
        """Every group's share of a prefix hit whose group-0 blocks are `cached_blocks`."""
        if self.num_groups == 1:
            return [cached_blocks]
        hits = self._group_hits(seq.prefix.hashes[: len(cached_blocks)])
        if hits[0] != cached_blocks:
            raise RuntimeError(f"sequence {seq.request_id!r}: its prefix hit changed since find_cached_prefix")
        return hits

    # ---- allocation ----------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, cached_blocks: list[int], num_tokens: int) -> bool:
        """Whether `allocate(seq, cached_blocks, num_tokens)` would succeed."""
        num_new = (self.num_blocks_for(num_tokens) - len(cached_blocks)) * self.num_groups
        # A hit on a cached *free* block takes it out of the free pool too.
        refs = self._ref_counts
        hits = self._hits_of_groups(seq, cached_blocks)
        num_revived = sum(1 for table in hits for b in table if b != NULL_BLOCK and refs[b] == 0)
        return num_new + num_revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached_blocks: list[int], num_tokens: int) -> bool:
        """Give a sequence with no blocks the cached prefix `cached_blocks` (from
        find_cached_prefix) plus fresh blocks up to `num_tokens` positions. Counts the prefix-cache
        query. Returns False, changing nothing, when the pool is short."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id!r} already holds blocks")
        if not self.can_allocate(seq, cached_blocks, num_tokens):
            return False
        refs = self._ref_counts
        hits = self._hits_of_groups(seq, cached_blocks)
        # Take the hits first so that the fresh allocation below cannot evict them.
        for group_hits in hits:
            for b in group_hits:
                if b == NULL_BLOCK:
                    continue
                if refs[b] == 0:
                    self._run_of[b].remove(b)  # type: ignore[union-attr]  # out of its LRU run: a cached free block has one
                    self._num_free_cached -= 1
                refs[b] += 1
        num_fresh = self.num_blocks_for(num_tokens) - len(cached_blocks)
        table = seq.block_table
        table.extend(cached_blocks)
        table.extend(self._take_free_blocks(num_fresh))
        if len(hits) > 1:
            seq.group_tables = [group_hits + self._take_free_blocks(num_fresh) for group_hits in hits[1:]]
        seq.prefix.num_committed = len(cached_blocks)
        self._owners[seq.request_id] = seq
        if self.enable_prefix_caching:
            self.prefix_cache_queries += len(seq.token_ids)
            self.prefix_cache_hits += len(cached_blocks) * self.block_size
        return True

    def append_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to cover `num_tokens` positions. Returns False, changing nothing,
        when the pool is short."""
        table = seq.block_table
        num_new = -(-num_tokens // self.block_size) - len(table)
        if num_new <= 0:
            return True
        if self.num_groups > 1:
            return self._append_to_groups(seq, num_new)
        if num_new > len(self._free_uncached) + self._num_free_cached:
            return False
        if num_new == 1:
            # A decode step crossing into a new block (once per block_size tokens of every
            # output): _take_free_blocks(1) inlined, since a call costs as much as the work.
            if self._free_uncached:
                block = self._free_uncached.pop()
            else:  # _evict(1), inlined
                lru = self._lru
                run = lru[0]
                while not run:  # emptied by prefix hits
                    lru.popleft()
                    run = lru[0]
                block = run.pop(0)
                if not run:
                    lru.popleft()
                evicted_hash = self._block_hash[block]
                assert evicted_hash is not None  # a block in the LRU holds cached content
                del self._hash_to_block[evicted_hash]
                self._block_hash[block] = None
                self._num_free_cached -= 1
                self.num_evictions += 1
            self._ref_counts[block] = 1
            table.append(block)
        else:
            table.extend(self._take_free_blocks(num_new))
        return True

    def _append_to_groups(self, seq: Sequence, num_new: int) -> bool:
        """append_slots for a model with several KV groups: `num_new` blocks on every table."""
        if num_new * self.num_groups > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take_free_blocks(num_new))
        for table in seq.group_tables:
            table.extend(self._take_free_blocks(num_new))
        return True

    def free_out_of_window(self, seq: Sequence) -> None:
        """Release the pages of seq's windowed groups that no query from its next position
        (num_computed_tokens) on reads: those wholly before num_computed_tokens - window + 1.
        Their entries become NULL_BLOCK; published pages stay in the prefix cache's LRU."""
        pos = seq.num_computed_tokens
        for g, window in self.windowed:
            table = seq.block_table if g == 0 else seq.group_tables[g - 1]
            cut = self._first_needed(window, pos)
            if cut == 0 or cut > len(table) or table[cut - 1] == NULL_BLOCK:
                continue  # nothing out of the window, or freed already
            start = cut - 1
            while start and table[start - 1] != NULL_BLOCK:
                start -= 1
            out = table[start:cut]
            table[start:cut] = [NULL_BLOCK] * len(out)
            self._append_run(self._drop_refs(out))  # oldest first: evicted first

    def append_block_each(self, seqs: Collection[Sequence]) -> bool:
        """One more block at the end of each of `seqs`' tables, handed out in their order exactly as
        append_slots would one by one (decodes crossing into a new block in the same step). Returns
        False, changing nothing, when the pool is short for all of them. One KV group only (the
        simulator's implicit decodes, which windowed models do not take)."""
        assert self.num_groups == 1, "append_block_each grows group 0's tables only"
        if len(seqs) > len(self._free_uncached) + self._num_free_cached:
            return False
        for seq, block in zip(seqs, self._take_free_blocks(len(seqs))):
            seq.block_table.append(block)
        return True

    def _take_free_blocks(self, count: int) -> list[int]:
        """`count` free blocks (the caller checked there are enough): never-hashed ones first, from
        the end of their list, then cached ones from the LRU end, dropping their content. One call
        per allocation rather than per block: a 1,024-token prompt takes 64 at once."""
        if count <= 0:
            return []
        uncached = self._free_uncached
        num_uncached = min(count, len(uncached))
        blocks = uncached[len(uncached) - num_uncached :]
        blocks.reverse()  # the order pop() would hand them out
        del uncached[len(uncached) - num_uncached :]
        if count > num_uncached:
            blocks += self._evict(count - num_uncached)
        refs = self._ref_counts
        for block in blocks:
            refs[block] = 1
        return blocks

    def _evict(self, count: int) -> list[int]:
        """Drop the content of the `count` least recently used cached free blocks (the caller
        checked there are enough) and return them."""
        lru = self._lru
        evicted: list[int] = []
        while len(evicted) < count:
            run = lru[0]
            take = count - len(evicted)
            if take >= len(run):
                evicted += run
                lru.popleft()
            else:
                evicted += run[:take]
                del run[:take]
        block_hash = self._block_hash
        hashes = _gather(block_hash, evicted)
        for b in evicted:
            block_hash[b] = None
        list(map(self._hash_to_block.pop, hashes))
        self._num_free_cached -= count
        self.num_evictions += count
        return evicted

    def commit_computed_blocks(self, seq: Sequence) -> None:
        """Publish seq's blocks that are full and computed, generated tokens included, so that a
        later request with the same prefix, or this one after preemption, reuses them."""
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        start = seq.prefix.num_committed
        if num_full <= start:
            return
        if num_full - start == 1:  # a decode filled one block: the common call
            end = num_full * bs
            self.commit_next_block(seq, hash(tuple(seq.token_ids[end - bs : end])))
            return
        seq.prefix.num_committed = num_full
        if not self.enable_prefix_caching:
            return
        self._update_block_hashes(seq)
        hashes = seq.prefix.hashes
        table = seq.block_table
        block_hash = self._block_hash
        # Blocks past prefix.num_committed were taken fresh (no hash) and only their one owner
        # can publish them (tests/scheduler_checks.py asserts it), so publishing is just recording the
        # pairs. Two sequences can compute the same prefix in the same step; the first published
        # copy wins and the duplicate stays private (freed uncached). setdefault publishes a hash
        # unless a block holds it already and returns the holder: one dict operation per block.
        new_hashes = hashes[start:num_full]
        new_blocks = table[start:num_full]
        holders = list(map(self._hash_to_block.setdefault, new_hashes, new_blocks))
        if holders == new_blocks:  # all published here: record them in one C pass
            list(map(block_hash.__setitem__, new_blocks, new_hashes))
        else:
            for block, h, holder in zip(new_blocks, new_hashes, holders):
                if holder == block:  # else another copy of this prefix was published first
                    block_hash[block] = h
        if seq.group_tables:
            self._publish_groups(seq, start, num_full)

    def commit_unreachable_blocks(self, seq: Sequence) -> None:
        """commit_computed_blocks for a finishing sequence (before its free()) whose blocks past
        the committed ones no lookup can reach (the simulator's requests with prompt tokens of
        their own, whose blocks hash like no other request's): each is published under a key of
        its own, -1 - its id, a value no chain hash takes barring a 64-bit coincidence, with no
        hash computed; free() then files it with the cached blocks, to be evicted in LRU order
        like any published block."""
        num_full = seq.num_computed_tokens // self.block_size
        start = seq.prefix.num_committed
        if num_full <= start:
            return
        seq.prefix.num_committed = num_full
        if not self.enable_prefix_caching:
            return
        blocks = seq.block_table[start:num_full]
        keys = list(map(invert, blocks))
        self._hash_to_block.update(zip(keys, blocks))
        list(map(self._block_hash.__setitem__, blocks, keys))

    def commit_next_block(self, seq: Sequence, tokens_hash: int) -> None:
        """Publish seq's next full block, whose tokens hash to `tokens_hash` (the hash of their
        tuple): commit_computed_blocks for one block, and for a caller that does not hold the
        tokens in `seq.token_ids` yet (the scheduler's implicit decodes). A block hashed before
        (this sequence was preempted and recomputed) keeps its hash."""
        index = seq.prefix.num_committed
        seq.prefix.num_committed = index + 1
        if not self.enable_prefix_caching:
            return
        hashes = seq.prefix.hashes
        if len(hashes) == index:
            hashes.append(hash((hashes[-1] if index else _ROOT_HASH, tokens_hash)))
        h = hashes[index]
        block = seq.block_table[index]
        if self._hash_to_block.setdefault(h, block) == block:
            self._block_hash[block] = h
        if seq.group_tables:
            self._publish_groups(seq, index, index + 1)

    def _publish_groups(self, seq: Sequence, start: int, end: int) -> None:
        """commit_computed_blocks for blocks [start, end) of groups 1..: each under
        hash((the block's chain hash, its group))."""
        hashes = seq.prefix.hashes
        block_hash = self._block_hash
        publish = self._hash_to_block.setdefault
        for g, table in enumerate(seq.group_tables, 1):
            for j in range(start, end):
                block = table[j]
                if block != NULL_BLOCK:
                    h = hash((hashes[j], g))
                    if publish(h, block) == block:
                        block_hash[block] = h

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Cached blocks stay reusable; the table's tail goes to the LRU
        end first, so a chain is evicted from its tail and its shared head survives longest."""
        if self._owners.pop(seq.request_id, None) is None:
            if seq.block_table:
                raise RuntimeError(f"sequence {seq.request_id!r} holds blocks this manager did not give")
            return
        self._free_table(seq.block_table)
        if seq.group_tables:
            for table in seq.group_tables:
                self._free_table(table)
            seq.group_tables = []
        seq.prefix.num_committed = 0

    def _free_table(self, table: list[int]) -> None:
        """free() for one of seq's block tables, which it empties."""
        if table and table[0] == NULL_BLOCK:  # a windowed group's: its freed pages lead the table
            del table[: table.count(NULL_BLOCK)]
        refs = self._ref_counts
        block_hash = self._block_hash
        free_uncached = self._free_uncached
        tail_first = table[::-1]
        hashes = _gather(block_hash, tail_first)
        unpublished = hashes.count(None)
        only_tail_unpublished = unpublished == 0 or (unpublished == 1 and hashes[0] is None)
        if only_tail_unpublished and _gather(refs, table).count(1) == len(table):
            # The common case, in C-level passes: no block shared, all published but perhaps the
            # partly filled last one (the head of tail_first).
            for block in table:
                refs[block] = 0
            if unpublished:
                free_uncached.append(tail_first[0])
                run = tail_first[1:]
            else:
                run = tail_first
        else:
            run = self._drop_refs(tail_first)
        self._append_run(run)
        table.clear()

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back seq's blocks past the first `num_tokens` positions (KV of rejected
        speculative tokens: never published, so they go straight to the free pool)."""
        keep = -(-num_tokens // self.block_size)
        for table in (seq.block_table, *seq.group_tables):
            if len(table) > keep:  # a tail past the computed tokens: never out of a window
                self._append_run(self._drop_refs(table[keep:][::-1]))
                del table[keep:]

    def _drop_refs(self, tail_first: list[int]) -> list[int]:
        """One reference less on each block; the ones nobody holds any more go back to the free
        pools: unpublished ones at once, published ones returned as a run for the LRU."""
        refs = self._ref_counts
        block_hash = self._block_hash
        run = []
        for block in tail_first:
            ref = refs[block] - 1
            refs[block] = ref
            if ref == 0:
                if block_hash[block] is not None:
                    run.append(block)
                else:
                    self._free_uncached.append(block)
        return run

    def _append_run(self, run: list[int]) -> None:
        if run:
            run_of = self._run_of
            for block in run:
                run_of[block] = run
            self._lru.append(run)
            self._num_free_cached += len(run)

    # ---- blocks outside a sequence's life (disaggregated prefill/decode) ------------------------

    def hold(self, seq: Sequence) -> list[int]:
        """One more reference on each of seq's blocks, so that they outlive seq's own free(): a
        prefill worker holds a finished prefill's KV until it has been sent. Returns the blocks,
        to give to release()."""
        if self.windowed:  # a prefill's KV is sent as whole blocks of one table (cluster/kv_transfer.py)
            raise RuntimeError("holding blocks for transfer needs a model without sliding-window layers")
        refs = self._ref_counts
        for block in seq.block_table:
            refs[block] += 1
        return list(seq.block_table)

    def release(self, held: list[int]) -> None:
        """Drop a hold() (once); published blocks stay in the prefix cache."""
        self._append_run(self._drop_refs(held[::-1]))

    def reserve(self, seq: Sequence, cached_blocks: list[int], num_tokens: int) -> bool:
        """allocate() for KV that will be written from outside (received from a prefill worker),
        not computed here: the prefix-cache hit figures are left alone. False, changing nothing,
        when the pool is short."""
        queries, hits = self.prefix_cache_queries, self.prefix_cache_hits
        ok = self.allocate(seq, cached_blocks, num_tokens)
        self.prefix_cache_queries, self.prefix_cache_hits = queries, hits
        return ok

    # ---- checks --------------------------------------------------------------------------------


def _gather(values: list, indices: list[int]) -> tuple:
    """values[i] for each i, as a tuple, in one C call (itemgetter returns a bare value for one
    index and cannot take none)."""
    if len(indices) > 1:
        return itemgetter(*indices)(values)
    return tuple(values[i] for i in indices)
