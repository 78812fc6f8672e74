"""No request stalls the others through its grammar or the size of its body: grammars compile in
their own worker processes, bounded in time and killed when their client leaves; large bodies
are prepared on a lane of their own; the compiled-grammar cache is bounded in bytes."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from servelab.core.structured_output import StructuredOutputSpec
from servelab.engine.grammar_workers import GrammarConfig
from servelab.engine.structured_output import GrammarCache
from servelab.errors import InvalidArgument
from servelab.server.app import create_app
from tests.server.adversarial import engine_with_grammars, plain_completion_s, slow_compile, slow_regex, wait_until


@pytest.fixture
def grammar_client(fake_engine, monkeypatch):
    """Factory: a TestClient over an app whose grammar workers run `slow_compile`."""
    from servelab.engine import grammar_workers

    monkeypatch.setattr(grammar_workers, "compile_spec", slow_compile)
    monkeypatch.setattr(grammar_workers.GrammarWorkers.__init__, "__defaults__",
                        (GrammarConfig(), slow_compile))  # fmt: skip
    clients = []

    def make(**config) -> TestClient:
        client = TestClient(create_app(engine_with_grammars(fake_engine), grammar_config=GrammarConfig(**config)))
        clients.append(client.__enter__())
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child not yet reaped is a zombie: as good as gone
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def _post_in_thread(client: TestClient, body: dict, results: list, path: str = "/v1/completions") -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(client.post(path, json=body)), daemon=True)
    thread.start()
    return thread


@pytest.mark.slow
def test_slow_compiles_do_not_hold_up_a_plain_request(grammar_client):
    client = grammar_client(compile_timeout_s=30, num_workers=2)
    # warm: the grammar workers and the first (import-time) compile
    assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                "structured_outputs": {"regex": "[a-z]+"}}).status_code == 200  # fmt: skip
    results: list = []
    threads = [
        _post_in_thread(client, {"prompt": "x", "max_tokens": 2, **slow_regex(6 + i)}, results) for i in range(2)
    ]
    grammars = client.app.state.servelab.grammars
    assert wait_until(lambda: len(grammars.worker_pids()) == 2, 10)  # both compiles running
    assert plain_completion_s(client) < 2.0
    assert plain_completion_s(client) < 2.0
    for thread in threads:
        thread.join(30)
    assert [r.status_code for r in results] == [200, 200]


@pytest.mark.slow
def test_a_compile_past_the_timeout_is_a_400_naming_the_field_and_its_worker_is_killed(grammar_client):
    client = grammar_client(compile_timeout_s=3, num_workers=1)
    grammars = client.app.state.servelab.grammars
    t0 = time.perf_counter()
    results: list = []
    thread = _post_in_thread(client, {"prompt": "x", "max_tokens": 2, **slow_regex(60)}, results)
    assert wait_until(lambda: grammars.worker_pids(), 10)
    pid = grammars.worker_pids()[0]
    thread.join(20)
    resp = results[0]
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == "structured_outputs"
    assert "did not compile within 3 s" in error["message"]
    assert time.perf_counter() - t0 < 10
    assert wait_until(lambda: not _alive(pid), 5), "the runaway compile's process still runs"
    assert wait_until(lambda: grammars.num_killed == 1, 5)
    # a fresh worker, started in its place, serves the next grammar
    assert wait_until(lambda: grammars.worker_pids() and pid not in grammars.worker_pids(), 10)
    resp = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                     "response_format": {"type": "json_object"}})  # fmt: skip
    assert resp.status_code == 200, resp.text


@pytest.mark.slow
def test_a_client_that_leaves_during_its_compile_has_the_compile_killed(fake_engine, monkeypatch):
    from servelab.engine import grammar_workers
    from servelab.server.async_engine import AsyncEngine
    from servelab.server.engine_requests import ClientDisconnected, build_requests, prepare_logits_processors
    from servelab.server.protocol import CompletionRequest
    from servelab.server.state import ServerState

    state = ServerState(api_key=None, grammar_config=GrammarConfig(compile_timeout_s=60, num_workers=1))
    monkeypatch.setattr(grammar_workers, "compile_spec", slow_compile)
    state.attach(AsyncEngine(engine_with_grammars(fake_engine)))
    state.grammars._compile_fn = slow_compile
    req = CompletionRequest.model_validate({"prompt": "x", "max_tokens": 2, **slow_regex(60)})
    engine_requests = build_requests(state.front, "r", [[5, 6]], req, 2, None, 0.0)

    class LeavingClient:
        """An ASGI request whose client hangs up once the compile has started."""

        async def receive(self) -> dict:
            while not state.grammars.worker_pids():
                await asyncio.sleep(0.05)
            pids.extend(state.grammars.worker_pids())
            await asyncio.sleep(0.5)
            return {"type": "http.disconnect"}

    pids: list[int] = []

    async def run() -> float:
        t0 = time.perf_counter()
        with pytest.raises(ClientDisconnected):
            await prepare_logits_processors(state, state.offload.small, engine_requests, LeavingClient())
        return time.perf_counter() - t0

    try:
        elapsed_s = asyncio.run(run())
        assert elapsed_s < 15
        assert wait_until(lambda: state.grammars.num_killed == 1, 5)
        assert wait_until(lambda: len(state.grammars.worker_pids()) == 1, 10)
        assert len(pids) == 1 and not _alive(pids[0]), "the abandoned compile's process still runs"
        assert engine_requests[0].params.prepared_edits is None  # nothing reached the engine
    finally:
        state.grammars.shutdown()
        state.offload.shutdown()


def test_a_constraint_too_large_to_compile_quickly_is_a_400_naming_its_field(fake_engine):
    with TestClient(create_app(engine_with_grammars(fake_engine))) as client:
        grammars = client.app.state.servelab.grammars
        compiles: list = []
        real_run = grammars._run
        grammars._run = lambda job: compiles.append(job.spec) or real_run(job)
        cases = [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                "type": "string", "pattern": "^[a-z]{1,10000}$"}}}}, "response_format", "bounded repetitions"),
            ({"guided_json": {"enum": list(range(2000))}}, "guided_json", "2,000 enum and const values"),
            ({"guided_json": {"enum": [f"value-{i}" for i in range(100_000)]}}, "guided_json", "at most 131,072"),
            ({"structured_outputs": {"regex": "([a-z]{1,100}){1,100}"}}, "structured_outputs", "10,000 characters"),
            ({"guided_choice": [str(i) for i in range(2000)]}, "guided_choice", "2,000 choices"),
        ]  # fmt: skip
        for extra, param, text in cases:
            resp = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
            assert resp.status_code == 400, resp.text
            error = resp.json()["error"]
            assert error["param"] == param and text in error["message"], error
        assert compiles == []  # refused before any compile


def test_the_first_grammar_meets_a_short_timeout_though_its_worker_starts_cold(grammar_client):
    """The worker processes start with the first compile (no memory held for a server that never
    sees a grammar), and that start (~2 s: xgrammar and torch imported) is not charged to it."""
    client = grammar_client(compile_timeout_s=1.0, num_workers=2)
    grammars = client.app.state.servelab.grammars
    assert grammars.worker_pids() == []
    body = {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "[a-z]+"}}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text


@pytest.mark.slow  # 4 s: two worker starts held back 1.5 s each
def test_a_compile_is_not_charged_the_start_of_its_worker_process(fake_engine, monkeypatch):
    """A compile that must wait for a worker process (none started yet, or a killed one's
    replacement) has its deadline moved by that wait; the compile itself is still bounded."""
    from servelab.engine import grammar_workers

    real_init = grammar_workers._Worker.__init__

    def slow_start(self, *args):  # a loaded host: a start well past the timeout
        time.sleep(1.5)
        real_init(self, *args)

    monkeypatch.setattr(grammar_workers._Worker, "__init__", slow_start)
    grammars = grammar_workers.GrammarWorkers(engine_with_grammars(fake_engine).logits_processors.structured,
                                              GrammarConfig(compile_timeout_s=1.0, num_workers=1), slow_compile)  # fmt: skip

    async def main() -> tuple[float, str]:
        t0 = time.perf_counter()
        await grammars.compile(StructuredOutputSpec("regex", "[a-z]+"))  # a cold start, then the compile
        cold_s = time.perf_counter() - t0
        with pytest.raises(InvalidArgument) as refused:  # past the timeout: killed, a replacement starts
            await grammars.compile(StructuredOutputSpec("regex", "slow30", source="guided_regex"))
        await grammars.compile(StructuredOutputSpec("regex", "[0-9]+"))  # waits for the replacement
        return cold_s, refused.value.message

    try:
        cold_s, message = asyncio.run(main())
    finally:
        grammars.shutdown()
    assert cold_s > 1.5
    assert "guided_regex: the regex constraint did not compile within 1 s" in message
    assert grammars.num_killed == 1


def test_a_compiler_that_cannot_start_is_a_503_not_a_timeout(fake_engine, monkeypatch):
    from servelab.engine import grammar_workers
    from servelab.errors import CompilerUnavailable

    def no_start(self, *args):
        raise TimeoutError("a grammar worker did not start within 120 s")

    monkeypatch.setattr(grammar_workers._Worker, "__init__", no_start)
    grammars = grammar_workers.GrammarWorkers(engine_with_grammars(fake_engine).logits_processors.structured,
                                              GrammarConfig(compile_timeout_s=30, num_workers=1))  # fmt: skip
    try:
        with pytest.raises(CompilerUnavailable, match="the grammar compiler could not start") as refused:
            asyncio.run(grammars.compile(StructuredOutputSpec("regex", "[a-z]+")))
    finally:
        grammars.shutdown()
    assert refused.value.http_status == 503


def test_the_grammar_cache_is_bounded_in_bytes():
    cache = GrammarCache(capacity_bytes=10_000)
    sizes = [3_000, 4_000, 2_500, 5_000, 1_000, 9_000, 20_000]
    specs = [StructuredOutputSpec("regex", f"[a-z]{{{i + 1}}}") for i in range(len(sizes))]
    for spec, size in zip(specs, sizes):
        cache.put(spec, SimpleNamespace(memory_size_bytes=size))
        accounted = sum(cache.get(s).memory_size_bytes for s in specs if cache._entries.get(s) is not None)
        assert cache.size_bytes == accounted <= cache.capacity_bytes
    # 9,000 dropped everything older but the 1,000 one; the 20,000 one was never kept
    assert cache.get(specs[4]) is not None and cache.get(specs[5]) is not None and len(cache) == 2
    assert cache.get(specs[6]) is None
    cache.resize(0)
    assert len(cache) == 0 and cache.size_bytes == 0


def test_the_cache_drops_the_least_recently_used_first():
    cache = GrammarCache(capacity_bytes=3)
    a, b, c, d = (StructuredOutputSpec("regex", x) for x in "abcd")
    for spec in (a, b, c):
        cache.put(spec, SimpleNamespace(memory_size_bytes=1))
    cache.get(a)  # a is now the most recent
    cache.put(d, SimpleNamespace(memory_size_bytes=1))
    assert cache.get(b) is None and all(cache.get(s) is not None for s in (a, c, d))


@pytest.mark.slow
def test_huge_tokenize_bodies_do_not_hold_up_a_plain_request(fake_engine):
    with TestClient(create_app(fake_engine())) as client:
        assert plain_completion_s(client) < 5  # warm
        text = "hello world " * 330_000  # 3.96 MB, under the 4 MiB body limit; ~4 s of tokenizing each
        results: list = []
        threads = [_post_in_thread(client, {"prompt": text}, results, "/tokenize") for _ in range(2)]
        time.sleep(0.5)  # both bodies read and being prepared
        assert plain_completion_s(client) < 2.0
        for thread in threads:
            thread.join(60)
        assert [r.status_code for r in results] == [200, 200]


def test_tokenize_is_refused_while_draining(fake_engine):
    with TestClient(create_app(fake_engine())) as client:
        client.app.state.servelab.draining = True
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
            resp = client.post(path, json=body)
            assert resp.status_code == 503 and resp.headers["Retry-After"], resp.text


def test_a_full_preparation_lane_answers_503(fake_engine):
    with TestClient(create_app(fake_engine())) as client:
        client.app.state.servelab.offload.small.max_pending = 0
        resp = client.post("/tokenize", json={"prompt": "hi"})
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "server_overloaded", resp.text
