"""`servelab serve --disagg 1:1` end to end, every process on 127.0.0.1: greedy output equals one
engine's in fp32 and with a float16 KV cache, a decode worker that is full back-pressures the
prefill worker without dropping anything, aborts leak no KV block on either worker, a killed
worker fails only the requests it holds and is restarted, linked to its peer again; and a KV
transfer fails by its deadline."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.cluster.server_checks import metric
from tests.server.conftest import launch_server

FLAGS = ("--disagg", "1:1", "--num-blocks", "64", "--max-model-len", "1024", "--seed", "0")
NO_RESTARTS = ("--worker-restart-limit", "0")  # a killed worker stays failed (restarts: their own test)
PROMPTS = [[11 + i, 40 + 3 * i, 7, 99 - i, 23] * (1 + 2 * i) for i in range(6)]  # 5..55 tokens


def _reference(tiny_model_dir: Path, **knobs) -> list[str]:
    from servelab.core.sequence import SamplingParams
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs.from_kwargs(model=str(tiny_model_dir), seed=0, num_blocks=64, max_model_len=1024,
                                                        **knobs))  # fmt: skip
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=24, temperature=0.0))
    texts = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta
    return [texts[str(i)] for i in range(len(PROMPTS))]


def _complete_all(url: str) -> list[str]:
    def complete(ids: list[int]) -> str:
        r = httpx.post(url + "/v1/completions", json={"prompt": ids, "max_tokens": 24, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(complete, PROMPTS))


def _wait_pools_full(url: str) -> tuple[dict, dict]:
    deadline = time.monotonic() + 15
    while True:  # the workers report their pools with each step and heartbeat
        text = httpx.get(url + "/metrics").text
        free, total = (
            metric(text, "servelab:worker_kv_cache_blocks_free"),
            metric(text, "servelab:worker_kv_cache_blocks_total"),
        )
        if free == total or time.monotonic() > deadline:
            return free, total
        time.sleep(0.3)


@pytest.mark.slow
def test_fp16_kv_through_a_one_sequence_decode_pool_equals_one_engine(tiny_model_dir, tmp_path):
    """With --max-num-seqs 1 the decode worker takes the 6 requests one at a time, while the
    prefill worker (which holds none of them past its first token) prefills them all: their
    offers queue on the decode side, their blocks stay held on the prefill side, none is dropped."""
    knobs = ("--kv-cache-dtype", "float16", "--max-num-seqs", "1")
    want = _reference(tiny_model_dir, kv_cache_dtype="float16", max_num_seqs=1)
    server = launch_server(tiny_model_dir, tmp_path, *FLAGS, *NO_RESTARTS, *knobs)
    try:
        assert _complete_all(server.url) == want
        text = httpx.get(server.url + "/metrics").text
        queued = metric(text, "servelab:kv_transfer_decode_queue_seconds_sum")[""]
        assert queued > 0.01, queued  # offers waited for the decode worker's sequence budget (~23 steps each)
        assert metric(text, "servelab:kv_transfer_seconds_count")[""] == len(PROMPTS)
        assert _wait_pools_full(server.url)[0] == {"1": 64.0, "2": 64.0}
        # a request whose KV has crossed lives on the decode worker: losing the prefill worker spares it
        pid = {w["role"]: w["pid"] for w in httpx.get(server.url + "/health").json()["workers"]}
        body = {"prompt": PROMPTS[1], "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
            lines = (line for line in r.iter_lines() if line)
            events = [next(lines)]  # its first token came from the decode worker
            os.kill(pid["prefill"], signal.SIGKILL)
            events.extend(lines)
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "length", events[-2]
        r = httpx.get(server.url + "/health")  # no prefill worker left: it cannot serve
        assert r.status_code == 503 and "no prefill worker is left" in r.json()["error"]["message"], r.text
    finally:
        assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def disagg_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    server = launch_server(tiny_model_dir, tmp_path_factory.mktemp("disagg-logs"), *FLAGS, *NO_RESTARTS)
    yield server
    server.stop()


@pytest.mark.slow
def test_greedy_output_equals_one_engine(disagg_server, tiny_model_dir):
    assert _complete_all(disagg_server.url) == _reference(tiny_model_dir)
    workers = httpx.get(disagg_server.url + "/health").json()["workers"]
    assert [(w["rank"], w["role"]) for w in workers] == [(1, "prefill"), (2, "decode")]
    text = httpx.get(disagg_server.url + "/metrics").text
    assert metric(text, "servelab:kv_transfer_bytes_sum")[""] > 0
    # prompt logprobs are scored on the prefill worker and arrive with the decode worker's tokens
    body = {"prompt": PROMPTS[2], "max_tokens": 4, "temperature": 0, "prompt_logprobs": 0}
    choice = httpx.post(disagg_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert len(choice["prompt_logprobs"]) == len(PROMPTS[2]) and choice["prompt_logprobs"][0] is None


@pytest.mark.slow
def test_aborts_leak_no_kv_block_on_either_worker(disagg_server):
    url = disagg_server.url

    def stream_then_leave(i: int) -> int:
        body = {"prompt": PROMPTS[i % 6], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line)
            return sum(1 for _, _ in zip(range(i % 3 + 1), lines))  # a chunk or three, then disconnect

    with ThreadPoolExecutor(8) as pool:
        left = list(pool.map(stream_then_leave, range(8)))
    assert left == [i % 3 + 1 for i in range(8)]
    free, total = _wait_pools_full(url)
    assert free == total == {"1": 64.0, "2": 64.0}, (free, total)
    assert httpx.get(url + "/health").json()["status"] == "ok"


@pytest.mark.slow
def test_a_killed_decode_worker_fails_its_requests_clearly(disagg_server):
    url = disagg_server.url
    pid = {w["role"]: w["pid"] for w in httpx.get(url + "/health").json()["workers"]}
    body = {"prompt": "hello world", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        lines = (line for line in r.iter_lines() if line)
        events = [next(lines)]  # decoding has begun
        os.kill(pid["decode"], signal.SIGKILL)
        events.extend(lines)
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert "worker 2 failed" in error["message"], error
    health = httpx.get(url + "/health")  # the only decode worker is gone: it cannot serve
    assert health.status_code == 503 and health.headers["retry-after"] == "1", health.text
    assert "no decode worker is left" in health.json()["error"]["message"], health.text
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 503 and "no decode worker is left" in r.json()["error"]["message"], r.text
    free, _ = _wait_pools_full(url)
    assert free["1"] == 64.0  # nothing held on the prefill side


def _wait_restarted(url: str, rank: int, old_pid: int) -> dict:
    """/health's entry for worker `rank` once the cluster serves again with a new process there."""
    deadline = time.monotonic() + 180
    while True:
        health = httpx.get(url + "/health", timeout=10)
        workers = {w["rank"]: w for w in health.json()["workers"]}
        if health.json()["status"] == "ok" and workers[rank]["pid"] != old_pid:
            return workers[rank]
        assert time.monotonic() < deadline, health.text
        time.sleep(0.5)


