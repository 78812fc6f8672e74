"""Sliding-window layers free their KV pages as they leave the window (spec/kv_groups.py), with
greedy tokens identical to transformers': Gemma 2 and Gemma 3 (local and global layers in KV groups
of their own) and an all-windowed Mistral (one group), in a pool too small for their whole context
at one block of every layer per position, with chunked prefill and a prefix-cache hit."""

from __future__ import annotations

import json

import pytest
import torch

from servelab.core.block_manager import NULL_BLOCK
from servelab.core.config import SchedulerConfig
from servelab.core.sequence import SamplingParams
from servelab.engine.llm_engine import EngineArgs, LLMEngine
from tests.tiny_families import write_family

transformers = pytest.importorskip("transformers")

BLOCK_SIZE = 4
OLD_BLOCKS = 14  # the pool's bytes as blocks of every layer: 56 tokens
IDS = [int(t) for t in torch.randint(3, 500, (100,), generator=torch.Generator().manual_seed(7))]
WINDOW = 8


def _write(tmp_path, name: str):
    if name != "mistral":
        return write_family(tmp_path / name, name, seed=3)
    path = tmp_path / "mistral"
    write_family(path, "llama3", seed=3)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=WINDOW, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "mistral"])
def family(request, tmp_path_factory):
    path = _write(tmp_path_factory.mktemp(request.param), request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return request.param, path, hf.eval()


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt) :].tolist()


def _engine(path, **kw) -> LLMEngine:
    """At the memory of OLD_BLOCKS blocks of every layer, in 16-token chunks."""
    cfg = json.loads((path / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    old_block_bytes = 2 * layers * BLOCK_SIZE * kv_heads * head_dim * 4  # fp32
    scheduler = SchedulerConfig(block_size=BLOCK_SIZE, max_num_batched_tokens=16, max_num_seqs=4)
    memory = OLD_BLOCKS * old_block_bytes
    args = EngineArgs(model=str(path), dtype="float32", scheduler=scheduler, kv_cache_memory_bytes=memory, **kw)
    return LLMEngine.from_args(args)


def _run(engine: LLMEngine, rid: str, prompt: list[int], n: int, watch=None):  # noqa: ANN001
    """Greedy tokens and, per token, the logprobs of the 5 likeliest ones."""
    seq = engine.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=5))
    logprobs: list[list[tuple[int, float]]] = []
    while engine.has_unfinished():
        for out in engine.step():
            logprobs += [lp.top for lp in out.logprobs or ()]
        if watch is not None:
            watch(seq)
    return seq, logprobs


def _check(hf, prompt: list[int], out: list[int], logprobs: list[list[tuple[int, float]]]) -> None:
    """Tokens as transformers generates them, and the top logprobs as it scores the whole
    sequence: the tiny Gemmas repeat one token at probability ~1, so the alternatives' logprobs
    are what a wrong key moves."""
    assert out == _hf_greedy(hf, prompt, len(out))
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out])).logits[0].float(), dim=-1)[len(prompt) - 1 : -1]
    ids = torch.tensor([[t for t, _ in top] for top in logprobs])
    ours = torch.tensor([[lp for _, lp in top] for top in logprobs])
    assert (ours - ref.gather(1, ids)).abs().max() <= 1e-4


