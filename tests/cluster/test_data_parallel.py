"""`servelab serve --data-parallel 2` end to end, every process on 127.0.0.1 (the same code as
separate hosts): greedy output equals one engine's, aborts leak no KV block on any worker, a
killed worker fails only its own requests, and a `servelab worker` joins through env://."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.cluster.server_checks import gone, grammar_workers, metric, reaped, streams_across_a_kill
from tests.server.conftest import REPO, launch_server

pytestmark = pytest.mark.slow

SERVER_FLAGS = ("--num-blocks", "256", "--max-model-len", "1100", "--seed", "0")
PROMPTS = [[11 + i, 40 + 3 * i, 7, 99 - i, 23] * (1 + i) for i in range(6)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("dp-model") / "tiny-llama")


@pytest.fixture(scope="module")
def dp_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # no restarts: a killed worker stays failed (test_a_killed_worker_is_restarted has its own server)
    server = launch_server(tiny_dir, tmp_path_factory.mktemp("dp-logs"), "--data-parallel", "2",
                           "--worker-restart-limit", "0", *SERVER_FLAGS)  # fmt: skip
    yield server
    pids = [w["pid"] for w in httpx.get(server.url + "/health").json()["workers"]]
    assert server.stop() == 0, server.log()
    assert gone(pids, timeout_s=10), f"worker processes {pids} outlived the server"


@pytest.fixture(scope="module")
def reference_texts(tiny_dir: Path) -> list[str]:
    return _reference_texts(tiny_dir, 24)


def _reference_texts(tiny_dir: Path, max_tokens: int) -> list[str]:
    """One in-process engine, the same flags: what greedy decoding must give."""
    from servelab.core.config import SchedulerConfig
    from servelab.core.sequence import SamplingParams
    from servelab.engine.llm_engine import EngineArgs, LLMEngine

    engine = LLMEngine.from_args(EngineArgs(model=str(tiny_dir), seed=0,
                                            scheduler=SchedulerConfig(num_blocks=256, max_model_len=1100)))  # fmt: skip
    for i, ids in enumerate(PROMPTS):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    texts = {}
    while engine.has_unfinished():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta
    return [texts[str(i)] for i in range(len(PROMPTS))]


def test_greedy_output_through_two_workers_equals_one_engine(dp_server, reference_texts):
    def complete(ids: list[int]) -> str:
        body = {"prompt": ids, "max_tokens": 24, "temperature": 0}
        r = httpx.post(dp_server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(complete, PROMPTS))
    assert texts == reference_texts
    queries = metric(httpx.get(dp_server.url + "/metrics").text, "servelab:worker_prefix_cache_queries_total")
    assert queries["1"] > 0 and queries["2"] > 0, queries  # both workers served


def test_aborts_leak_no_kv_block_on_any_worker(dp_server):
    url = dp_server.url
    body = {"prompt": "the quick brown fox", "max_tokens": 400, "ignore_eos": True, "stream": True}

    def stream_then_leave(_: int) -> int:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = (line for line in r.iter_lines() if line)
            return sum(1 for _, _ in zip(range(3), lines))  # three chunks, then disconnect

    def complete(_: int) -> str:
        return httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 5}, timeout=60).json()

    with ThreadPoolExecutor(8) as pool:
        left = list(pool.map(stream_then_leave, range(6)))
        done = list(pool.map(complete, range(4)))
    assert left == [3] * 6 and all(d["choices"][0]["finish_reason"] for d in done)
    deadline = time.monotonic() + 15
    while True:  # the workers report their pools with each step and heartbeat
        text = httpx.get(url + "/metrics").text
        free, total = (
            metric(text, "servelab:worker_kv_cache_blocks_free"),
            metric(text, "servelab:worker_kv_cache_blocks_total"),
        )
        running = metric(text, "servelab:num_requests_running")
        if (free == total and running == {"": 0.0}) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert free == total == {"1": 256.0, "2": 256.0}, (free, total)
    assert running == {"": 0.0}
    assert metric(text, "servelab:request_success_total")  # labelled by reason; present
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_a_killed_worker_fails_only_its_requests(dp_server):
    url = dp_server.url
    pid = {w["rank"]: w["pid"] for w in httpx.get(url + "/health").json()["workers"]}
    errors, finished, seconds = streams_across_a_kill(url, 1000, lambda: os.kill(pid[2], signal.SIGKILL))
    assert len(errors) == 1 and "worker 2 failed" in errors[0]["message"], (errors, finished)
    assert errors[0]["type"] == "internal_server_error"
    assert finished == ["length"]  # the other worker's stream ran to its end
    assert seconds < 60
    health = httpx.get(url + "/health")
    assert health.status_code == 200
    states = {w["rank"]: w["status"] for w in health.json()["workers"]}
    assert health.json()["status"] == "degraded" and states == {1: "ok", 2: "failed"}
    for _ in range(3):  # the router sends nothing to the dead worker
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
    text = httpx.get(url + "/metrics").text
    assert metric(text, "servelab:worker_up") == {"1": 1.0, "2": 0.0}
    assert reaped(pid[2], timeout_s=10), "the killed worker is left a zombie"


def compile_on_each(url: str, worker_pids, regex: str) -> None:
    """Structured requests in pairs (least-outstanding sends a pair one to each worker, unless the
    first ends before the second arrives) until every worker has compiled in a grammar worker;
    each pair's grammar is new, so it compiles wherever it lands."""
    for n in range(1, 9):
        body = {"prompt": "hello", "max_tokens": 8, "structured_outputs": {"regex": f"{regex}x{{{n}}}"}}
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(2)))
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        assert all(re.fullmatch(f"{regex}x{{{n}}}", a.json()["choices"][0]["text"]) for a in answers), answers
        if all(grammar_workers(pid) for pid in worker_pids):
            return
    raise AssertionError("8 pairs of structured requests never reached every worker")


