"""The hand-off of a prefilled request between two engines, in one process: the block manager's
hold/release/reserve, the scheduler's prefilled admission, the engine hooks and the cache's
export/import. The same steps cluster/disagg_worker.py runs around a point-to-point transfer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.core.block_manager import BlockManager
from servelab.core.sequence import SamplingParams, Sequence
from servelab.errors import RequestTooLong
from tests.scheduler_checks import check_block_manager

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40), st.sampled_from(["free", "hold", "release"])),
                min_size=1, max_size=40))  # fmt: skip
def test_held_blocks_are_never_handed_out_and_all_come_back(ops):
    """Sequences (four shared prefixes) allocate, get held, freed and released in any order: the
    pool stays consistent, a held block is never given to anyone else, and releasing every hold
    after freeing every sequence returns the whole pool."""
    bm = BlockManager(num_blocks=24, block_size=4)
    live: list[Sequence] = []
    held: list[list[int]] = []
    for i, (prefix, length, op) in enumerate(ops):
        s = Sequence(str(i), [prefix * 1000 + t for t in range(length)], SamplingParams())
        hits = bm.find_cached_prefix(s)
        if bm.allocate(s, hits, length):
            assert not {b for h in held for b in h} & set(s.block_table[len(hits) :])
            s.num_computed_tokens = length
            bm.commit_computed_blocks(s)
            live.append(s)
        if op == "hold" and live:
            held.append(bm.hold(live[-1]))
        elif op == "free" and live:
            bm.free(live.pop(0))
        elif op == "release" and held:
            bm.release(held.pop(0))
        check_block_manager(bm, held)
    for s in live:
        bm.free(s)
    for h in held:
        bm.release(h)
    check_block_manager(bm)
    assert bm.num_free_blocks == bm.num_blocks


def _run(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def _prefill(engine, rid: str, prompt: list[int], params: SamplingParams):
    """Runs rid's prompt on `engine` until its first token; returns (first token, held blocks)."""
    engine.add_request(rid, prompt, params)
    while True:
        for o in engine.step():
            if o.request_id == rid:
                assert not o.finished and o.new_token_ids
                return o.new_token_ids[0], engine.detach_prefilled(rid)


def _copy_kv(src, held: list[int], dst, blocks: list[int], granularity: str) -> None:
    if granularity == "layer":
        src_slots, dst_slots = src.block_slots(held), dst.block_slots(blocks)
        for layer in range(src.num_layers):
            dst.import_layer(layer, dst_slots, src.export_layer(layer, src_slots))
    else:
        for a, b in zip(held, blocks, strict=True):
            dst.import_block(b, src.export_block(a))


PROMPTS = [
    [5, 17, 42, 9, 300, 7, 88] * 6,  # 42 tokens: 2 full blocks of 16 and a partial one
    [11, 12, 13],
    [5, 17, 42, 9, 300, 7, 88] * 5 + [1, 2, 3],  # shares 2 blocks with the first: found in the decode cache
]


@pytest.mark.parametrize(("kv_dtype", "granularity"), [("auto", "layer"), ("float16", "block"), ("float16", "layer")])
def test_a_handed_off_request_decodes_as_if_prefilled_locally(tiny_engine_factory, kv_dtype, granularity):
    single = tiny_engine_factory(kv_cache_dtype=kv_dtype, num_blocks=32)
    for i, p in enumerate(PROMPTS):
        single.add_request(str(i), p, GREEDY)
    want = _run(single)

    prefill = tiny_engine_factory(kv_cache_dtype=kv_dtype, num_blocks=32)
    decode = tiny_engine_factory(kv_cache_dtype=kv_dtype, num_blocks=32)
    got: dict[str, list[int]] = {}
    sent_blocks = []
    for i, prompt in enumerate(PROMPTS):
        first, held = _prefill(prefill, str(i), prompt, GREEDY)
        seq = decode.reserve_prefilled(str(i), prompt, first, GREEDY)
        first_block = seq.num_cached_tokens // 16
        _copy_kv(
            prefill.executor.kv_cache,
            held[first_block:],
            decode.executor.kv_cache,
            seq.block_table[first_block:],
            granularity,
        )
        sent_blocks.append(len(held) - first_block)
        prefill.release_held(held)
        decode.start_prefilled(seq)
        for o in decode.step():  # the decode runs on while the next prompt is handed over
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    for rid, tokens in _run(decode).items():
        got.setdefault(rid, []).extend(tokens)
    assert got == want
    assert sent_blocks == [3, 1, 1]  # the third prompt's first two blocks were in the decode cache
    for engine in (prefill, decode):
        assert engine.stats().num_blocks_free == 32
        check_block_manager(engine.scheduler.block_manager)
    assert prefill.scheduler.block_manager.num_cached_blocks >= 2  # released blocks stay cached for reuse


def test_a_short_decode_pool_reserves_nothing_until_blocks_free(tiny_engine_factory):
    """Back-pressure: reserve_prefilled answers None, changing nothing, while the pool or the
    sequence budget is short; a cancelled reservation gives every block back. A reservation
    waits for its KV: /metrics counts it as a deferred waiting request."""
    decode = tiny_engine_factory(num_blocks=4, max_num_seqs=2)
    bm = decode.scheduler.block_manager
    a = decode.reserve_prefilled("a", list(range(1, 40)), 7, GREEDY)  # 3 blocks of 16
    assert a is not None and bm.num_free_blocks == 1 and decode.stats().num_waiting_deferred == 1
    assert decode.reserve_prefilled("b", list(range(100, 130)), 7, GREEDY) is None  # needs 2
    assert bm.num_free_blocks == 1 and decode.scheduler.get("b") is None
    c = decode.reserve_prefilled("c", [1, 2], 7, GREEDY)
    assert c is not None and bm.num_free_blocks == 0
    decode.cancel_prefilled(c)
    assert decode.reserve_prefilled("d", [1, 2], 7, GREEDY) is not None  # a block, but...
    assert decode.reserve_prefilled("e", [3], 7, GREEDY) is None  # ...max_num_seqs=2 reservations
    assert decode.stats().num_waiting_deferred == 2  # a and d
    decode.cancel_prefilled(a)
    assert bm.num_free_blocks == 3 and decode.stats().num_waiting_deferred == 1
    with pytest.raises(RequestTooLong, match="KV pool of 64 tokens"):
        decode.reserve_prefilled("f", list(range(1, 70)), 7, SamplingParams(max_tokens=2))


def test_a_request_that_ends_on_its_first_token_is_not_handed_off(tiny_engine_factory):
    prefill = tiny_engine_factory(num_blocks=8)
    prefill.add_request("one", [1, 2, 3], SamplingParams(max_tokens=1, temperature=0))
    outs = _run(prefill)
    assert len(outs["one"]) == 1 and prefill.stats().num_blocks_free == 8
