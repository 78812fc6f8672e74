"""ClusterEngine over real WorkerLoops in one process (tests/cluster/memory_cluster.py): routing,
admission across workers, aborts and a worker's death, without starting processes."""

from __future__ import annotations

import asyncio

import pytest

from servelab.core.sequence import FinishReason, SamplingParams
from servelab.errors import QueueFull
from servelab.server.async_engine import AsyncEngine, EngineFailure, EngineRequest

from tests.cluster.memory_cluster import memory_cluster

PROMPT = list(range(20, 60))  # two full 16-token blocks: prefix-affinity has something to hash


def _req(rid: str, max_tokens: int = 8, prompt=None) -> EngineRequest:
    return EngineRequest(rid, prompt or PROMPT, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _collect(stream) -> list:
    return [out async for out in stream]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _texts(outputs) -> dict[str, str]:
    texts: dict[str, str] = {}
    for out in outputs:
        texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta
    return texts


def test_requests_spread_over_workers_and_match_one_engine(fake_engine):
    async def main(driver):
        driver.start()
        streams = [await driver.submit([_req(f"r{i}", 5 + i, list(range(20 + i, 40 + 2 * i)))]) for i in range(6)]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        await driver.stop()
        return results

    cluster, engines, _ = memory_cluster(fake_engine, 2)
    got = run(main(cluster))
    want = run(main(AsyncEngine(fake_engine())))
    assert [_texts(r) for r in got] == [_texts(r) for r in want]
    for i, outputs in enumerate(got):
        assert sum(len(o.new_token_ids) for o in outputs) == 5 + i
        last = outputs[-1]
        assert last.finished and last.finish_reason is FinishReason.LENGTH
        assert last.seq.num_output_tokens == 5 + i and len(last.seq.token_times_s) == 5 + i
        assert last.seq.first_scheduled_s <= last.seq.first_token_s <= last.seq.finished_s
    assert all(e.stats().prefix_cache_queries > 0 for e in engines.values())  # both served
    assert cluster.stats.num_running == 0 and all(w.outstanding == 0 for w in cluster.workers)


def test_a_full_queue_passes_the_request_to_another_worker(fake_engine):
    async def main(driver):
        driver.start()
        first = await driver.submit([_req("r0", 500)])
        it = first.__aiter__()
        await it.__anext__()  # r0 runs on worker 1 (max_num_seqs=1)
        held = [first]  # a stream dropped unread is aborted: hold them
        held.append(await driver.submit([_req("r1", 500)]))  # same prefix: worker 1's queue, now full
        held.append(await driver.submit([_req("r2", 500)]))  # worker 1 refuses: worker 2 takes it
        where = {rid: r.worker.index for rid, r in driver._remote.items()}
        held.append(await driver.submit([_req("r3", 500)]))  # worker 2's queue
        with pytest.raises(QueueFull, match="max_waiting=1"):
            await driver.submit([_req("r4", 500)])  # every queue is full
        assert "r4" not in driver._sinks and "r4" not in driver._remote
        await driver.stop()
        return where

    cluster, _, _ = memory_cluster(fake_engine, 2, "prefix-affinity", max_num_seqs=1, max_waiting=1,
                                   step_sleep_s=0.01, max_model_len=1024, num_blocks=256)  # fmt: skip
    assert run(main(cluster)) == {"r0": 1, "r1": 1, "r2": 2}


def test_a_dead_worker_fails_only_its_requests(fake_engine):
    async def main(driver, kills):
        driver.start()
        a = await driver.submit([_req("a", 400)])
        b = await driver.submit([_req("b", 400)])  # least-outstanding: the other worker
        on = {rid: r.worker.index for rid, r in driver._remote.items()}
        assert on == {"a": 1, "b": 2}
        got_b = asyncio.ensure_future(_collect(b))
        await asyncio.sleep(0.05)
        kills[2]()
        with pytest.raises(EngineFailure, match="worker 2 failed .*connection lost"):
            await got_b
        outputs = await _collect(a)
        assert outputs[-1].finish_reason is FinishReason.LENGTH
        health = driver.health()
        assert health["status"] == "degraded"
        assert [(w["rank"], w["status"]) for w in health["workers"]] == [(1, "ok"), (2, "failed")]
        c = await driver.submit([_req("c", 3)])  # the router skips the dead worker
        assert driver._remote["c"].worker.index == 1
        await _collect(c)
        assert set(driver.worker_stats()) == {"1", "2"} and driver.worker_stats()["2"] is None
        assert driver.is_running
        kills[1]()
        await asyncio.sleep(0.1)
        assert not driver.is_running and driver.health()["status"] == "degraded"
        await driver.stop()

    cluster, _, kills = memory_cluster(fake_engine, 2, step_sleep_s=0.005, max_model_len=1024, num_blocks=256)
    errors = []
    cluster.add_observer(lambda out: errors.append(out.request_id) if out.finish_reason is FinishReason.ERROR else None)
    run(main(cluster, kills))
    assert errors == ["b"]  # the metrics see the failed request end with finish reason error


def test_aborts_and_early_exits_leak_no_block_on_any_worker(fake_engine):
    async def main(driver):
        driver.start()

        async def leave_early(rid: str) -> None:
            stream = await driver.submit([_req(rid, 300)])
            it = stream.__aiter__()
            await it.__anext__()
            await it.aclose()  # the client went away: close() aborts it on its worker

        async def finish(rid: str) -> None:
            await _collect(await driver.submit([_req(rid, 6)]))

        await asyncio.gather(*(leave_early(f"x{i}") for i in range(5)), *(finish(f"f{i}") for i in range(5)))
        driver.abort_all(EngineFailure("grace over"))
        for _ in range(200):  # the workers confirm every abort with a final output
            if not driver._remote:
                break
            await asyncio.sleep(0.01)
        assert not driver._remote and not driver._sinks
        await driver.stop()

    cluster, engines, _ = memory_cluster(fake_engine, 2, max_model_len=1024, num_blocks=256)
    aborted = []
    cluster.add_observer(lambda out: aborted.append(out.request_id) if out.finish_reason is FinishReason.ABORT else None)
    run(main(cluster))
    assert sorted(aborted) == [f"x{i}" for i in range(5)]
    for engine in engines.values():
        stats = engine.stats()
        assert stats.num_blocks_free == stats.num_blocks_total and stats.num_running == stats.num_waiting == 0
        assert not engine._requests


def test_admission_errors_come_back_as_themselves_and_leave_nothing(fake_engine):
    from servelab.errors import RequestTooLong

    async def main(driver):
        driver.start()
        with pytest.raises(RequestTooLong, match="maximum context length is 64 tokens"):
            await driver.submit([_req("long", 40)])  # 40-token prompt + 40 > 64
        assert not driver._remote and not driver._sinks
        assert all(w.outstanding == 0 for w in driver.workers)
        stream = await driver.submit([_req("n-0", 3), _req("n-1", 5)])  # n choices: one worker, together
        assert {r.worker.index for r in driver._remote.values()} == {1}
        per_request: dict[str, int] = {}
        for out in await _collect(stream):
            per_request[out.request_id] = per_request.get(out.request_id, 0) + len(out.new_token_ids)
        assert per_request == {"n-0": 3, "n-1": 5}
        await driver.stop()

    cluster, _, _ = memory_cluster(fake_engine, 2, max_model_len=64)
    run(main(cluster))
