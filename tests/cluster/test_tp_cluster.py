"""`servelab serve --data-parallel 2 --tensor-parallel-size 2` end to end: each worker is rank 0
of its own tensor-parallel group (five processes on 127.0.0.1). Greedy output equals one
engine's, a killed TP rank fails only its worker's requests, and stopping the server leaves no
process behind, TP ranks included. And `--disagg 1:1 --tensor-parallel-size 2`: every rank's KV
heads cross from the prefill worker to the decode worker, and the output equals one engine's."""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.cluster.server_checks import gone, streams_across_a_kill
from tests.server.conftest import launch_server

pytestmark = pytest.mark.slow

FLAGS = ("--data-parallel", "2", "--tensor-parallel-size", "2", "--num-blocks", "64", "--max-model-len", "256",
         "--seed", "0")  # fmt: skip
PROMPTS = [[5, 17, 42, 9, 300, 7], [11, 12, 13], [99, 98, 3, 4]]
MAX_TOKENS = 12


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of `pid`'s child processes, from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append((int(entry.name), cmdline))
    return out


def _tp_ranks(worker_pid: int) -> list[int]:
    """Its tensor-parallel ranks: the processes it spawned, less its grammar workers."""
    from tests.cluster.server_checks import is_grammar_worker

    return [pid for pid, cmd in _children(worker_pid) if "spawn_main" in cmd and not is_grammar_worker(pid)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("tpdp-model") / "tiny-llama")  # 4 heads, 2 KV heads


@pytest.fixture(scope="module")
def tpdp_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    server = launch_server(tiny_dir, tmp_path_factory.mktemp("tpdp-logs"), *FLAGS)
    workers = [w["pid"] for w in httpx.get(server.url + "/health").json()["workers"]]
    ranks = {pid: _tp_ranks(pid) for pid in workers}
    assert all(len(r) == 1 for r in ranks.values()), ranks  # TP=2: rank 1 beside each worker
    yield server, ranks
    assert server.stop() == 0, server.log()
    every = workers + [pid for r in ranks.values() for pid in r]
    assert gone(every, timeout_s=15), f"processes {every} outlived the server"


@pytest.fixture(scope="module")
def expected_texts(tiny_dir: Path) -> list[str]:
    """One in-process engine (TP=1), the same flags: what greedy decoding must give."""
    from servelab.core.config import SchedulerConfig
    from servelab.core.sequence import SamplingParams
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs(model=str(tiny_dir), seed=0,
                                            scheduler=SchedulerConfig(num_blocks=64, max_model_len=256)))  # fmt: skip
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    texts: dict[str, str] = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta
    engine.close()
    return [texts[str(i)] for i in range(len(PROMPTS))]


def _complete_all(url: str) -> list[str]:
    def complete(ids: list[int]) -> str:
        body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(complete, PROMPTS))


def test_greedy_output_through_tp_workers_equals_one_engine(tpdp_server, expected_texts):
    server, _ = tpdp_server
    assert _complete_all(server.url) == expected_texts
    workers = httpx.get(server.url + "/health").json()["workers"]
    assert all(w["status"] == "ok" for w in workers)


def test_a_killed_tp_rank_fails_alone_and_its_worker_comes_back(tpdp_server, expected_texts):
    server, ranks = tpdp_server
    url = server.url
    worker_pid = {w["rank"]: w["pid"] for w in httpx.get(url + "/health").json()["workers"]}
    kill_rank = lambda: os.kill(ranks[worker_pid[2]][0], signal.SIGKILL)  # noqa: E731  worker 2's TP rank 1
    errors, finished, seconds = streams_across_a_kill(url, 200, kill_rank)
    assert len(errors) == 1 and "worker 2" in errors[0]["message"], (errors, finished)
    assert "tensor-parallel rank failure: rank 1 exited" in errors[0]["message"]  # the cause, not just a lost link
    assert finished == ["length"]  # worker 1's stream ran to its end
    assert seconds < 60
    health = httpx.get(url + "/health").json()
    assert health["status"] == "degraded"
    assert {w["rank"]: w["status"] for w in health["workers"]}[1] == "ok"
    assert gone([worker_pid[2]], timeout_s=15)  # the worker whose rank died exits
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text  # worker 1 serves on
    deadline = time.monotonic() + 90  # worker 2 comes back, with a tensor-parallel group of its own
    while (two := {w["rank"]: w for w in httpx.get(url + "/health").json()["workers"]}[2])["status"] != "ok":
        assert two["status"] == "restarting" and time.monotonic() < deadline, two
        time.sleep(0.5)
    assert two["pid"] != worker_pid[2] and len(_tp_ranks(two["pid"])) == 1  # its own TP rank 1 (rank 0 is itself)
    assert _complete_all(url) == expected_texts


def test_disagg_with_tp_moves_every_ranks_heads(tiny_dir, expected_texts, tmp_path):
    flags = ("--disagg", "1:1", *FLAGS[2:])
    server = launch_server(tiny_dir, tmp_path, *flags)
    try:
        workers = [w["pid"] for w in httpx.get(server.url + "/health").json()["workers"]]
        ranks = [pid for w in workers for pid in _tp_ranks(w)]
        assert len(ranks) == 2
        assert _complete_all(server.url) == expected_texts
        text = httpx.get(server.url + "/metrics").text
        sent = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("servelab:kv_transfer_bytes_sum")]  # fmt: skip
        # each prompt fills one 16-token block: K and V x 2 layers x 2 KV heads (both ranks') x 16 dims,
        # in the cache's dtype (float16, the default path's)
        cache_dtype = re.search(r'servelab:cache_config_info\{[^}]*cache_dtype="(\w+)"', text)[1]
        itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}[cache_dtype]
        assert sent == [len(PROMPTS) * 2 * 2 * 2 * 16 * 16 * itemsize], text
    finally:
        assert server.stop() == 0, server.log()
    assert gone(workers + ranks, timeout_s=15)