def test_a_killed_worker_is_restarted_and_serves_again(tiny_dir, tmp_path):
    """Its replacement comes up as the first workers did: its grammar workers start with its first
    compile, as many as the server's --structured-output-compile-workers, and die with it."""
    server = launch_server(tiny_dir, tmp_path, "--data-parallel", "2", "--structured-output-compile-workers", "1",
                           *SERVER_FLAGS)  # fmt: skip
    try:
        url = server.url
        before = {w["rank"]: w["pid"] for w in httpx.get(url + "/health").json()["workers"]}
        assert all(grammar_workers(pid) == [] for pid in before.values())  # none until a grammar comes
        compile_on_each(url, before.values(), "[a-z]{2}")
        grammar_pids = {rank: grammar_workers(pid) for rank, pid in before.items()}
        assert all(len(pids) == 1 for pids in grammar_pids.values()), grammar_pids
        os.kill(before[2], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while True:
            health = httpx.get(url + "/health", timeout=10)
            workers = {w["rank"]: w for w in health.json()["workers"]}
            if health.json()["status"] == "ok" and workers[2]["pid"] != before[2]:
                break
            noticed = workers[2]["status"] in ("failed", "restarting") or workers[2]["pid"] == before[2]
            assert health.status_code == 200 and noticed, health.text  # "ok" under the old pid: not noticed yet
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.5)
        assert (workers[1]["pid"], workers[2]["restarts"]) == (before[1], 1)
        assert reaped(before[2], timeout_s=10), "the killed worker is left a zombie"
        assert gone(grammar_pids[2], timeout_s=10), "the killed worker's grammar workers outlived it"
        body = {"prompt": "hello", "max_tokens": 40, "ignore_eos": True}
        with ThreadPoolExecutor(2) as pool:  # least-outstanding: one on each worker, the new one included
            answers = list(pool.map(lambda _: httpx.post(url + "/v1/completions", json=body, timeout=60), range(2)))
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        compile_on_each(url, [w["pid"] for w in workers.values()], "[a-z]{3}")
        assert len(grammar_workers(workers[2]["pid"])) == 1
        assert metric(httpx.get(url + "/metrics").text, "servelab:worker_up") == {"1": 1.0, "2": 1.0}
        pids = [w["pid"] for w in workers.values()]
    finally:
        assert server.stop() == 0, server.log()
    assert gone(pids, timeout_s=10), f"worker processes {pids} outlived the server"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_worker_joins_through_env_rendezvous(tiny_dir, reference_texts, tmp_path):
    port = _free_port()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1", WORLD_SIZE="2",
               PYTHONUNBUFFERED="1")  # fmt: skip
    log = open(tmp_path / "worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "-m", "servelab", "worker", "--join-timeout", "120s"],
                              stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)  # fmt: skip
    log.close()
    try:
        server = launch_server(tiny_dir, tmp_path, "--external-workers", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), *SERVER_FLAGS)  # fmt: skip
        try:
            workers = httpx.get(server.url + "/health").json()["workers"]
            assert [(w["rank"], w["pid"], w["status"]) for w in workers] == [(1, worker.pid, "ok")]
            r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 24,
                                                                 "temperature": 0}, timeout=60)  # fmt: skip
            assert r.json()["choices"][0]["text"] == reference_texts[0]
        finally:
            assert server.stop() == 0, server.log()
        assert worker.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
