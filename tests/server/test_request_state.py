"""Nothing per request outlives the request: after a mix of finished, abandoned, cancelled and
rejected requests, every per-request map of the bridge, the engine and the scheduler is empty
and every KV block is free. (The soak's RSS creep was not such a leak: docs/benchmarks.md, Soak.)"""

from __future__ import annotations

import asyncio

import pytest

from servelab.core.sequence import SamplingParams
from servelab.errors import RequestTooLong
from servelab.engine.client import EngineRequest
from servelab.server.async_engine import AsyncEngine


def _req(rid: str, max_tokens: int, prompt: str = "hello world", seed: int | None = None) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=["zz"], seed=seed, temperature=0.7)
    return EngineRequest(rid, prompt, params)


async def _leave_after(stream, tokens: int) -> None:
    got = 0
    async for out in stream:
        got += len(out.new_token_ids)
        if got >= tokens:
            break


def test_finished_abandoned_cancelled_and_rejected_requests_leave_no_state(fake_engine):
    async def main():
        engine = fake_engine(step_sleep_s=0.002, max_model_len=128)
        bridge = AsyncEngine(engine)
        bridge.start()
        jobs = []
        for i in range(24):
            prompt = "the quick brown fox " * (1 + i % 5)
            kind = i % 4
            if kind == 0:  # read to the end
                stream = await bridge.submit([_req(f"done-{i}", 4 + i % 7, prompt, seed=i)])
                jobs.append(asyncio.ensure_future(_leave_after(stream, 10**6)))
            elif kind == 1:  # the client leaves mid-stream
                stream = await bridge.submit([_req(f"left-{i}", 60, prompt)])
                jobs.append(asyncio.ensure_future(_leave_after(stream, 2)))
            elif kind == 2:  # n = 2 choices, the consuming task is cancelled (a disconnect)
                stream = await bridge.submit([_req(f"cut-{i}-0", 60, prompt), _req(f"cut-{i}-1", 60, prompt)])
                task = asyncio.ensure_future(_leave_after(stream, 10**6))
                asyncio.get_running_loop().call_later(0.02, task.cancel)
                jobs.append(task)
            else:  # rejected at admission
                with pytest.raises(RequestTooLong):
                    await bridge.submit([_req(f"long-{i}", 500, prompt)])
        await asyncio.gather(*jobs, return_exceptions=True)
        for _ in range(300):  # aborts reach the engine thread asynchronously
            if bridge.stats.num_running == 0 and not bridge._live and not engine._pending:
                break
            await asyncio.sleep(0.01)
        scheduler = engine.scheduler
        left = (dict(bridge._sinks), set(bridge._live), {**engine.core._requests, **engine.output_processor._requests},
                list(engine._pending),
                dict(scheduler._live), dict(scheduler.block_manager._owners),
                bridge.stats)  # fmt: skip
        await bridge.stop()
        return left

    sinks, live, requests, aborted, scheduled, owners, stats = asyncio.run(asyncio.wait_for(main(), 60))
    assert sinks == {} and live == set() and requests == {} and aborted == []
    assert scheduled == {} and owners == {}
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_blocks_free == stats.num_blocks_total
