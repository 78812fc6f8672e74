"""KV groups (spec/kv_groups.py, core/kv_groups.py): sliding-window layers free the pages that
leave the window, and the prefix cache stays correct when windowed and full layers share the pool."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from servelab.core.block_manager import NULL_BLOCK, BlockManager
from servelab.core.config import ADMISSIONS, POLICIES, SchedulerConfig
from servelab.core.kv_groups import max_context_tokens, pages_for
from servelab.core.scheduler import Scheduler
from servelab.core.sequence import SamplingParams, Sequence
from servelab.spec.kv_groups import KVGroups
from tests.driver import run_to_completion
from tests.fake_executor import FakeExecutor
from tests.scheduler_checks import check_block_manager, check_invariants

GEMMA2 = (None, 8)  # alternating local and global layers: a full group and a windowed one
GEMMA3 = (None, 8, 8, 8, 8, 8)  # five local layers, then one global
MISTRAL = (8,)  # every layer windowed: one group


def seq(rid: str, prompt: list[int], max_tokens: int, arrival_s: float = 0.0) -> Sequence:
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=arrival_s)


def live(table: list[int]) -> list[int]:
    return [b for b in table if b != NULL_BLOCK]


def test_layers_are_grouped_by_window_in_groups_of_the_rarest_kinds_count():
    gemma2 = KVGroups.from_layer_windows([8, None] * 3)
    assert gemma2.windows == GEMMA2 and gemma2.slots_per_page == 3
    assert gemma2.layer_group == (1, 0, 1, 0, 1, 0) and gemma2.layer_slot == (0, 0, 1, 1, 2, 2)
    # 10 local layers in groups of 2 (the 2 global layers' count): 5 windowed groups, no padding
    gemma3 = KVGroups.from_layer_windows([8, 8, 8, 8, 8, None] * 2)
    assert gemma3.windows == GEMMA3 and gemma3.slots_per_page == 2
    assert gemma3.layer_group[5] == gemma3.layer_group[11] == 0
    # 26 layers, global every 6th (Gemma 3 1B): 22 local layers in 6 groups of 4, the last padded
    g3_1b = KVGroups.from_layer_windows([None if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert g3_1b.num_groups == 7 and g3_1b.slots_per_page == 4
    assert max(g3_1b.layer_slot) == 3 and g3_1b.layer_group.count(6) == 2
    # one kind of layer: one group of every layer, as a cache without groups lays them out
    for one in (KVGroups.from_layer_windows([8] * 4), KVGroups.from_layer_windows([None] * 5)):
        assert one.num_groups == 1 and one.slots_per_page == len(one.layer_slot)
        assert one.layer_slot == tuple(range(len(one.layer_slot)))


def test_capacity_counts_a_windowed_groups_pages_up_to_its_window():
    bs = 4
    # a decode holds every full block and ceil(8 / 4) + 1 = 3 windowed ones
    assert pages_for(GEMMA2, 400, bs) == 100 + 3
    assert pages_for(GEMMA2, 8, bs) == 2 + 2  # shorter than the window: every block
    # a step writing a 16-token chunk reads the 7 positions before it too: 23 span up to 7 blocks
    assert pages_for(GEMMA2, 400, bs, chunk_tokens=16) == 100 + 7
    # the longest lone sequence: 200 pages hold 197 full blocks beside 3 windowed ones
    assert max_context_tokens(GEMMA2, 200, bs, 1) == 197 * bs
    assert max_context_tokens(GEMMA2, 200, bs, None) == 100 * bs  # a whole context in one step: both groups
    assert max_context_tokens(MISTRAL, 10, bs, 16) is None  # every layer windowed: no length too long
    assert max_context_tokens((None,), 200, bs, 16) == 800  # a plain model: the pool


def test_a_long_decode_holds_at_most_the_windows_pages_and_publishes_what_it_frees():
    bs, window = 4, 8
    bm = BlockManager(64, bs, group_windows=GEMMA2)
    s = seq("a", list(range(10)), 200)
    assert bm.allocate(s, [], 10)
    s.num_computed_tokens = 10
    bm.commit_computed_blocks(s)
    bm.free_out_of_window(s)
    for t in range(100):  # 100 decodes
        s.token_ids.append(1000 + t)
        assert bm.append_slots(s, len(s.token_ids))
        s.num_computed_tokens = len(s.token_ids)
        bm.commit_computed_blocks(s)
        bm.free_out_of_window(s)
        check_block_manager(bm)
        windowed = live(s.group_tables[0])
        assert len(windowed) <= -(-window // bs) + 1
        assert len(s.block_table) == len(s.group_tables[0]) == len(live(s.block_table))  # full: every block
    assert bm.num_used_blocks == len(s.block_table) + len(live(s.group_tables[0]))
    assert bm.num_evictable_blocks == len(s.block_table) - len(live(s.group_tables[0]))  # freed, still cached
    bm.free(s)
    check_block_manager(bm)
    assert bm.num_used_blocks == 0


def test_a_shared_prefix_hits_in_every_group_though_its_windowed_pages_left_the_window():
    bs = 4
    bm = BlockManager(64, bs, group_windows=GEMMA2)
    prompt = list(range(40))
    a = seq("a", prompt + [7], 1)
    assert bm.allocate(a, bm.find_cached_prefix(a), 41)
    a.num_computed_tokens = 41
    bm.commit_computed_blocks(a)
    bm.free_out_of_window(a)
    assert a.group_tables[0][:8] == [NULL_BLOCK] * 8  # positions < 41 - 8 + 1 = 34: blocks 0-7
    b = seq("b", prompt + [9, 9], 1)
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:10]  # 40 tokens: every full block of the prefix
    assert bm.allocate(b, hits, 42)
    check_block_manager(bm)
    # the windowed group reads from position 40 - 8 + 1 = 33 on: blocks 8 and 9, shared with a
    assert b.group_tables[0][:8] == [NULL_BLOCK] * 8 and b.group_tables[0][8:10] == a.group_tables[0][8:10]
    assert bm.prefix_cache_hits == 40


def test_a_prefix_whose_windowed_pages_were_evicted_hits_only_as_far_as_the_window_allows():
    bs = 4
    bm = BlockManager(24, bs, group_windows=GEMMA2)
    a = seq("a", list(range(40)) + [7], 1)
    assert bm.allocate(a, [], 41)
    a.num_computed_tokens = 41
    bm.commit_computed_blocks(a)
    bm.free_out_of_window(a)
    windowed_freed = [b for b in bm._lru[-1]]
    bm.free(a)
    # a new allocation evicts the LRU's oldest pages: the first run, a's out-of-window ones
    filler = seq("f", [5000 + i for i in range(4 * len(windowed_freed) // 2 - 1)], 1)
    assert bm.allocate(filler, [], len(filler.token_ids))
    assert all(bm._block_hash[b] is None for b in windowed_freed[:4])
    b = seq("b", list(range(40)) + [9, 9], 1)
    hits = bm.find_cached_prefix(b)
    # the full group holds all 10 blocks, the windowed one lost blocks 0-3: a hit of n blocks needs
    # windowed blocks (4n - 7) // 4 .. n - 1, all present from n = 6 on, up to 10
    assert 0 < len(hits) <= 10
    first_needed = max(0, (len(hits) * bs - 8 + 1) // bs)
    assert all(bm._hash_to_block.get(hash((h, 1))) is not None for h in b.prefix.hashes[first_needed : len(hits)])
    assert bm.allocate(b, hits, 42)
    check_block_manager(bm)
    assert all(x != NULL_BLOCK for x in b.group_tables[0][first_needed:])


def test_without_a_full_group_a_hit_needs_only_the_windows_blocks():
    bs = 4
    bm = BlockManager(32, bs, group_windows=MISTRAL)
    a = seq("a", list(range(40)) + [7], 1)
    assert bm.allocate(a, [], 41)
    a.num_computed_tokens = 41
    bm.commit_computed_blocks(a)
    bm.free_out_of_window(a)
    assert a.block_table[:8] == [NULL_BLOCK] * 8 and bm.num_used_blocks == 3
    b = seq("b", list(range(40)) + [9, 9], 1)
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 10 and hits[:8] == [NULL_BLOCK] * 8 and hits[8:] == a.block_table[8:10]
    assert bm.allocate(b, hits, 42)
    check_block_manager(bm)
    bm.free(a)
    bm.free(b)
    check_block_manager(bm)
    assert bm.num_used_blocks == 0


def test_speculative_trim_gives_back_every_groups_tail():
    bm = BlockManager(32, 4, group_windows=GEMMA2)
    s = seq("a", list(range(10)), 10)
    assert bm.allocate(s, [], 10)
    assert bm.append_slots(s, 18)  # room for drafts
    assert len(s.block_table) == len(s.group_tables[0]) == 5 and bm.num_used_blocks == 10
    bm.trim(s, 11)
    assert len(s.block_table) == len(s.group_tables[0]) == 3 and bm.num_used_blocks == 6
    check_block_manager(bm)


def test_a_windowed_models_pool_runs_more_long_sequences_at_once():
    """At the same memory (a Gemma 2 page holds half the layers: twice the pages), 7 sequences of
    12 + 180 tokens: 48 blocks each of every layer overflow 200 blocks, and preempt; 48 full pages
    and 3 windowed ones each fit 400 pages, and none is preempted."""

    def preemptions(windows: tuple[int | None, ...], num_blocks: int) -> int:
        s = Scheduler(
            SchedulerConfig(num_blocks=num_blocks, block_size=4, max_model_len=512).resolve(kv_group_windows=windows)
        )
        seqs = [seq(f"r{i}", [100 * i + j for j in range(12)], 180) for i in range(7)]
        done = run_to_completion(s, FakeExecutor(), seqs, on_step=lambda *_: check_invariants(s), max_steps=50_000)
        assert len(done) == 7 and s.block_manager.num_used_blocks == 0
        return s.num_preemptions

    assert preemptions((None,), 200) > 0
    assert preemptions(GEMMA2, 400) == 0


request = st.tuples(st.integers(1, 50), st.integers(1, 60), st.sampled_from([0.0, 0.0, 0.002]), st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=14),
    groups=st.sampled_from([GEMMA2, GEMMA3, MISTRAL]),
    policy=st.sampled_from(POLICIES),
    admission=st.sampled_from(ADMISSIONS),
    num_blocks=st.integers(24, 70),
    budget=st.integers(8, 64),
    abort_every=st.sampled_from([0, 0, 7]),
)
def test_windowed_groups_leak_nothing_across_preemption_prefix_hits_and_aborts(
    requests, groups, policy, admission, num_blocks, budget, abort_every
):
    bs = 4
    cfg = SchedulerConfig(
        num_blocks=num_blocks, block_size=bs, max_model_len=100, policy=policy, admission=admission,
        max_num_batched_tokens=budget, max_num_seqs=8,
    ).resolve(kv_group_windows=groups)  # fmt: skip
    s = Scheduler(cfg)
    shared = list(range(30))  # a prefix half the requests share: prefix hits
    seqs = [
        seq(f"r{i}", (shared[:p] + [900 + i] * max(0, p - 30)) if share else [100 * i + j for j in range(p)], o, t)
        for i, (p, o, t, share) in enumerate(requests)
    ]
    rejected, aborted = [], []
    steps = 0

    def on_step(plan, result, outputs):  # noqa: ANN001, ANN202
        nonlocal steps
        steps += 1
        check_invariants(s)
        if admission == "no-evict":  # bookings in pages, a windowed group's bounded by its window
            assert not plan.preempted
        chunk = max((e.num_tokens for e in plan.scheduled), default=1)
        for q in s.running:
            for g, w in s.block_manager.windowed:
                table = q.block_table if g == 0 else q.group_tables[g - 1]
                assert len(live(table)) <= -(-(w - 1 + max(chunk, len(q.token_ids))) // bs) + 1
                # after the step: only the blocks the next query's window reads, and the ones ahead
                first = max(0, (q.num_computed_tokens - w + 1) // bs)
                assert table[:first] == [NULL_BLOCK] * first
        if abort_every and steps % abort_every == 0 and s.running:
            victim = s.running[-1]
            aborted.append(victim.request_id)
            s.abort(victim.request_id)

    done = run_to_completion(
        s, FakeExecutor(), seqs, on_step=on_step, on_reject=lambda q, err: rejected.append(q.request_id),
        max_steps=20_000,
    )  # fmt: skip
    assert len(done) + len(rejected) == len(seqs)
    # to max_tokens, or to the longest context the pool holds for one sequence
    assert all(len(q.token_ids) == s.length_limit(q) for q in done if q.request_id not in aborted)
    check_block_manager(s.block_manager)
    assert s.block_manager.num_used_blocks == 0 and not s.running and not s.waiting


def test_a_prompt_longer_than_every_groups_share_of_the_pool_is_refused_by_name():
    from servelab.errors import RequestTooLong

    cfg = SchedulerConfig(num_blocks=20, block_size=4, max_model_len=400).resolve(kv_group_windows=GEMMA2)
    s = Scheduler(cfg)
    assert cfg.kv_capacity_tokens == 40
    with pytest.raises(RequestTooLong, match="pool of 40 tokens .20 blocks x 4, shared by 2 KV groups"):
        s.add(seq("a", list(range(41)), 4))
