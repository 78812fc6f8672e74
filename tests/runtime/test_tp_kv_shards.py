"""A tensor-parallel engine's KV cache as one whole (runtime/parallel/kv_shards.py), what a
disaggregated transfer moves: rank 0 gathers every rank's heads into a piece equal to a TP=1
cache's, and an imported piece lands on each rank's heads and exports back unchanged."""

from __future__ import annotations

import pytest
import torch

from servelab.core.sequence import SamplingParams
from tests.tiny_models import write_tiny_llama

pytestmark = pytest.mark.slow


def _prefilled(path, tp: int, prompt: list[int]):
    """An engine with `prompt` prefilled and its blocks held (as a prefill worker holds them)."""
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs(model=str(path), dtype="float32", tensor_parallel_size=tp, seed=0))
    engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert engine.step()  # the prompt and its first token
    return engine, engine.detach_prefilled("r")


def test_gathered_pieces_equal_one_engines_and_imports_round_trip(tmp_path):
    from servelab.runtime.parallel.kv_shards import TensorParallelKV

    path = write_tiny_llama(tmp_path / "m", heads=4, kv_heads=2)  # TP=2: one KV head per rank
    prompt = [5, 17, 42, 9, 300, 7, 88, 3] * 5  # 40 tokens: three blocks
    one, one_blocks = _prefilled(path, 1, prompt)
    two, two_blocks = _prefilled(path, 2, prompt)
    try:
        whole = one.executor.kv_cache
        tp = TensorParallelKV(two.executor.kv_cache, two.executor.model.group)
        assert tp.block_shape() == whole.block_shape() and tp.layer_shape(3) == whole.layer_shape(3)
        for a, b in zip(one_blocks, two_blocks, strict=True):
            torch.testing.assert_close(tp.export_block(b), whole.export_block(a), atol=1e-5, rtol=1e-5)
        slots1, slots2 = whole.block_slots(one_blocks), tp.block_slots(two_blocks)
        for layer in range(whole.num_layers):
            torch.testing.assert_close(tp.export_layer(layer, slots2), whole.export_layer(layer, slots1),
                                       atol=1e-5, rtol=1e-5)  # fmt: skip

        free = [b for b in range(10, 13) if b not in two_blocks]  # blocks no sequence uses
        pieces = [whole.export_block(a) for a in one_blocks[: len(free)]]
        for block, piece in zip(free, pieces, strict=True):
            tp.import_block(block, piece)
        assert all(torch.equal(tp.export_block(b), p) for b, p in zip(free, pieces, strict=True))
        slots = tp.block_slots(free)
        layer_pieces = [whole.export_layer(layer, whole.block_slots(one_blocks[: len(free)])) for layer in range(2)]
        for layer, piece in enumerate(layer_pieces):
            tp.import_layer(layer, slots, piece.flip(-1))  # different values from what the blocks hold now
        assert all(torch.equal(tp.export_layer(layer, slots), p.flip(-1)) for layer, p in enumerate(layer_pieces))
    finally:
        one.close()
        two.close()
