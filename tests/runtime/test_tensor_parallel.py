"""Tensor parallelism (runtime/parallel/): the split of the weights, and TP=N against TP=1 with
real worker processes joined by gloo on 127.0.0.1."""

from __future__ import annotations

import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servelab.core.sequence import SamplingParams
from servelab.runtime.parallel.sharding import Shard, check_tensor_parallel
from servelab.errors import InvalidArgument
from servelab.spec.model import ModelSpec
from tests.tiny_models import prefill_logits, write_tiny_llama


def _spec(heads: int, kv_heads: int, ffn: int = 96, vocab: int = 100) -> ModelSpec:
    return ModelSpec("t", num_layers=1, hidden_size=64, num_heads=heads, num_kv_heads=kv_heads, head_dim=8,
                     ffn_size=ffn, vocab_size=vocab, tie_embeddings=False, max_context=64, rope_theta=1e4)  # fmt: skip


@st.composite
def _splits(draw):
    size = draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    kv_heads = draw(st.sampled_from([d for d in (1, 2, 3, 4, 6, 8, 12) if d % size == 0 or size % d == 0]))
    heads = kv_heads * draw(st.integers(1, 4))
    while heads % size:
        heads += kv_heads
    return _spec(heads, kv_heads, ffn=24 * size, vocab=draw(st.integers(size, 300))), size


