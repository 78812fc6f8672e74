"""The asyncio <-> engine-thread bridge, over a real LLMEngine whose model is core's FakeExecutor."""

from __future__ import annotations

import asyncio
import threading

import pytest

from servelab.core.sequence import FinishReason, SamplingParams
from servelab.errors import InvalidArgument, QueueFull, RequestTooLong
from servelab.engine.client import EngineFailure, EngineRequest, EngineStopped
from servelab.server.async_engine import AsyncEngine


def _req(rid: str, max_tokens: int = 8, prompt: str = "hello world") -> EngineRequest:
    return EngineRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def _collect(stream) -> list:
    return [out async for out in stream]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_concurrent_requests_all_finish_with_their_own_tokens(fake_engine):
    async def main():
        bridge = AsyncEngine(fake_engine())
        bridge.start()
        streams = [await bridge.submit([_req(f"r{i}", max_tokens=5 + i)]) for i in range(6)]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        await bridge.stop()
        return bridge, results

    bridge, results = run(main())
    for i, outputs in enumerate(results):
        assert {o.request_id for o in outputs} == {f"r{i}"}
        assert sum(len(o.new_token_ids) for o in outputs) == 5 + i
        assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH
        assert all(not o.finished for o in outputs[:-1])
    assert bridge.num_steps > 0
    assert bridge.stats.num_running == 0 and bridge.stats.num_blocks_free == bridge.stats.num_blocks_total


def test_n_choices_are_admitted_together_and_all_finish(fake_engine):
    async def main():
        bridge = AsyncEngine(fake_engine())
        bridge.start()
        stream = await bridge.submit([_req("c-0", 4), _req("c-1", 6), _req("c-2", 3)])
        outputs = await _collect(stream)
        await bridge.stop()
        return outputs

    outputs = run(main())
    per_request = {}
    for out in outputs:
        per_request.setdefault(out.request_id, 0)
        per_request[out.request_id] += len(out.new_token_ids)
    assert per_request == {"c-0": 4, "c-1": 6, "c-2": 3}


def test_admission_errors_are_raised_by_submit_and_admit_nothing(fake_engine):
    async def main():
        engine = fake_engine(max_model_len=64)
        bridge = AsyncEngine(engine)
        bridge.start()
        with pytest.raises(RequestTooLong) as too_long:
            # the second choice is fine, the first is not: neither may run
            await bridge.submit([_req("a-0", max_tokens=500), _req("a-1", max_tokens=4)])
        await asyncio.sleep(0.05)
        stats = bridge.stats
        ok = await _collect(await bridge.submit([_req("b", 3)]))
        await bridge.stop()
        return too_long.value, stats, ok

    error, stats, ok = run(main())
    assert "64" in error.message and "500" in error.message
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert ok[-1].finished


def test_full_queue_raises_queue_full(fake_engine):
    async def main():
        bridge = AsyncEngine(fake_engine(max_num_seqs=1, max_waiting=1, step_sleep_s=0.01))
        bridge.start()
        first = await bridge.submit([_req("first", 200)])
        first_outputs = first.__aiter__()  # held: dropping the iterator would abort the request
        await first_outputs.__anext__()  # running
        second = await bridge.submit([_req("second", 200)])  # waiting
        with pytest.raises(QueueFull):
            await bridge.submit([_req("third", 5)])
        running, waiting = bridge.stats.num_running, bridge.stats.num_waiting
        await first_outputs.aclose()
        second.close()
        await bridge.stop()
        return running, waiting

    assert run(main()) == (1, 1)


