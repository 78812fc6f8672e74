"""A real disaggregated cluster: a front end (this process), prefill and decode worker processes
joined by gloo on 127.0.0.1, the tiny random model, KV blocks sent point-to-point."""

from __future__ import annotations

import os
import time

import pytest

from servelab.core.sequence import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [[(7 * i + j) % 400 + 3 for j in range(20 + 9 * i)] for i in range(8)]  # 20..83 tokens


def _args(path, **kwargs):
    from servelab.engine.llm_engine import EngineArgs

    return EngineArgs.from_kwargs(model=str(path), dtype="float32", **kwargs)


def _single(path, prompts, **kwargs) -> dict[str, list[int]]:
    from servelab.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_args(_args(path, **kwargs))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def _drain(cluster, timeout_s: float = 120.0) -> dict[str, list]:
    """Every output until no request is left, by request."""
    outputs: dict[str, list] = {}
    deadline = time.monotonic() + timeout_s
    while cluster.has_unfinished():
        assert time.monotonic() < deadline, f"requests hung: {sorted(cluster._routes)}"
        for o in cluster.poll(0.5):
            outputs.setdefault(o.request_id, []).append(o)
    return outputs


def _tokens(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


@pytest.mark.slow
def test_fp16_kv_through_a_short_decode_pool_with_an_abort(tiny_llama):
    """Greedy tokens after the transfer equal one engine's with a float16 KV cache, while the
    decode pool (12 blocks, 2-3 requests) back-pressures the prefill side: nothing is dropped,
    some transfers wait for blocks. An aborted request ends as aborted; every block comes back."""
    from servelab.cluster.disagg import DisaggCluster

    knobs = {"kv_cache_dtype": "float16", "num_blocks": 12}
    want = _single(tiny_llama, PROMPTS, **knobs)
    with DisaggCluster(_args(tiny_llama, **knobs), 1, 1) as cluster:
        for i, p in enumerate(PROMPTS):
            cluster.add_request(str(i), p, GREEDY)
        cluster.add_request("gone", PROMPTS[0], SamplingParams(max_tokens=150, temperature=0, ignore_eos=True))
        cluster.abort("gone")
        got = _drain(cluster)
        assert {rid: _tokens(outs) for rid, outs in got.items() if rid != "gone"} == want
        assert got["gone"][-1].finish_reason == "abort", got["gone"][-1].error
        firsts = [outs[0] for rid, outs in got.items() if rid != "gone"]
        assert all(o.kv_bytes and o.transfer_s is not None for o in firsts)
        assert max(o.queue_s for o in firsts) > 0.01  # some waited for decode blocks
        stats = cluster.stats()
    assert [s["num_free_blocks"] for s in stats.values()] == [12, 12]


@pytest.mark.slow
def test_greedy_output_equals_one_engine_and_a_lost_decode_worker_fails_only_its_requests(tiny_llama):
    from servelab.cluster.disagg import ClusterFailed, DisaggCluster

    want = _single(tiny_llama, PROMPTS[:3], num_blocks=64)
    with DisaggCluster(_args(tiny_llama, num_blocks=64), 1, 1) as cluster:
        for i, p in enumerate(PROMPTS[:3]):
            cluster.add_request(str(i), p, GREEDY)
        assert {rid: _tokens(outs) for rid, outs in _drain(cluster).items()} == want

        long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
        for i, p in enumerate(PROMPTS[:3]):
            cluster.add_request(f"long{i}", p, long)
        while not any(o.new_token_ids for o in cluster.poll(0.5)):
            pass  # decoding has begun
        decode = cluster.workers[1]
        decode.process.kill()
        t0 = time.monotonic()
        got = _drain(cluster, timeout_s=30)
        assert time.monotonic() - t0 < 10
        assert {outs[-1].finish_reason for outs in got.values()} == {"error"}
        assert all("decode worker rank 2" in outs[-1].error for outs in got.values())
        assert cluster.stats() == {1: {"num_blocks": 64, "num_free_blocks": 64}}  # nothing held on the prefill side
        with pytest.raises(ClusterFailed, match="no decode worker is left"):
            cluster.add_request("after", [1, 2, 3], GREEDY)


def _transfer_peer(rank: int, port: int, results) -> None:
    """Rank 0 waits for KV from rank 1, which never sends, then from rank 2, which exits: the
    first timeout must not break the second pair's group."""
    from datetime import timedelta

    import torch.distributed as dist

    from servelab.cluster.kv_transfer import KVTransferError, pair_groups, recv_blocks
    from servelab.engine.kv_cache import PagedKVCache
    from servelab.spec.model import ModelSpec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=30))  # fmt: skip
    groups = pair_groups([0], [1, 2], timeout_s=30)
    if rank == 0:
        spec = ModelSpec("t", num_layers=2, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8,
                         ffn_size=32, vocab_size=10, tie_embeddings=False, max_context=64, rope_theta=1e4)  # fmt: skip
        import torch

        kv = PagedKVCache(spec, 4, 4, dtype=torch.float32)
        for src, timeout_s in ((1, 0.5), (2, 20.0)):
            t0 = time.monotonic()
            try:
                recv_blocks(kv, [1, 2], src, tag=5, timeout_s=timeout_s, group=groups[src])
                results.put((src, "received", 0.0))
            except KVTransferError as exc:
                results.put((src, str(exc), time.monotonic() - t0))
    else:
        time.sleep(1.0 if rank == 2 else 3.0)  # rank 2 exits while rank 0 waits
    results.close()
    results.join_thread()  # flushed before the exit below skips the feeder thread
    os._exit(0)  # leave the broken groups as they are: tearing them down waits on dead peers


@pytest.mark.slow
def test_a_transfer_fails_by_its_deadline_or_at_once_when_the_peer_dies():
    import torch.multiprocessing as mp

    from servelab.engine.parallel.group import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_transfer_peer, args=(r, port, results), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        silent, dead = results.get(timeout=60), results.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert silent[0] == 1 and "did not cross" in silent[1] and 0.4 < silent[2] < 3
    assert dead[0] == 2 and "did not cross" in dead[1] and dead[2] < 5  # the closed connection, not the 20 s deadline