def test_greedy_tokens_past_the_old_pool_match_transformers(family):
    """20 + 60 tokens, more than 56 positions of every layer: the windowed layers' pages go back
    to the pool as they leave the window, and the tokens are transformers' own."""
    name, path, hf = family
    engine = _engine(path)
    bm = engine.core.scheduler.block_manager
    assert bm.windowed and OLD_BLOCKS * BLOCK_SIZE < 80
    most = 0

    def watch(seq):  # noqa: ANN001, ANN202
        nonlocal most
        if seq.is_finished:
            return
        for g, _ in bm.windowed:
            table = seq.block_table if g == 0 else seq.group_tables[g - 1]
            most = max(most, sum(b != NULL_BLOCK for b in table))

    seq, logprobs = _run(engine, "long", IDS[:20], 60, watch)
    _check(hf, IDS[:20], seq.output_token_ids, logprobs)
    # a decode's window spans ceil(8 / 4) + 1 pages; a 16-token prefill chunk's up to 7
    assert most <= -(-(WINDOW - 1 + 16) // BLOCK_SIZE) + 1
    assert bm.num_used_blocks == 0


def test_a_shared_prefix_hits_and_decodes_as_transformers_does(family):
    """A 44-token prompt in chunks, then a second sharing its first 40 tokens: it is served those
    40 from the prefix cache (the windowed groups only the window's blocks) and decodes 36 more."""
    name, path, hf = family
    engine = _engine(path)
    a, logprobs = _run(engine, "a", IDS[:44], 4)
    _check(hf, IDS[:44], a.output_token_ids, logprobs)
    prompt = IDS[:40] + IDS[60:65]
    b, logprobs = _run(engine, "b", prompt, 36)
    assert b.num_cached_tokens == 40
    _check(hf, prompt, b.output_token_ids, logprobs)
    assert engine.core.scheduler.block_manager.num_used_blocks == 0


def test_a_gemma_pool_holds_more_pages_than_blocks_of_every_layer(family):
    """Gemma 2's pages hold half the layers (twice the pages), Gemma 3's one layer in six; an
    all-windowed model keeps one group, its layout unchanged."""
    name, path, _ = family
    engine = _engine(path)
    cfg = engine.core.config
    assert cfg.num_blocks == {"gemma2": 2, "gemma3": 6, "mistral": 1}[name] * OLD_BLOCKS
    # num_blocks asked for explicitly counts pages, as the pool and /metrics do
    scheduler = SchedulerConfig(num_blocks=OLD_BLOCKS, block_size=BLOCK_SIZE, max_num_batched_tokens=16)
    asked = LLMEngine.from_args(EngineArgs(model=str(path), dtype="float32", scheduler=scheduler))
    assert asked.core.config.num_blocks == OLD_BLOCKS
    assert asked.executor.kv_cache.nbytes * cfg.num_blocks == engine.executor.kv_cache.nbytes * OLD_BLOCKS
    assert cfg.kv_capacity_tokens == OLD_BLOCKS * BLOCK_SIZE  # a whole prompt: every group's pages
    if name == "mistral":
        assert cfg.kv_context_tokens is None  # no length too long: every layer windowed
    else:
        assert cfg.kv_context_tokens > OLD_BLOCKS * BLOCK_SIZE


@pytest.mark.slow
def test_tensor_parallel_2_frees_the_window_like_one_rank(tmp_path):
    """TP = 2 on Gemma 2: each rank's cache has the same groups; the tokens are transformers'."""
    path = _write(tmp_path, "gemma2")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    engine = _engine(path, tensor_parallel_size=2)
    try:
        seq, logprobs = _run(engine, "long", IDS[:20], 60)
        _check(hf.eval(), IDS[:20], seq.output_token_ids, logprobs)
    finally:
        engine.close()


def test_predicted_outputs_roll_back_every_groups_pages(family):
    """A prediction (speculative drafts) half right: the rejected drafts' pages go back from every
    group's table, and the tokens and logprobs are transformers' own."""
    _, path, hf = family
    engine = _engine(path)
    prompt = IDS[:20]
    expected = _hf_greedy(hf, prompt, 40)
    prediction = expected[:10] + [3] * 10 + expected[20:]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=5, prediction=prediction)
    seq = engine.add_request("p", prompt, params)
    logprobs: list[list[tuple[int, float]]] = []
    while engine.has_unfinished():
        for out in engine.step():
            logprobs += [lp.top for lp in out.logprobs or ()]
    assert seq.spec_counters is not None and seq.spec_counters.num_accepted_tokens >= 10
    _check(hf, prompt, seq.output_token_ids, logprobs)
    assert engine.core.scheduler.block_manager.num_used_blocks == 0


def test_a_disaggregated_worker_keeps_window_blocks_and_refuses_mixed_layers_by_name(tmp_path):
    """Its transfers move one table's whole blocks: an all-windowed model keeps every block (one
    full group to the block manager); one that mixes window and full layers is refused."""
    from servelab.cluster.worker import _check_transferable
    from servelab.errors import InvalidArgument

    path = _write(tmp_path, "mistral")
    mistral = _engine(path, free_window_blocks=False)
    assert mistral.core.config.kv_group_windows == (None,) and not mistral.core.scheduler.block_manager.windowed
    _check_transferable(mistral)
    kept, _ = _run(mistral, "kept", IDS[:20], 20)
    freed, _ = _run(_engine(path), "freed", IDS[:20], 20)
    assert kept.output_token_ids == freed.output_token_ids
    gemma = _engine(_write(tmp_path, "gemma2"), free_window_blocks=False)
    with pytest.raises(InvalidArgument, match="mixes sliding-window and full-attention layers .2 KV groups"):
        _check_transferable(gemma)