def test_choices_are_admitted_all_or_none_and_never_if_they_cannot_fit(fake_engine):
    """A request's choices (prompts x n) are refused before any is queued: 503 when the queue has
    no room for all of them now, 400 naming n when it never could; nothing is admitted and
    aborted on the way (no 'abort' finishes in the metrics)."""

    async def main():
        engine = fake_engine(max_num_seqs=1, max_waiting=2, step_sleep_s=0.01)
        bridge = AsyncEngine(engine)
        bridge.start()
        with pytest.raises(InvalidArgument, match=r"3 sequences .*max_waiting=2") as never:
            await bridge.submit([_req(f"n-{i}", 5) for i in range(3)])
        first = (await bridge.submit([_req("first", 200)])).__aiter__()
        await first.__anext__()  # running
        second = await bridge.submit([_req("second", 200)])  # waiting: room for one more
        with pytest.raises(QueueFull):
            await bridge.submit([_req("pair-0", 5), _req("pair-1", 5)])
        waiting, seen = bridge.stats.num_waiting, set(engine.core._requests)
        await first.aclose()
        second.close()
        await bridge.stop()
        return never.value.param, waiting, seen

    param, waiting, seen = run(main())
    assert param == "n" and waiting == 1 and seen == {"first", "second"}


def test_leaving_a_stream_early_aborts_it_and_frees_its_blocks(fake_engine):
    async def main():
        engine = fake_engine(step_sleep_s=0.005)
        bridge = AsyncEngine(engine)
        bridge.start()
        idle = bridge.stats
        stream = await bridge.submit([_req("long", 150, prompt="the quick brown fox " * 4)])
        got = 0
        async for out in stream:
            got += len(out.new_token_ids)
            if got >= 3:
                break  # the client went away
        busy_blocks = engine.scheduler_config.num_blocks - bridge.stats.num_blocks_free
        for _ in range(200):
            await asyncio.sleep(0.01)
            if bridge.stats.num_running == 0 and bridge.stats.num_blocks_free == idle.num_blocks_free:
                break
        after = bridge.stats
        await bridge.stop()
        return idle, busy_blocks, after, engine

    idle, busy_blocks, after, engine = run(main())
    assert busy_blocks > 0
    assert after.num_running == 0 and after.num_waiting == 0
    assert after.num_blocks_free == idle.num_blocks_free
    assert engine.executor.num_calls < 100  # it did not run on to 150 tokens


def test_a_failing_step_fails_the_requests_in_flight_and_the_engine_serves_on(fake_engine):
    async def main():
        bridge = AsyncEngine(fake_engine(fail_steps={3}))
        bridge.start()
        stream = await bridge.submit([_req("doomed", 20)])
        with pytest.raises(EngineFailure) as failure:
            await _collect(stream)
        later = await _collect(await bridge.submit([_req("fine", 5)]))
        await bridge.stop()
        return failure.value, later, bridge

    failure, later, bridge = run(main())
    assert "injected failure" in failure.message
    assert sum(len(o.new_token_ids) for o in later) == 5 and later[-1].finish_reason is FinishReason.LENGTH
    assert bridge.num_step_failures == 1
    assert bridge.stats.num_running == 0 and bridge.stats.num_blocks_free == bridge.stats.num_blocks_total


def test_stop_aborts_what_is_running_and_wakes_its_consumers(fake_engine):
    async def main():
        bridge = AsyncEngine(fake_engine(step_sleep_s=0.01))
        bridge.start()
        stream = await bridge.submit([_req("long", 250)])
        consumer = asyncio.ensure_future(_collect(stream))
        await asyncio.sleep(0.05)
        await bridge.stop()
        with pytest.raises(EngineStopped):
            await consumer
        with pytest.raises(EngineStopped):
            await bridge.submit([_req("late", 2)])
        return bridge

    bridge = run(main())
    assert not bridge.is_running
    assert bridge.stats.num_running == 0


def test_the_step_loop_sleeps_when_idle(fake_engine):
    """No busy spin: with nothing to do, the engine thread does not step."""

    async def main():
        engine = fake_engine()
        bridge = AsyncEngine(engine)
        bridge.start()
        await _collect(await bridge.submit([_req("one", 3)]))
        steps = bridge.num_steps
        await asyncio.sleep(0.3)
        idle_steps = bridge.num_steps - steps
        alive = bridge.is_running
        await bridge.stop()
        return idle_steps, alive

    idle_steps, alive = run(main())
    assert alive and idle_steps == 0