@pytest.mark.slow  # ~60 s: a cluster's start and two restarts
def test_killed_decode_and_prefill_workers_are_restarted_and_transfer_again(tiny_model_dir, tmp_path):
    """A replacement links to its peer of the other pool (a pair link formed after the world) and
    the KV of the next request crosses that link: the same greedy text as before the kill."""
    from tests.cluster.server_checks import reaped

    server = launch_server(tiny_model_dir, tmp_path, *FLAGS)
    try:
        url = server.url
        body = {"prompt": PROMPTS[3], "max_tokens": 24, "temperature": 0}
        want = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        for role, rank in (("decode", 2), ("prefill", 1)):
            pid = {w["role"]: w["pid"] for w in httpx.get(url + "/health").json()["workers"]}
            os.kill(pid[role], signal.SIGKILL)
            back = _wait_restarted(url, rank, pid[role])
            assert back["role"] == role and back["restarts"] == 1, back
            assert reaped(pid[role], timeout_s=10), f"the killed {role} worker is left a zombie"
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, (r.text, server.log())
        text = httpx.get(url + "/metrics").text
        assert metric(text, "servelab:kv_transfer_seconds_count")[""] == 3  # each crossed a link
        assert _wait_pools_full(url)[0] == {"1": 64.0, "2": 64.0}
    finally:
        assert server.stop() == 0, server.log()


def _transfer_peer(rank: int, port: int, results) -> None:
    """Rank 0 waits for KV from rank 1, which never sends, then from rank 2, which exits: the
    first timeout must not break the second pair's group."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from servelab.cluster.kv_transfer import KVTransferError, pair_groups, recv_blocks
    from servelab.runtime.kv_cache import PagedKVCache
    from servelab.spec.model import ModelSpec

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=timedelta(seconds=30))  # fmt: skip
    groups = pair_groups([0], [1, 2], timeout_s=30)
    if rank == 0:
        spec = ModelSpec("t", num_layers=2, hidden_size=16, num_heads=2, num_kv_heads=1, head_dim=8,
                         ffn_size=32, vocab_size=10, tie_embeddings=False, max_context=64, rope_theta=1e4)  # fmt: skip
        kv = PagedKVCache(spec, 4, 4, dtype=torch.float32)
        for src, timeout_s in ((1, 0.5), (2, 20.0)):
            t0 = time.monotonic()
            try:
                recv_blocks(kv, [1, 2], src, tag=16, timeout_s=timeout_s, group=groups[src])
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

    from servelab.runtime.parallel.group import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_transfer_peer, args=(r, port, results), daemon=True) for r in range(3)]
    for p in procs:
        p.start()
    try:
        silent, dead = results.get(timeout=120), results.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert silent[0] == 1 and "did not cross" in silent[1] and 0.4 < silent[2] < 3
    assert dead[0] == 2 and "did not cross" in dead[1] and dead[2] < 5  # the closed connection, not the 20 s deadline


@pytest.mark.slow
def test_external_prefill_and_decode_workers_join_through_env(tiny_model_dir, tmp_path):
    """The two-host launch (docs/disaggregation.md): `servelab worker` processes started on their
    own, joining by MASTER_ADDR/RANK/WORLD_SIZE, take the prefill and decode roles."""
    import sys

    from tests.cluster.server_checks import env_workers

    port, workers = env_workers(tmp_path, [sys.executable, "-m", "servelab", "worker", "--join-timeout", "120s"])
    try:
        server = launch_server(tiny_model_dir, tmp_path, *FLAGS, "--external-workers", "--master-addr", "127.0.0.1",
                               "--master-port", str(port))  # fmt: skip
        try:
            health = httpx.get(server.url + "/health").json()["workers"]
            assert [(w["rank"], w["role"], w["pid"]) for w in health] == [
                (1, "prefill", workers[0].pid), (2, "decode", workers[1].pid)]  # fmt: skip
            assert _complete_all(server.url) == _reference(tiny_model_dir)
            assert metric(httpx.get(server.url + "/metrics").text, "servelab:kv_transfer_bytes_sum")[""] > 0
        finally:
            assert server.stop() == 0, server.log()
        for rank, worker in zip((1, 2), workers):
            assert worker.wait(timeout=30) == 0, (tmp_path / f"worker{rank}.log").read_text()
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
