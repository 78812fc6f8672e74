"""ClusterEngine over real WorkerLoops in one process (tests/cluster/memory_cluster.py): routing,
admission across workers, aborts and a worker's death, without starting processes."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servelab.core.sequence import FinishReason, SamplingParams
from servelab.errors import InvalidArgument, QueueFull
from servelab.engine.client import EngineFailure, EngineRequest
from servelab.server.async_engine import AsyncEngine

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
        assert last.num_output_tokens == 5 + i and sum(len(o.token_offsets_s) for o in outputs) == 5 + i
        assert 0 <= last.first_scheduled_offset_s <= last.first_token_offset_s <= last.finished_offset_s
    assert all(e.stats().prefix_cache_queries > 0 for e in engines.values())  # both served
    assert cluster.stats.num_running == 0 and all(w.outstanding == 0 for w in cluster.workers)


async def _until(predicate, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached")


def test_max_waiting_bounds_the_clusters_waiting_requests_not_each_workers(fake_engine):
    async def main(driver):
        driver.start()
        held = []  # a stream (or its iterator) dropped unread is aborted: hold them
        for rid in ("r0", "r1"):  # one running on each worker (max_num_seqs=1)
            held.append((await driver.submit([_req(rid, 500)])).__aiter__())
            await held[-1].__anext__()
        await _until(lambda: driver.num_waiting == 0)
        held.append(await driver.submit([_req("r2", 500)]))
        held.append(await driver.submit([_req("r3", 500)]))  # least-outstanding: one waits on each worker
        assert {rid: r.worker.index for rid, r in driver._remote.items()} == {"r0": 1, "r1": 2, "r2": 1, "r3": 2}
        # each worker's own queue (bound 2) has room; the cluster's (bound 2) has none
        with pytest.raises(QueueFull, match=r"request 'r4' rejected: the waiting queue is full \(max_waiting=2\)"):
            await driver.submit([_req("r4", 500)])
        assert "r4" not in driver._sinks and "r4" not in driver._remote
        assert [w.outstanding for w in driver.workers] == [2, 2]
        driver.abort(["r3"])  # one waiting request leaves: room for one, not for two choices
        await _until(lambda: driver.num_waiting == 1)
        with pytest.raises(QueueFull, match="max_waiting=2"):
            await driver.submit([_req("n-0", 5), _req("n-1", 5)])
        assert not {"n-0", "n-1"} & set(driver._remote)
        with pytest.raises(InvalidArgument, match="could never be admitted"):  # more choices than the bound: a 400
            await driver.submit([_req(f"x-{i}", 5) for i in range(3)])
        held.append(await driver.submit([_req("r5", 5)]))
        await driver.stop()

    cluster, engines, _ = memory_cluster(fake_engine, 2, max_num_seqs=1, max_waiting=2, step_sleep_s=0.01,
                                         max_model_len=1024, num_blocks=256)  # fmt: skip
    run(main(cluster))
    for engine in engines.values():
        stats = engine.stats()
        assert stats.num_blocks_free == stats.num_blocks_total and not engine.core._requests


def test_a_full_cluster_answers_the_same_503_as_one_engine(fake_engine):
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from servelab.server.app import create_app

    def overflow(app, stats) -> tuple[int, str | None, dict]:
        """Two running, two waiting (the bound), then one more request."""
        body = {"prompt": "hello", "max_tokens": 60, "ignore_eos": True}
        with TestClient(app) as c, ThreadPoolExecutor(4) as pool:
            long = []
            for running, waiting in ((2, 0), (2, 2)):
                long += [pool.submit(c.post, "/v1/completions", json=body) for _ in range(2)]
                for _ in range(1000):
                    if (stats().num_running, stats().num_waiting) == (running, waiting):
                        break
                    time.sleep(0.01)
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert [f.result().status_code for f in long] == [200] * 4
        return r.status_code, r.headers.get("retry-after"), r.json()

    one = fake_engine(max_num_seqs=2, max_waiting=2, step_sleep_s=0.01)
    single = overflow(create_app(one), one.stats)
    cluster, _, _ = memory_cluster(fake_engine, 2, max_num_seqs=1, max_waiting=2, step_sleep_s=0.01)
    clustered = overflow(create_app(cluster), lambda: cluster.stats)
    assert single[:2] == clustered[:2] == (503, "1")
    for body in (single[2], clustered[2]):
        body["error"]["message"] = re.sub(r"request '[^']*'", "request ID", body["error"]["message"])
    assert single[2] == clustered[2]
    assert clustered[2]["error"]["type"] == "server_overloaded" and "max_waiting=2" in clustered[2]["error"]["message"]


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
        assert not driver.is_running and driver.health()["status"] == "down"
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
    cluster.add_observer(
        lambda out: aborted.append(out.request_id) if out.finish_reason is FinishReason.ABORT else None
    )
    run(main(cluster))
    assert sorted(aborted) == [f"x{i}" for i in range(5)]
    for engine in engines.values():
        stats = engine.stats()
        assert stats.num_blocks_free == stats.num_blocks_total and stats.num_running == stats.num_waiting == 0
        assert not engine.core._requests


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


def test_a_refusal_that_arrives_after_its_worker_was_declared_failed_is_dropped(fake_engine):
    from servelab.cluster import messages as m

    cluster, _, _ = memory_cluster(fake_engine, 2)
    # the worker refused a batch that the front end had already failed along with the worker (its
    # receiving thread can post one more message after posting the failure)
    refusal = m.Admitted(batch=7, error=m.WireError("RuntimeError", "the worker could not admit it"))
    cluster._on_message(cluster.workers[0], refusal)
    assert not cluster._admissions and not cluster._remote


def test_counters_keep_a_dead_workers_share_and_gauges_drop_it(fake_engine):
    counters = ("num_preemptions", "prefix_cache_hits", "prefix_cache_queries")

    async def main(driver, kills):
        driver.start()
        for i in range(2):  # two at once: one on each worker; the second time, from each one's prefix cache
            streams = [await driver.submit([_req(f"r{i}{j}", 3)]) for j in range(2)]
            await asyncio.gather(*(_collect(s) for s in streams))
        assert all(w.stats.prefix_cache_queries > 0 and w.stats.prefix_cache_hits > 0 for w in driver.workers)
        before = driver.stats
        kills[2]()
        await _until(lambda: not driver.workers[1].alive)
        after = driver.stats
        for name in counters:
            assert getattr(after, name) == getattr(before, name) > 0 or name == "num_preemptions", name
        assert after.num_blocks_total == before.num_blocks_total // 2  # a gauge: the live worker's pool
        await _collect(await driver.submit([_req("r9", 3)]))  # the survivor's counters still add up
        assert driver.stats.prefix_cache_queries > after.prefix_cache_queries
        await driver.stop()

    cluster, _, kills = memory_cluster(fake_engine, 2, max_model_len=1024, num_blocks=256)
    run(main(cluster, kills))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.booleans(), st.integers(0, 5)), max_size=30))
def test_cluster_counters_never_decrease_whatever_reports_and_deaths_come(events):
    """Each event: worker i reports counters grown by d (True: then it dies). A report after its
    death is dropped, as the front end stops reading a failed worker."""
    from types import SimpleNamespace

    from servelab.cluster.front_end import ClusterEngine, WorkerHandle
    from servelab.engine.outputs import EngineStats

    workers = [WorkerHandle(i, link=None, ready=None, stats=EngineStats.idle(8)) for i in range(3)]
    cluster = SimpleNamespace(workers=workers, retired=[])
    totals = lambda s: (s.num_preemptions, s.prefix_cache_hits, s.prefix_cache_queries)  # noqa: E731
    last = totals(ClusterEngine.stats.fget(cluster))
    for i, dies, d in events:
        w = workers[i]
        if w.alive:
            s = w.stats
            counts = replace(s.scheduler, num_preemptions=s.num_preemptions + d, prefix_cache_hits=s.prefix_cache_hits + d,
                             prefix_cache_queries=s.prefix_cache_queries + 2 * d)  # fmt: skip
            w.stats = EngineStats(counts, 8)
            if dies:
                w.failure = "killed"
        now = totals(ClusterEngine.stats.fget(cluster))
        assert all(a >= b for a, b in zip(now, last)), (now, last)
        last = now
    assert ClusterEngine.stats.fget(cluster).num_blocks_total == 8 * sum(w.alive for w in workers)


@pytest.mark.parametrize("dead", ["prefill", "decode"])
def test_a_disaggregated_cluster_without_a_pool_answers_health_503(fake_engine, dead):
    """--disagg 1:1 with its only prefill (or decode) worker dead cannot serve: /health is 503
    with Retry-After and the dead pool named, not 200 "degraded", and so is a new request."""
    from dataclasses import replace

    from fastapi.testclient import TestClient

    from servelab.server.app import create_app
    from servelab.engine.client import EngineStopped

    cluster, _, kills = memory_cluster(fake_engine, 2, step_sleep_s=0.005)
    for w, role in zip(cluster.workers, ("prefill", "decode")):
        w.ready = replace(w.ready, role=role)
    with TestClient(create_app(cluster)) as c:
        assert c.get("/health").json()["status"] == "ok"
        kills[1 if dead == "prefill" else 2]()
        for _ in range(200):
            if not all(w.alive for w in cluster.workers):
                break
            time.sleep(0.01)
        r = c.get("/health")
        assert (r.status_code, r.headers.get("retry-after")) == (503, "1"), r.text
        assert f"no {dead} worker is left" in r.json()["error"]["message"], r.text
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and f"no {dead} worker is left" in r.json()["error"]["message"], r.text
    with pytest.raises(EngineStopped, match="not running"):
        run(cluster.submit([_req("x")]))


def test_embeddings_are_refused_with_a_501_naming_the_limitation(fake_engine):
    from fastapi.testclient import TestClient

    from servelab.server.app import create_app

    cluster, _, _ = memory_cluster(fake_engine, 2)
    with TestClient(create_app(cluster)) as client:
        resp = client.post("/v1/embeddings", json={"input": "hello"})
        assert resp.status_code == 501, resp.text
        err = resp.json()["error"]
        assert "data-parallel or disaggregated cluster" in err["message"] and err["param"] == "input"
        assert client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}).status_code == 200
    assert not cluster._remote and not cluster._sinks


def _wait(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def fast_restarts(monkeypatch):
    from servelab.cluster import front_end

    monkeypatch.setattr(front_end, "RESTART_BACKOFF_S", 0.05)


def test_a_failed_worker_is_restarted_and_serves_again(fake_engine, fast_restarts):
    from tests.cluster.memory_cluster import memory_worker

    kwargs = {"step_sleep_s": 0.005, "max_model_len": 1024, "num_blocks": 256}
    cluster, _, kills = memory_cluster(fake_engine, 2, **kwargs)
    replacements = []

    def restart(old, peers):
        assert peers == []  # data-parallel: no peers to link to
        handle, _, kill = memory_worker(fake_engine, old.index, **kwargs)
        replacements.append(kill)
        return handle

    cluster.restart = restart

    async def main(driver):
        driver.start()
        a = await driver.submit([_req("a", 300)])
        b = await driver.submit([_req("b", 300)])
        assert driver._remote["b"].worker.index == 2
        got_b = asyncio.ensure_future(_collect(b))
        await asyncio.sleep(0.05)
        before = driver.stats.prefix_cache_queries
        kills[2]()
        with pytest.raises(EngineFailure, match="worker 2 failed"):
            await got_b  # its request fails alone...
        assert (await _collect(a))[-1].finish_reason is FinishReason.LENGTH  # ...the other runs to its end
        for _ in range(500):
            if driver.health()["status"] == "ok":
                break
            await asyncio.sleep(0.02)
        health = driver.health()
        assert health["status"] == "ok", health
        assert [(w["rank"], w["status"], w["restarts"]) for w in health["workers"]] == [(1, "ok", 0), (2, "ok", 1)]
        assert driver.stats.prefix_cache_queries >= before  # the failed worker's counters still count
        held = await driver.submit([_req("c", 200)])  # least-outstanding: c on 1, d on the new 2
        d = await driver.submit([_req("d", 5)])
        assert driver._remote["d"].worker is driver.workers[1] and driver.workers[1] is not None
        assert (await _collect(d))[-1].finish_reason is FinishReason.LENGTH
        await _collect(held)
        await driver.stop()

    run(main(cluster))
    assert len(replacements) == 1 and len(cluster.retired) == 1


def test_restarts_stop_at_the_limit(fake_engine, fast_restarts):
    cluster, _, kills = memory_cluster(fake_engine, 2, step_sleep_s=0.005)
    attempts = []

    def restart(old, peers):
        attempts.append(old.index)
        raise RuntimeError("the model file is gone")

    cluster.restart, cluster.restart_limit = restart, 2

    async def main(driver):
        driver.start()
        kills[2]()
        for _ in range(500):
            w = driver.workers[1]
            if not w.alive and not w.restarting:
                break
            await asyncio.sleep(0.02)
        health = driver.health()
        assert health["status"] == "degraded"
        assert [(w["status"], w["restarts"]) for w in health["workers"]] == [("ok", 0), ("failed", 2)]
        await driver.stop()

    run(main(cluster))
    assert attempts == [2, 2]


def test_health_lists_the_workers_in_its_503_while_the_only_worker_restarts(fake_engine, monkeypatch):
    from fastapi.testclient import TestClient

    from servelab.cluster import front_end
    from servelab.server.app import create_app
    from tests.cluster.memory_cluster import memory_worker

    monkeypatch.setattr(front_end, "RESTART_BACKOFF_S", 0.5)  # long enough to see the gap
    cluster, _, kills = memory_cluster(fake_engine, 1, step_sleep_s=0.005)
    cluster.restart = lambda old, peers: memory_worker(fake_engine, old.index, step_sleep_s=0.005)[0]
    with TestClient(create_app(cluster)) as c:
        ok = c.get("/health")
        assert ok.status_code == 200 and [w["status"] for w in ok.json()["workers"]] == ["ok"]
        kills[1]()
        _wait(lambda: not cluster.workers[0].alive)
        down = c.get("/health")
        assert (down.status_code, down.headers["retry-after"]) == (503, "1"), down.text
        body = down.json()
        assert body["status"] == "down" and body["error"]["type"] == "server_overloaded"
        assert [(w["rank"], w["status"]) for w in body["workers"]] == [(1, "restarting")]
        _wait(lambda: c.get("/health").status_code == 200)
        assert c.get("/health").json()["workers"][0]["restarts"] == 1
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_a_failed_workers_lingering_process_is_killed_and_reaped(fake_engine):
    """A hung worker's process is alive when the front end gives up on it: it is killed, then
    waited for, so no zombie is left in the process table."""
    import multiprocessing

    from tests.cluster.server_checks import reaped

    cluster, _, _ = memory_cluster(fake_engine, 2, step_sleep_s=0.005)
    wedged = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,), daemon=True)
    wedged.start()
    cluster.workers[1].process = wedged

    async def main(driver):
        driver.start()
        driver._lost(driver.workers[1], "hung: the test's")
        assert driver.health()["workers"][1]["status"] == "failed"  # no restart given: it stays failed
        assert await asyncio.to_thread(reaped, wedged.pid, 10.0)  # while the server runs on, not at its stop
        await driver.stop()

    run(main(cluster))
