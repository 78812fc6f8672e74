"""A server that sends JSON of the wrong shape in its stream: each such request is a failure
with its reason, counted like any other, and the rest of the run goes on."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from servelab.bench.client import BenchRequest, OpenAIStreamClient, StreamResult
from servelab.bench.runner import run_load

# The stream each prompt gets; "ok" is a well-formed one-token completion.
BODIES = {
    "ok": [{"choices": [{"index": 0, "text": " hi", "finish_reason": "length"}]}],
    "number": [5],
    "list": [["not", "a", "chunk"]],
    "bad-choice": [{"choices": [7]}],
    "bad-usage": [{"choices": [{"index": 0, "text": " hi"}], "usage": "lots"}],
}


async def _serve(request: web.Request) -> web.StreamResponse:
    prompt = (await request.json())["prompt"]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for chunk in BODIES[prompt.split("#")[0]]:
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


async def _run(prompts: list[str], *, closed_loop: bool):
    app = web.Application()
    app.router.add_post("/v1/completions", _serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        requests = [BenchRequest(i, p, 1, 1) for i, p in enumerate(prompts)]
        if not closed_loop:
            for i, r in enumerate(requests):
                r.planned_send_s = 0.001 * i
        async with OpenAIStreamClient(f"http://127.0.0.1:{port}", model="m", endpoint="completions",
                                      max_connections=2) as client:  # fmt: skip
            return await asyncio.wait_for(run_load(client, requests, concurrency=2 if closed_loop else None), 30)
    finally:
        await runner.cleanup()


def _check(out, prompts: list[str]) -> None:
    by_index = {r.index: r for r in out.results}
    assert sorted(by_index) == list(range(len(prompts)))  # nothing silently dropped
    for i, prompt in enumerate(prompts):
        r = by_index[i]
        if prompt.startswith("ok"):
            assert r.success and r.text == " hi", r.error
        else:
            assert not r.success and r.error.startswith("malformed stream chunk"), (prompt, r.error)


def test_wrong_shaped_chunks_are_failures_with_a_reason_closed_loop():
    prompts = ["ok#0", "number", "ok#1", "list", "bad-choice", "bad-usage", "ok#2"]
    _check(asyncio.run(_run(prompts, closed_loop=True)), prompts)


def test_wrong_shaped_chunks_are_failures_with_a_reason_open_loop():
    prompts = ["number", "ok#0", "bad-choice", "ok#1"]
    _check(asyncio.run(_run(prompts, closed_loop=False)), prompts)


class _BrokenClient:
    """A client whose stream raises for some requests, as an unforeseen bug would."""

    async def stream(self, request, *, planned_send_s=None, on_first_token=None):  # noqa: ANN001, ANN201
        await asyncio.sleep(0.001)
        if request.prompt.startswith("boom"):
            raise RuntimeError("unforeseen")
        now = time.perf_counter()
        return StreamResult(index=request.index, planned_send_s=planned_send_s, send_s=now, first_token_s=now,
                            token_times_s=[now], end_s=now, success=True, text="x")  # fmt: skip


def test_a_request_whose_stream_raises_is_a_failure_not_lost():
    requests = [BenchRequest(i, "boom" if i % 3 == 1 else "ok", 1, 1) for i in range(9)]
    out = asyncio.run(run_load(_BrokenClient(), requests, concurrency=2))
    by_index = {r.index: r for r in out.results}
    assert sorted(by_index) == list(range(9))
    for i, r in by_index.items():
        assert r.success == (i % 3 != 1)
        if not r.success:
            assert r.error == "client error: RuntimeError: unforeseen"
