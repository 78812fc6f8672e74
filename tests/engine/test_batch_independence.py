"""A request's greedy output does not depend on what else the engine does: alone, in a batch of
16, with its prompt chunked, after a preemption, and with a prefix-cache hit; with the KV cache
in the compute dtype and in fp16, and under int8 linears."""

from __future__ import annotations

import random

import pytest

from servelab.core.sequence import SamplingParams
from tests.scheduler_checks import check_invariants

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _run(engine, prompts: dict[str, list[int]], params=GREEDY) -> dict:
    seqs = {rid: engine.add_request(rid, ids, params) for rid, ids in prompts.items()}
    while engine.has_unfinished():
        engine.step()
    check_invariants(engine.scheduler)
    return seqs


VARIANTS = {
    "fp32": {},
    "fp16-kv": {"kv_cache_dtype": "float16"},
    # int8 linears: each activation row has its own scale and the integer sums are exact
    "int8": {"quantization": "int8", "kv_cache_dtype": "float16"},
    # bf16 linears: a row's lanes and sums are its own whatever the tile (csrc/bf16_linear.c)
    "bf16": {"quantization": "bf16"},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def factory(request, tiny_engine_factory):
    if "quantization" in VARIANTS[request.param]:
        from servelab.runtime.quantization import check_supported
        from servelab.errors import InvalidArgument

        try:
            check_supported(VARIANTS[request.param]["quantization"])
        except InvalidArgument as exc:
            pytest.skip(str(exc))
    return lambda **kwargs: tiny_engine_factory(**VARIANTS[request.param], **kwargs)


@pytest.fixture(scope="module")
def target(factory):
    engine = factory()
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog and the server answers fast")
    alone = _run(engine, {"t": ids})["t"]
    assert alone.num_output_tokens == GREEDY.max_tokens
    return ids, alone.output_token_ids


def _others(n: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"o{i}": [rng.randrange(3, 500) for _ in range(rng.randint(5, 60))] for i in range(n)}


def test_same_output_in_a_batch_of_16(factory, target):
    ids, expected = target
    engine = factory()
    prompts = _others(15)
    prompts["t"] = ids  # admitted last: shares every step with the others
    assert _run(engine, prompts)["t"].output_token_ids == expected


def test_same_output_with_the_prompt_chunked(factory, target):
    ids, expected = target
    engine = factory(max_num_batched_tokens=5)
    prompts = _others(3, seed=1)
    prompts["t"] = ids
    assert _run(engine, prompts)["t"].output_token_ids == expected


def test_same_output_after_a_preemption(factory, target):
    ids, expected = target
    engine = factory(num_blocks=16, block_size=4, enable_prefix_caching=False)
    prompts = _others(5, seed=2)
    prompts = {k: v[:20] for k, v in prompts.items()}
    prompts["t"] = ids  # the newest: the first to be preempted when blocks run out
    seq = _run(engine, prompts)["t"]
    assert engine.stats().num_preemptions > 0
    assert seq.num_preemptions > 0
    assert seq.output_token_ids == expected


def test_same_output_with_a_prefix_cache_hit(factory, target):
    ids, expected = target
    engine = factory(block_size=4)
    _run(engine, {"warm": ids[:-2] + [7, 8, 9]})  # shares all but the last few prompt tokens
    seq = _run(engine, {"t": ids})["t"]
    assert seq.num_cached_tokens >= 8
    assert engine.stats().prefix_cache_hits >= seq.num_cached_tokens
    assert seq.output_token_ids == expected


def test_same_output_as_the_batch_shrinks_and_grows_between_decode_steps(factory, target):
    """Others finish at different steps and the target joins mid-way: decode-only steps of
    changing shape keep, rewrite and remake the executor's step buffer (model_executor._DecodeInts)."""
    ids, expected = target
    engine = factory(block_size=4)
    for i, (rid, prompt) in enumerate(_others(4, seed=3).items()):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=3 + 9 * i, temperature=0, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert _run(engine, {"t": ids})["t"].output_token_ids == expected


def test_the_decode_step_buffer_is_rewritten_in_place_and_remade_for_a_new_shape():
    from servelab.engine.model_executor import _DecodeInts

    ints = _DecodeInts()
    first = ints.fill(2, 3, list(range(14)))
    assert [t.tolist() for t in first[:4]] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert first[4].tolist() == [[8, 9, 10], [11, 12, 13]]
    again = ints.fill(2, 3, list(range(100, 114)))
    assert all(a is b for a, b in zip(first, again)) and first[4].tolist() == [[108, 109, 110], [111, 112, 113]]
    other = ints.fill(1, 2, [1, 2, 3, 4, 5, 6])
    assert [t.tolist() for t in other] == [[1], [2], [3], [4], [[5, 6]]]
    assert first[0].tolist() == [100, 101]  # the old shape's buffer is not written again
    with pytest.raises(ValueError):
        ints.fill(1, 2, [1, 2, 3])
