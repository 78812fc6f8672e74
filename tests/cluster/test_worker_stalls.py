"""A worker's step loop that stalls, in a cluster in one process (tests/cluster/memory_cluster.py):
the front end's watchdog fails a hung worker (and only its requests) while idle and busy workers
stay up, and a slow grammar compile does not stall a worker's other requests."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from servelab.core.sequence import FinishReason, SamplingParams
from servelab.server.async_engine import EngineFailure, EngineRequest

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
        assert last.finish_reason is FinishReason.LENGTH and last.seq.num_output_tokens == 600
        await driver.stop()
        return detected_s

    try:
        detected_s = run(main(cluster))
    finally:
        release.set()
    assert 1.5 <= detected_s < 5.0