def test_observers_run_on_the_engine_thread_for_every_output(fake_engine):
    seen: list[tuple[str, str]] = []

    async def main():
        bridge = AsyncEngine(fake_engine())
        bridge.add_observer(lambda out: seen.append((threading.current_thread().name, out.request_id)))
        bridge.start()
        outputs = await _collect(await bridge.submit([_req("x", 4)]))
        await bridge.stop()
        return outputs

    outputs = run(main())
    assert len(seen) == len(outputs)
    assert {name for name, _ in seen} == {"servelab-engine"}


def test_a_finished_request_is_no_longer_counted_running_when_its_client_sees_it(fake_engine):
    # The stats snapshot (the /metrics gauges, the lab's live panel) is refreshed before a step's
    # outputs go out. A slow stats() widens the window in which the old order showed a finished
    # request as still running.
    import time

    engine = fake_engine()
    stats = engine.stats

    def slow_stats():
        time.sleep(0.05)
        return stats()

    engine.stats = slow_stats

    async def main():
        bridge = AsyncEngine(engine)
        bridge.start()
        seen = []
        async for out in await bridge.submit([_req("r", max_tokens=3)]):
            seen.append((out.finished, bridge.stats.num_running))
        await bridge.stop()
        return seen

    seen = run(main())
    assert seen[-1] == (True, 0)


def test_the_step_log_has_a_line_per_step_with_its_shape_and_times(fake_engine):
    # `serve --step-log`: what calibrate fits the serving term from
    import io
    import json

    log = io.StringIO()

    async def main():
        bridge = AsyncEngine(fake_engine())
        bridge.step_log = log
        bridge.start()
        first = await bridge.submit([_req("a", 4)])
        await _collect(first)
        await asyncio.sleep(0.05)  # idle: the next step's line says how long the loop waited
        streams = [await bridge.submit([_req(f"b{i}", 3)]) for i in range(2)]
        await asyncio.gather(*(_collect(s) for s in streams))
        await bridge.stop()
        return bridge

    bridge = run(main())
    lines = [json.loads(line) for line in log.getvalue().splitlines()]
    assert len(lines) == bridge.num_steps  # every step ran tokens
    assert lines[0]["num_seqs"] == 1 and lines[0]["num_tokens"] > 1 and lines[0]["decode_seqs"] == 0  # the prefill
    assert [x["num_tokens"] for x in lines[1:4]] == [1, 1, 1]  # a's decodes
    assert lines[4]["waited_s"] >= 0.04 and all(x["waited_s"] < 0.04 for x in lines[5:])
    assert max(x["num_seqs"] for x in lines) == 2
    for x in lines:
        assert x["start_s"] <= x["start_s"] + x["execute_s"] <= x["start_s"] + x["step_s"] + 1e-6 <= x["end_s"] + 1e-6
        assert x["pairs"] >= x["context_tokens"] >= x["num_tokens"]
        assert x["logit_rows"] == x["num_seqs"]  # no drafts: one logit row a sequence
    assert all(a["end_s"] <= b["start_s"] for a, b in zip(lines, lines[1:]))


def test_one_engine_answers_the_engine_client_interface_as_worker_0(fake_engine):
    """Health, down_reason and per-worker stats are its own engine's; its front is the engine's
    tokenizer, names and limits; no KV ever crosses to another engine."""
    engine = fake_engine(max_model_len=128)
    bridge = AsyncEngine(engine)
    assert bridge.front.model_name == "fake-model" and bridge.front.max_model_len == 128
    assert bridge.front.tokenizer is engine.tokenizer and bridge.front.kv_cache_dtype == "none"
    assert bridge.down_reason == "the engine is not running" and bridge.health() == {"status": "down"}
    assert bridge.worker_stats() == {"0": None}

    async def main():
        bridge.start()
        bridge.add_transfer_observer(lambda *_: pytest.fail("one engine transfers no KV"))
        stream = await bridge.submit([_req("r", max_tokens=3)])
        outputs = await _collect(stream)
        seen = (bridge.down_reason, bridge.health(), bridge.worker_stats())
        await bridge.stop()
        return outputs, seen

    outputs, (down, health, per_worker) = run(main())
    assert outputs[-1].finished and down is None and health == {"status": "ok"}
    assert per_worker == {"0": bridge.stats}
    assert bridge.down_reason == "the engine is not running"
