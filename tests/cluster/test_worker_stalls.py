"""A worker's step loop that stalls: the front end's watchdog fails a hung worker (and only its
requests) while idle and busy workers stay up, in a cluster in one process
(tests/cluster/memory_cluster.py) and with real worker processes; and a slow grammar compile
does not stall a worker's other requests."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from servelab.core.sequence import FinishReason, SamplingParams
from servelab.engine.client import EngineFailure, EngineRequest

from tests.cluster.memory_cluster import memory_cluster

PROMPT = list(range(20, 40))


def _req(rid: str, max_tokens: int, **params) -> EngineRequest:
    return EngineRequest(rid, PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.slow  # 6 s: an idle wait and a hang, each past the watchdog's 1.5 s
def test_a_hung_worker_is_failed_alone_and_an_idle_one_is_not(fake_engine):
    cluster, engines, _ = memory_cluster(fake_engine, 2, step_sleep_s=0.005, max_model_len=1024, num_blocks=256)
    cluster.hang_timeout_s = 1.5
    hang, release = threading.Event(), threading.Event()
    real_step = engines[2].step

    def step():  # the test's hook: worker 2's engine stops in a step, its other threads live on
        if hang.is_set():
            release.wait()
        return real_step()

    engines[2].step = step

    async def main(driver):
        driver.start()
        await asyncio.sleep(2.5)  # idle longer than the timeout: waiting for work is no hang
        assert driver.health()["status"] == "ok"
        a = (await driver.submit([_req("a", 600)])).__aiter__()
        b = (await driver.submit([_req("b", 900)])).__aiter__()  # least-outstanding: the other worker
        assert {rid: r.worker.index for rid, r in driver._remote.items()} == {"a": 1, "b": 2}
        await a.__anext__()
        await b.__anext__()
        hang.set()
        t0 = time.monotonic()
        with pytest.raises(EngineFailure, match=r"worker 2 failed \(hung: .* past --worker-hang-timeout 1.5s\)"):
            async for _ in b:
                pass
        detected_s = time.monotonic() - t0
        health = driver.health()
        assert health["status"] == "degraded"
        assert [(w["rank"], w["status"]) for w in health["workers"]] == [(1, "ok"), (2, "failed")]
        assert "hung" in health["workers"][1]["error"]
        c = await driver.submit([_req("c", 3)])  # the router skips the hung worker
        assert driver._remote["c"].worker.index == 1
        async for _ in c:
            pass
        last = [out async for out in a][-1]  # worker 1 served on through the hang
        assert last.finish_reason is FinishReason.LENGTH and last.num_output_tokens == 600
        await driver.stop()
        return detected_s

    try:
        detected_s = run(main(cluster))
    finally:
        release.set()
    assert 1.5 <= detected_s < 5.0


def test_a_slow_grammar_compile_does_not_stall_the_workers_other_requests(tiny_engine_factory):
    """The test's hook makes preparing one request's logits processors (its grammar compile, or
    here its bad words) take 1.5 s on the worker; the request already running there keeps
    getting tokens meanwhile, and the slow one is served once prepared."""
    cluster, engines, _ = memory_cluster(tiny_engine_factory, 1, num_blocks=64, max_model_len=256)
    worker = engines[1]
    window: list[float] = []
    real_prepare, real_step = worker.logits_processors.prepare, worker.step

    def slow_prepare(params, *siblings, **kwargs):
        window.append(time.perf_counter())
        time.sleep(1.5)
        real_prepare(params, *siblings, **kwargs)
        window.append(time.perf_counter())

    def paced_step():  # the running request must outlast the compile on any host: 229 steps >= 2.3 s
        time.sleep(0.01)
        return real_step()

    worker.logits_processors.prepare, worker.step = slow_prepare, paced_step

    async def main(driver):
        driver.start()
        arrival_s = time.perf_counter()
        a_req = _req("a", 230, temperature=0.0)
        a_req.arrival_s = arrival_s
        a = (await driver.submit([a_req])).__aiter__()
        first = await a.__anext__()
        slow = await driver.submit([_req("slow", 4, bad_words=["hello"])])
        outputs = [first, *[out async for out in a]]
        slow_outputs = [out async for out in slow]
        await driver.stop()
        return [arrival_s + t for out in outputs for t in out.token_offsets_s], slow_outputs[-1]

    times, slow_last = run(main(cluster))
    assert slow_last.finish_reason is FinishReason.LENGTH and slow_last.num_output_tokens == 4
    start, end = window
    assert times[0] < start and times[-1] > end, "the running request must span the compile"
    during = [t for t in times if start <= t <= end]
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert len(during) > 10 and max(gaps) < 0.75, (len(during), max(gaps))


def test_a_request_the_worker_cannot_prepare_is_refused_with_its_error_and_leaves_nothing(tiny_engine_factory):
    from servelab.errors import InvalidArgument

    async def main(driver):
        driver.start()
        with pytest.raises(InvalidArgument, match="allowed_token_ids") as refused:
            await driver.submit([_req("bad", 4, allowed_token_ids=[10**6])])  # outside the vocabulary
        assert refused.value.param == "allowed_token_ids"
        assert not driver._remote and not driver._sinks and driver.workers[0].outstanding == 0
        ok = [out async for out in await driver.submit([_req("ok", 3)])]  # the worker serves on
        await driver.stop()
        return ok[-1]

    cluster, engines, _ = memory_cluster(tiny_engine_factory, 1, num_blocks=64, max_model_len=256)
    assert run(main(cluster)).finish_reason is FinishReason.LENGTH
    assert not engines[1].core._requests


HANG_TOKEN = 477  # a prompt that starts with it hangs the worker that runs it (the hook below)


def hanging_worker_main() -> None:
    """A `servelab worker` (rendezvous from the environment) with the test's hook: its step loop
    stops for good in the first step that runs a prompt starting with HANG_TOKEN, while its
    other threads (the heartbeat's sender) live on."""
    import sys

    from servelab.cluster import worker
    from servelab.cluster.channel import Rendezvous

    real_step = worker.WorkerLoop._step

    def step(self) -> None:
        if any(state.seq.prompt_token_ids[0] == HANG_TOKEN for state in self.engine.core._requests.values()):
            threading.Event().wait()
        real_step(self)

    worker.WorkerLoop._step = step
    sys.exit(worker.worker_main(Rendezvous.from_env(timeout_s=120.0)))


@pytest.mark.slow  # 22 s here, 18 of them starting the processes
def test_a_hung_worker_process_is_failed_and_the_cluster_serves_on(tiny_model_dir, tmp_path):
    """Real processes and gloo links: two external workers, one of which hangs in a step."""
    import sys

    import httpx

    from tests.cluster.server_checks import env_workers, metric
    from tests.server.conftest import launch_server

    code = "from tests.cluster.test_worker_stalls import hanging_worker_main; hanging_worker_main()"
    port, workers = env_workers(tmp_path, [sys.executable, "-c", code])
    try:
        server = launch_server(tiny_model_dir, tmp_path, "--data-parallel", "2", "--external-workers",
                               "--master-addr", "127.0.0.1", "--master-port", str(port), "--worker-hang-timeout", "2s",
                               "--num-blocks", "64", "--max-model-len", "256")  # fmt: skip
        try:
            url = server.url
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/completions", json={"prompt": [HANG_TOKEN, 5, 6], "max_tokens": 20}, timeout=60)
            seconds = time.monotonic() - t0
            assert r.status_code == 500, r.text
            error = r.json()["error"]
            assert error["type"] == "internal_server_error"
            assert "hung: its step loop finished nothing for" in error["message"], error
            assert "past --worker-hang-timeout 2s" in error["message"] and 2.0 <= seconds < 10.0
            health = httpx.get(url + "/health")
            assert health.status_code == 200 and health.json()["status"] == "degraded", (health.text, server.log())
            states = {w["rank"]: w["status"] for w in health.json()["workers"]}
            hung = next(rank for rank, state in states.items() if state == "failed")
            assert sorted(states.values()) == ["failed", "ok"]
            for _ in range(2):  # the router skips the hung worker
                ok = httpx.post(url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
                assert ok.status_code == 200, ok.text
            assert metric(httpx.get(url + "/metrics").text, "servelab:worker_up")[str(hung)] == 0.0
            assert workers[hung - 1].poll() is None  # external: cut off, not killed; its host's to restart
        finally:
            assert server.stop() == 0, server.log()
        healthy = 3 - hung
        assert workers[healthy - 1].wait(timeout=30) == 0, (tmp_path / f"worker{healthy}.log").read_text()
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