@given(_splits())
def test_every_head_and_token_is_on_a_rank_with_the_kv_heads_it_reads(split):
    spec, size = split
    d, group = spec.head_dim, spec.num_heads // spec.num_kv_heads
    q_rows, vocab = [], []
    for rank in range(size):
        shard = Shard(spec, rank, size)
        q = shard.slice_of("model.layers.0.self_attn.q_proj.weight")
        k = shard.slice_of("model.layers.0.self_attn.k_proj.weight")
        assert shard.slice_of("model.layers.0.self_attn.o_proj.weight") == type(q)(1, q.start, q.stop)
        q_rows += range(q.start, q.stop)
        kv_heads = range(k.start // d, k.stop // d)
        assert len(kv_heads) == shard.num_kv_heads == shard.local_spec().num_kv_heads
        for head in range(q.start // d, q.stop // d):  # each query head's KV head is on its rank, in order
            assert head // group - kv_heads.start == (head - q.start // d) // (shard.num_heads // shard.num_kv_heads)
        vocab += range(*shard.vocab_range)
    assert q_rows == list(range(spec.num_heads * d))
    assert vocab == list(range(spec.vocab_size))


def test_a_split_that_does_not_divide_the_heads_is_refused_naming_them():
    with pytest.raises(InvalidArgument, match="divide the model's 9 attention heads"):
        check_tensor_parallel(_spec(9, 3), 2)
    with pytest.raises(InvalidArgument, match="4 KV heads"):
        check_tensor_parallel(_spec(12, 4), 3)


@pytest.mark.slow
def test_gguf_slices_are_the_dequantized_tensors_slices():
    """Cut in the file's blocks (row and column slices, 1-D norms), a shard dequantizes to the
    same values as the whole tensor cut after dequantization."""
    from servelab.engine.bundled import bundled_model_path
    from servelab.runtime.loader import read_gguf_tensors
    from servelab.runtime.parallel.shard_loading import shard_gguf_tensors
    from servelab.runtime.weight_layout import dequantize_gguf_tensor, hf_name

    path = bundled_model_path()
    gguf, tensors = read_gguf_tensors(path)
    spec = ModelSpec.from_gguf_metadata(
        gguf.metadata, name="b", tensor_shapes={n: t.shape for n, t in gguf.tensors.items()}
    )
    shard = Shard(spec, 1, 3)
    names = [n for n in tensors if n.startswith("blk.0.") or not n.startswith("blk.")]
    sliced = shard_gguf_tensors({n: tensors[n] for n in names}, shard)
    for name in names:
        full = dequantize_gguf_tensor(tensors[name])
        part = shard.slice_of(hf_name(name) or "")
        want = (
            full if part is None else full[part.start : part.stop] if part.dim == 0 else full[:, part.start : part.stop]
        )
        assert dequantize_gguf_tensor(sliced[name]).equal(want), name


def test_a_model_the_ranks_cannot_split_is_refused_before_any_worker_starts(tmp_path):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    path = write_tiny_llama(tmp_path / "m", hidden=72, heads=9, kv_heads=3)
    with pytest.raises(InvalidArgument, match="tensor_parallel_size=2 must divide the model's 9 attention heads"):
        LLMEngine.from_args(EngineArgs(model=str(path), dtype="float32", tensor_parallel_size=2))
    with pytest.raises(InvalidArgument, match="cpu"):
        EngineArgs(device="cuda", tensor_parallel_size=2).validate()


# ------------------------------------------------------------------ real ranks


def _engine(path, tp: int, quantization: str | None = None):
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    return LLMEngine.from_args(
        EngineArgs(model=str(path), dtype="float32", tensor_parallel_size=tp, quantization=quantization)
    )


def _greedy(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {
        "4q2kv": write_tiny_llama(root / "a", heads=4, kv_heads=2),
        # like the bundled model: 9 query and 3 KV heads; a vocabulary 3 does not divide
        "9q3kv": write_tiny_llama(root / "b", hidden=72, heads=9, kv_heads=3, tie_embeddings=True, seed=1),
    }


@pytest.mark.slow
# TP=4 over 2 KV heads replicates them; four processes on a small host: fewer tokens
# bf16 linears: each rank's row-parallel partial sums are rounded as the whole's are not, and a
# bf16 rounding of the next activations can amplify that, so the logits get a looser bound
@pytest.mark.parametrize(
    ("model", "tp", "max_tokens", "quantization"),
    [("4q2kv", 2, 64, None), ("9q3kv", 3, 64, None), ("4q2kv", 4, 16, None), ("9q3kv", 3, 32, "bf16")],
)
def test_tp_greedy_output_and_logits_equal_tp1(models, model, tp, max_tokens, quantization):
    import torch

    prompts = [[5, 17, 42, 9, 300, 7, 88], [11, 12, 13]]
    engines = {}
    threads = torch.get_num_threads()
    try:
        for n in (1, tp):
            engines[n] = _engine(models[model], n, quantization)
        tokens = {n: _greedy(e, prompts, max_tokens) for n, e in engines.items()}
        assert tokens[tp] == tokens[1]
        seq = prompts[0] + tokens[1]["0"]
        logits = {n: prefill_logits(e.executor.model, seq) for n, e in engines.items()}
        assert logits[tp].shape == logits[1].shape == (len(seq), 512)
        assert (logits[tp] - logits[1]).abs().max() < (1e-4 if quantization is None else 1e-2)
    finally:
        for e in engines.values():
            e.close()
    assert torch.get_num_threads() == threads  # rank 0's share of the host's threads is given back


@pytest.mark.slow
def test_a_dead_rank_fails_the_engine_promptly_and_loudly(models):
    from servelab.runtime.parallel.group import RankFailed

    engine = _engine(models["9q3kv"], 3)
    try:
        assert _greedy(engine, [[1, 2, 3]], 4)
        worker, survivor = engine.executor.model.group.workers
        worker.kill()
        worker.join()
        engine.add_request("after", [4, 5, 6], SamplingParams(max_tokens=4, temperature=0))
        t0 = time.monotonic()
        with pytest.raises(RankFailed, match="rank 1 exited"):
            engine.step()
        assert time.monotonic() - t0 < 3
        assert not survivor.is_alive()  # stopped, not left waiting on the broken group
        with pytest.raises(RankFailed):  # and stays failed
            engine.step()
    finally:
        engine.close()
